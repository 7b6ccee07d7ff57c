"""Which cgroup layout this host has, and reading/writing a sandbox's cgroup files (v1 or v2)."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import time
from pathlib import Path
from typing import Any

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_mode() -> str:
    """'v2' (unified), 'hybrid' (v1 controllers + a v2 tree) or 'v1'. (Read once per CGROUP_ROOT: it is
    asked on every cgroup access, and a stat in cgroupfs can wait on the kernel's cgroup locks.)"""
    return _mode_of(str(CGROUP_ROOT))


@functools.lru_cache(maxsize=8)
def _mode_of(root: str) -> str:
    r = Path(root)
    if (r / "cgroup.controllers").exists():
        return "v2"
    if (r / "unified").is_dir():
        return "hybrid"
    return "v1"


def v1_controllers() -> set[str]:
    """Mounted v1 hierarchies (by controller name), from /proc/self/mountinfo."""
    found = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            _pre, _, post = line.partition(" - ")
            fields = post.split()
            if fields and fields[0] == "cgroup":
                opts = fields[2].split(",") if len(fields) > 2 else []
                found.update(o for o in opts if o not in ("rw", "ro", "relatime", "nosuid", "nodev", "noexec"))
    return found


def v1_available_controllers() -> set[str]:
    """Controllers the kernel offers (from /proc/cgroups, enabled column)."""
    out = set()
    with open("/proc/cgroups") as f:
        for line in f:
            if line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) >= 4 and parts[3] == "1":
                out.add(parts[0])
    return out


class SandboxCgroup:
    """Files of one sandbox's cgroup(s), located by its cgroupsPath (e.g. '/shoal/<id>')."""

    def __init__(self, rel_path: str) -> None:
        self.rel = rel_path.strip("/")
        self.mode = cgroup_mode()

    def dir(self, controller: str) -> Path:
        """Directory of this cgroup in `controller`'s hierarchy (v2: the single tree)."""
        if self.mode == "v2":
            return CGROUP_ROOT / self.rel
        return CGROUP_ROOT / controller / self.rel

    def read(self, controller: str, name: str) -> str | None:
        """Read a cgroup file; None when absent."""
        try:
            return (self.dir(controller) / name).read_text()
        except (FileNotFoundError, OSError):
            return None

    def write(self, controller: str, name: str, value: str) -> bool:
        """Write a cgroup file; False when it does not exist or refuses the value."""
        try:
            (self.dir(controller) / name).write_text(value)
            return True
        except OSError:
            return False

    def set_frozen(self, frozen: bool) -> bool:
        """Ask the freezer to freeze (or thaw) every process (v1 freezer.state, v2 cgroup.freeze)."""
        if self.mode == "v2":
            return self.write("memory", "cgroup.freeze", "1" if frozen else "0")
        return self.write("freezer", "freezer.state", "FROZEN" if frozen else "THAWED")

    def frozen(self) -> bool:
        """True once every process is frozen, or the cgroup is gone (nothing runs in it)."""
        if self.mode == "v2":
            events = self.read("memory", "cgroup.events")
            return events is None or "frozen 1" in events
        return (self.read("freezer", "freezer.state") or "").strip() in ("FROZEN", "")

    def memory_bytes(self) -> int | None:
        """Current memory charge of the sandbox (bytes)."""
        v = self.read("memory", "memory.current" if self.mode == "v2" else "memory.usage_in_bytes")
        return int(v) if v and v.strip().isdigit() else None

    def memory_stat(self) -> dict[str, int]:
        """memory.stat as a dict."""
        out = {}
        raw = self.read("memory", "memory.stat") or ""
        for line in raw.splitlines():
            k, _, v = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[k] = int(v)
        return out

    def working_set_bytes(self) -> int | None:
        """Memory the sandbox holds that reclaim cannot simply drop: its charge minus file pages on the LRU
        lists (page cache; tmpfs and shared memory are swap-backed, so they stay in)."""
        total = self.memory_bytes()
        if total is None:
            return None
        st = self.memory_stat()
        return max(0, total - st.get("active_file", 0) - st.get("inactive_file", 0))

    def pids(self) -> list[int]:
        """PIDs (host view) in this cgroup."""
        raw = self.read("pids", "cgroup.procs") or ""
        return [int(x) for x in raw.split()]

    def exists(self) -> bool:
        """True when the cgroup directory is present in the memory hierarchy."""
        return self.dir("memory").is_dir()


