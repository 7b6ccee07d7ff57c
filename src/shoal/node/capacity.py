"""What a create needs of the host besides memory, checked at admission (issue 24, item 1).

A node that runs for days must refuse a create cleanly when the host runs out of something — never
fail half-way with a raw `OSError`, crash its client, or leave a half-made sandbox. The resources:

* **descriptors** — the node process's own `RLIMIT_NOFILE` (raised at start as far as the host allows:
  `raise_nofile`) and the host's `fs.file-max`. An idle sandbox holds none of the node's descriptors
  (agent connections close when idle, one swap watch for all: shoal.node.connections,
  shoal.backends.container.swapwatch); a create holds a few while it runs.
* **PIDs** — every sandbox's agent is a process, every create forks the runtime: the host's tasks
  (`/proc/loadavg`) against `kernel.pid_max` and `kernel.threads-max`.
* **inotify watches** — on cgroup v2 the swap watch takes one per sandbox (`fs.inotify.max_user_watches`).
* **veths** — a sandbox with a network has a port on the node's bridge, and a Linux bridge takes at most
  1,024 ports (`BR_MAX_PORTS`).
* **loop devices** — a layer mounted through a loop device (`SHOAL_EROFS_MOUNT=loop`, or kernels before
  6.12 without file-backed EROFS mounts) takes one per layer not yet mounted on the host (layers are shared,
  shoal.images.mounts). Available: the existing devices bound to no file (`/sys/block/loopN` without a
  `loop/` directory, with a node in /dev) plus, when /dev/loop-control is there, the devices the kernel adds
  on demand — up to its minor numbers (2**20 >> the module's partition shift). The module's `max_loop` only
  bounds devices made by opening a dead /dev node, not those made through loop-control, so it is no limit
  here. A mount that still finds none (another process took the last) is reported the same way (`from_oserror`).

Each check keeps a reserve (for the host and the node's own work) and refuses with `CapacityExceeded`
whose `details["reason"]` is "resource" and `details["resource"]` names what ran out, with the limit
and what to do. Errors that still escape a create (a race with another process taking the last PID)
are translated by `from_oserror` after the create cleaned up.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.errors import CapacityExceeded

if TYPE_CHECKING:
    from shoal.spec import SandboxSpec

#: never raise RLIMIT_NOFILE past this (select()-based libraries misbehave with huge descriptor numbers
#: only when the descriptors exist; this bounds the table the kernel allocates)
NOFILE_CEILING = 1 << 20
#: descriptors one create holds while it runs (listener, connection, pidfd, runtime pipes, files)
FDS_PER_CREATE = 16
#: tasks one create adds (the agent) or spawns for a moment (runtime, its helper, the mount helper)
TASKS_PER_CREATE = 6
#: a Linux bridge's port limit (BR_MAX_PORTS); the bridge itself is not a port
BRIDGE_PORTS = 1024
#: how long a count of the node's open descriptors is reused (s): counting is a directory listing
FD_SAMPLE_S = 0.5
#: minor-number bits of a block device: the loop driver gives each device 2**part_shift of them
MINOR_BITS = 20
#: /dev/loop-control's device number (misc major 10, LOOP_CTRL_MINOR)
LOOP_CONTROL = (10, 237)


def _read_int(path: str, default: int = 0) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int(Path(path).read_text().split()[0])
    return default


def raise_nofile(ceiling: int = NOFILE_CEILING) -> tuple[int, int]:
    """Raise this process's RLIMIT_NOFILE as far as the host allows: as root (CAP_SYS_RESOURCE) the hard
    limit too, up to `fs.nr_open` (at most `ceiling`); otherwise the soft limit to the hard one.
    Returns (soft, hard) afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    want = min(ceiling, _read_int("/proc/sys/fs/nr_open", ceiling))
    if hard != inf and hard < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))  # fails without CAP_SYS_RESOURCE
            return resource.getrlimit(resource.RLIMIT_NOFILE)
    top = min(hard, ceiling) if hard != inf else ceiling
    if soft == inf or soft >= top:
        return soft, hard
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def open_descriptors() -> int:
    """Descriptors this process has open now."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # the listing's own
    except OSError:
        return 0


def host_tasks() -> int:
    """Tasks (processes and threads) on the host now: the 4th field of /proc/loadavg (running/total)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[1])
    return 0


def bridge_ports(bridge: str) -> int:
    """Ports on the node's bridge now (0 when it does not exist yet)."""
    try:
        return len(os.listdir(f"/sys/class/net/{bridge}/brif"))
    except OSError:
        return 0


@dataclass(frozen=True)
class LoopDevices:
    """The host's loop devices at one instant: `bound` to a file, `free` (bound to none, with a /dev node)
    and how many more the kernel adds on demand (`creatable`: 0 without /dev/loop-control)."""

    bound: int
    free: int
    creatable: int

    @property
    def available(self) -> int:
        """Loop devices a mount can still get."""
        return self.free + self.creatable

    @property
    def limit(self) -> int:
        """Loop devices this host can have bound at once."""
        return self.bound + self.available


