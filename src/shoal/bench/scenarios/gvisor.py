"""`gvisor`: what the stronger runtime costs — create and exec under gVisor (runsc) beside crun, in one run.

Both runtimes create the same sandboxes (the scenarios' common spec) one after another, then run
sequential `true` round trips in one sandbox each. gVisor here is Debian 12's runsc on the ptrace
platform (no KVM for it on this host): every syscall of the sandbox is intercepted by the sentry, so
exec-heavy work pays most. The ratio rows say how many times crun is faster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios.common import Timed, close_all, first_errors, spec
from shoal.bench.stats import latency_summary

TRUE = ["true"]


@dataclass(frozen=True)
class GvisorParams:
    """How much work the gvisor scenario does."""

    creates: int = param(30, quick=5, help="sequential creates per runtime")
    rtt: int = param(200, quick=30, help="sequential `true` round trips per runtime")


async def _runtime(ctx: BenchContext, runtime: str, sz: GvisorParams) -> dict[str, Any]:
    node = ctx.node
    made: list[str] = []
    create, rtt = Timed(), Timed()
    try:
        with ctx.task(f"{runtime}: {sz.creates} sequential creates", sz.creates) as adv:
            for _ in range(sz.creates):
                t = time.perf_counter()
                try:
                    made.append((await node.create(spec(ctx, runtime=runtime))).id)
                except Exception as e:
                    create.errors.append(str(e)[:300])
                    continue
                create.latencies.append(time.perf_counter() - t)
                adv()
        if made:
            sid = made[0]
            for _ in range(min(10, sz.rtt)):  # warm-up
                await node.exec(sid, TRUE)
            with ctx.task(f"{runtime}: {sz.rtt} round trips of `true`", sz.rtt) as adv:
                for _ in range(sz.rtt):
                    t = time.perf_counter()
                    try:
                        r = await node.exec(sid, TRUE)
                        if r.exit_code != 0:
                            raise RuntimeError(f"true exited {r.exit_code}")
                    except Exception as e:
                        rtt.errors.append(str(e)[:300])
                        continue
                    rtt.latencies.append(time.perf_counter() - t)
                    adv()
    finally:
        await close_all(ctx, made, f"{runtime}: closing sandboxes")
    return {"create": latency_summary(create.latencies), "create_errors": first_errors(create.errors),
            "exec": latency_summary(rtt.latencies), "exec_errors": first_errors(rtt.errors),
            "create_s": [round(x, 4) for x in create.latencies], "exec_s": [round(x, 5) for x in rtt.latencies]}


async def run(ctx: BenchContext, sz: GvisorParams) -> ScenarioResult:
    """The gvisor scenario (see the module docstring)."""
    res = ScenarioResult("gvisor", docker=ctx.docker_status)
    statuses = ctx.node.runtime_statuses
    gv = statuses.get("gvisor")
    if gv is None or not gv.works:
        res.data["skipped"] = f"gVisor does not work here: {gv.reason if gv else 'unknown'} (apt-get install runsc)"
        return res
    crun = "crun" if statuses.get("crun") and statuses["crun"].works else "runc"
    d = res.data
    d["runtimes"] = {crun: await _runtime(ctx, crun, sz), "gvisor": await _runtime(ctx, "gvisor", sz)}
    d["gvisor_version"] = gv.version
    a, g = d["runtimes"][crun], d["runtimes"]["gvisor"]

    def row(what: str, key: str, q: str) -> list[Metric]:
        base, other = a[key].get(q), g[key].get(q)
        ratio = round(other / base, 1) if base and other else None
        return [Metric(f"{what} {q}, {crun}", base, None, "ms"),
                Metric(f"{what} {q}, gVisor (runsc, ptrace)", other, None, "ms",
                       note=f"{ratio}x {crun}" if ratio else "")]

    res.add(*row("create", "create", "p50_ms"), *row("exec round trip (`true`)", "exec", "p50_ms"),
            *row("exec round trip (`true`)", "exec", "p99_ms"))
    return res


SCENARIO = Scenario("gvisor", "create and exec under gVisor (runsc) beside crun", run, GvisorParams)
