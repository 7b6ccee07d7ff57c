"""Pausing, never killing: preemption for higher-priority work, compute tides, and when to resume.

* `plan_preemption`: a request (or a burst) of priority class P finds no room. Idle sandboxes of
  classes at least `Policy.preempt_gap` ranks below P are chosen for pausing (their memory is
  reclaimed and stops counting as promised), lowest class first, then longest idle, on as few
  nodes per copy as possible while the burst stays spread.
* `plan_tides`: a node's used memory passes `Policy.tide_high` of its RAM; sandboxes idle longer than
  `Policy.tide_idle_s` are paused, lowest class and longest idle first, until it is back under
  `Policy.tide_low`.
* `can_resume`: a paused sandbox comes back when its next call arrives; this says whether its node
  has room for it again.

The driver does the pausing (the node agent's pause + reclaim) and reports it with `Cluster.paused`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from shoal.sched.cluster import Cluster
from shoal.sched.policy import Policy
from shoal.sched.state import NodeState, Request, SandboxView


def _room_after(node: NodeState, req: Request, p: Policy, mem: int, cpus: float, run: int, used: int) -> int:
    """Copies of `req` the node could take after pausing sandboxes holding mem/cpus/run/used."""
    w = p.paused_commit_weight
    free = node.mem_limit_mb - node.committed_mb - w * node.paused_mb + mem * (1.0 - w)
    k = int(free // req.memory_mb) if req.memory_mb > 0 else 1 << 30
    if req.cpus > 0:
        k = min(k, int((node.cpu_limit - node.committed_cpus + cpus + 1e-9) // req.cpus))
    if node.max_sandboxes:
        k = min(k, node.max_sandboxes - node.running + run)
    if node.memory_mb - (node.used_mb - used) < p.min_free_mb:
        return 0
    return max(k, 0)


class _Cand:
    __slots__ = ("cpus", "it", "mem", "node", "run", "taken", "used", "victims")

    def __init__(self, node: NodeState, it: Iterator[SandboxView], base: int) -> None:
        self.node = node
        self.it = it
        self.victims: list[SandboxView] = []
        self.mem = 0
        self.cpus = 0.0
        self.run = 0
        self.used = 0
        self.taken = base  # copies that fit already (not ours to count)


def plan_preemption(req: Request, n: int, cluster: Cluster, now: float
                    ) -> dict[str, tuple[int, list[SandboxView]]]:
    """Idle lower-priority sandboxes to pause so that up to `n` more copies of `req` fit.

    Only sandboxes the driver tracks (`Cluster.track`) are candidates. Returns node id -> (copies that
    fit there once its victims are paused, victims). Empty when no idle sandbox of a low enough class
    exists. Reads `cluster` and never changes it. Costs O(victims log n) plus O(nodes)."""
    p = cluster.policy
    lowest = req.priority + p.preempt_gap
    if n <= 0 or lowest >= len(p.priorities):
        return {}
    idle_before = now - p.min_idle_s
    cands: list[tuple[int, _Cand]] = []
    for nid in cluster.healthy_ids():
        node = cluster.node(nid)
        if req.backend not in node.backends or nid in req.avoid:
            continue
        low = max((r for r in node.by_priority if r >= lowest), default=-1)
        if low < 0:
            continue
        it = cluster.iter_idle(nid, lowest, idle_before)
        cands.append((low, _Cand(node, it, _room_after(node, req, p, 0, 0.0, 0, 0))))
    if not cands:
        return {}
    # nodes holding sandboxes of the lowest classes go first; then those with the most promised memory
    cands.sort(key=lambda lc: (-lc[0], -lc[1].node.committed_mb))
    order = [c for _, c in cands]
    budget = p.max_victims * n
    left = n
    try:
        per_node = math.ceil(n / len(order))
        for cap in (per_node, n):  # a spread pass, then whatever room is left
            for c in order:
                if left <= 0 or budget <= 0:
                    break
                got = _room_after(c.node, req, p, c.mem, c.cpus, c.run, c.used) - c.taken
                target = min(left + got, cap)
                while got < target and budget > 0:
                    v = next(c.it, None)
                    if v is None:
                        break
                    c.victims.append(v)
                    budget -= 1
                    c.mem += v.memory_mb
                    c.cpus += v.cpus
                    c.run += 1
                    c.used += v.used_mb
                    new = _room_after(c.node, req, p, c.mem, c.cpus, c.run, c.used) - c.taken
                    left -= new - got
                    got = new
                left = max(left, 0)
    finally:
        for c in order:
            c.it.close()  # type: ignore[attr-defined]
    out: dict[str, tuple[int, list[SandboxView]]] = {}
    for c in order:
        if c.victims:
            copies = _room_after(c.node, req, p, c.mem, c.cpus, c.run, c.used) - c.taken
            if copies > 0:
                out[c.node.node_id] = (copies, c.victims)
    _trim(out, n)
    return out


def _trim(out: dict[str, tuple[int, list[SandboxView]]], n: int) -> None:
    # the last victim on a node may have made room for more copies than the burst still needed
    total = sum(k for k, _ in out.values())
    for nid in list(out):
        if total <= n:
            break
        k, vs = out[nid]
        cut = min(k, total - n)
        if cut == k:
            del out[nid]
        else:
            out[nid] = (k - cut, vs)
        total -= cut


def plan_tides(node_id: str, cluster: Cluster, now: float) -> list[SandboxView]:
    """Sandboxes to pause on a node whose used memory is over `tide_high`; [] when memory is not tight.

    Lowest class first, longest idle first, only those idle at least `tide_idle_s`, until the node would
    be back under `tide_low`. Reads `cluster` and never changes it."""
    p = cluster.policy
    node = cluster.node(node_id)
    if node.used_mb < p.tide_high * node.memory_mb:
        return []
    need = node.used_mb - p.tide_low * node.memory_mb
    out: list[SandboxView] = []
    freed = 0
    it = cluster.iter_idle(node_id, 0, now - p.tide_idle_s)
    try:
        for v in it:
            if freed >= need:
                break
            out.append(v)
            freed += v.used_mb
    finally:
        it.close()  # type: ignore[attr-defined]
    return out


def can_resume(view: SandboxView, cluster: Cluster) -> bool:
    """True when the paused sandbox's node has room for it to run again."""
    p = cluster.policy
    node = cluster.node(view.node_id)
    w = p.paused_commit_weight
    if node.committed_mb + w * (node.paused_mb - view.memory_mb) + view.memory_mb > node.mem_limit_mb:
        return False
    if node.committed_cpus + view.cpus > node.cpu_limit + 1e-9:
        return False
    if node.max_sandboxes and node.running >= node.max_sandboxes:
        return False
    return node.memory_mb - node.used_mb - view.used_mb >= p.min_free_mb
