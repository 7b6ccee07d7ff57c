"""The cluster runtime's side of the scheduler contract (docs/scheduling.md): node agents' reports become
`shoal.sched.NodeState`s, a create becomes a `shoal.sched.Request`, and the decisions are the scheduler's
(`place` for one create, `place_many` for a burst). No policy lives here.

Each client keeps its own `ClusterView` (no central actor on the per-create path): fresh reports replace
node states, placements are reserved at once so concurrent creates of one client see each other, and a
node's refusal is released and the node avoided when placing again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from shoal.errors import CapacityExceeded
from shoal.limits import DEFAULT_BACKEND
from shoal.models import SandboxSpec
from shoal.sched import (
    Cluster,
    NodeState,
    Placement,
    Policy,
    Request,
    job_labels,
    place,
    place_many,
    plan_preemptible,
    reserve_plan,
)

Report = Mapping[str, Any]
#: a node's admission does not limit CPUs (only memory): the view must not either
_NO_CPU_LIMIT = 1e9
#: what `pick_node` asks for (work that is not a sandbox of its own: image listing, run_code)
_TINY = Request(cpus=0.0, memory_mb=0)


def node_state(report: Report, policy: Policy) -> NodeState:
    """A node agent's report (`NodeAgent.state`) as the scheduler's NodeState, limits as the node has them."""
    mem, cpus = report.get("memory", {}), report.get("cpus", {})
    total = max(1, int(mem.get("total_mb", 0)))
    sb = report.get("sandboxes", {})
    running = int(sb.get("running", 0)) + int(sb.get("creating", 0))
    room = mem.get("room")
    # measured admission says how many more sandboxes the node takes now: a cap on live sandboxes
    cap = running + int(room) if room is not None else 0
    st = NodeState.new(
        str(report["node_id"]), cpus=float(cpus.get("count", 1)), memory_mb=total, policy=policy,
        memory_overcommit=float(mem.get("limit_mb", 0)) / total, cpu_overcommit=_NO_CPU_LIMIT,
        max_sandboxes=cap, committed_mb=int(mem.get("committed_mb", 0)),
        committed_cpus=float(cpus.get("committed", 0.0)), used_mb=int(mem.get("used_mb", 0)), running=running,
        paused=int(sb.get("paused", 0)), layers=set(report.get("layers") or ()),
        backends=frozenset(report.get("backends") or (DEFAULT_BACKEND,)),
        idle_mb={policy.rank(k): int(v) for k, v in (report.get("idle_mb") or {}).items() if k in policy.priorities})
    if room is not None and int(room) <= 0:
        st.healthy = False  # takes nothing now (a cap of 0 would read as "no cap")
    return st


def request(spec: SandboxSpec, layers: tuple[str, ...] = (), avoid: Iterable[str] = (),
            policy: Policy | None = None) -> Request:
    """One create of `spec` as the scheduler's Request (its job and priority class from its labels)."""
    jl = job_labels(spec.labels, policy or Policy(), project=spec.project)
    return Request(cpus=float(spec.cpus), memory_mb=int(spec.memory_mb), disk_mb=0, backend=spec.backend,
                   image=spec.image, layers=tuple(layers), priority=jl.priority, job=jl.job, project=spec.project,
                   avoid=frozenset(avoid))


class ClusterView:
    """One client's scheduler view of the cluster, fed by node reports."""

    def __init__(self, policy: Policy | None = None, seed: int | None = None) -> None:
        # the node's own admission checks free memory (and reports it as `room`): not the policy's min_free_mb
        self.policy = policy or Policy(min_free_mb=0)
        self.cluster = Cluster((), self.policy, seed=seed)

    def update(self, reports: Iterable[Report]) -> None:
        """Replace every node's state with its fresh report; nodes that did not report are forgotten."""
        seen = set()
        for r in reports:
            self.cluster.upsert(node_state(r, self.policy))
            seen.add(str(r["node_id"]))
        for n in list(self.cluster):
            if n.node_id not in seen:
                self.cluster.remove(n.node_id)

    def split(self, spec: SandboxSpec, n: int, *, layers: tuple[str, ...] = (),
              avoid: Iterable[str] = ()) -> dict[str, int]:
        """Node id → copies for `n` creates of `spec` (fewer in all when the cluster has less room),
        reserved in the view until the next reports."""
        req = request(spec, layers, avoid, self.policy)
        counts: dict[str, int] = {}
        if n == 1:
            try:
                p = place(req, self.cluster)
                self.cluster.reserve(p, req)
                return {p.node_id: 1}
            except CapacityExceeded:
                short = 1
        else:
            plan = place_many(req, n, self.cluster)
            reserve_plan(self.cluster, plan, req)
            counts = dict(plan.counts)
            short = plan.short
        if short:
            # what fits nowhere may fit where idle lower-priority sandboxes can be paused: those nodes'
            # admission pauses them itself (shoal.node.scheduling)
            extra = plan_preemptible(req, short, self.cluster)
            reserve_plan(self.cluster, extra, req)
            for nid, k in extra.counts.items():
                counts[nid] = counts.get(nid, 0) + k
        return counts

    def refused(self, node_id: str, spec: SandboxSpec, count: int) -> None:
        """A node refused `count` of what it was given: stop counting them there."""
        if node_id in self.cluster:
            self.cluster.release(node_id, request(spec, policy=self.policy), count)

    def pick_node(self) -> str | None:
        """Any node for work that is not a sandbox of its own (power-of-k choices by headroom)."""
        try:
            p: Placement = place(_TINY, self.cluster)
        except CapacityExceeded:
            return None
        return p.node_id
