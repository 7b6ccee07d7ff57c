"""The scheduler: pure decisions over node states (no I/O, no asyncio, no Ray).

One module, two drivers: the cluster runtime (node reports in, placements out; nodes keep the final
say through their admission) and `shoal sim` (virtual nodes in virtual time) call the same functions,
so a policy exists once. The embedded single-node client uses the same preemption and tide decisions.

    from shoal.sched import Cluster, NodeState, Policy, Request, place, place_many

    cluster = Cluster([NodeState.new("n1", cpus=64, memory_mb=256_000),
                       NodeState.new("n2", cpus=64, memory_mb=256_000)], Policy(), seed=1)
    req = Request(cpus=1, memory_mb=2048, layers=("sha256:base", "sha256:task17"), priority=0, job="step-3")
    p = place(req, cluster)               # -> Placement(node_id=..., cold_layers=(...))
    cluster.reserve(p, req)               # count it until the node's next report
    plan = place_many(req, 500, cluster)  # -> BurstPlan(counts={"n1": 250, "n2": 250})

See docs/scheduling.md for the policies and the driver contract.
"""

from shoal.sched.cluster import Cluster, as_cluster
from shoal.sched.place import (
    cold_layers,
    fits,
    place,
    place_many,
    plan_gang,
    plan_preemptible,
    release_plan,
    reserve_plan,
    room,
    score,
)
from shoal.sched.policy import (
    DEFAULT_PRIORITIES,
    LABEL_JOB,
    LABEL_MAX_SANDBOXES,
    LABEL_PRIORITY,
    LABEL_WEIGHT,
    JobLabels,
    Policy,
    job_labels,
    labels_for_job,
)
from shoal.sched.preempt import can_resume, plan_preemption, plan_tides
from shoal.sched.queue import FairQueue, Job, JobBook
from shoal.sched.state import BurstPlan, NodeState, Placement, Request, SandboxView

__all__ = [
    "DEFAULT_PRIORITIES", "LABEL_JOB", "LABEL_MAX_SANDBOXES", "LABEL_PRIORITY", "LABEL_WEIGHT", "BurstPlan",
    "Cluster", "FairQueue", "Job", "JobBook", "JobLabels", "NodeState", "Placement", "Policy", "Request",
    "SandboxView", "as_cluster", "can_resume", "cold_layers", "fits", "job_labels", "labels_for_job", "place",
    "place_many", "plan_gang", "plan_preemptible", "plan_preemption", "plan_tides", "release_plan", "reserve_plan",
    "room", "score",
]
