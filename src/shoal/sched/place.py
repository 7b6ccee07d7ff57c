"""Placement: which node takes a sandbox (`place`), how a burst is split (`place_many`), gangs.

A decision reads the request and the node states and returns where to go; it never contacts a node.
The node's own admission stays the authority: when a node refuses, the driver calls `Cluster.release`,
adds the node to `Request.avoid` and places again.

One create (`place`): power-of-k-choices (DSec, E2B: sample a few nodes, keep the best) over the
healthy nodes, plus a few of the nodes that already hold the image's top layer (image locality), each
scored by headroom, locality and how busy its cold-mount slots are. When no sampled node has room, the
node with the most headroom (a heap) and then the others in headroom order are tried, so a request
fails only when no node can take it.

A burst (`place_many`): every node's room for copies of the request is counted once, and the burst is
split in proportion to that room (spreading), with a bonus for nodes holding the image (locality)
bounded by `Policy.burst_share_slack`. A node whose cold-mount slots are busy takes none of a burst
that needs a cold mount there: the burst goes to nodes that can read it now (burst smoothing).
"""

from __future__ import annotations

from collections.abc import Iterable

from shoal.errors import CapacityExceeded, GangUnsatisfiable
from shoal.sched.cluster import Cluster, as_cluster
from shoal.sched.policy import Policy
from shoal.sched.state import BurstPlan, NodeState, Placement, Request

_NEG = float("-inf")


def cold_layers(node: NodeState, req: Request) -> tuple[str, ...]:
    """The request's layers the node would have to mount."""
    have = node.layers
    return tuple(d for d in req.layers if d not in have)


def score(node: NodeState, req: Request, policy: Policy, mounts: bool = True) -> float:
    """How good `node` is for `req` (higher is better); -inf when the request does not fit there.

    `mounts=False` ignores the cold-mount bound (is there room at all, once the node's mounts finish?)."""
    if not node.healthy or req.backend not in node.backends or node.node_id in req.avoid:
        return _NEG
    limit = node.mem_limit_mb
    free = limit - node.committed_mb - policy.paused_commit_weight * node.paused_mb - req.memory_mb
    if free < 0 or node.committed_cpus + req.cpus > node.cpu_limit:
        return _NEG
    if node.max_sandboxes and node.running >= node.max_sandboxes:
        return _NEG
    if node.memory_mb - node.used_mb < policy.min_free_mb or node.free_disk_mb < req.disk_mb:
        return _NEG
    s = free / limit
    layers = req.layers
    if layers:
        have = node.layers
        cold = 0
        for d in layers:
            if d not in have:
                cold += 1
        slots = node.cold_slots
        # a node already mounting as much as it can read waits; an idle one may always start
        if cold and slots and mounts and node.cold_mounts and node.cold_mounts + cold > slots:
            return _NEG
        s += policy.locality_weight * (len(layers) - cold) / len(layers)
        if slots:
            s -= policy.cold_penalty * node.cold_mounts / slots
    return s


def fits(node: NodeState, req: Request, policy: Policy) -> bool:
    """True when `node` can take `req` now."""
    return score(node, req, policy) != _NEG


