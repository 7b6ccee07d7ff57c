"""`fork` (alias `snapshot`): snapshot a sandbox and start children from it, beside `docker commit` + run.

- fork: a parent writes `change_mb` MB, is snapshotted; `n` children start from the snapshot (every one
  must see the parent's file), next to `n` fresh `base` sandboxes in the same run; then `fork(8)` end to end.
- snapshot: a sandbox with `snapshot_mb` MB of changes (30% in 2,000 small files, the rest in 4 big ones)
  is snapshotted `reps` times: seconds, time frozen, layer size.
- Docker: `docker commit` of a container with the same change, then `n` containers from the new image.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import shoal
from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult, at_most
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios.common import docker_create_one, docker_remove_all, gather_bounded
from shoal.bench.stats import latency_summary


@dataclass(frozen=True)
class ForkParams:
    """How much work the fork scenario does."""

    n: int = param(100, quick=10, help="children started from the snapshot (and fresh sandboxes, and containers)")
    change_mb: int = param(10, help="MB the parent writes before the snapshot")
    memory_mb: int = param(256, help="memory limit of the parent and the children")
    snapshot_mb: int = param(50, help="MB of changes in the snapshot-timing sandbox")
    reps: int = param(3, quick=2, help="snapshots timed")


async def fork_bench(c: shoal.Client, n: int = 100, change_mb: int = 10, memory_mb: int = 256) -> dict[str, Any]:
    """Time until `n` children of a snapshot are ready (agent answering), next to `n` fresh `base` sandboxes."""
    out: dict[str, Any] = {"bench": "fork", "n": n, "change_mb": change_mb}
    node = c.transport.node  # type: ignore[attr-defined]
    parent = await c.create("base", memory_mb=memory_mb)
    name = f"bench-stateful/fork:{os.getpid()}"
    try:
        await parent.exec(f"mkdir -p /work && head -c {change_mb << 20} /dev/urandom > /work/data && "
                          "echo parent > /work/who")
        t0 = time.monotonic()
        img = await parent.snapshot(name)
        snap_s = time.monotonic() - t0
        t0 = time.monotonic()
        kids = await c.create_many(name, n=n, memory_mb=memory_mb)
        children_s = time.monotonic() - t0
        ok = [k for k in kids if not isinstance(k, Exception)]
        # every child is usable and sees the parent's files
        t0 = time.monotonic()
        outs = await gather_bounded([k.exec("cat /work/who") for k in ok], 16)
        first_exec_s = time.monotonic() - t0
        good = sum(o.stdout == b"parent\n" for o in outs)
        await gather_bounded([k.close() for k in ok], 16)
        t0 = time.monotonic()
        fresh = await c.create_many("base", n=n, memory_mb=memory_mb)
        fresh_s = time.monotonic() - t0
        await gather_bounded([k.close() for k in fresh if not isinstance(k, Exception)], 16)
        t0 = time.monotonic()
        forked = await parent.fork(min(n, 8), name=f"{name}-8", memory_mb=memory_mb)
        fork8_s = time.monotonic() - t0
        await gather_bounded([k.close() for k in forked], 16)
        out.update(snapshot_s=round(snap_s, 3), layer_mib=round(img["diff_bytes"] / 2**20, 1),
                   children_ready_s=round(children_s, 3), children_ok=len(ok), children_see_parent=good,
                   children_per_s=round(len(ok) / children_s, 1), exec_all_children_s=round(first_exec_s, 3),
                   fresh_base_ready_s=round(fresh_s, 3), snapshot_plus_children_s=round(snap_s + children_s, 3),
                   fork8_total_s=round(fork8_s, 3))
    finally:
        with contextlib.suppress(shoal.ShoalError):
            await parent.close()
        for nm in (name, f"{name}-8"):
            with contextlib.suppress(Exception):
                node.store.remove_image(nm)
    return out


async def snapshot_bench(c: shoal.Client, change_mb: int = 50, reps: int = 3) -> dict[str, Any]:
    """Snapshot of a sandbox with `change_mb` MB of changes (30% in 2,000 small files, the rest in 4 big ones)."""
    times: list[float] = []
    frozen: list[float] = []
    sizes: list[int] = []
    names = []
    sb = await c.create("base", memory_mb=512)
    try:
        for rep in range(reps):
            small = int(change_mb * 0.3 * 2**20 / 2000)
            big_mb = max(1, int(change_mb * 0.7 / 4))
            await sb.exec(
                f"rm -rf /work; mkdir -p /work/src && cd /work/src && "
                f"for i in $(seq 2000); do head -c {small} /dev/urandom > f$i.txt; done && "
                f"for j in 1 2 3 4; do head -c {big_mb << 20} /dev/urandom > /work/big$j.bin; done && "
                f"echo {rep} > /work/rep", timeout=600)
            name = f"bench-stateful/snap:{os.getpid()}-{rep}"
            img = await sb.snapshot(name)
            names.append(name)
            times.append(img["seconds"])
            frozen.append(img["frozen_s"])
            sizes.append(img["diff_bytes"])
    finally:
        with contextlib.suppress(shoal.ShoalError):
            await sb.close()
        store = c.transport.node.store  # type: ignore[attr-defined]
        for nm in names:
            with contextlib.suppress(Exception):
                store.remove_image(nm)
    return {"bench": "snapshot", "change_mb": change_mb, "reps": reps, "seconds": latency_summary(times),
            "frozen": latency_summary(frozen), "layer_mib": round(statistics.fmean(sizes) / 2**20, 1) if sizes else 0}


async def docker_fork(ctx: BenchContext, n: int, change_mb: int = 10) -> dict[str, Any]:
    """`docker commit` of a container with `change_mb` MB written, then `n` containers from the new image."""
    assert ctx.docker is not None
    d = ctx.docker
    parent = await docker_create_one(ctx)
    tag = "shoal-bench-fork:latest"
    kids: list[str] = []
    try:
        code, _ = await d.exec(parent, ["sh", "-c", f"mkdir -p /work && head -c {change_mb << 20} /dev/urandom "
                                        "> /work/data && echo parent > /work/who"])
        t0 = time.perf_counter()
        r = await d.client.post("/commit", params={"container": parent, "repo": "shoal-bench-fork", "tag": "latest"})
        commit_s = time.perf_counter() - t0
        if r.status_code != 201:
            return {"error": f"commit: {r.status_code} {r.text[:200]}"}
        base_image = d.image
        d.image = tag
        try:
            t0 = time.perf_counter()
            with ctx.task(f"Docker: {n} containers from the commit", n) as adv:
                got = await ctx.bounded([docker_create_one(ctx) for _ in range(n)], 16, adv)
            children_s = time.perf_counter() - t0
        finally:
            d.image = base_image
        kids = [c for c in got if isinstance(c, str)]
        return {"n": n, "ok": len(kids), "change_mb": change_mb, "commit_s": round(commit_s, 3),
                "children_ready_s": round(children_s, 3), "snapshot_plus_children_s": round(commit_s + children_s, 3),
                "exit": code}
    finally:
        await docker_remove_all(ctx, [*kids, parent])
        with contextlib.suppress(Exception):
            await d.client.delete(f"/images/{tag}", params={"force": "1"})


async def run(ctx: BenchContext, p: ForkParams) -> ScenarioResult:
    """The fork scenario (see the module docstring)."""
    res = ScenarioResult("fork", docker=ctx.docker_status)
    fk = await fork_bench(ctx.client, p.n, p.change_mb, p.memory_mb)
    res.data["fork"] = fk
    dk: dict[str, Any] = {}
    if ctx.docker:
        dk = await docker_fork(ctx, p.n, p.change_mb)
        res.data["docker_fork"] = dk
    ready = fk.get("children_ready_s")
    res.add(Metric(f"snapshot + {p.n} children ready", fk.get("snapshot_plus_children_s"),
                   dk.get("snapshot_plus_children_s"), "s", note="Docker: commit + run"),
            Metric(f"{p.n} children ready (after the snapshot)", ready, dk.get("children_ready_s"), "s",
                   target="≤ 2 s (issue 4)", met=at_most(ready, 2)),
            Metric(f"children that see the parent's file (of {fk.get('children_ok')})", fk.get("children_see_parent"),
                   None, "", better="higher"),
            Metric(f"{p.n} fresh base sandboxes ready (same run)", fk.get("fresh_base_ready_s"), None, "s"),
            Metric("fork(8): snapshot + 8 children ready", fk.get("fork8_total_s"), None, "s"))
    snap = await snapshot_bench(ctx.client, p.snapshot_mb, p.reps)
    res.data["snapshot"] = snap
    p50 = snap["seconds"].get("p50_ms")
    p50_s = p50 / 1000 if p50 is not None else None
    res.add(Metric(f"snapshot of a sandbox with {p.snapshot_mb} MB of changes, p50", p50_s, None, "s",
                   target="≤ 2 s (issue 4)", met=at_most(p50_s, 2),
                   note=f"frozen {snap['frozen'].get('p50_ms') or 0:.0f} ms, layer {snap['layer_mib']} MiB"))
    return res


SCENARIO = Scenario("fork", "snapshot a sandbox and start children from it (beside docker commit + run)", run,
                    ForkParams)
