"""CPU classes: how a sandbox's CPU time is weighed against its neighbours' (the long tail of latency).

Most agent sandboxes idle, and the busy ones are of two kinds: *interactive* work — short agent steps
(a shell command, a file read, a small script) whose latency the trainer waits on — and *batch* work —
compiles, test suites, evaluations that run for seconds to minutes and only care about throughput.
Under plain CFS a batch hog gets the same weight as a latency-sensitive step, so steps queue behind
hogs and their tail latency inflates (DSec: 45.2% p99 inflation, 17.3% with classes). A sandbox's
`cpu_class` says which kind it is:

| class | weight | idle policy | quota (cpus × period) | burst |
| --- | --- | --- | --- | --- |
| `interactive` (default) | cpus × 1024 (v1 shares) / cpus × 100 (v2 weight) | no | yes | one period of quota |
| `batch` | the minimum | `cpu.idle` = 1: the whole sandbox is SCHED_IDLE | yes | none |

`cpu.idle` (Linux ≥ 5.15, v1 and v2) makes a cgroup an idle entity: it runs on whatever CPU time no
normal task wants, and a waking interactive task preempts it at once. On cgroup v1 batch sandboxes sit
under one idle cgroup beside the sandboxes' parent (see `apply`), so the parent's own share of the host
is not spent on them. Where the kernel has no
`cpu.idle`, the batch sandbox's agent is put under SCHED_IDLE (inherited by everything it runs) and
its weight is the minimum. Burst (`cpu.cfs_burst_us` / `cpu.max.burst`, Linux ≥ 5.14) lets an interactive
sandbox that was idle spend banked quota in a short step instead of being throttled mid-step.

`NEUTRAL` is what the benchmark compares with: every sandbox the same, no idle, no burst — default Linux
scheduling between equal cgroups.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

from shoal.errors import InvalidRequest
from shoal.host import cgroups

# the class names and their check live in shoal.limits (the spec validates them without a backend)
from shoal.limits import BATCH as BATCH
from shoal.limits import CPU_CLASSES as CPU_CLASSES
from shoal.limits import DEFAULT_CPU_CLASS as DEFAULT_CPU_CLASS
from shoal.limits import INTERACTIVE as INTERACTIVE
from shoal.limits import check_cpu_class as check_cpu_class

#: what the benchmark compares with: plain CFS between equal cgroups (not a class users pick)
NEUTRAL = "neutral"
PERIOD_US = 100_000


@dataclass(frozen=True)
class CpuSettings:
    """The cgroup values of one class for a sandbox of `cpus` CPUs."""

    shares: int  # v1 cpu.shares (v2 cpu.weight is derived)
    quota_us: int
    burst_us: int
    idle: bool

    @property
    def weight(self) -> int:
        """cgroup v2 cpu.weight (1..10000) for these shares (1024 shares = weight 100)."""
        return max(1, min(10000, round(self.shares * 100 / 1024)))


def settings_for(cls: str, cpus: float) -> CpuSettings:
    """What `cls` means for a sandbox of `cpus` CPUs."""
    quota = max(1000, int(cpus * PERIOD_US))
    shares = max(2, int(cpus * 1024))
    if cls == BATCH:
        return CpuSettings(shares=2, quota_us=quota, burst_us=0, idle=True)
    if cls == INTERACTIVE:
        return CpuSettings(shares=shares, quota_us=quota, burst_us=quota, idle=False)
    if cls == NEUTRAL:
        return CpuSettings(shares=shares, quota_us=quota, burst_us=0, idle=False)
    raise InvalidRequest(f"unknown CPU class {cls!r}")


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
        return True
    except OSError:
        return False


#: cgroup v1: where batch sandboxes' processes live in the cpu hierarchy (an idle cgroup beside /shoal)
BATCH_PARENT = "shoal-batch"


def _move_procs(src: Path, dst: Path) -> bool:
    """Move every process of cgroup `src` to `dst` (v1 cgroup.procs; a child forked meanwhile is moved by
    the next round). True when `src` ends up empty."""
    for _ in range(20):
        try:
            pids = (src / "cgroup.procs").read_text().split()
        except OSError:
            return True
        if not pids:
            return True
        for pid in pids:
            _write(dst / "cgroup.procs", pid)
    return False


def _batch_parent(base: Path) -> Path | None:
    parent = base / "cpu" / BATCH_PARENT
    try:
        parent.mkdir(exist_ok=True)
    except OSError:
        return None
    if not _write(parent / "cpu.idle", "1"):
        _write(parent / "cpu.shares", "2")  # a kernel without cpu.idle: the least weight instead
    return parent


def apply(cgroup: str, cls: str, cpus: float, pid: int | None = None, *, root: Path | None = None
          ) -> dict[str, object]:
    """Put a running sandbox (its cgroup path, e.g. /shoal/<id>) in CPU class `cls`; also changes the
    class of a live sandbox. Returns what was set. Never raises for a cgroup file the host lacks.

    cgroup v1 (and hybrid): a batch sandbox's processes move, in the cpu hierarchy only, to
    `/shoal-batch/<id>`, under an idle parent beside `/shoal` — so batch work is idle against everything
    on the host, and the sandboxes' parent is not charged for it (its memory, pids and freezer cgroups stay
    at /shoal/<id>). cgroup v2 has one tree: the sandbox's own cgroup gets cpu.idle. `pid`: the sandbox's
    agent, put under SCHED_IDLE where the kernel has no cpu.idle at all."""
    st = settings_for(cls, cpus)
    rel = cgroup.strip("/")
    sid = rel.rsplit("/", 1)[-1]
    mode = cgroups.cgroup_mode()
    base = root or cgroups.CGROUP_ROOT
    out: dict[str, object] = {"class": cls}
    idle_ok = False
    if mode == "v2":
        d = base / rel
        out["weight"] = _write(d / "cpu.weight", str(st.weight)) and st.weight
        out["burst"] = _write(d / "cpu.max.burst", str(st.burst_us)) and st.burst_us
        idle_ok = _write(d / "cpu.idle", "1" if st.idle else "0")
    else:
        home = base / "cpu" / rel
        away = base / "cpu" / BATCH_PARENT / sid
        if st.idle:
            parent = _batch_parent(base)
            if parent is not None:
                with_idle = (parent / "cpu.idle").exists()
                try:
                    away.mkdir(exist_ok=True)
                    _write(away / "cpu.cfs_period_us", str(PERIOD_US))
                    _write(away / "cpu.cfs_quota_us", str(st.quota_us))
                    idle_ok = _move_procs(home, away) and with_idle
                    out["cgroup"] = f"/{BATCH_PARENT}/{sid}"
                except OSError as e:
                    out["error"] = str(e)
        else:
            if away.is_dir():
                _move_procs(away, home)
                with contextlib.suppress(OSError):
                    away.rmdir()
            out["shares"] = _write(home / "cpu.shares", str(st.shares)) and st.shares
            out["burst"] = _write(home / "cpu.cfs_burst_us", str(st.burst_us)) and st.burst_us
    out["idle"] = st.idle and idle_ok
    if pid and root is None:
        # no cpu.idle at all: the agent (and all it runs from now on) under SCHED_IDLE instead
        policy = os.SCHED_IDLE if st.idle and not idle_ok else os.SCHED_OTHER
        with contextlib.suppress(OSError, AttributeError):
            if os.sched_getscheduler(pid) != policy:
                os.sched_setscheduler(pid, policy, os.sched_param(0))
                out["sched_idle"] = policy == os.SCHED_IDLE
    return out


def batch_cgroup(sandbox_id: str, root: Path | None = None) -> Path:
    """Where a batch sandbox's processes live in the cpu hierarchy on cgroup v1."""
    return (root or cgroups.CGROUP_ROOT) / "cpu" / BATCH_PARENT / sandbox_id


def forget(sandbox_id: str, root: Path | None = None, wait_s: float = 2.0) -> bool:
    """Remove a closed sandbox's batch cpu cgroup (cgroup v1), waiting up to `wait_s` for its killed
    processes to leave it. True when it is gone (or never existed). Blocking: run it in a thread."""
    d = batch_cgroup(sandbox_id, root)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            d.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)


def sweep(min_age_s: float = 60.0, root: Path | None = None) -> int:
    """Remove batch cpu cgroups left empty by sandboxes closed while no node ran (older than `min_age_s`,
    so a sandbox another node is creating right now keeps its own). Returns how many were removed."""
    parent = (root or cgroups.CGROUP_ROOT) / "cpu" / BATCH_PARENT
    n = 0
    now = time.time()
    with contextlib.suppress(OSError):
        for e in os.scandir(parent):
            if not e.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                if now - e.stat(follow_symlinks=False).st_ctime < min_age_s:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    if (Path(e.path) / "cgroup.procs").read_text().strip():
                        continue
                os.rmdir(e.path)
                n += 1
    return n
