"""`dashboard`: what watching the factory costs (issue 20).

1. **Event log cost per create** — sequential creates with the node's event log on and off, in ABBA rounds
   on the same node in one run (so a drifting machine load does not decide the difference), plus the
   cost of one `emit` alone. "Off" is the create path as it was before the log (`SHOAL_EVENTS=0`).
2. **Sandbox list page load with N sandboxes alive** — N real sandboxes, the API app served in this
   process (uvicorn on 127.0.0.1), Debian's chromium (headless, driven by Playwright) loads
   `/ui#/sandboxes`: the time from navigation start until the first page of rows is on screen, measured
   in the browser (`performance.now()`), each load a fresh navigation.
3. **A page of 50,000 rows** — the server's filter/sort/page pass over 50,000 index rows (no browser).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios.common import close_all, create_one, spec
from shoal.bench.stats import latency_summary

CHROMIUM = "/usr/bin/chromium"
_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run", "--disable-quic", "--disable-dev-shm-usage"]


@dataclass(frozen=True)
class DashboardParams:
    """How much work the dashboard scenario does."""

    rounds: int = param(8, quick=4, help="ABBA rounds of the event-log cost (each: one round on, one off)")
    per_round: int = param(25, quick=10, help="sequential creates per round")
    alive: int = param(5000, quick=200, help="sandboxes alive while the list page is loaded")
    loads: int = param(5, quick=3, help="page loads measured")
    rows: int = param(50_000, quick=50_000, help="index rows of the server-side paging figure")


async def _creates(ctx: BenchContext, n: int) -> list[float]:
    lat, ids = [], []
    for _ in range(n):
        t = time.perf_counter()
        info = await create_one(ctx)
        lat.append(time.perf_counter() - t)
        ids.append(info.id)
    await close_all(ctx, ids, "closing")
    return lat


async def event_log_cost(ctx: BenchContext, p: DashboardParams) -> dict:
    """Create latency with the event log on vs off (ABBA), and one emit's cost."""
    log = ctx.node.events
    was = (log.enabled, log.commands_enabled)
    on: list[float] = []
    off: list[float] = []
    order = [True, False, False, True] * ((p.rounds + 1) // 2)
    try:
        with ctx.task("event log on/off, ABBA", len(order[: 2 * p.rounds])) as adv:
            for flag in order[: 2 * p.rounds]:
                log.enabled = log.commands_enabled = flag
                (on if flag else off).extend(await _creates(ctx, p.per_round))
                adv()
    finally:
        log.enabled, log.commands_enabled = was
    from shoal.node.events import EventLog

    tmp = tempfile.mkdtemp(prefix="shoal-evbench-")
    try:
        el = EventLog(tmp, "n0")
        n = 20_000
        t = time.perf_counter()
        for i in range(n):
            el.emit("created", "n0-aaaaaaaaaaaaaaaaaaaaaaaaaa", "default", image="base:latest", backend="container",
                    cpus=1.0, memory_mb=1024, labels=None, pooled=None, i=i)
        emit_us = (time.perf_counter() - t) / n * 1e6
        el.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"on": latency_summary(on), "off": latency_summary(off), "emit_us": round(emit_us, 2),
            "mean_diff_ms": round((statistics.mean(on) - statistics.mean(off)) * 1000, 3),
            "median_diff_ms": round((statistics.median(on) - statistics.median(off)) * 1000, 3)}