def room(node: NodeState, req: Request, policy: Policy) -> int:
    """How many copies of `req` the node can take now (0 when it is unhealthy or busy mounting)."""
    if score(node, req, policy) == _NEG:
        return 0
    free = node.mem_limit_mb - node.committed_mb - policy.paused_commit_weight * node.paused_mb
    k = int(free // req.memory_mb) if req.memory_mb > 0 else 1 << 30
    if req.cpus > 0:
        k = min(k, int((node.cpu_limit - node.committed_cpus + 1e-9) // req.cpus))
    if node.max_sandboxes:
        k = min(k, node.max_sandboxes - node.running)
    if req.disk_mb > 0:
        k = min(k, int(node.free_disk_mb // req.disk_mb))
    return max(k, 0)


def _candidates(cluster: Cluster, req: Request) -> list[str]:
    p = cluster.policy
    up = cluster.healthy_ids()
    n = len(up)
    if n <= p.choices + p.locality_choices:
        return list(up)
    rnd = cluster.rng.random
    # a request with layers samples the nodes that may start a mount now (the others only take it if
    # they hold its layers: the locality picks below)
    pool = cluster.mount_free_ids() if req.layers else up
    m = len(pool)
    out = [pool[int(rnd() * m)] for _ in range(p.choices)] if m else []
    if req.layers and p.locality_choices:
        holders = cluster.nodes_with_layer(req.layers[-1])
        m = len(holders)
        if m <= p.locality_choices:
            out.extend(holders)
        elif m:
            out.extend(holders[int(rnd() * m)] for _ in range(p.locality_choices))
    return out


def place(req: Request, nodes: Cluster | Iterable[NodeState], policy: Policy | None = None) -> Placement:
    """The node for one sandbox; raises CapacityExceeded when no node can take it now.

    Reads `nodes` and never changes it: call `Cluster.reserve(placement, req)` to count the sandbox."""
    cluster = as_cluster(nodes, policy)
    p = cluster.policy
    best: NodeState | None = None
    best_s = _NEG
    get = cluster.node
    for nid in _candidates(cluster, req):
        node = get(nid)
        s = score(node, req, p)
        if s > best_s:
            best, best_s = node, s
    if best is None:
        best, best_s = _fallback(cluster, req)
    return Placement(best.node_id, cold_layers(best, req) if req.layers else (), (), best_s)


def _fallback(cluster: Cluster, req: Request) -> tuple[NodeState, float]:
    """Sampling found no node: the best of the nodes that could take it, or why none.

    The headroom heap answers "no node has the memory" in O(log n). A request with layers can only go
    to a node with a free mount slot or one that holds its image, so only those are scanned: during a
    burst, when most nodes are busy mounting, that is a few nodes, not all of them."""
    p = cluster.policy
    top = cluster.most_free()
    if top is None or cluster.free_mb(top) < req.memory_mb:
        raise _no_room(cluster, req)
    up = cluster.healthy_ids()
    free = cluster.mount_free_ids()
    cand: Iterable[str] = up
    if req.layers:
        cand = dict.fromkeys([*free, *cluster.nodes_with_layer(req.layers[-1])])
    best: NodeState | None = None
    best_s = _NEG
    get = cluster.node
    for nid in cand:
        node = get(nid)
        s = score(node, req, p)
        if s > best_s:
            best, best_s = node, s
    if best is not None:
        return best, best_s
    if req.layers and len(free) < len(up):
        raise _mounting(req)  # nodes busy mounting may have room once their mounts finish
    raise _no_room(cluster, req)


def _mounting(req: Request) -> CapacityExceeded:
    return CapacityExceeded(
        f"every node with room for a sandbox of image {req.image!r} is busy mounting layers; retry in a moment",
        retry_after_s=0.5, reason="mounting")


def _no_room(cluster: Cluster, req: Request) -> CapacityExceeded:
    top = cluster.most_free()
    free = int(cluster.free_mb(top)) if top is not None else 0
    return CapacityExceeded(
        f"no node can take a sandbox of {req.memory_mb} MiB / {req.cpus} CPUs on backend {req.backend!r} now "
        f"(most memory left on one node: {free} MiB, healthy nodes: {len(cluster.healthy_ids())}); retry later, "
        "close sandboxes, or ask for less", retry_after_s=2.0, largest_free_mb=free, reason="capacity")


def place_many(req: Request, n: int, nodes: Cluster | Iterable[NodeState], policy: Policy | None = None
               ) -> BurstPlan:
    """Split a burst of `n` copies of `req` over the nodes by their room, with locality and spreading.

    Copies no node can take now are `plan.short`. Reads `nodes` and never changes it: call
    `reserve_plan(cluster, plan, req)` to count the burst."""
    cluster = as_cluster(nodes, policy)
    p = cluster.policy
    plan = BurstPlan(requested=int(n))
    if n <= 0:
        return plan
    rooms: dict[str, int] = {}
    weights: dict[str, float] = {}
    colds: dict[str, tuple[str, ...]] = {}
    get = cluster.node
    for nid in cluster.healthy_ids():
        node = get(nid)
        k = room(node, req, p)
        if k <= 0:
            continue
        rooms[nid] = k
        cold = cold_layers(node, req) if req.layers else ()
        colds[nid] = cold
        warm = (len(req.layers) - len(cold)) / len(req.layers) if req.layers else 0.0
        weights[nid] = k * min(1.0 + p.locality_weight * warm, p.burst_share_slack)
    total_room = sum(rooms.values())
    if not total_room:
        return plan
    if total_room <= n:
        plan.counts = dict(rooms)  # every node fills up
    else:
        plan.counts = _split(n, rooms, weights)
    plan.cold_layers = {nid: colds[nid] for nid in plan.counts if colds[nid]}
    return plan


def _split(n: int, rooms: dict[str, int], weights: dict[str, float]) -> dict[str, int]:
    """`n` copies in proportion to `weights`, no node over its room (water-filling, largest remainder)."""
    counts = dict.fromkeys(rooms, 0)
    open_ = set(rooms)
    left = n
    while left > 0 and open_:
        w = sum(weights[i] for i in open_)
        shares = {i: left * weights[i] / w for i in open_}
        placed = 0
        for i in list(open_):
            add = min(int(shares[i]), rooms[i] - counts[i])
            counts[i] += add
            placed += add
            if counts[i] >= rooms[i]:
                open_.discard(i)
        left -= placed
        if placed == 0:
            # fractional shares only: one each to the largest remainders, in a stable order
            for i in sorted(open_, key=lambda j: (-(shares[j] - int(shares[j])), j)):
                if left == 0:
                    break
                counts[i] += 1
                left -= 1
                if counts[i] >= rooms[i]:
                    open_.discard(i)
    return {i: c for i, c in counts.items() if c}


def reserve_plan(cluster: Cluster, plan: BurstPlan, req: Request) -> None:
    """Count every copy of a burst plan on its node (see `Cluster.reserve`)."""
    for nid, k in plan.counts.items():
        cluster.reserve(Placement(nid, plan.cold_layers.get(nid, ())), req, k)


def release_plan(cluster: Cluster, plan: BurstPlan, req: Request) -> None:
    """Undo `reserve_plan` (a gang that could not start)."""
    for nid, k in plan.counts.items():
        cluster.release(nid, req, k)
        if plan.cold_layers.get(nid):
            cluster.mount_done(nid, len(plan.cold_layers[nid]))
            cluster.unmounted(nid, plan.cold_layers[nid])


def plan_preemptible(req: Request, n: int, nodes: Cluster | Iterable[NodeState], policy: Policy | None = None
                     ) -> BurstPlan:
    """Copies of `req` (up to `n`) that fit only once nodes pause idle sandboxes of lower classes, from
    what nodes report (`NodeState.idle_mb`), split in proportion to what each can free.

    For a driver that tracks no sandboxes (the cluster runtime): it sends these copies to their nodes,
    whose own admission chooses and pauses the victims (`plan_preemption` over the node's sandboxes,
    shoal.node.scheduling). Reads `nodes` and never changes it: `reserve_plan` counts the plan (the nodes'
    promised memory then passes their limit in the view by what pausing will free, so the next plan offers
    only the rest)."""
    cluster = as_cluster(nodes, policy)
    p = cluster.policy
    plan = BurstPlan(requested=int(n))
    lowest = req.priority + p.preempt_gap
    if n <= 0 or lowest >= len(p.priorities) or req.memory_mb <= 0:
        return plan
    w = p.paused_commit_weight
    rooms: dict[str, int] = {}
    get = cluster.node
    for nid in cluster.healthy_ids():
        node = get(nid)
        if req.backend not in node.backends or nid in req.avoid or not node.idle_mb:
            continue
        freeable = sum(mb for r, mb in node.idle_mb.items() if r >= lowest)
        if freeable <= 0 or node.memory_mb - node.used_mb < p.min_free_mb:
            continue
        free = node.mem_limit_mb - node.committed_mb - w * node.paused_mb
        extra = int((free + freeable * (1.0 - w)) // req.memory_mb) - max(0, int(free // req.memory_mb))
        if node.max_sandboxes:
            extra = min(extra, node.max_sandboxes - node.running)
        if extra > 0:
            rooms[nid] = extra
    if not rooms:
        return plan
    plan.counts = dict(rooms) if sum(rooms.values()) <= n else _split(n, rooms, {k: float(v) for k, v in rooms.items()})
    for nid in plan.counts:
        cold = cold_layers(get(nid), req) if req.layers else ()
        if cold:
            plan.cold_layers[nid] = cold
    return plan


def plan_gang(req: Request, n: int, nodes: Cluster | Iterable[NodeState], policy: Policy | None = None, *,
              now: float | None = None, preempt: bool = False) -> BurstPlan:
    """All `n` copies of `req` or none: a plan placing all of them, or GangUnsatisfiable saying how many fit.

    With `preempt=True` (and `now`, the driver's clock), idle lower-priority sandboxes may be paused to
    make room (`plan.preempt`). Reads `nodes` and never changes it."""
    from shoal.sched.preempt import plan_preemption

    cluster = as_cluster(nodes, policy)
    plan = place_many(req, n, cluster)
    if plan.short and preempt and now is not None:
        reserve_plan(cluster, plan, req)
        try:
            extra = plan_preemption(req, plan.short, cluster, now)
        finally:
            release_plan(cluster, plan, req)
        for nid, (k, victims) in extra.items():
            plan.counts[nid] = plan.counts.get(nid, 0) + k
            plan.preempt[nid] = tuple(v.id for v in victims)
            if nid not in plan.cold_layers:
                cold = cold_layers(cluster.node(nid), req)
                if cold:
                    plan.cold_layers[nid] = cold
    if plan.short:
        raise GangUnsatisfiable(
            f"only {plan.placed} of {n} sandboxes fit now (all_or_nothing: none were created); "
            f"ask for at most {plan.placed}, retry later, or drop all_or_nothing to get as many as fit",
            requested=int(n), available=plan.placed)
    return plan

