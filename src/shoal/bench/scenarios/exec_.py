"""`exec`: round trip of `true` in one sandbox, and throughput of small execs spread over many sandboxes.

shoal: the node's exec (agent protocol over the sandbox's Unix socket) of argv ["true"]. Docker: the
Engine API's exec (create, start attached until EOF, inspect for the exit code) of the same argv —
what `docker exec` and docker-py's exec_run do. Also the agent alone: the same round trip to the agent
binary run as a plain host process (no sandbox, no node), which is the floor the sandbox figure sits on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from shoal.bench import plots
from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult, at_most
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
from shoal.bench.stats import latency_summary
from shoal.errors import ShoalError

TRUE = ["true"]


@dataclass(frozen=True)
class ExecParams:
    """How much work the exec scenario does."""

    rtt: int = param(1000, quick=200, help="sequential round trips of `true` in one sandbox (shoal)")
    rtt_docker: int = param(200, quick=30, help="sequential `docker exec true` round trips")
    agent_rtt: int = param(1000, quick=200, help="round trips to the agent run as a host process (0: skip)")
    sandboxes: int = param(100, quick=10, help="sandboxes the throughput phase spreads execs over (shoal)")
    sandboxes_docker: int = param(20, quick=5, help="containers the throughput phase spreads execs over")
    throughput_s: float = param(5.0, quick=2.0, help="seconds of the throughput phase")
    concurrency: int = param(32, quick=16, help="execs in flight in the throughput phase")


async def agent_alone(ctx: BenchContext, n: int) -> Timed:
    """Round trips of `true` to the agent binary started as a plain host process on a private socket."""
    from shoal.agentbin import find_agent_binary
    from shoal.agentproto import AgentClient

    d = Path(tempfile.mkdtemp(prefix="sba-", dir="/tmp"))  # short: Unix socket paths are limited to 108 bytes
    sock = d / "a.sock"
    proc = subprocess.Popen([str(find_agent_binary()), "--listen", str(sock)], start_new_session=True,
                            stdin=subprocess.DEVNULL)
    try:
        for _ in range(1500):
            if sock.exists() or proc.poll() is not None:
                break
            await asyncio.sleep(0.01)
        client = await AgentClient.connect_unix(str(sock))
        try:
            async def call() -> None:
                r = await client.exec(TRUE)
                if r.exit_code != 0:
                    raise ShoalError(f"true exited {r.exit_code}")

            return await _rtt(ctx, n, call, "agent alone")
        finally:
            await client.close()
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(d, ignore_errors=True)


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


async def run(ctx: BenchContext, sz: ExecParams) -> ScenarioResult:
    """The exec scenario (see the module docstring)."""
    res = ScenarioResult("exec", docker=ctx.docker_status)
    d = res.data
    node = ctx.node

    sid = (await create_one(ctx)).id
    try:
        async def shoal_true() -> None:
            r = await node.exec(sid, TRUE, timeout=30)
            if r.exit_code != 0:
                raise ShoalError(f"true exited {r.exit_code}")

        rtt = await _rtt(ctx, sz.rtt, shoal_true, "shoal")
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

            drtt = await _rtt(ctx, sz.rtt_docker, docker_true, "Docker")
        finally:
            await docker_remove_all(ctx, [cid])
        d["round_trip"]["docker"] = latency_summary(drtt.latencies)
        d["round_trip"]["docker_ms"] = [round(x * 1000, 3) for x in drtt.latencies]
    s = d["round_trip"]["shoal"]
    dk = d["round_trip"].get("docker", {})
    res.add(Metric("exec round trip p50 (`true`)", s.get("p50_ms"), dk.get("p50_ms"), "ms", target="≤ 3 ms",
                   met=at_most(s.get("p50_ms"), 3)),
            Metric("exec round trip p99 (`true`)", s.get("p99_ms"), dk.get("p99_ms"), "ms"))
    if sz.agent_rtt:
        alone = await agent_alone(ctx, sz.agent_rtt)
        d["round_trip"]["agent_alone"] = latency_summary(alone.latencies)
        d["round_trip"]["agent_alone_errors"] = first_errors(alone.errors)
        res.add(Metric("exec round trip p50, agent alone (host process: no sandbox, no node)",
                       d["round_trip"]["agent_alone"].get("p50_ms"), None, "ms",
                       note="the protocol's floor under the sandbox figure"))

    # throughput over many sandboxes
    n_sb, conc, dur = sz.sandboxes, sz.concurrency, sz.throughput_s
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
        n_d = sz.sandboxes_docker
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


SCENARIO = Scenario("exec", "exec round trip of `true`; throughput of small execs across many sandboxes", run,
                    ExecParams)