def exists_anywhere(rel_path: str) -> bool:
    """True when the cgroup directory exists in any hierarchy (a few stat calls)."""
    rel = rel_path.strip("/")
    if cgroup_mode() == "v2":
        return (CGROUP_ROOT / rel).is_dir()
    return any((p / rel).is_dir() for p in CGROUP_ROOT.iterdir())


def _rmdir(path: str, wait_s: float) -> None:
    # EBUSY while the last killed tasks are still leaving the cgroup: try again for a moment
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                return
            time.sleep(0.002)


def remove_if_there(rel_path: str, wait_s: float = 1.0) -> bool:
    """`remove_tree` when the cgroup exists anywhere; True when nothing of it is left. Blocking (stat and
    rmdir in cgroupfs wait on the kernel's cgroup locks): run it in a thread."""
    if not exists_anywhere(rel_path):
        return True
    remove_tree(rel_path, wait_s)
    return not exists_anywhere(rel_path)


def remove_tree(rel_path: str, wait_s: float = 1.0) -> None:
    """Remove a cgroup (its processes gone or going) in every hierarchy; ignores what is already gone."""
    rel = rel_path.strip("/")
    roots = [CGROUP_ROOT] if cgroup_mode() == "v2" else [p for p in CGROUP_ROOT.iterdir() if p.is_dir()]
    for root in roots:
        d = root / rel
        if not d.is_dir():
            continue
        for sub, dirs, _ in os.walk(d, topdown=False):
            for name in dirs:
                _rmdir(os.path.join(sub, name), wait_s)
        _rmdir(str(d), wait_s)


def oom_kills(rel_path: str) -> int | None:
    """How many processes the kernel's OOM killer has killed in this memory cgroup (v2 `memory.events`,
    v1 `memory.oom_control`: both have an `oom_kill` line since Linux 4.13); None when unreadable."""
    cg = SandboxCgroup(rel_path)
    raw = cg.read("memory", "memory.events" if cg.mode == "v2" else "memory.oom_control")
    if not raw:
        return None
    for line in raw.splitlines():
        k, _, v = line.partition(" ")
        if k == "oom_kill" and v.strip().isdigit():
            return int(v)
    return None


def usage(rel_path: str) -> dict[str, Any]:
    """What a sandbox's cgroups measure now: memory charge and working set (MiB), memory limit, CPU time
    (s), processes, OOM kills. Missing files leave their keys out."""
    cg = SandboxCgroup(rel_path)
    out: dict[str, Any] = {}
    mem = cg.memory_bytes()
    if mem is not None:
        out["memory_mb"] = round(mem / 2**20, 2)
        ws = cg.working_set_bytes()
        if ws is not None:
            out["working_set_mb"] = round(ws / 2**20, 2)
    lim = cg.read("memory", "memory.max" if cg.mode == "v2" else "memory.limit_in_bytes")
    if lim and lim.strip().isdigit() and int(lim) < 1 << 60:
        out["memory_limit_mb"] = round(int(lim) / 2**20, 1)
    if cg.mode == "v2":
        for line in (cg.read("cpu", "cpu.stat") or "").splitlines():
            k, _, v = line.partition(" ")
            if k == "usage_usec" and v.strip().isdigit():
                out["cpu_s"] = round(int(v) / 1e6, 3)
    else:
        usage = cg.read("cpuacct", "cpuacct.usage")
        if usage and usage.strip().isdigit():
            out["cpu_s"] = round(int(usage) / 1e9, 3)
    pids = cg.read("pids", "pids.current")
    if pids and pids.strip().isdigit():
        out["pids"] = int(pids)
    kills = oom_kills(rel_path)
    if kills is not None:
        out["oom_kills"] = kills
    return out