def _loop_part_shift(sys_module: Path) -> int:
    """The loop module's partition shift: fls(max_part) when max_part > 0 (drivers/block/loop.c)."""
    return max(0, _read_int(str(sys_module / "parameters/max_part"), 0)).bit_length()


def _is_loop_control(node: Path) -> bool:
    with contextlib.suppress(OSError):
        st = node.stat()
        return stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == LOOP_CONTROL
    return False


def loop_devices(dev: Path = Path("/dev"), sys_block: Path = Path("/sys/block"),
                 sys_module: Path = Path("/sys/module/loop")) -> LoopDevices:
    """Count the host's loop devices (see the module docstring); all zero where the loop driver is absent."""
    try:
        names = [n for n in os.listdir(sys_block) if n.startswith("loop") and n[4:].isdigit()]
    except OSError:
        names = []
    bound = free = 0
    for n in names:
        if (sys_block / n / "loop").is_dir():  # the driver adds loop/ (backing_file, …) while bound
            bound += 1
        elif (dev / n).exists():
            free += 1
    creatable = 0
    if _is_loop_control(dev / "loop-control"):
        creatable = max(0, (1 << (MINOR_BITS - _loop_part_shift(sys_module))) - len(names))
    return LoopDevices(bound=bound, free=free, creatable=creatable)


@dataclass(frozen=True)
class Limits:
    """The host's limits a create is checked against (read once per node; `refresh()` rereads them)."""

    nofile: int
    file_max: int
    pid_max: int
    threads_max: int
    inotify_watches: int

    @classmethod
    def read(cls) -> Limits:
        """The current limits of this process and host."""
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return cls(nofile=NOFILE_CEILING if soft == resource.RLIM_INFINITY else int(soft),
                   file_max=_read_int("/proc/sys/fs/file-max", 1 << 62),
                   pid_max=_read_int("/proc/sys/kernel/pid_max", 32768),
                   threads_max=_read_int("/proc/sys/kernel/threads-max", 1 << 30),
                   inotify_watches=_read_int("/proc/sys/fs/inotify/max_user_watches", 8192))


