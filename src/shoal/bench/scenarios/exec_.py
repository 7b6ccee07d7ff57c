"""`exec`: round trip of `true` in one sandbox, and throughput of small execs spread over many sandboxes.

shoal: the node's exec (agent protocol over the sandbox's Unix socket) of argv ["true"]. Docker: the
Engine API's exec (create, start attached until EOF, inspect for the exit code) of the same argv —
what `docker exec` and docker-py's exec_run do.
"""

from __future__ import annotations

import itertools
import time

from shoal.bench import plots
from shoal.bench.context import BenchContext
from shoal.bench.registry import scenario
from shoal.bench.results import Metric, ScenarioResult, at_most
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
from shoal.bench.stats import latency_summary
from shoal.errors import ShoalError

TRUE = ["true"]


async def _rtt(ctx: BenchContext, n: int, call, label: str) -> Timed:
    out = Timed()
    for _ in range(min(20, n)):  # warm-up: first execs fault in the binary and the agent's pages
        await call()
    with ctx.task(f"{label}: {n} round trips of `true`", n) as adv:
        for _ in range(n):
            t = time.perf_counter()
            try:
                await call()
            except Exception as e:
                out.errors.append(str(e)[:300])
                continue
            out.latencies.append(time.perf_counter() - t)
            adv()
    return out


@scenario("exec", "exec round trip of `true`; throughput of small execs across many sandboxes")
async def run(ctx: BenchContext) -> ScenarioResult:
    """The exec scenario (see the module docstring)."""
    sz = ctx.sizes
    res = ScenarioResult("exec", docker=ctx.docker_status)
    d = res.data
    node = ctx.node

    sid = (await create_one(ctx)).id
    try:
        async def shoal_true() -> None:
            r = await node.exec(sid, TRUE, timeout=30)
            if r.exit_code != 0:
                raise ShoalError(f"true exited {r.exit_code}")

        rtt = await _rtt(ctx, sz.exec_rtt, shoal_true, "shoal")
    finally:
        await close_all(ctx, [sid], "closing")
    d["round_trip"] = {"shoal": latency_summary(rtt.latencies), "errors": first_errors(rtt.errors),
                       "shoal_ms": [round(x * 1000, 3) for x in rtt.latencies]}
    drtt = None
    if ctx.docker:
        cid = await docker_create_one(ctx)
        try:
            async def docker_true() -> None:
                code, _ = await ctx.docker.exec(cid, TRUE)
                if code != 0:
                    raise RuntimeError(f"true exited {code}")

            drtt = await _rtt(ctx, sz.exec_rtt_docker, docker_true, "Docker")
        finally:
            await docker_remove_all(ctx, [cid])
        d["round_trip"]["docker"] = latency_summary(drtt.latencies)
        d["round_trip"]["docker_ms"] = [round(x * 1000, 3) for x in drtt.latencies]
    s = d["round_trip"]["shoal"]
    dk = d["round_trip"].get("docker", {})
    res.add(Metric("exec round trip p50 (`true`)", s.get("p50_ms"), dk.get("p50_ms"), "ms", target="≤ 3 ms",
                   met=at_most(s.get("p50_ms"), 3)),
            Metric("exec round trip p99 (`true`)", s.get("p99_ms"), dk.get("p99_ms"), "ms"))

    # throughput over many sandboxes
    n_sb, conc, dur = sz.exec_sandboxes, sz.exec_concurrency, sz.exec_throughput_s
    with ctx.task(f"shoal: creating {n_sb} sandboxes", n_sb) as adv:
        infos = await node.create_many(spec(ctx), n_sb, on_done=lambda _r: adv())
    ids = [i.id for i in infos if not isinstance(i, ShoalError)]
    try:
        rr = itertools.cycle(ids)
        with ctx.task(f"shoal: execs over {len(ids)} sandboxes, {conc} at a time, {dur:.0f}s", None) as adv:
            tp = await closed_loop(lambda: node.exec(next(rr), TRUE, timeout=30), conc, dur, adv)
    finally:
        await close_all(ctx, ids)
    d["throughput"] = {"shoal": {"sandboxes": len(ids), "concurrency": conc, "seconds": dur,
                                 "execs": len(tp.items), "per_s": round(tp.rate(), 1),
                                 "latency": latency_summary(tp.latencies), "errors": first_errors(tp.errors)}}
    dtp = None
    if ctx.docker:
        n_d = sz.exec_sandboxes_docker
        with ctx.task(f"Docker: starting {n_d} containers", n_d) as adv:
            cids = [c for c in await ctx.bounded([docker_create_one(ctx) for _ in range(n_d)], 8, adv)
                    if isinstance(c, str)]
        try:
            rc = itertools.cycle(cids)
            with ctx.task(f"Docker: execs over {len(cids)} containers, {conc} at a time, {dur:.0f}s", None) as adv:
                dtp = await closed_loop(lambda: ctx.docker.exec(next(rc), TRUE), conc, dur, adv)
        finally:
            await docker_remove_all(ctx, cids)
        d["throughput"]["docker"] = {"containers": len(cids), "concurrency": conc, "seconds": dur,
                                     "execs": len(dtp.items), "per_s": round(dtp.rate(), 2),
                                     "latency": latency_summary(dtp.latencies), "errors": first_errors(dtp.errors)}
    ts = d["throughput"]["shoal"]
    td = d["throughput"].get("docker", {})
    res.add(Metric(f"exec throughput ({conc} concurrent, over {len(ids)} sandboxes)", ts["per_s"], td.get("per_s"),
                   "/s", better="higher", note=f"Docker over {td.get('containers')} containers" if td else ""),
            Metric("exec latency under that load, p50", ts["latency"].get("p50_ms"),
                   td.get("latency", {}).get("p50_ms"), "ms"),
            Metric("exec latency under that load, p99", ts["latency"].get("p99_ms"),
                   td.get("latency", {}).get("p99_ms"), "ms"))
    if ctx.plot_dir:
        series = {"shoal": [x * 1000 for x in rtt.latencies]}
        if drtt:
            series["Docker"] = [x * 1000 for x in drtt.latencies]
        res.figures.append(plots.latency_cdf(ctx.figure_path("exec_rtt_cdf.png"), series,
                                             "exec round trip of `true` (one sandbox, sequential)"))
        series = {"shoal": [x * 1000 for x in tp.latencies]}
        if dtp:
            series["Docker"] = [x * 1000 for x in dtp.latencies]
        res.figures.append(plots.latency_cdf(ctx.figure_path("exec_load_cdf.png"), series,
                                             f"exec latency with {conc} concurrent execs over many sandboxes"))
    return res
