"""`qos`: exec latency of latency-sensitive sandboxes next to CPU hogs — default Linux scheduling vs shoal's
CPU classes (shoal.backends.container.cpuclass).

`hogs` sandboxes run compile-like loops (gzip -9 in two processes each, more CPU than their quota of one
core); `latency` sandboxes issue short agent steps (a shell tool call) with a little think time between
them. Three phases, interleaved within every round in a rotating order so that whatever else runs on the
machine weighs on all three alike:

* **idle** — the hogs are frozen (cgroup freezer): the reference;
* **default** — the hogs run; every sandbox is an equal cgroup (plain CFS, quota = cpus, no burst, no idle:
  what any container runtime does by default);
* **policy** — the hogs run in the `batch` class (an idle cgroup beside the sandboxes' parent on cgroup
  v1, cpu.idle on v2), the steps' sandboxes in `interactive` (weight by cpus, quota with burst).

Inflation = p99 of a phase ÷ p99 of idle − 1, over every step of every round (end to end through the node,
and the step's own duration as the in-sandbox agent timed it). Per-round inflations show how stable it is.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

from shoal.backends.container import cpuclass
from shoal.bench import plots
from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult, at_least, at_most
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios.common import close_all, spec
from shoal.bench.stats import latency_summary, percentile

PHASES = ("idle", "default", "policy")


@dataclass(frozen=True)
class QosParams:
    """How the qos scenario loads the machine."""

    hogs: int = param(4, quick=2, help="CPU-hog sandboxes (1 CPU each, two compile-like loops in each)")
    latency: int = param(8, quick=3, help="latency-sensitive sandboxes issuing short steps")
    rounds: int = param(8, quick=2, help="rounds of the three phases (idle, default, policy)")
    phase_s: float = param(6.0, quick=2.0, help="seconds of steps per phase per round")
    think_ms: float = param(20.0, help="mean think time between two steps of one sandbox (ms)")
    step: str = param("grep -c root /etc/passwd >/dev/null && ls /usr/lib | wc -l", help="the short agent step")
    hog: str = param("while :; do gzip -9 < /usr/bin/bash > /dev/null; done",
                     help="one hog loop (two run in each hog sandbox)")


async def _steps(ctx: BenchContext, ids: list[str], seconds: float, think_ms: float, cmd: str
                 ) -> tuple[list[float], list[float], int]:
    """Every latency sandbox issues steps for `seconds`; returns end-to-end and in-sandbox seconds, errors."""
    node = ctx.node
    e2e: list[float] = []
    inner: list[float] = []
    errors = 0
    stop = time.perf_counter() + seconds

    async def one(sid: str) -> None:
        nonlocal errors
        rng = random.Random(sid)
        while time.perf_counter() < stop:
            await asyncio.sleep(rng.uniform(0.0, 2.0) * think_ms / 1000.0)
            t = time.perf_counter()
            try:
                r = await node.exec(sid, cmd, timeout=60)
            except Exception:
                errors += 1
                continue
            if r.exit_code != 0:
                errors += 1
                continue
            e2e.append(time.perf_counter() - t)
            inner.append(r.duration_s)

    await asyncio.gather(*(one(s) for s in ids))
    return e2e, inner, errors


async def _set_classes(ctx: BenchContext, hogs: list[str], lat: list[str], phase: str) -> None:
    node = ctx.node
    hog_cls, lat_cls = ((cpuclass.NEUTRAL, cpuclass.NEUTRAL) if phase == "default"
                        else (cpuclass.BATCH, cpuclass.INTERACTIVE))
    for sid, cls in [*((h, hog_cls) for h in hogs), *((s, lat_cls) for s in lat)]:
        rec = node.record(sid)
        # NEUTRAL is the benchmark's reference, not a class users pick: set through the module directly
        await asyncio.to_thread(cpuclass.apply, rec.cgroup, cls, float(rec.spec.cpus), rec.init_pid)


def _inflation(p: float, base: float) -> float | None:
    return round((p / base - 1.0) * 100.0, 1) if base else None


async def run(ctx: BenchContext, sz: QosParams) -> ScenarioResult:
    """The qos scenario (see the module docstring)."""
    res = ScenarioResult("qos")
    node = ctx.node
    hogs = [i.id for i in await node.create_many(spec(ctx, memory_mb=256), sz.hogs) if hasattr(i, "id")]
    lat = [i.id for i in await node.create_many(spec(ctx, memory_mb=256), sz.latency) if hasattr(i, "id")]
    try:
        for h in hogs:
            await node.exec(h, f"for i in 1 2; do nohup sh -c '{sz.hog}' >/dev/null 2>&1 & done")
            await node.pause(h, reclaim=False)
        hog_running = False
        samples: dict[str, dict[str, list[float]]] = {p: {"e2e": [], "inner": []} for p in PHASES}
        per_round: list[dict[str, Any]] = []
        errors = 0
        order = list(PHASES)
        with ctx.task(f"qos: {sz.rounds} rounds × {len(PHASES)} phases × {sz.phase_s:g}s", sz.rounds * 3) as adv:
            for r in range(sz.rounds):
                row: dict[str, Any] = {"round": r, "order": list(order)}
                for phase in order:
                    want_running = phase != "idle"
                    if want_running != hog_running:
                        for h in hogs:
                            if want_running:
                                await node.resume(h, prefetch=False)
                            else:
                                await node.pause(h, reclaim=False)
                        hog_running = want_running
                    await _set_classes(ctx, hogs, lat, phase)
                    await asyncio.sleep(0.5)  # let the hogs fill the cores again after a thaw
                    e2e, inner, err = await _steps(ctx, lat, sz.phase_s, sz.think_ms, sz.step)
                    errors += err
                    samples[phase]["e2e"] += e2e
                    samples[phase]["inner"] += inner
                    row[phase] = {"n": len(e2e), "p50_ms": round(percentile(e2e, 50) * 1000, 2),
                                  "p99_ms": round(percentile(e2e, 99) * 1000, 2),
                                  "inner_p99_ms": round(percentile(inner, 99) * 1000, 2)}
                    adv()
                for phase in ("default", "policy"):
                    row[phase]["p99_inflation_pct"] = _inflation(row[phase]["p99_ms"], row["idle"]["p99_ms"])
                per_round.append(row)
                ctx.log(f"round {r}: p99 idle {row['idle']['p99_ms']} ms, default {row['default']['p99_ms']} ms "
                        f"(+{row['default']['p99_inflation_pct']}%), policy {row['policy']['p99_ms']} ms "
                        f"(+{row['policy']['p99_inflation_pct']}%)")
                order = order[1:] + order[:1]  # rotate: no phase always follows the same one
    finally:
        await close_all(ctx, hogs + lat, "closing the qos sandboxes")
    summ = {p: {"e2e": latency_summary(v["e2e"]), "inner": latency_summary(v["inner"])} for p, v in samples.items()}
    infl = {p: {k: _inflation(summ[p]["e2e"][f"{k}_ms"], summ["idle"]["e2e"][f"{k}_ms"]) for k in ("p50", "p90", "p99")}
            for p in ("default", "policy")}
    infl_inner = {p: _inflation(summ[p]["inner"]["p99_ms"], summ["idle"]["inner"]["p99_ms"])
                  for p in ("default", "policy")}
    rounds_def = [r["default"]["p99_inflation_pct"] for r in per_round]
    rounds_pol = [r["policy"]["p99_inflation_pct"] for r in per_round]
    res.data = {"phases": summ, "inflation_pct": infl, "inner_p99_inflation_pct": infl_inner,
                "per_round": per_round, "errors": errors, "hogs": len(hogs), "latency_sandboxes": len(lat),
                "cgroup_mode": cpuclass.cgroups.cgroup_mode()}
    d99, p99 = infl["default"]["p99"], infl["policy"]["p99"]
    res.add(Metric("step latency p99, idle host (hogs frozen)", summ["idle"]["e2e"].get("p99_ms"), None, "ms",
                   note=f"{summ['idle']['e2e'].get('n', 0)} steps; p50 {summ['idle']['e2e'].get('p50_ms')} ms"),
            Metric("p99 inflation next to hogs, default Linux scheduling", d99, None, "%",
                   target="≥ 45% (DSec's baseline)", met=at_least(d99, 45),
                   note=f"per round {min(rounds_def, default=None)}…{max(rounds_def, default=None)}%"),
            Metric("p99 inflation next to hogs, shoal CPU classes", p99, None, "%", target="≤ 17%",
                   met=at_most(p99, 17),
                   note=f"per round {min(rounds_pol, default=None)}…{max(rounds_pol, default=None)}%"),
            Metric("p50 inflation, default → shoal CPU classes", infl["default"]["p50"], None, "%",
                   note=f"shoal: {infl['policy']['p50']}%"),
            Metric("in-sandbox step time p99 inflation, default → shoal", infl_inner["default"], None, "%",
                   note=f"shoal: {infl_inner['policy']}% (the agent's own timing, without the node's RPC)"))
    if errors:
        res.notes.append(f"{errors} steps failed")
    if ctx.plot_dir:
        series = {f"{p} ({summ[p]['e2e'].get('n', 0)} steps)": [x * 1000 for x in samples[p]["e2e"]] for p in PHASES}
        res.figures.append(plots.latency_cdf(ctx.figure_path("qos_latency_cdf.png"), series,
                                             "short agent steps next to CPU hogs: idle, default scheduling, "
                                             "shoal CPU classes"))
    return res


SCENARIO = Scenario("qos", "step latency next to CPU hogs: default scheduling vs shoal's CPU classes", run,
                    QosParams, uses_docker=False, default_run=False)
