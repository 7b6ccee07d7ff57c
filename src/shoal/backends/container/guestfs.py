"""The read-only host files every container sandbox sees: the agent, and what masks host information.

They live on a small tmpfs of their own at `$SHOAL_HOME/guestfs`, not on the host's root filesystem,
because a bind mount shows its source in the sandbox's /proc/self/mountinfo: a bind from the host's disk
names the host's block device (`/dev/vda`) and the host path of the directory; a bind from this tmpfs
shows `tmpfs` and a path inside it (`/agent`), nothing else.

- `agent/shoal-agent`: the in-sandbox agent, bound read-only at `/.shoal`.
- `empty/` and `empty-file`: bound over /proc and /sys entries that must not be read (oci.MASKED_PATHS).
- `resolv.proxy.conf`: the resolv.conf of sandboxes with an egress allowlist (the node's DNS proxy).
- `cmdline`: an empty /proc/cmdline (the host kernel's command line names its devices and services).
- `meminfo/<MiB>[-<swap MiB>]`: a /proc/meminfo that reports the sandbox's own memory limit instead of
  the host's RAM, one file per distinct limit, shared by every sandbox of that size. The numbers are
  static (total = free = available = the limit), unlike LXCFS's live ones: programs that size
  themselves from /proc/meminfo (make -j, JVMs, worker pools) see the limit they will be held to.

Without the tmpfs (it cannot be mounted) the same files are made on disk and only the path leak remains.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from shoal.config import Paths
from shoal.fsutil import flocked, install_copy
from shoal.host import syscalls

log = logging.getLogger(__name__)

# the agent (~1 MiB) plus a page per meminfo size; a fixed size also keeps the host's RAM out of the
# tmpfs mount options a sandbox can read
_TMPFS_OPTS = "mode=0755,size=16m,nr_inodes=4096"


def meminfo_text(memory_mb: int, swap_mb: int | None = None) -> str:
    """/proc/meminfo of a sandbox limited to `memory_mb` (and `swap_mb` of swap)."""
    kb = int(memory_mb) * 1024
    swap_kb = max(0, int(swap_mb or 0)) * 1024
    rows = [("MemTotal", kb), ("MemFree", kb), ("MemAvailable", kb), ("Buffers", 0), ("Cached", 0),
            ("SwapCached", 0), ("Active", 0), ("Inactive", 0), ("Shmem", 0), ("SReclaimable", 0),
            ("SwapTotal", swap_kb), ("SwapFree", swap_kb), ("Dirty", 0), ("Writeback", 0),
            ("AnonPages", 0), ("Mapped", 0), ("Slab", 0), ("SUnreclaim", 0), ("CommitLimit", kb + swap_kb),
            ("Committed_AS", 0), ("HugePages_Total", 0), ("HugePages_Free", 0), ("Hugepagesize", 2048)]
    out = []
    for name, val in rows:
        unit = "" if name.startswith("HugePages_") else " kB"
        out.append(f"{name + ':':<16}{val:>8}{unit}")
    return "\n".join(out) + "\n"


class GuestFiles:
    """The tmpfs at `$SHOAL_HOME/guestfs` and the files in it (see the module docstring)."""

    def __init__(self, paths: Paths, agent_src: Path, root: Path | None = None, tmpfs: bool = True) -> None:
        self.paths = paths
        #: (another root without a tmpfs: the runtime probe's own copy, see shoal.backends.container.runtime)
        self.root = root or paths.home / "guestfs"
        self.tmpfs = tmpfs
        self.agent_src = Path(agent_src)
        self._ready = False
        self._meminfo: set[str] = set()

    @property
    def agent_dir(self) -> Path:
        """The directory bound at /.shoal."""
        return self.root / "agent"

    @property
    def empty_dir(self) -> Path:
        """An empty directory bound over masked directories."""
        return self.root / "empty"

    @property
    def empty_file(self) -> Path:
        """An empty file bound over masked files."""
        return self.root / "empty-file"

    @property
    def cmdline(self) -> Path:
        """The sandbox's /proc/cmdline (empty)."""
        return self.root / "cmdline"

    def ensure(self) -> None:
        """Mount the tmpfs (if possible) and fill it; cheap after the first call."""
        if self._ready and self.empty_file.exists():
            return
        with flocked(self.paths.locks / "guestfs.lock"):
            self.root.mkdir(parents=True, exist_ok=True)
            if self.tmpfs and not syscalls.is_mountpoint(str(self.root)):
                try:
                    syscalls.mount("tmpfs", str(self.root), "tmpfs",
                                   syscalls.MS_NOSUID | syscalls.MS_NODEV, _TMPFS_OPTS)
                except OSError as e:
                    log.warning("guest files stay on disk (sandboxes can read their host paths): %s", e)
            self._install_agent()
            self.empty_dir.mkdir(mode=0o555, exist_ok=True)
            for f in (self.empty_file, self.cmdline):
                if not f.exists():
                    f.write_bytes(b"")
                    os.chmod(f, 0o444)
        self._meminfo.clear()
        self._ready = True

    def _install_agent(self) -> None:
        # a stable copy: a rebuilt repo never swaps the binary under live sandboxes (rename is atomic)
        self.agent_dir.mkdir(mode=0o755, exist_ok=True)
        install_copy(self.agent_src, self.agent_dir / "shoal-agent")

    def config_args(self, memory_mb: int, swap_mb: int | None = None) -> dict[str, Any]:
        """build_config's arguments naming these files: the agent, the masks and the virtual /proc files of
        a sandbox of this size (one place, so the runtime probe tries the config every create uses)."""
        return {"guest_dir": str(self.agent_dir), "empty_dir": str(self.empty_dir),
                "empty_file": str(self.empty_file),
                "proc_files": {"/proc/cmdline": str(self.cmdline),
                               "/proc/meminfo": str(self.meminfo(memory_mb, swap_mb))}}

    def proxy_resolv(self, gateway: str) -> Path:
        """The resolv.conf of networked sandboxes: the node's DNS proxy on the bridge (at `gateway`)."""
        self.ensure()
        p = self.root / "resolv.proxy.conf"
        if not p.exists():
            tmp = p.with_name(f".resolv.{os.getpid()}")
            tmp.write_text(f"nameserver {gateway}\noptions timeout:2 attempts:2\n")
            os.chmod(tmp, 0o444)
            os.rename(tmp, p)
        return p

    def meminfo(self, memory_mb: int, swap_mb: int | None = None) -> Path:
        """The meminfo file for this limit (made on first use)."""
        name = f"{int(memory_mb)}-{int(swap_mb or 0)}"
        path = self.root / "meminfo" / name
        if name in self._meminfo:
            return path
        if not path.exists():
            path.parent.mkdir(mode=0o755, exist_ok=True)
            tmp = path.with_name(f".{name}.{os.getpid()}")
            tmp.write_text(meminfo_text(memory_mb, swap_mb))
            os.chmod(tmp, 0o444)
            os.rename(tmp, path)
        self._meminfo.add(name)
        return path

    def teardown(self) -> bool:
        """Unmount the tmpfs if no sandbox directory is left in SHOAL_HOME. True if unmounted."""
        self._ready = False
        with flocked(self.paths.locks / "guestfs.lock"):
            if not syscalls.is_mountpoint(str(self.root)):
                return False
            with contextlib.suppress(FileNotFoundError), os.scandir(self.paths.sandboxes) as it:
                if any(True for _ in it):
                    return False
            # (a sandbox that is still running keeps its own binds of these files: detach is safe)
            syscalls.umount(str(self.root), detach=True)
            with contextlib.suppress(OSError):
                self.root.rmdir()
            return True