def reserve(limit: int, floor: int) -> int:
    """What a check keeps free of `limit`: 2% of it, at least `floor` (never more than half)."""
    return min(limit // 2, max(floor, limit // 50))


class HostCapacity:
    """The checks of one node (see the module docstring). `watches` counts the swap watch's inotify
    watches (cgroup v2), `bridge` names the bridge sandboxes with a network join."""

    def __init__(self, *, bridge: str = "shoal0", inotify_in_use: Any = None, dev: Path = Path("/dev"),
                 sys_block: Path = Path("/sys/block")) -> None:
        self.bridge = bridge
        #: where loop devices are counted (`loop_devices`): the host's /dev and /sys/block
        self.dev = dev
        self.sys_block = sys_block
        self.limits = Limits.read()
        self._inotify_in_use = inotify_in_use  # callable -> watches this node holds (None: no watches)
        self._fds = 0
        self._fds_at = 0.0
        #: creates past admission and not yet finished (their descriptors and tasks are not counted yet)
        self.in_flight = 0

    def refresh(self) -> None:
        """Read the limits again (after the node raised its RLIMIT_NOFILE, or an operator changed a sysctl)."""
        self.limits = Limits.read()
        self._fds_at = 0.0

    def descriptors(self) -> int:
        """The node's open descriptors (a count at most FD_SAMPLE_S old)."""
        now = time.monotonic()
        if now - self._fds_at > FD_SAMPLE_S:
            self._fds = open_descriptors()
            self._fds_at = now
        return self._fds

    def descriptors_short(self) -> bool:
        """True when the node has used more than 80% of what its RLIMIT_NOFILE leaves after the reserve."""
        lim = self.limits.nofile
        return self.descriptors() > 0.8 * (lim - reserve(lim, 64))

    def check(self, spec: SandboxSpec | Any, n: int = 1, *, loops: int = 0) -> CapacityExceeded | None:
        """The refusal `n` more creates of `spec` get now for a resource other than memory, or None.
        `loops`: the loop devices those creates take (their layers not mounted yet, when mounts take one)."""
        lim = self.limits
        k = n + self.in_flight
        fds = self.descriptors()
        keep = reserve(lim.nofile, 64)
        if fds + k * FDS_PER_CREATE > lim.nofile - keep:
            return _refuse("descriptors", fds, lim.nofile, keep,
                           "the node process's open-file limit (RLIMIT_NOFILE); run the node as root or raise "
                           "its hard limit (`ulimit -Hn`, LimitNOFILE= in a systemd unit), or close sandboxes")
        allocated = _read_int("/proc/sys/fs/file-nr")
        fkeep = reserve(lim.file_max, 1024)
        if allocated and allocated + k * FDS_PER_CREATE > lim.file_max - fkeep:
            return _refuse("descriptors", allocated, lim.file_max, fkeep,
                           "the host's open files (fs.file-max); raise it with `sysctl fs.file-max=N`")
        tasks = host_tasks()
        tmax = min(lim.pid_max, lim.threads_max)
        tkeep = reserve(tmax, 256)
        if tasks and tasks + k * TASKS_PER_CREATE > tmax - tkeep:
            what = "kernel.pid_max" if lim.pid_max <= lim.threads_max else "kernel.threads-max"
            return _refuse("pids", tasks, tmax, tkeep,
                           f"the host's processes and threads ({what}); raise it with `sysctl {what}=N` "
                           "(4194304 is the largest pid_max), or close sandboxes")
        if self._inotify_in_use is not None:
            used = int(self._inotify_in_use())
            wkeep = reserve(lim.inotify_watches, 512)
            if used + k > lim.inotify_watches - wkeep:
                return _refuse("inotify watches", used, lim.inotify_watches, wkeep,
                               "inotify watches of this user (fs.inotify.max_user_watches; the swap watch takes "
                               "one per sandbox on cgroup v2); raise it with `sysctl fs.inotify.max_user_watches=N`")
        if getattr(spec, "network", False):
            ports = bridge_ports(self.bridge)
            if ports + k > BRIDGE_PORTS - 1:
                return _refuse("veths", ports, BRIDGE_PORTS - 1, 0,
                               f"ports on the bridge {self.bridge} (a Linux bridge takes at most {BRIDGE_PORTS}); "
                               "close networked sandboxes or create on another node")
        if loops > 0:
            lo = loop_devices(self.dev, self.sys_block)
            lkeep = reserve(lo.limit, 1) if lo.creatable else 0  # a fixed set of devices is the node's to use
            if loops > lo.available - lkeep:
                more = "" if lo.creatable else " (no /dev/loop-control to add more)"
                return _refuse("loop devices", lo.bound, lo.limit, lkeep,
                               f"this create mounts {loops} image layer(s) through loop devices and "
                               f"{lo.available} are free{more}; detach unused ones (`losetup -D`), give the node "
                               "/dev/loop-control, or use file-backed EROFS mounts (Linux >= 6.12, "
                               "SHOAL_EROFS_MOUNT=auto)")
        return None


def _refuse(resource_name: str, used: int, limit: int, keep: int, what: str) -> CapacityExceeded:
    return CapacityExceeded(
        f"this node is out of {resource_name}: {used} in use of {limit} ({keep} kept free) — {what}",
        retry_after_s=5.0, reason="resource", resource=resource_name, used=used, limit=limit, reserve=keep)


_ERRNO_RESOURCE = {errno.EMFILE: "descriptors", errno.ENFILE: "descriptors"}


def _pids_short() -> bool:
    """True when the host's tasks are within 5% of its limit (an EAGAIN then came from fork)."""
    lim = Limits.read()
    tmax = min(lim.pid_max, lim.threads_max)
    return host_tasks() > tmax - max(64, tmax // 20)


def from_oserror(e: BaseException, *, during: str = "create") -> CapacityExceeded | None:
    """The CapacityExceeded a resource error met during a create stands for (EMFILE/ENFILE: descriptors,
    EAGAIN while the host is short of tasks: PIDs, ENOSPC from inotify: inotify watches, no free loop
    device), or None. Follows the chain of causes."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        text = str(cur)
        if isinstance(cur, OSError) and cur.errno is not None:
            name = _ERRNO_RESOURCE.get(cur.errno)
            if cur.errno == errno.EAGAIN and _pids_short():
                name = "pids"
            if cur.errno == errno.ENOSPC and "inotify" in text:
                name = "inotify watches"
            if name:
                return CapacityExceeded(f"this node ran out of {name} during a {during}: {cur}; nothing was "
                                        "left behind — retry later, close sandboxes, or raise the host's limit",
                                        retry_after_s=5.0, reason="resource", resource=name)
        low = text.lower()
        if "unused loop device" in low or "no free loop" in low:
            return CapacityExceeded(f"this node ran out of loop devices during a {during}: {text[-300:]}; "
                                    "detach unused ones (`losetup -D`) or raise the loop module's max_loop",
                                    retry_after_s=5.0, reason="resource", resource="loop devices")
        if "resource temporarily unavailable" in low and ("fork" in low or "clone" in low) and _pids_short():
            return CapacityExceeded(f"this node ran out of pids during a {during}: {text[-300:]}",
                                    retry_after_s=5.0, reason="resource", resource="pids")
        if "too many open files" in low:
            return CapacityExceeded(f"this node ran out of descriptors during a {during}: {text[-300:]}",
                                    retry_after_s=5.0, reason="resource", resource="descriptors")
        cur = cur.__cause__ or cur.__context__
    return None
