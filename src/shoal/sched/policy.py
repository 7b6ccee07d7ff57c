"""The knobs of the scheduler, the priority classes and the label names that carry a sandbox's job.

Everything here is plain data. A `Policy` is shared by every decision of one scheduler (the cluster
runtime's, the embedded node's, the simulator's), so the same numbers mean the same thing everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.errors import InvalidRequest

#: label naming the job a sandbox belongs to (a rollout step, an eval run, an interactive user)
LABEL_JOB = "shoal.job"
#: label naming the sandbox's priority class (one of `Policy.priorities`)
LABEL_PRIORITY = "shoal.priority"
#: label capping how many live sandboxes the job may hold (an integer); carried by each create of the job
LABEL_MAX_SANDBOXES = "shoal.max-sandboxes"
#: label giving the job's weight in fair share between jobs of one priority class (a positive number)
LABEL_WEIGHT = "shoal.weight"

#: the default priority classes, most important first
DEFAULT_PRIORITIES: tuple[str, ...] = ("train-rollout", "eval", "interactive", "batch")
#: the class of a sandbox that names none
DEFAULT_PRIORITY = "interactive"


@dataclass
class Policy:
    """Limits and weights of every scheduling decision. Node-reported limits win over these defaults."""

    #: priority class names, most important first; a request's `priority` is an index into this tuple
    priorities: tuple[str, ...] = DEFAULT_PRIORITIES
    #: class of a request that names none
    default_priority: str = DEFAULT_PRIORITY
    #: a node refuses when memory promised to running sandboxes passes this multiple of its RAM
    memory_overcommit: float = 4.0
    #: a node refuses when CPUs promised to running sandboxes pass this multiple of its cores
    #: (90% of agent sandboxes use under 5% of what they ask for)
    cpu_overcommit: float = 16.0
    #: live sandboxes (running + paused) per node; 0 = no limit
    max_sandboxes_per_node: int = 0
    #: a node refuses when less than this much of its RAM is actually free (MiB)
    min_free_mb: int = 512
    #: fraction of a paused (reclaimed) sandbox's memory that still counts as promised
    paused_commit_weight: float = 0.0
    #: layers one node may be mounting at once (cold reads from the shared store); 0 = no limit
    cold_mount_slots: int = 8
    #: nodes sampled per decision (power-of-k-choices), besides the nodes that already hold the image
    choices: int = 2
    #: nodes holding the request's image sampled per decision
    locality_choices: int = 2
    #: score of a node holding all of the request's layers, against 1.0 for an empty node
    locality_weight: float = 1.0
    #: score lost by a node whose cold-mount slots are all busy
    cold_penalty: float = 0.5
    #: a burst gives no node more than this multiple of its fair (capacity-proportional) share
    burst_share_slack: float = 1.5
    #: preemption and tides only pause sandboxes idle (no call) at least this long (seconds)
    min_idle_s: float = 60.0
    #: compute tides: pause idle sandboxes when a node's used memory passes this fraction of its RAM ...
    tide_high: float = 0.85
    #: ... until it is back under this fraction
    tide_low: float = 0.75
    #: compute tides only pause sandboxes idle at least this long (seconds)
    tide_idle_s: float = 300.0
    #: preemption only pauses sandboxes of a class at least this many ranks below the request's
    preempt_gap: int = 1
    #: at most this many sandboxes paused for one placement decision
    max_victims: int = 64
    #: fair-share weight of a project or job that names none
    default_weight: float = 1.0
    #: project weights (fair share between projects inside one priority class)
    project_weights: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.priorities or len(set(self.priorities)) != len(self.priorities):
            raise InvalidRequest("priorities must be a non-empty list of distinct class names")
        if self.default_priority not in self.priorities:
            raise InvalidRequest(f"default priority {self.default_priority!r} is not one of {list(self.priorities)}")
        if not 0 < self.tide_low <= self.tide_high <= 1:
            raise InvalidRequest("tide thresholds need 0 < tide_low <= tide_high <= 1")
        if self.memory_overcommit <= 0 or self.cpu_overcommit <= 0:
            raise InvalidRequest("memory_overcommit and cpu_overcommit must be positive")
        self._rank = {name: i for i, name in enumerate(self.priorities)}

    @classmethod
    def from_settings(cls, s: object, **overrides: object) -> Policy:
        """The policy a node's settings ask for (`shoal.config.Settings`: priorities, admission limits,
        preemption and tide knobs); keyword arguments win."""
        kw: dict[str, object] = {
            "priorities": tuple(getattr(s, "priorities", DEFAULT_PRIORITIES)),
            "default_priority": getattr(s, "default_priority", DEFAULT_PRIORITY),
            "memory_overcommit": getattr(s, "memory_overcommit", 4.0),
            "min_free_mb": getattr(s, "min_free_mb", 512),
            "min_idle_s": getattr(s, "preempt_idle_s", 60.0),
            "tide_high": getattr(s, "tide_high", 0.85),
            "tide_low": getattr(s, "tide_low", 0.75),
            "tide_idle_s": getattr(s, "tide_idle_s", 300.0),
        }
        kw.update(overrides)
        return cls(**kw)  # type: ignore[arg-type]

    def rank(self, priority: str | int | None) -> int:
        """The rank of a priority class (0 = most important); a name, a rank or None (the default class)."""
        if priority is None or priority == "":
            return self._rank[self.default_priority]
        if isinstance(priority, int) and not isinstance(priority, bool):
            if 0 <= priority < len(self.priorities):
                return priority
        elif isinstance(priority, str) and priority in self._rank:
            return self._rank[priority]
        raise InvalidRequest(f"unknown priority {priority!r}: choose one of {', '.join(self.priorities)}")

    def name(self, rank: int) -> str:
        """The class name of a rank."""
        return self.priorities[rank]

    def project_weight(self, project: str) -> float:
        """Fair-share weight of a project."""
        return self.project_weights.get(project, self.default_weight)


@dataclass(frozen=True)
class JobLabels:
    """What a sandbox's labels say about its job (see `job_labels`)."""

    job: str
    priority: int
    max_sandboxes: int | None
    weight: float


