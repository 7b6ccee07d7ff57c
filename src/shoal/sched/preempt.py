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

from shoal.sched.cluster import Cluster
from shoal.sched.policy import Policy
from shoal.sched.state import NodeState, Request, SandboxView


def victim_order(v: SandboxView) -> tuple[int, float, int]:
    """Sort key of pause candidates: lowest class first, then longest idle, then largest."""
    return (-v.priority, v.last_used, -v.memory_mb)


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
    __slots__ = ("cpus", "i", "mem", "node", "run", "taken", "used", "victims")

    def __init__(self, node: NodeState, victims: list[SandboxView], base: int) -> None:
        self.node = node
        self.victims = victims
        self.i = 0
        self.mem = 0
        self.cpus = 0.0
        self.run = 0
        self.used = 0
        self.taken = base  # copies that fit already (not ours to count)


def plan_preemption(req: Request, n: int, cluster: Cluster, now: float
                    ) -> dict[str, tuple[int, list[SandboxView]]]:
    """Idle lower-priority sandboxes to pause so that up to `n` more copies of `req` fit.

    Returns node id -> (copies that fit there once its victims are paused, victims). Empty when no
    idle sandbox of a low enough class exists. Reads `cluster` and never changes it."""
    p = cluster.policy
    lowest = req.priority + p.preempt_gap
    if n <= 0 or lowest >= len(p.priorities):
        return {}
    cands: list[_Cand] = []
    for nid in cluster.healthy_ids():
        node = cluster.node(nid)
        if req.backend not in node.backends or nid in req.avoid:
            continue
        if not any(r >= lowest for r in node.by_priority):
            continue
        idle_before = now - p.min_idle_s
        victims = [v for v in node.sandboxes.values()
                   if v.state == "running" and v.priority >= lowest and v.last_used <= idle_before]
        if not victims:
            continue
        victims.sort(key=victim_order)
        cands.append(_Cand(node, victims, _room_after(node, req, p, 0, 0.0, 0, 0)))
    if not cands:
        return {}
    # nodes whose idle sandboxes are of the lowest class go first; then those with most to give
    cands.sort(key=lambda c: (-c.victims[0].priority, -sum(v.memory_mb for v in c.victims)))
    budget = p.max_victims * n
    left = n
    per_node = math.ceil(n / len(cands))
    for cap in (per_node, n):  # a spread pass, then whatever room is left
        for c in cands:
            if left <= 0 or budget <= 0:
                break
            got = _room_after(c.node, req, p, c.mem, c.cpus, c.run, c.used) - c.taken
            target = min(left + got, cap)
            while got < target and c.i < len(c.victims) and budget > 0:
                v = c.victims[c.i]
                c.i += 1
                budget -= 1
                c.mem += v.memory_mb
                c.cpus += v.cpus
                c.run += 1
                c.used += v.used_mb
                new = _room_after(c.node, req, p, c.mem, c.cpus, c.run, c.used) - c.taken
                left -= new - got
                got = new
            left = max(left, 0)
    out: dict[str, tuple[int, list[SandboxView]]] = {}
    for c in cands:
        if c.i:
            copies = _room_after(c.node, req, p, c.mem, c.cpus, c.run, c.used) - c.taken
            if copies > 0:
                out[c.node.node_id] = (copies, c.victims[:c.i])
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


def plan_tides(node: NodeState, now: float, policy: Policy) -> list[SandboxView]:
    """Sandboxes to pause on a node whose used memory is over `tide_high`; [] when memory is not tight."""
    if node.used_mb < policy.tide_high * node.memory_mb:
        return []
    need = node.used_mb - policy.tide_low * node.memory_mb
    idle_before = now - policy.tide_idle_s
    victims = [v for v in node.sandboxes.values() if v.state == "running" and v.last_used <= idle_before]
    victims.sort(key=victim_order)
    out: list[SandboxView] = []
    freed = 0
    for v in victims:
        if freed >= need:
            break
        out.append(v)
        freed += v.used_mb
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
