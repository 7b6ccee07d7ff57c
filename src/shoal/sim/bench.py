"""Scheduler decision speed in isolation (`shoal sim --bench`): decisions per second of CPU, a 32k burst.

Measured with `time.process_time` (CPU of this process only), so a busy shared machine slows the
wall clock but not the figure. The cluster is DSec-sized (160 nodes × 190 cores × 1.5 TiB) and
half full of tracked sandboxes, as at an ordinary hour of the simulated day.
"""

from __future__ import annotations

import gc
import random
import time
from typing import Any

from shoal.sched import (
    Cluster,
    NodeState,
    Placement,
    Policy,
    Request,
    SandboxView,
    place,
    place_many,
    plan_preemption,
    reserve_plan,
)


def _cluster(nodes: int, fill: float, seed: int) -> tuple[Cluster, random.Random]:
    pol = Policy()
    c = Cluster([NodeState.new(f"n{i}", 190, 1_572_864, pol) for i in range(nodes)], pol, seed=seed)
    rng = random.Random(seed)
    per_node = int(fill * 1_572_864 * pol.memory_overcommit / 2048)
    sid = 0
    for node in list(c):
        for _ in range(per_node):
            sid += 1
            prio = rng.choice((0, 1, 2, 3, 3))
            req = Request(cpus=0.5, memory_mb=2048, priority=prio, job=f"j{prio}")
            c.reserve(Placement(node.node_id), req)
            c.track(SandboxView(f"s{sid}", node.node_id, 2048, 0.5, prio, f"j{prio}",
                                last_used=rng.uniform(-3600, 0), used_mb=400))
        c.mount_started(node, [f"base{i}" for i in range(8)] + [f"task{rng.randrange(60_000)}" for _ in range(200)])
        c.mount_done(node.node_id, 208)
    return c, rng


def run(nodes: int = 160, decisions: int = 100_000, burst: int = 32_000, seed: int = 0) -> dict[str, Any]:
    """Time `decisions` single placements, one `burst` of distinct images, one of a single image, and
    a preemption plan for a burst on a full cluster. Returns the figures."""
    was = gc.isenabled()
    gc.disable()  # as in a simulation run: a collection must not land inside a timed decision
    try:
        return _run(nodes, decisions, burst, seed)
    finally:
        if was:
            gc.enable()


def _run(nodes: int, decisions: int, burst: int, seed: int) -> dict[str, Any]:
    clock = time.process_time
    out: dict[str, Any] = {"nodes": nodes}
    c, rng = _cluster(nodes, 0.5, seed)
    reqs = [Request(cpus=1, memory_mb=rng.choice((1024, 2048, 4096)), priority=rng.randrange(4), job="j",
                    layers=(f"base{rng.randrange(8)}", "toolkit0", f"task{rng.randrange(60_000)}"))
            for _ in range(decisions)]
    t0 = clock()
    for r in reqs:
        p = place(r, c)
        c.reserve(p, r)
        if p.cold_layers:
            c.mount_done(p.node_id, len(p.cold_layers))
    dt = clock() - t0
    out["place"] = {"decisions": decisions, "cpu_s": round(dt, 3), "decisions_per_s": round(decisions / dt)}

    c, rng = _cluster(nodes, 0.3, seed + 1)
    reqs = [Request(cpus=1, memory_mb=2048, priority=0, job="step", layers=("base0", "toolkit0", f"task{i // 2}"))
            for i in range(burst)]
    t0 = clock()
    for r in reqs:
        p = place(r, c)
        c.reserve(p, r)
        if p.cold_layers:
            c.mount_done(p.node_id, len(p.cold_layers))
    dt = clock() - t0
    per_node = [n.running for n in c]
    out["burst_distinct_images"] = {"size": burst, "cpu_s": round(dt, 3), "decisions_per_s": round(burst / dt)}

    c, rng = _cluster(nodes, 0.3, seed + 2)
    before = {n.node_id: n.running for n in c}
    req = Request(cpus=1, memory_mb=2048, priority=0, job="step", layers=("base0", "toolkit0", "task-one"))
    t0 = clock()
    plan = place_many(req, burst, c)
    reserve_plan(c, plan, req)
    dt = clock() - t0
    got = [n.running - before[n.node_id] for n in c]
    out["burst_one_image"] = {"size": burst, "placed": plan.placed, "cpu_s": round(dt, 4),
                              "max_per_node": max(got), "min_per_node": min(got)}
    del per_node

    c, rng = _cluster(nodes, 0.999, seed + 3)
    req = Request(cpus=1, memory_mb=2048, priority=0, job="step", layers=("base0",))
    t0 = clock()
    pre = plan_preemption(req, burst, c, now=0.0)
    dt = clock() - t0
    out["preempt_plan"] = {"size": burst, "copies": sum(k for k, _ in pre.values()),
                           "victims": sum(len(v) for _, v in pre.values()), "nodes": len(pre), "cpu_s": round(dt, 3)}
    return out


def text(res: dict[str, Any]) -> str:
    """One line per figure."""
    p, b, o, pr = res["place"], res["burst_distinct_images"], res["burst_one_image"], res["preempt_plan"]
    return "\n".join([
        f"scheduler decisions on {res['nodes']} nodes (CPU time of this process):",
        f"  place + reserve:            {p['decisions_per_s']:,} decisions/s ({p['decisions']:,} in {p['cpu_s']} s)",
        f"  burst of {b['size']:,} (distinct images, one decision each): {b['cpu_s']} s",
        f"  burst of {o['size']:,} (one image, place_many): {o['cpu_s']} s, per node {o['min_per_node']}-"
        f"{o['max_per_node']}",
        f"  preemption plan for {pr['size']:,} on a full cluster: {pr['cpu_s']} s ({pr['victims']:,} victims on "
        f"{pr['nodes']} nodes make room for {pr['copies']:,})",
    ])
