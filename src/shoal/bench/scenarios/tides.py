"""`tides`: compute tides on the real node — one tide pass pauses the idle sandboxes while memory is tight;
the memory it returns, how long the pass takes, and what a tided sandbox's next call costs (it resumes).

`n` idle sandboxes (a bash session and a Python process holding `workload_mb` of ordinary data plus
files it wrote, as in `pause`) and `busy` sandboxes that keep serving calls. The idle ones last served a
call over `SHOAL_TIDE_IDLE_S` ago. This shared host is not filled to make memory tight: the node's
tide thresholds are set just under the host's current use for the pass (`tide_high`), with `tide_low`
low enough that every idle sandbox goes. The memory charged to the idle sandboxes before and after
(zram's own pool counted against the gain) gives what the tides returned; the busy ones must not be
touched. Then each tided sandbox serves one request: resume (prefetch + thaw) and the request, against
the same request on a running sandbox.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from shoal.backends.container import reclaim
from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios.common import gather_bounded
from shoal.bench.scenarios.pause import _REQUEST, _charged, _make_idle, _zram_bytes
from shoal.bench.stats import latency_summary
from shoal.node.scheduling import _meminfo_mb


@dataclass(frozen=True)
class TidesParams:
    """How much the tides scenario does."""

    n: int = param(50, quick=8, help="idle sandboxes (the tide pauses them)")
    busy: int = param(10, quick=2, help="busy sandboxes (the tide must leave them running)")
    workload_mb: int = param(16, help="MB of data each sandbox's Python holds")
    file_mb: int = param(4, help="MB of files each sandbox wrote (its page cache)")
    memory_mb: int = param(256, help="memory limit of each sandbox")
    swap: str = param("on", help="zram swap during the pass: on (made for the run if the host has none) or off")
    zram_size: str = param("8G", help="size of the zram device made for the run")


async def tides_bench(ctx: BenchContext, p: TidesParams) -> dict[str, Any]:
    """One tide pass over `n` idle and `busy` busy sandboxes; memory returned and resume cost."""
    node = ctx.node
    sch = node.scheduling
    made_swap = False
    if p.swap == "on" and not reclaim.swap_active():
        reclaim.setup_zram_swap(p.zram_size)
        made_swap = True
    saved = sch.policy
    try:
        idle = await _make_idle(ctx.client, p.n, p.workload_mb, p.file_mb, p.memory_mb)
        busy = await _make_idle(ctx.client, p.busy, p.workload_mb, p.file_mb, p.memory_mb)
        warm: list[float] = []
        for sb, _ in idle + busy:
            t = time.monotonic()
            await sb.exec(_REQUEST)
            warm.append(time.monotonic() - t)
        long_ago = time.time() - saved.tide_idle_s - 60
        for sb, _ in idle:
            sch.last_used[sb.id] = long_ago
        mem_before, _ = _charged(idle)
        busy_before, _ = _charged(busy)
        zram_before = _zram_bytes()
        total, avail = _meminfo_mb()
        used_frac = (total - avail) / total
        # memory "tight": thresholds just under what the host uses now; low enough that every idle one goes
        sch.policy = replace(saved, tide_high=max(0.01, used_frac - 0.01), tide_low=0.01)
        t0 = time.monotonic()
        paused = await sch.tide_once()
        pass_s = time.monotonic() - t0
        sch.policy = saved
        mem_after, swap_after = _charged(idle)
        zram_growth = max(0, _zram_bytes() - zram_before)
        idle_ids = {sb.id for sb, _ in idle}
        busy_ids = {sb.id for sb, _ in busy}
        first: list[float] = []
        for sb, _ in idle:
            t = time.monotonic()
            await sb.exec(_REQUEST)  # resumes transparently
            first.append(time.monotonic() - t)
        states_after = [(await ctx.client.get(sb.id)).info.state for sb, _ in idle]
        await gather_bounded([sb.close() for sb, _ in idle + busy], 8)
    finally:
        sch.policy = saved
        if made_swap:
            reclaim.teardown_zram_swap()
    net = mem_before - mem_after - zram_growth
    return {
        "n": len(idle), "busy": len(busy), "workload_mb": p.workload_mb, "file_mb": p.file_mb,
        "swap": p.swap, "host_used_fraction": round(used_frac, 3),
        "paused_idle": len(idle_ids & set(paused)), "paused_busy": len(busy_ids & set(paused)),
        "pass_s": round(pass_s, 3), "per_sandbox_pause_s": round(pass_s / max(1, len(paused)), 4),
        "charged_before_mib": round(mem_before / 2**20, 1), "charged_after_mib": round(mem_after / 2**20, 1),
        "in_swap_mib": round(swap_after / 2**20, 1), "zram_pool_growth_mib": round(zram_growth / 2**20, 1),
        "returned_mib": round(net / 2**20, 1), "returned_pct": round(100 * net / max(1, mem_before), 1),
        "per_sandbox_before_mib": round(mem_before / max(1, len(idle)) / 2**20, 2),
        "per_sandbox_after_mib": round((mem_after + zram_growth) / max(1, len(idle)) / 2**20, 2),
        "busy_charged_mib": round(busy_before / 2**20, 1),
        "request_running": latency_summary(warm), "first_request_after_tide": latency_summary(first),
        "running_after": states_after.count("running"),
    }


async def run(ctx: BenchContext, p: TidesParams) -> ScenarioResult:
    """The tides scenario (see the module docstring)."""
    if p.swap not in ("on", "off"):
        raise ValueError(f"swap must be on or off, not {p.swap!r}")
    res = ScenarioResult("tides", docker=ctx.docker_status)
    out = await tides_bench(ctx, p)
    res.data["tides"] = out
    ok = out["paused_idle"] == out["n"] and out["paused_busy"] == 0
    res.add(
        Metric(f"idle sandboxes paused by one tide pass (of {out['n']}; busy ones paused: {out['paused_busy']})",
               out["paused_idle"], None, "", better="higher", met=ok),
        Metric("memory the tide returned", out["returned_pct"], None, "%", better="higher",
               note=f"{out['per_sandbox_before_mib']} -> {out['per_sandbox_after_mib']} MiB each, "
                    f"{out['returned_mib']} MiB in all (swap {out['swap']})"),
        Metric("tide pass (pause + reclaim), per sandbox", out["per_sandbox_pause_s"] * 1000, None, "ms"),
        Metric("first request after a tide (resume + request) p50", out["first_request_after_tide"].get("p50_ms"),
               None, "ms", note=f"a running sandbox: {out['request_running'].get('p50_ms')} ms"),
        Metric("first request after a tide p99", out["first_request_after_tide"].get("p99_ms"), None, "ms"),
    )
    return res


SCENARIO = Scenario("tides", "compute tides: memory a tide pass returns, and the resume on the next call", run,
                    TidesParams, uses_docker=False, default_run=False)