def job_labels(labels: dict[str, str], policy: Policy, *, project: str = "default") -> JobLabels:
    """Read the job, priority class, job cap and fair-share weight from a sandbox's labels.

    A sandbox without `shoal.job` belongs to a job named after its project; bad values raise
    InvalidRequest naming the label."""
    job = labels.get(LABEL_JOB) or f"project:{project}"
    try:
        prio = policy.rank(labels.get(LABEL_PRIORITY))
    except InvalidRequest:
        raise InvalidRequest(f"label {LABEL_PRIORITY}={labels.get(LABEL_PRIORITY)!r} is not a priority class: "
                             f"choose one of {', '.join(policy.priorities)}") from None
    cap: int | None = None
    raw = labels.get(LABEL_MAX_SANDBOXES)
    if raw not in (None, ""):
        try:
            cap = int(raw)  # type: ignore[arg-type]
        except ValueError:
            cap = -1
        if cap < 1:
            raise InvalidRequest(f"label {LABEL_MAX_SANDBOXES}={raw!r} must be a positive integer")
    weight = policy.default_weight
    raw = labels.get(LABEL_WEIGHT)
    if raw not in (None, ""):
        try:
            weight = float(raw)  # type: ignore[arg-type]
        except ValueError:
            weight = -1.0
        if not 0 < weight < 1e6:
            raise InvalidRequest(f"label {LABEL_WEIGHT}={raw!r} must be a positive number")
    return JobLabels(job, prio, cap, weight)


def labels_for_job(job: str, priority: str | None = None, max_sandboxes: int | None = None,
                   weight: float | None = None) -> dict[str, str]:
    """The labels that put a sandbox in `job` (the inverse of `job_labels`)."""
    out = {LABEL_JOB: job}
    if priority is not None:
        out[LABEL_PRIORITY] = priority
    if max_sandboxes is not None:
        out[LABEL_MAX_SANDBOXES] = str(int(max_sandboxes))
    if weight is not None:
        out[LABEL_WEIGHT] = repr(float(weight))
    return out
