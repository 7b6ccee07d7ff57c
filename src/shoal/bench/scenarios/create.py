"""`create`: sequential create-to-ready latency, sustained creates/s with concurrency, a 1,000-sandbox burst.

"Ready" for shoal: the sandbox's agent answered `hello` (commands can run). For Docker: the Engine API's
`start` returned (the container's process runs) — Docker's most favourable reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from shoal.bench import plots
from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult, at_least, at_most
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios.common import (
    Timed,
    close_all,
    closed_loop,
    create_one,
    docker_create_one,
    docker_remove_all,
    first_errors,
    spec,
)
from shoal.bench.stats import latency_summary, rate_timeline
from shoal.errors import ShoalError


@dataclass(frozen=True)
class CreateParams:
    """How much work the create scenario does."""

    seq: int = param(200, quick=20, help="sequential creates (shoal)")
    seq_docker: int = param(30, quick=5, help="sequential create+start (Docker)")
    pool_size: int = param(64, quick=16, help="warm pool size for the pool-hit figures")
    sustained_s: float = param(10.0, quick=3.0, help="seconds of each sustained-rate phase (shoal)")
    sustained_concurrency: tuple[int, ...] = param((1, 8, 32), quick=(16,),
                                                   help="concurrency of the sustained-rate phases")
    sustained_docker_s: float = param(15.0, quick=4.0, help="seconds of each sustained-rate phase (Docker)")
    interleaved_concurrency: tuple[int, ...] = param((8, 32), quick=(16,),
                                                     help="workers of the create-then-close-the-previous loop")
    burst: int = param(1000, quick=100, help="sandboxes in the create_many burst (shoal)")
    burst_docker: int = param(1000, quick=20, help="containers in the burst (Docker)")
    docker_budget_s: float = param(180.0, quick=30.0, help="time Docker gets per phase before it is cut short")


async def sequential(ctx: BenchContext, n: int) -> Timed:
    """`n` creates one after the other (all kept alive until the end, then closed)."""
    out = Timed()
    with ctx.task(f"shoal: {n} sequential creates", n) as adv:
        for _ in range(n):
            t = time.perf_counter()
            try:
                info = await create_one(ctx)
            except ShoalError as e:
                out.errors.append(str(e)[:300])
                adv()
                continue
            out.latencies.append(time.perf_counter() - t)
            out.items.append(info.id)
            adv()
    await close_all(ctx, out.items)
    return out


async def docker_sequential(ctx: BenchContext, n: int, budget_s: float) -> Timed:
    """`n` Docker create+start one after the other (for at most `budget_s`), then removed."""
    out = Timed()
    t0 = time.perf_counter()
    with ctx.task(f"Docker: {n} sequential runs", n) as adv:
        for _ in range(n):
            if time.perf_counter() - t0 > budget_s:
                break
            t = time.perf_counter()
            try:
                cid = await docker_create_one(ctx)
            except Exception as e:
                out.errors.append(str(e)[:300])
                adv()
                continue
            out.latencies.append(time.perf_counter() - t)
            out.items.append(cid)
            adv()
    await docker_remove_all(ctx, out.items)
    return out


async def pool_hits(ctx: BenchContext, size: int) -> tuple[Timed, dict[str, Any]]:
    """Sequential creates served by a warm pool of `size` (refilled in the background as they are taken)."""
    node = ctx.node
    node.pool.configure(spec(ctx), size)
    t0 = time.perf_counter()
    with ctx.task(f"shoal: filling a warm pool of {size}", None):
        await node.pool.wait_full()
    fill_s = time.perf_counter() - t0
    hits0, misses0 = node.pool.hits, node.pool.misses
    out = Timed()
    n = max(1, size // 2)
    with ctx.task(f"shoal: {n} sequential creates from the pool", n) as adv:
        for _ in range(n):
            t = time.perf_counter()
            info = await create_one(ctx)
            out.latencies.append(time.perf_counter() - t)
            out.items.append(info.id)
            adv()
    stats = {"pool_size": size, "fill_s": round(fill_s, 2), "fill_rate_per_s": round(size / fill_s, 1),
             "hits": node.pool.hits - hits0, "misses": node.pool.misses - misses0}
    await close_all(ctx, out.items)
    return out, stats


async def sustained_with_pool(ctx: BenchContext, concurrency: int, duration: float, size: int) -> dict[str, Any]:
    """The sustained loop with a warm pool on: every hit is refilled by a cold create in the background."""
    node = ctx.node
    node.pool.configure(spec(ctx), size)
    await node.pool.wait_full()
    hits0 = node.pool.hits
    t, _ = await sustained(ctx, concurrency, duration)
    hits = node.pool.hits - hits0
    node.pool.configure(spec(ctx), 0)
    await node.pool.close()
    return {"concurrency": concurrency, "pool_size": size, "seconds": duration, "created": len(t.items),
            "rate_per_s": round(t.rate(), 1), "pool_hits": hits, "latency": latency_summary(t.latencies)}


async def sustained(ctx: BenchContext, concurrency: int, duration: float) -> tuple[Timed, float]:
    """Creates back to back by `concurrency` workers for `duration` s; then close them (timed)."""
    with ctx.task(f"shoal: sustained creates, {concurrency} at a time, {duration:.0f}s", None) as adv:
        t = await closed_loop(lambda: create_one(ctx), concurrency, duration, adv)
    ids = [i.id for i in t.items]
    close_s = await close_all(ctx, ids, f"closing {len(ids)} sandboxes")
    return t, close_s


async def interleaved(create: Callable[[], Awaitable[Any]], close: Callable[[Any], Awaitable[Any]], concurrency: int,
                      duration: float, advance: Callable[..., None] | None = None) -> tuple[Timed, list[float]]:
    """The RL loop: `concurrency` workers create sandboxes back to back for `duration` s, and after each
    create the worker closes the oldest one still alive, so `concurrency` stay alive and every create
    competes with a teardown. Returns the creates (latency, completion times) and the closes' latencies;
    the last ones are closed."""
    alive: deque[Any] = deque()
    closes: list[float] = []

    async def rotate(item: Any) -> None:
        alive.append(item)
        if len(alive) > concurrency:
            old = alive.popleft()
            c = time.perf_counter()
            with contextlib.suppress(Exception):
                await close(old)
            closes.append(time.perf_counter() - c)

    out = await closed_loop(create, concurrency, duration, advance, on_item=rotate)
    out.items.clear()  # closed, or closed below: nothing for the caller
    await asyncio.gather(*(close(x) for x in alive), return_exceptions=True)
    return out, closes


async def docker_sustained(ctx: BenchContext, concurrency: int, duration: float) -> tuple[Timed, float]:
    """The same closed loop with Docker create+start."""
    with ctx.task(f"Docker: sustained runs, {concurrency} at a time, {duration:.0f}s", None) as adv:
        t = await closed_loop(lambda: docker_create_one(ctx), concurrency, duration, adv)
    rm_s = await docker_remove_all(ctx, t.items)
    return t, rm_s


def _bucket(duration: float) -> float:
    # about 50 points per curve, at least 0.1 s wide (narrower buckets only show quantisation noise)
    return max(0.25, round(duration / 40, 1))


async def burst(ctx: BenchContext, n: int) -> dict[str, Any]:
    """`create_many(n)`: per-sandbox ready time since the burst started, and when all were ready."""
    done_at: list[float] = []
    errors: list[str] = []
    with ctx.task(f"shoal: burst of {n} (create_many)", n) as adv:
        t0 = time.perf_counter()

        def on_done(res: Any) -> None:
            if isinstance(res, ShoalError):
                errors.append(str(res)[:300])
            else:
                done_at.append(time.perf_counter() - t0)
            adv()

        items = await ctx.node.create_many(spec(ctx), n, on_done=on_done)
        all_s = time.perf_counter() - t0
    ids = [i.id for i in items if not isinstance(i, ShoalError)]
    close_s = await close_all(ctx, ids, f"closing {len(ids)} sandboxes")
    return {"n": n, "ok": len(ids), "errors": len(errors), "error_samples": first_errors(errors),
            "all_ready_s": round(all_s, 3), "ready_since_start": latency_summary(done_at),
            "rate_per_s": round(len(ids) / all_s, 1) if all_s else None,
            "timeline": rate_timeline(done_at, _bucket(all_s)), "close_all_s": round(close_s, 2),
            "_done_at": done_at}


async def docker_burst(ctx: BenchContext, n: int, budget: float) -> dict[str, Any]:
    """`n` Docker runs at once (the same parallelism as create_many), within `budget` seconds."""
    conc = ctx.node.config.create_concurrency
    with ctx.task(f"Docker: burst of {n} ({conc} at a time, ≤{budget:.0f}s)", n) as adv:
        t = await closed_loop(lambda: docker_create_one(ctx), conc, budget, adv, max_items=n)
    rm_s = await docker_remove_all(ctx, t.items)
    ok = len(t.items)
    last = max(t.done_at) if t.done_at else None
    return {"n": n, "ok": ok, "errors": len(t.errors), "error_samples": first_errors(t.errors),
            "all_ready_s": round(last, 3) if ok == n and last else None,
            "finished_within_budget": ok == n, "budget_s": budget, "ready_since_start": latency_summary(t.done_at),
            "rate_per_s": round(ok / last, 1) if last else None,
            "timeline": rate_timeline(t.done_at, _bucket(last or 0)), "remove_all_s": round(rm_s, 2),
            "_done_at": t.done_at}


async def run(ctx: BenchContext, sz: CreateParams) -> ScenarioResult:
    """The create scenario (see the module docstring)."""
    res = ScenarioResult("create", docker=ctx.docker_status)
    d = res.data
    # warm-up: first use mounts the image's layers and the upper pool; not part of any figure
    await close_all(ctx, [(await create_one(ctx)).id], "warm-up")

    seq = await sequential(ctx, sz.seq)
    d["sequential"] = {"shoal": latency_summary(seq.latencies), "errors": first_errors(seq.errors),
                       "shoal_ms": [round(x * 1000, 3) for x in seq.latencies]}
    dseq = None
    if ctx.docker:
        await docker_remove_all(ctx, [await docker_create_one(ctx)], "Docker warm-up")
        dseq = await docker_sequential(ctx, sz.seq_docker, sz.docker_budget_s)
        d["sequential"]["docker"] = latency_summary(dseq.latencies)
        d["sequential"]["docker_ms"] = [round(x * 1000, 3) for x in dseq.latencies]
    s50 = d["sequential"]["shoal"].get("p50_ms")
    dd = d["sequential"].get("docker", {})
    res.add(Metric("create-to-ready p50 (sequential)", s50, dd.get("p50_ms"), "ms", target="≤ 15 ms",
                   met=at_most(s50, 15)),
            Metric("create-to-ready p99 (sequential)", d["sequential"]["shoal"].get("p99_ms"), dd.get("p99_ms"), "ms"))

    # the same sequential creates served by a warm pool (refilled in the background)
    ph, pstats = await pool_hits(ctx, sz.pool_size)
    ctx.node.pool.configure(spec(ctx), 0)
    await ctx.node.pool.close()
    d["pool"] = {"shoal": latency_summary(ph.latencies), **pstats,
                 "shoal_ms": [round(x * 1000, 3) for x in ph.latencies]}
    res.add(Metric(f"create-to-ready p50, warm-pool hit (pool of {sz.pool_size})", d["pool"]["shoal"].get("p50_ms"),
                   dd.get("p50_ms"), "ms", note="refills run in the background; cold figure above"),
            Metric("create-to-ready p99, warm-pool hit", d["pool"]["shoal"].get("p99_ms"), dd.get("p99_ms"), "ms"))

    # sustained rate at each concurrency; the best one is the node's sustained rate
    d["sustained"] = []
    best = (0.0, 0)
    for c in sz.sustained_concurrency:
        t, close_s = await sustained(ctx, c, sz.sustained_s)
        row = {"concurrency": c, "seconds": sz.sustained_s, "created": len(t.items), "rate_per_s": round(t.rate(), 1),
               "latency": latency_summary(t.latencies), "errors": len(t.errors),
               "error_samples": first_errors(t.errors), "close_rate_per_s": round(len(t.items) / close_s, 1)
               if close_s else None}
        d["sustained"].append(row)
        if t.rate() > best[0]:
            best = (t.rate(), c)
    # with a warm pool the rate cannot be higher: every hit costs a cold create to refill
    d["sustained_with_pool"] = await sustained_with_pool(ctx, best[1] or 16, sz.sustained_s, sz.pool_size)
    dbest = (0.0, 0)
    if ctx.docker:
        d["sustained_docker"] = []
        for c in sorted({min(c, 16) for c in sz.sustained_concurrency}):
            t, rm_s = await docker_sustained(ctx, c, sz.sustained_docker_s)
            d["sustained_docker"].append({"concurrency": c, "seconds": sz.sustained_docker_s, "created": len(t.items),
                                          "rate_per_s": round(t.rate(), 2), "latency": latency_summary(t.latencies),
                                          "errors": len(t.errors), "error_samples": first_errors(t.errors),
                                          "remove_rate_per_s": round(len(t.items) / rm_s, 2) if rm_s else None})
            if t.rate() > dbest[0]:
                dbest = (t.rate(), c)
    res.add(Metric(f"sustained creates/s (best of concurrency {list(sz.sustained_concurrency)})", round(best[0], 1),
                   round(dbest[0], 2) if ctx.docker else None, "/s", better="higher", target="≥ 150/s",
                   met=at_least(best[0], 150), note=f"shoal at {best[1]}, Docker at {dbest[1]}"))
    # the RL loop: every create beside the close of the sandbox it replaces (shoal, then Docker)
    d["interleaved"] = []
    ibest: tuple[float, int, dict[str, Any]] = (0.0, 0, {})
    for c in sz.interleaved_concurrency:
        with ctx.task(f"shoal: create + close the previous, {c} workers, {sz.sustained_s:.0f}s", None) as adv:
            t, closes = await interleaved(lambda: create_one(ctx), lambda i: ctx.node.close(i.id), c,
                                          sz.sustained_s, adv)
        row = {"concurrency": c, "seconds": sz.sustained_s, "created": len(t.latencies),
               "rate_per_s": round(t.rate(), 1), "create": latency_summary(t.latencies),
               "close": latency_summary(closes), "errors": len(t.errors), "error_samples": first_errors(t.errors)}
        d["interleaved"].append(row)
        if t.rate() > ibest[0]:
            ibest = (t.rate(), c, row)
    dib: tuple[float, int, dict[str, Any]] = (0.0, 0, {})
    if ctx.docker:
        d["interleaved_docker"] = []
        docker = ctx.docker
        for c in sorted({min(c, 16) for c in sz.interleaved_concurrency}):
            with ctx.task(f"Docker: run + remove the previous, {c} workers, {sz.sustained_docker_s:.0f}s", None) as adv:
                t, closes = await interleaved(lambda: docker_create_one(ctx), docker.remove, c,
                                              sz.sustained_docker_s, adv)
            row = {"concurrency": c, "seconds": sz.sustained_docker_s, "rate_per_s": round(t.rate(), 2),
                   "create": latency_summary(t.latencies), "close": latency_summary(closes), "errors": len(t.errors)}
            d["interleaved_docker"].append(row)
            if t.rate() > dib[0]:
                dib = (t.rate(), c, row)
    res.add(Metric(f"sustained creates/s with closes interleaved (best of {list(sz.interleaved_concurrency)})",
                   round(ibest[0], 1), round(dib[0], 2) if ctx.docker else None, "/s", better="higher",
                   target="≥ 150/s", met=at_least(ibest[0], 150),
                   note=f"shoal at {ibest[1]} workers, Docker at {dib[1]}; every create beside the close of the "
                        "sandbox it replaces"),
            Metric("create p50 in that loop", ibest[2].get("create", {}).get("p50_ms"),
                   dib[2].get("create", {}).get("p50_ms") if dib[2] else None, "ms",
                   note=f"close p50 {ibest[2].get('close', {}).get('p50_ms')} ms"))
    sp = d["sustained_with_pool"]
    res.add(Metric(f"sustained creates/s with a warm pool of {sp['pool_size']} (refills included)",
                   sp["rate_per_s"], None, "/s", better="higher", note=f"{sp['pool_hits']} pool hits"))
    if ctx.docker and dbest[0]:
        x = best[0] / dbest[0]
        res.add(Metric("create rate ÷ Docker's (same run)", round(x, 1), 1.0, "×", better="higher",
                       target="≥ 20×", met=at_least(x, 20)))

    b = await burst(ctx, sz.burst)
    done_shoal = b.pop("_done_at")
    b["done_at_s"] = [round(x, 4) for x in done_shoal]
    d["burst"] = b
    db = None
    done_docker: list[float] = []
    if ctx.docker:
        db = await docker_burst(ctx, sz.burst_docker, sz.docker_budget_s)
        done_docker = db.pop("_done_at")
        db["done_at_s"] = [round(x, 4) for x in done_docker]
        d["burst_docker"] = db
    res.add(Metric(f"burst of {b['n']}: all ready", b["all_ready_s"], db["all_ready_s"] if db else None, "s",
                   target="≤ 8 s" if b["n"] >= 1000 else "",
                   met=at_most(b["all_ready_s"], 8) if b["n"] >= 1000 else None,
                   note="" if not db or db["finished_within_budget"] else
                   f"Docker: {db['ok']} of {db['n']} in its {db['budget_s']:.0f}s budget"),
            Metric(f"burst of {b['n']}: ready p50 (since burst start)", b["ready_since_start"].get("p50_ms"),
                   db["ready_since_start"].get("p50_ms") if db else None, "ms"),
            Metric(f"burst of {b['n']}: ready p99 (since burst start)", b["ready_since_start"].get("p99_ms"),
                   db["ready_since_start"].get("p99_ms") if db else None, "ms"),
            Metric(f"burst of {b['n']}: sandboxes/s", b["rate_per_s"], db["rate_per_s"] if db else None, "/s",
                   better="higher"))
    if b["errors"]:
        res.notes.append(f"burst: {b['errors']} creates failed: {b['error_samples']}")
    if db and db["n"] != b["n"]:
        res.notes.append(f"the Docker burst had {db['n']} containers (--quick), shoal's {b['n']}")

    if ctx.plot_dir:
        series = {"shoal (cold)": [x * 1000 for x in seq.latencies],
                  f"shoal (warm-pool hit, pool of {sz.pool_size})": [x * 1000 for x in ph.latencies]}
        if dseq:
            series["Docker"] = [x * 1000 for x in dseq.latencies]
        res.figures.append(plots.latency_cdf(ctx.figure_path("create_latency_cdf.png"), series,
                                             "create-to-ready, sequential (shoal: agent answers; Docker: started)"))
        tl = {"shoal": (b["timeline"]["t_s"], b["timeline"]["per_s"], b["timeline"]["cumulative"])}
        if db:
            tl["Docker"] = (db["timeline"]["t_s"], db["timeline"]["per_s"], db["timeline"]["cumulative"])
        res.figures.append(plots.rate_over_time(ctx.figure_path("create_burst_rate.png"), tl,
                                                f"burst: create_many({b['n']}) vs Docker at the same parallelism"))
        bs = {"shoal burst": [x * 1000 for x in done_shoal]}
        if done_docker:
            bs["Docker burst"] = [x * 1000 for x in done_docker]
        res.figures.append(plots.latency_cdf(ctx.figure_path("create_burst_cdf.png"), bs,
                                             "burst: time from burst start until each sandbox is ready",
                                             "ms since the burst started"))
    return res


SCENARIO = Scenario("create", "create-to-ready latency, sustained creates/s, 1,000-sandbox burst", run, CreateParams)