async def page_load(ctx: BenchContext, p: DashboardParams) -> dict:
    """N sandboxes alive, the list page loaded `p.loads` times in chromium."""
    import uvicorn
    from playwright.async_api import async_playwright

    from shoal.server.app import create_app
    from shoal.server.proc import free_port
    from shoal.server.settings import ServerSettings
    from shoal.server.tokens import TokenStore

    with ctx.task(f"create {p.alive} sandboxes", None):
        items = await ctx.node.create_many(spec(ctx), p.alive)
    ids = [i.id for i in items if not isinstance(i, BaseException) and hasattr(i, "id")]
    out: dict = {"alive": len(ids), "errors": p.alive - len(ids)}
    port = free_port()
    app = create_app(ctx.node, ServerSettings(host="127.0.0.1", port=port), manage_node=False,
                     tokens=TokenStore(ctx.home / "bench-ui-tokens"))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    serving = asyncio.create_task(server.serve())
    profile = tempfile.mkdtemp(prefix="shoal-chromium-")
    try:
        while not server.started:
            await asyncio.sleep(0.05)
        url = f"http://127.0.0.1:{port}/ui#/sandboxes"
        loads, api_ms = [], []
        async with async_playwright() as pw:
            br = await pw.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, headless=True,
                                                            args=_ARGS, viewport={"width": 1400, "height": 900})
            try:
                for _ in range(p.loads):
                    # past the index's max age: the first load waits for its first build (the cold case), the
                    # later ones are answered from the index while it is rebuilt in the background
                    await asyncio.sleep(1.2)
                    page = await br.new_page()
                    await page.goto(url)
                    await page.wait_for_function("document.querySelectorAll('#sandboxes tbody tr').length >= "
                                                 f"{min(50, len(ids))}", timeout=120_000)
                    loads.append(await page.evaluate("performance.now()"))
                    api_ms.append(await page.evaluate("window.shoalLastPageMs || 0"))
                    total = await page.inner_text("#range")
                    await page.close()
            finally:
                await br.close()
        view = app.state.shoal.view
        out.update({"load_ms": [round(x, 1) for x in loads], "load_median_ms": round(statistics.median(loads), 1),
                    "first_load_ms": round(loads[0], 1), "index_builds": view.index.builds,
                    "load_max_ms": round(max(loads), 1), "api_ms": [round(x, 1) for x in api_ms],
                    "index_build_ms": round(view.index.build_s * 1000, 1), "range_text": total})
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serving, 15)
        shutil.rmtree(profile, ignore_errors=True)
        await close_all(ctx, ids, f"closing {len(ids)} sandboxes")
    return out


def paging_50k(n: int) -> dict:
    """The server's page pass over `n` synthetic index rows: the default page and a filtered one."""
    from shoal.server.observe import SandboxQuery, page_rows

    rnd = random.Random(1)
    now = time.time()
    rows = [{"id": f"n{i % 8}-{i:026d}", "project": f"p{rnd.randrange(20)}", "state": rnd.choice(
        ["running", "running", "running", "paused"]), "backend": "container", "image": f"task-{rnd.randrange(3000)}",
        "created_at": now - (n - i), "labels": {"shoal.job": f"j{rnd.randrange(50)}"},
        "job": f"j{rnd.randrange(50)}", "cpus": 1.0, "memory_mb": 1024, "node": f"n{i % 8}"} for i in range(n)]
    cache: dict = {}
    t = time.perf_counter()
    sum(1 for _ in range(1_000_000))
    out = {"calibration_1M_loop_ms": round((time.perf_counter() - t) * 1000, 1)}  # how busy the machine was
    for name, q in (("default", SandboxQuery()), ("filtered", SandboxQuery(project="p3", states=("paused",),
                                                                          image="task-1", offset=20)),
                    ("sorted", SandboxQuery(sort="image", desc=False))):
        times = []
        for _ in range(10):
            t = time.perf_counter()
            page_rows(rows, q, now, cache)
            times.append(time.perf_counter() - t)
        out[name + "_ms"] = round(statistics.median(times) * 1000, 2)
    return out


async def run(ctx: BenchContext, p: DashboardParams) -> ScenarioResult:
    """The dashboard scenario (see the module docstring)."""
    res = ScenarioResult("dashboard")
    await close_all(ctx, [(await create_one(ctx)).id], "warm-up")
    ev = await event_log_cost(ctx, p)
    res.data["event_log"] = ev
    res.add(Metric("create p50, event log on", ev["on"].get("p50_ms"), None, "ms",
                   note=f"off: {ev['off'].get('p50_ms')} ms (ABBA, {p.rounds}×{p.per_round} each)"),
            Metric("added per create (median on − off)", ev["median_diff_ms"], None, "ms",
                   note=f"mean: {ev['mean_diff_ms']} ms"),
            Metric("one event appended", ev["emit_us"], None, "µs"))
    pg = await asyncio.to_thread(paging_50k, p.rows)
    res.data["paging"] = pg
    res.add(Metric(f"page of {p.rows:,} rows (server)", pg["default_ms"], None, "ms",
                   note=f"filtered {pg['filtered_ms']} ms, sorted by image {pg['sorted_ms']} ms"))
    if not os.path.exists(CHROMIUM):
        res.notes.append("no chromium (apt-get install chromium): page load not measured")
        return res
    pl = await page_load(ctx, p)
    res.data["page_load"] = pl
    res.add(Metric(f"sandbox list page load, {pl['alive']:,} alive (browser)", pl.get("load_median_ms"), None,
                   "ms", note=f"first (cold index) {pl.get('first_load_ms')} ms, max {pl.get('load_max_ms')} ms; "
                   f"index build {pl.get('index_build_ms')} ms"))
    return res


SCENARIO = Scenario("dashboard", "event log cost per create, list page load with N sandboxes alive, paging", run,
                    DashboardParams)
