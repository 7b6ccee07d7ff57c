"""`soak`: a day of churn through one node process — does anything it holds grow with the sandboxes it has seen?

Thousands of sandboxes stay alive while create → exec → close cycles run through the node (the oldest
sandbox is closed as each new one is made). Every `sample_every` cycles the node process's descriptors,
threads (/proc/self/task), RSS, the event loop's lag (a 50 ms ticker: how late it woke, p99 and max over
the window) and the sizes of its per-sandbox tables are recorded. The figures are **slopes per 1,000
sandboxes** (least squares over the samples after the ramp): a node that runs for days has ~0 for all of
them. Docker's daemon (dockerd + containerd) goes through the same churn, as far as it keeps up within its
time budget, with its descriptors, threads and RSS sampled the same way (issue 24, item 3).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult, at_most
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios.common import SPEC_KW, first_errors, spec
from shoal.bench.stats import linear_slope, percentile
from shoal.errors import ShoalError
from shoal.host import heap


@dataclass(frozen=True)
class SoakParams:
    """How long and how wide the churn is."""

    cycles: int = param(100_000, quick=600, help="create/exec/close cycles through the node")
    budget_s: float = param(0.0, quick=0.0, help="stop shoal's churn after this many seconds (0: no limit)")
    alive: int = param(2_000, quick=100, help="sandboxes kept alive while the churn runs")
    concurrency: int = param(16, quick=8, help="cycles in flight at once")
    sample_every: int = param(1_000, quick=100, help="cycles between two samples")
    docker_cycles: int = param(5_000, quick=100, help="the same cycles through Docker (as far as its budget goes)")
    docker_alive: int = param(200, quick=20, help="containers kept alive during Docker's churn")
    docker_budget_s: float = param(1800.0, quick=120.0, help="time Docker's churn gets (at least 60)")


MIB = 2**20
#: how often the loop-lag ticker wakes (s)
TICK_S = 0.05


def _status_kib(pid: int | str, field: str) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _count(path: str) -> int:
    try:
        return len(os.listdir(path))
    except OSError:
        return 0


def heap_figures() -> dict[str, float]:
    """Where this process's memory sits: Python's live objects (`py_blocks`, gc-tracked `py_objects`) and
    glibc malloc's heap — in use by anyone (`heap_used_mib`) and free but kept from the OS
    (`heap_free_mib`). RSS growing while the first three stay flat is the allocator keeping freed memory
    (fragmentation), not a leak."""
    out: dict[str, float] = {"py_blocks": sys.getallocatedblocks(), "py_objects": len(gc.get_objects())}
    hs = heap.stats()
    if hs is not None:
        out["heap_used_mib"] = round(hs.used / MIB, 2)
        out["heap_free_mib"] = round(hs.free / MIB, 2)
    return out


def process_figures(pids: Sequence[int | str]) -> dict[str, float]:
    """Descriptors, threads and RSS (MiB) summed over processes."""
    return {"fds": sum(_count(f"/proc/{p}/fd") for p in pids),
            "threads": sum(_count(f"/proc/{p}/task") for p in pids),
            "rss_mib": round(sum(_status_kib(p, "VmRSS") for p in pids) / 1024, 2)}


class LoopLag:
    """How late the event loop wakes a 50 ms timer: the lag every request on the node waits too."""

    def __init__(self) -> None:
        self.window: list[float] = []
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start ticking."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(TICK_S)
            self.window.append(max(0.0, loop.time() - t - TICK_S))

    def take(self) -> dict[str, float]:
        """p50/p99/max lag (ms) since the last take."""
        w, self.window = self.window, []
        if not w:
            return {"lag_p50_ms": 0.0, "lag_p99_ms": 0.0, "lag_max_ms": 0.0}
        return {"lag_p50_ms": round(percentile(w, 50) * 1000, 2), "lag_p99_ms": round(percentile(w, 99) * 1000, 2),
                "lag_max_ms": round(max(w) * 1000, 2)}

    async def stop(self) -> None:
        """Stop ticking."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def slopes(samples: list[dict[str, Any]], keys: list[str], skip: int = 1) -> dict[str, float | None]:
    """Least-squares slope of each key per 1,000 cycles over the samples after the first `skip` (the ramp)."""
    pts = samples[skip:] if len(samples) > skip + 1 else samples
    out: dict[str, float | None] = {}
    for k in keys:
        xs = [p["cycles"] / 1000 for p in pts if p.get(k) is not None]
        ys = [float(p[k]) for p in pts if p.get(k) is not None]
        s = linear_slope(xs, ys) if len(xs) >= 2 else float("nan")
        out[k] = round(s, 4) if s == s else None
    return out


