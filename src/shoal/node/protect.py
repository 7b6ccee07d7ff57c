"""Keep the node agent and the host out of the OOM killer's reach while sandboxes oversubscribe memory.

Applied once when a node starts (`protect_host`), on whatever cgroup layout the host has (detected,
never assumed):

* **the sandboxes' parent cgroup** (`/shoal`, the parent of every sandbox's `/shoal/<id>`) is limited to
  RAM − `SHOAL_HOST_RESERVE_MB`: however many sandboxes grow at once, they cannot take the memory the
  host and the node agent run in. When they hit it together, the OOM is the parent cgroup's, and its
  victim is a sandbox process (cgroup v1: memory.limit_in_bytes, hierarchical; v2: memory.max);
* **the node agent** lowers its own oom_score_adj to `SHOAL_NODE_OOM_SCORE_ADJ` (-1000: never picked)
  where it has CAP_SYS_RESOURCE, and every sandbox process runs at 500 (shoal.host.oom);
* **cgroup v2**: when the node agent's cgroup holds only the node and its children, it gets
  `memory.min` = `SHOAL_NODE_MEMORY_MIN_MB` (its memory is never reclaimed for sandboxes). cgroup v1 has
  no memory.min; the parent limit above does that job there.

Every step is best effort and reported in `Protection` (`node.protection`, `shoal doctor`): a host that
refuses one (a container without CAP_SYS_RESOURCE, a read-only cgroup tree) still runs sandboxes.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shoal.host import cgroups, oom
from shoal.host.memory import meminfo

#: the parent of every sandbox cgroup (the OCI cgroupsPath is /shoal/<id>)
SANDBOX_PARENT = "shoal"


def auto_reserve_mb(total_mb: int) -> int:
    """Memory kept for the host and the node agent when SHOAL_HOST_RESERVE_MB is 0 (auto):
    1/16 of RAM, at least 1 GiB and at most 8 GiB."""
    return int(min(8192, max(1024, total_mb // 16)))


@dataclass
class Protection:
    """What `protect_host` did, and why not where it could not."""

    cgroup_mode: str = ""
    #: limit put on the sandboxes' parent cgroup (MiB), None when it could not be set
    sandbox_limit_mb: int | None = None
    host_reserve_mb: int = 0
    node_oom_score_adj: int | None = None
    #: memory.min of the node's own cgroup (cgroup v2 only), MiB
    node_memory_min_mb: int | None = None
    can_lower_scores: bool = False
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


def _parent_dir(mode: str, root: Path) -> Path:
    return root / SANDBOX_PARENT if mode == "v2" else root / "memory" / SANDBOX_PARENT


def limit_sandbox_parent(limit_mb: int, mode: str | None = None, root: Path | None = None) -> tuple[bool, str]:
    """Limit the memory of the sandboxes' parent cgroup to `limit_mb` (made if missing). (ok, why not)."""
    mode = mode or cgroups.cgroup_mode()
    root = root or cgroups.CGROUP_ROOT
    d = _parent_dir(mode, root)
    try:
        d.mkdir(exist_ok=True)
    except OSError as e:
        return False, f"cannot make {d}: {e.strerror or e}"
    value = str(int(limit_mb) << 20)
    if mode == "v2":
        # the parent must hand the memory controller down to the sandboxes below it
        with contextlib.suppress(OSError):
            (d / "cgroup.subtree_control").write_text("+memory")
        name = "memory.max"
    else:
        name = "memory.limit_in_bytes"
    try:
        (d / name).write_text(value)
    except OSError as e:
        # EBUSY: the sandboxes already use more than the new limit (it stays as it was)
        return False, f"{d / name}: {e.strerror or e}"
    return True, ""


def _own_cgroup_v2() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                return line[3:].strip() or "/"
    return None


def _descendants_of_self(pids: list[int]) -> bool:
    """True when every pid is this process or one of its descendants (the cgroup is ours alone)."""
    me = os.getpid()
    for pid in pids:
        p = pid
        for _ in range(64):
            if p == me:
                break
            try:
                stat = Path(f"/proc/{p}/stat").read_text()
                p = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                return False
            if p <= 1:
                return False
        else:
            return False
    return True


def protect_node_cgroup_v2(min_mb: int, root: Path | None = None) -> tuple[int | None, str]:
    """cgroup v2: memory.min on the node's own cgroup when it holds nothing but this process tree."""
    root = root or cgroups.CGROUP_ROOT
    rel = _own_cgroup_v2()
    if rel is None or rel == "/":
        return None, "the node agent runs in the root cgroup (no memory.min there); run it in a cgroup of its own"
    d = root / rel.lstrip("/")
    try:
        pids = [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError) as e:
        return None, f"cannot read {d}/cgroup.procs: {e}"
    if not _descendants_of_self(pids):
        return None, f"the node agent's cgroup {rel} holds other processes too: memory.min left alone"
    try:
        (d / "memory.min").write_text(str(int(min_mb) << 20))
    except OSError as e:
        return None, f"{d}/memory.min: {e.strerror or e}"
    return min_mb, ""


def protect_host(*, reserve_mb: int = 0, node_oom_score_adj: int | None = oom.NODE_OOM_SCORE_ADJ,
                 node_memory_min_mb: int = 256) -> Protection:
    """Apply the protections above; never raises (see `Protection.notes` for what was refused)."""
    mode = cgroups.cgroup_mode()
    p = Protection(cgroup_mode=mode, can_lower_scores=oom.can_lower())
    total_mb = meminfo().get("MemTotal", 0) // 1024
    p.host_reserve_mb = reserve_mb or auto_reserve_mb(total_mb)
    if os.geteuid() != 0:
        p.notes.append("not root: no cgroup limits and no OOM scores were set")
        return p
    limit = max(256, total_mb - p.host_reserve_mb)
    ok, why = limit_sandbox_parent(limit, mode)
    if ok:
        p.sandbox_limit_mb = limit
    else:
        p.notes.append(f"sandboxes' parent cgroup not limited: {why}")
    if node_oom_score_adj is not None:
        p.node_oom_score_adj, why = oom.protect_self(node_oom_score_adj)
        if why:
            p.notes.append(why)
    else:
        p.node_oom_score_adj = oom.read_adj()
    if mode == "v2" and node_memory_min_mb > 0:
        p.node_memory_min_mb, why = protect_node_cgroup_v2(node_memory_min_mb)
        if why:
            p.notes.append(why)
    elif mode != "v2":
        p.notes.append(f"cgroup {mode}: no memory.min for the node agent (cgroup v2 only); the sandboxes' "
                       "parent limit keeps their memory off the node's")
    return p
