"""What the scheduler knows and decides: requests, node states, sandboxes, placements.

Plain slotted dataclasses, no I/O. A driver (the cluster runtime from node reports, the embedded node
from its own records, the simulator from its virtual nodes) fills `NodeState`s; the decisions in
`shoal.sched.place` and `shoal.sched.preempt` read them and return `Placement`s and plans.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.limits import DEFAULT_BACKEND
from shoal.sched.policy import Policy

#: `NodeState.free_disk_mb` of a node that does not report its disk
UNKNOWN_DISK_MB = 1 << 40


@dataclass(slots=True)
class Request:
    """One sandbox to place (a create, or one item of a burst)."""

    cpus: float = 1.0
    memory_mb: int = 1024
    disk_mb: int = 0
    backend: str = DEFAULT_BACKEND
    #: image reference (for reports); placement looks at `layers`
    image: str = ""
    #: digests of the image's layers, bottom first: nodes that have them mounted are preferred
    layers: tuple[str, ...] = ()
    #: rank of the priority class (0 = most important; see Policy.priorities)
    priority: int = 2
    job: str = ""
    project: str = "default"
    #: nodes that refused this request already (placement avoids them)
    avoid: frozenset[str] = frozenset()


@dataclass(slots=True)
class SandboxView:
    """A live sandbox as preemption and compute tides see it."""

    id: str
    node_id: str
    memory_mb: int
    cpus: float = 1.0
    priority: int = 2
    job: str = ""
    project: str = "default"
    #: "running" or "paused"
    state: str = "running"
    #: when it last served a call (seconds, the driver's clock): the idle time is `now - last_used`
    last_used: float = 0.0
    #: memory it actually holds (MiB): what pausing it gives back
    used_mb: int = 0


@dataclass(slots=True)
class NodeState:
    """One node as the scheduler sees it: capacity, what is promised and used, layers, health.

    Build it with `NodeState.new(...)` so its limits come from the policy unless the node reports its
    own. `sandboxes` (id -> SandboxView) is only needed by preemption and tides: a driver may list just
    the running, idle ones.
    """

    node_id: str
    cpus: float
    memory_mb: int
    #: refuse when committed_mb (+ paused memory at the policy's weight) would pass this (MiB)
    mem_limit_mb: int
    #: refuse when committed_cpus would pass this
    cpu_limit: float
    #: live sandboxes allowed (0 = no limit)
    max_sandboxes: int = 0
    #: layers it may mount at once (0 = no limit)
    cold_slots: int = 0
    #: memory promised to sandboxes running or being created (MiB)
    committed_mb: int = 0
    committed_cpus: float = 0.0
    #: memory promised to paused sandboxes (MiB); counts at Policy.paused_commit_weight
    paused_mb: int = 0
    #: memory in use on the host (MiB)
    used_mb: int = 0
    free_disk_mb: int = UNKNOWN_DISK_MB
    #: sandboxes running or being created
    running: int = 0
    paused: int = 0
    healthy: bool = True
    backends: frozenset[str] = frozenset({DEFAULT_BACKEND})
    #: layer digests mounted (or being mounted) on the node
    layers: set[str] = field(default_factory=set)
    #: layer mounts in flight
    cold_mounts: int = 0
    #: live sandboxes per priority rank, and per job
    by_priority: dict[int, int] = field(default_factory=dict)
    by_job: dict[str, int] = field(default_factory=dict)
    #: live sandboxes preemption and tides may choose from
    sandboxes: dict[str, SandboxView] = field(default_factory=dict)
    #: memory (MiB) of running sandboxes idle at least Policy.min_idle_s, per priority rank, as the node
    #: reports it: what pausing could free there (`plan_preemptible`) when the driver tracks no sandboxes
    idle_mb: dict[int, int] = field(default_factory=dict)
    #: bumped by every change the Cluster index must see (headroom heap entries carry it)
    version: int = 0

    @classmethod
    def new(cls, node_id: str, cpus: float, memory_mb: int, policy: Policy | None = None, *,
            memory_overcommit: float | None = None, cpu_overcommit: float | None = None,
            max_sandboxes: int | None = None, cold_slots: int | None = None, **kw: object) -> NodeState:
        """A node of `cpus` cores and `memory_mb` RAM; limits the node reports override the policy's."""
        p = policy or Policy()
        mo = p.memory_overcommit if memory_overcommit is None else memory_overcommit
        co = p.cpu_overcommit if cpu_overcommit is None else cpu_overcommit
        return cls(node_id=node_id, cpus=float(cpus), memory_mb=int(memory_mb),
                   mem_limit_mb=int(memory_mb * mo), cpu_limit=float(cpus) * co,
                   max_sandboxes=p.max_sandboxes_per_node if max_sandboxes is None else max_sandboxes,
                   cold_slots=p.cold_mount_slots if cold_slots is None else cold_slots, **kw)  # type: ignore[arg-type]

    @property
    def live(self) -> int:
        """Sandboxes on the node (running, being created or paused)."""
        return self.running + self.paused


@dataclass(slots=True)
class Placement:
    """Where one request goes, and what the node does first."""

    node_id: str
    #: layers the node has to mount for it (cold reads from the store)
    cold_layers: tuple[str, ...] = ()
    #: sandboxes to pause on that node before creating (preemption); empty normally
    preempt: tuple[str, ...] = ()
    score: float = 0.0


@dataclass
class BurstPlan:
    """How a burst of `requested` copies of one request is split over nodes."""

    requested: int
    #: node id -> how many copies it takes
    counts: dict[str, int] = field(default_factory=dict)
    #: node id -> layers it has to mount for them
    cold_layers: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: node id -> sandboxes to pause there first (a preempting gang)
    preempt: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def placed(self) -> int:
        """Copies given a node."""
        return sum(self.counts.values())

    @property
    def short(self) -> int:
        """Copies no node could take now."""
        return self.requested - self.placed

    def placements(self) -> list[Placement]:
        """One Placement per copy (nodes interleaved, so the creates can run concurrently across nodes)."""
        left = dict(self.counts)
        out: list[Placement] = []
        first: set[str] = set()
        while left:
            for nid in list(left):
                cold = self.cold_layers.get(nid, ()) if nid not in first else ()
                pre = self.preempt.get(nid, ()) if nid not in first else ()
                first.add(nid)
                out.append(Placement(nid, cold, pre))
                left[nid] -= 1
                if not left[nid]:
                    del left[nid]
        return out