async def shoal_soak(ctx: BenchContext, p: SoakParams) -> dict[str, Any]:
    """The churn through the bench's node (see the module docstring)."""
    node = ctx.node
    lag = LoopLag()
    lag.start()
    alive: collections.deque[str] = collections.deque()
    errors: list[str] = []
    lat: dict[str, list[float]] = {"create": [], "exec": [], "close": []}
    samples: list[dict[str, Any]] = []
    done = 0
    next_sample = 0
    t0 = time.perf_counter()
    stop_reason = f"reached {p.cycles} cycles"

    def sample(phase: str) -> None:
        gc.collect()
        row: dict[str, Any] = {"cycles": done, "phase": phase, "alive": len(alive),
                               "elapsed_s": round(time.perf_counter() - t0, 1),
                               **process_figures(["self"]), **heap_figures(), **lag.take(), **node.table_sizes()}
        # agent connections come and go with use (closed after SHOAL_AGENT_IDLE_S): the rest must be flat
        row["fds_besides_connections"] = row["fds"] - row["connections"]
        for k, v in lat.items():
            row[f"{k}_p50_ms"] = round(percentile(v, 50) * 1000, 2) if v else None
            v.clear()
        samples.append(row)

    try:
        with ctx.task(f"shoal: ramp to {p.alive} alive sandboxes", p.alive) as adv:
            while len(alive) < p.alive:
                k = min(100, p.alive - len(alive))
                items = await node.create_many(spec(ctx), k, on_done=lambda _r: adv())
                alive.extend(i.id for i in items if not isinstance(i, ShoalError))
                bad = [str(i)[:300] for i in items if isinstance(i, ShoalError)]
                errors += bad
                if bad and len(bad) == k:
                    raise RuntimeError(f"the ramp could not create sandboxes: {bad[0]}")
        sample("ramp")
        next_sample = p.sample_every

        async def cycle() -> None:
            nonlocal done
            t = time.perf_counter()
            try:
                info = await node.create(spec(ctx))
            except ShoalError as e:
                errors.append(str(e)[:300])
                if len(errors) > max(100, p.cycles // 100):
                    raise RuntimeError(f"{len(errors)} errors after {done} cycles (last: {errors[-1]})") from e
                await asyncio.sleep(0.5)  # a refusal: let closes catch up
                return
            t1 = time.perf_counter()
            lat["create"].append(t1 - t)
            try:
                r = await node.exec(info.id, ["true"], timeout=60)
                if r.exit_code != 0:
                    errors.append(f"exec exit {r.exit_code}")
            except ShoalError as e:
                errors.append(str(e)[:300])
            t2 = time.perf_counter()
            lat["exec"].append(t2 - t1)
            alive.append(info.id)
            old = alive.popleft()
            try:
                await node.close(old)
            except ShoalError as e:
                errors.append(str(e)[:300])
            lat["close"].append(time.perf_counter() - t2)
            done += 1

        with ctx.task(f"shoal: {p.cycles} create/exec/close cycles, {p.alive} alive", p.cycles) as adv:
            async def worker() -> None:
                nonlocal next_sample, stop_reason
                while done < p.cycles:
                    if p.budget_s > 0 and time.perf_counter() - t0 > p.budget_s:
                        stop_reason = f"time budget of {p.budget_s:.0f}s used up after {done} cycles"
                        return
                    await cycle()
                    adv()
                    if done >= next_sample:
                        next_sample += p.sample_every
                        sample("churn")
                        ctx.log(f"{done} cycles: node fds {samples[-1]['fds']}, threads {samples[-1]['threads']}, "
                                f"RSS {samples[-1]['rss_mib']} MiB, loop lag p99 {samples[-1]['lag_p99_ms']} ms")

            await asyncio.gather(*(worker() for _ in range(max(1, p.concurrency))))
        churn_s = time.perf_counter() - t0
        sample("end of churn")
    finally:
        ids = list(alive)
        alive.clear()
        with contextlib.suppress(ShoalError):
            await node.close_many(ids)
        await lag.stop()
    await asyncio.sleep(max(1.0, node.connections.idle_s))
    await node.connections.sweep()
    sample("all closed")
    keys = ["fds", "fds_besides_connections", "threads", "rss_mib", "py_blocks", "py_objects", "heap_used_mib",
            "heap_free_mib", "lag_p99_ms", "lag_max_ms", "parsed_records",
            "admission_live", "last_used", "swap_watches"]
    churn = [s for s in samples if s["phase"] in ("ramp", "churn", "end of churn")]
    return {"cycles": done, "alive": p.alive, "seconds": round(churn_s, 1), "stop_reason": stop_reason,
            "cycles_per_s": round(done / churn_s, 1) if churn_s else None, "errors": len(errors),
            "error_samples": first_errors(errors), "samples": samples,
            "slopes_per_1000": slopes(churn, keys),
            # the second half alone: a warm-up (allocator arenas, caches filling) shows as a slope over the
            # whole churn that is gone here; a leak keeps its slope in both
            "steady_slopes_per_1000": slopes(churn[len(churn) // 2:], keys, skip=0),
            "first": churn[0] if churn else {},
            "last": churn[-1] if churn else {}, "after_close": samples[-1]}


async def docker_soak(ctx: BenchContext, p: SoakParams) -> dict[str, Any]:
    """The same churn through the private Docker engine, within its budget."""
    assert ctx.docker is not None
    eng = ctx.docker
    alive: collections.deque[str] = collections.deque()
    errors: list[str] = []
    samples: list[dict[str, Any]] = []
    done = 0
    t0 = time.perf_counter()
    budget = max(60.0, p.docker_budget_s)
    step = max(10, p.sample_every * p.docker_cycles // max(1, p.cycles))
    next_sample = step
    stop_reason = f"reached {p.docker_cycles} cycles"

    def sample(phase: str) -> None:
        samples.append({"cycles": done, "phase": phase, "alive": len(alive),
                        "elapsed_s": round(time.perf_counter() - t0, 1), **process_figures(eng.daemon_pids())})

    async def make() -> str:
        return await eng.create_start(memory_mb=SPEC_KW["memory_mb"], cpus=SPEC_KW["cpus"], pids=SPEC_KW["pids"])

    try:
        with ctx.task(f"Docker: ramp to {p.docker_alive} containers", p.docker_alive) as adv:
            got = await ctx.bounded([make() for _ in range(p.docker_alive)], 16, adv)
            alive.extend(c for c in got if isinstance(c, str))
            errors += [str(c)[:300] for c in got if not isinstance(c, str)]
        sample("ramp")
        with ctx.task(f"Docker: {p.docker_cycles} cycles (≤{budget:.0f}s)", p.docker_cycles) as adv:
            async def worker() -> None:
                nonlocal done, next_sample, stop_reason
                while done < p.docker_cycles:
                    if time.perf_counter() - t0 > budget:
                        stop_reason = f"time budget of {budget:.0f}s used up after {done} cycles"
                        return
                    try:
                        cid = await make()
                        code, _ = await eng.exec(cid, ["true"])
                        if code != 0:
                            errors.append(f"exec exit {code}")
                        alive.append(cid)
                        await eng.remove(alive.popleft())
                    except Exception as e:
                        errors.append(str(e)[:300])
                        continue
                    done += 1
                    adv()
                    if done >= next_sample:
                        next_sample += step
                        sample("churn")

            await asyncio.gather(*(worker() for _ in range(max(1, min(8, p.concurrency)))))
        sample("end of churn")
        churn_s = time.perf_counter() - t0
    finally:
        await eng.remove_many(list(alive))
    churn = [s for s in samples if s["phase"] != "all closed"]
    return {"cycles": done, "alive": p.docker_alive, "seconds": round(churn_s, 1),
            "cycles_per_s": round(done / churn_s, 1) if churn_s else None, "stop_reason": stop_reason,
            "errors": len(errors), "error_samples": first_errors(errors), "samples": samples,
            "slopes_per_1000": slopes(churn, ["fds", "threads", "rss_mib"]),
            "first": churn[0] if churn else {}, "last": churn[-1] if churn else {}}


async def run(ctx: BenchContext, p: SoakParams) -> ScenarioResult:
    """The soak scenario (see the module docstring)."""
    res = ScenarioResult("soak", docker=ctx.docker_status)
    s = res.data["shoal"] = await shoal_soak(ctx, p)
    d: dict[str, Any] = {}
    if ctx.docker:
        d = res.data["docker"] = await docker_soak(ctx, p)
    ss, ds = s["slopes_per_1000"], d.get("slopes_per_1000", {})
    dn = f"Docker: {d['cycles']} cycles with {d['alive']} alive ({d['stop_reason']})" if d else ""
    res.add(Metric(f"cycles through one node ({p.alive} alive)", s["cycles"], d.get("cycles"), "", better="higher",
                   target=f"≥ {p.cycles}", met=s["cycles"] >= p.cycles,
                   note="; ".join(x for x in (f"shoal: {s['stop_reason']}", dn) if x)),
            Metric("cycles/s", s["cycles_per_s"], d.get("cycles_per_s"), "/s", better="higher"),
            Metric("node descriptors: slope per 1,000 sandboxes", ss.get("fds"), ds.get("fds"), "fds",
                   better="neither", target="≤ 1 (flat)",
                   met=at_most(abs(ss["fds"]) if ss.get("fds") is not None else None, 1.0),
                   note=f"{s['first'].get('fds')} → {s['last'].get('fds')} during the churn; "
                        f"{s['after_close'].get('fds')} after every close"),
            Metric("node descriptors besides agent connections: slope per 1,000", ss.get("fds_besides_connections"),
                   None, "fds", better="neither", target="≤ 0.5 (flat)",
                   met=at_most(abs(ss["fds_besides_connections"])
                               if ss.get("fds_besides_connections") is not None else None, 0.5),
                   note=f"{s['first'].get('fds_besides_connections')} → "
                        f"{s['last'].get('fds_besides_connections')} (agent connections open on demand)"),
            Metric("node threads: slope per 1,000 sandboxes", ss.get("threads"), ds.get("threads"), "threads",
                   better="neither", target="≤ 0.5 (flat)",
                   met=at_most(abs(ss["threads"]) if ss.get("threads") is not None else None, 0.5),
                   note=f"{s['first'].get('threads')} → {s['last'].get('threads')}"),
            Metric("node RSS: slope per 1,000 sandboxes", ss.get("rss_mib"), ds.get("rss_mib"), "MiB",
                   better="neither", target="≤ 1 MiB (flat)", met=at_most(ss.get("rss_mib"), 1.0),
                   note=f"{s['first'].get('rss_mib')} → {s['last'].get('rss_mib')} MiB"),
            Metric("node RSS: slope per 1,000, second half of the churn", s["steady_slopes_per_1000"].get("rss_mib"),
                   None, "MiB", better="neither", target="≤ 0.1 MiB (flat once warm)",
                   met=at_most(abs(s["steady_slopes_per_1000"]["rss_mib"])
                               if s["steady_slopes_per_1000"].get("rss_mib") is not None else None, 0.1),
                   note="a slope over the whole churn that is gone here is warm-up, not a leak"),
            Metric("event-loop lag p99: slope per 1,000 sandboxes", ss.get("lag_p99_ms"), None, "ms",
                   better="neither", target="≤ 1 ms (flat)", met=at_most(ss.get("lag_p99_ms"), 1.0),
                   note=f"p99 {s['first'].get('lag_p99_ms')} → {s['last'].get('lag_p99_ms')} ms"),
            Metric("errors during the churn", s["errors"], d.get("errors"), "", target="= 0", met=s["errors"] == 0,
                   note="; ".join(s["error_samples"][:2])))
    res.notes.append("per-sandbox tables at the end of the churn: " + ", ".join(
        f"{k} {s['last'].get(k)}" for k in ("admission_live", "last_used", "connections", "parsed_records",
                                             "state_locks", "swap_watches")))
    if ctx.plot_dir and s["samples"]:
        from shoal.bench import plots

        series = {"node RSS (MiB)": ([x["cycles"] for x in s["samples"]], [x["rss_mib"] for x in s["samples"]]),
                  "node fds": ([x["cycles"] for x in s["samples"]], [x["fds"] for x in s["samples"]]),
                  "node fds besides agent connections": ([x["cycles"] for x in s["samples"]],
                                                         [x["fds_besides_connections"] for x in s["samples"]])}
        if d.get("samples"):
            series["dockerd+containerd RSS (MiB)"] = ([x["cycles"] for x in d["samples"]],
                                                      [x["rss_mib"] for x in d["samples"]])
        res.figures.append(plots.memory_vs_count(ctx.figure_path("soak.png"), series,
                                                 f"one node process, {p.alive} alive, through create/exec/close churn",
                                                 ylabel="MiB / descriptors", xlabel="create/exec/close cycles"))
    return res


SCENARIO = Scenario("soak", "a day of churn: create/exec/close cycles through one node, slopes per 1,000",
                    run, SoakParams, default_run=False)
