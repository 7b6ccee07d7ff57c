"""`fncall`: short Python calls per second and their latency on the warm fncall pool, beside SandboxFusion (when
configured) and `docker exec python3 -c` on warm containers, in one run.

Measured one after the other on the same machine, each after a warm-up:
  * shoal SDK      — `Client().run_code_many` on an embedded node (what an RL trainer in-process does);
  * shoal HTTP     — `shoal fncall serve` (started here), SandboxFusion's `/run_code` request over HTTP;
  * SandboxFusion  — the bytedance/SandboxFusion server from a checkout (`sf_dir`, started here with its
                     default config, as its Docker image runs it) or an already running one (`sf_url`);
  * Docker         — `docker exec python3 -c` in 8 warm containers (when the run has Docker).
Every call runs the same snippet (default `print(1+1)`) and must print the right answer; each HTTP row
uses the same client (`concurrency` requests in flight).

`sf_dir` expects the layout of docs/fncall.md ("Benchmark"): DIR/src (the repository),
DIR/conda/envs/sandbox/bin/python (its server's Python with its dependencies), DIR/conda/condabin and
DIR/conda/bin/activate (what its python runner looks for), DIR/conda/envs/sandbox-runtime (the Python
that runs snippets).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios.common import docker_create_one, docker_remove_all, private_client, private_home
from shoal.bench.scenarios.fncall_load import bench_http, bench_shoal_sdk, sandboxfusion_server, shoal_fncall_server
from shoal.bench.stats import latency_summary


@dataclass(frozen=True)
class FncallParams:
    """How much work the fncall scenario does, and which systems it compares."""

    n: int = param(3000, quick=300, help="measured calls per system")
    concurrency: int = param(32, help="calls in flight")
    warmup: int = param(200, quick=50, help="unmeasured calls first")
    snippet: str = param("print(1+1)", help="the Python every call runs")
    expect: str = param("2", help="what the snippet must print")
    http: bool = param(True, help="also measure shoal over HTTP (`shoal fncall serve`)")
    sf_dir: str | None = param(None, help="a SandboxFusion checkout + Pythons (docs/fncall.md); "
                                          "default $SHOAL_SANDBOXFUSION_DIR")
    sf_url: str | None = param(None, help="an already running SandboxFusion; default $SHOAL_SANDBOXFUSION_URL")
    docker_n: int = param(300, quick=50, help="`docker exec python3 -c` calls (Docker)")
    log_dir: str | None = param(None, help="where the servers' logs go (default: the temp dir)")


async def fncall_bench(ctx: BenchContext, p: FncallParams) -> dict[str, Any]:
    """Run every phase and return {config, results: [row per system], ratios, notes}.

    Without `sf_dir`/`sf_url`, the environment's SHOAL_SANDBOXFUSION_DIR / SHOAL_SANDBOXFUSION_URL are used
    (so `shoal bench` includes SandboxFusion when they are set)."""
    import tempfile

    from shoal.config import settings

    n, concurrency, snippet, expect, warmup = p.n, p.concurrency, p.snippet, p.expect, p.warmup
    st = settings()
    sf_dir = p.sf_dir or st.sandboxfusion_dir or None
    sf_url = p.sf_url or st.sandboxfusion_url or None
    log = ctx.log
    # the servers' logs are for debugging a run, not results: they go to the temp dir unless asked otherwise
    log_dir = Path(p.log_dir or tempfile.gettempdir())
    log_dir.mkdir(parents=True, exist_ok=True)
    from shoal.backends.fncall import FncallConfig

    pool = FncallConfig.from_settings(st).max_size
    out: dict[str, Any] = {
        "config": {"n": n, "concurrency": concurrency, "snippet": snippet, "warmup": warmup, "cpus": os.cpu_count(),
                   "pool_max_size": pool, "loadavg_before": os.getloadavg()[0],
                   "kernel": os.uname().release, "time": time.strftime("%Y-%m-%d %H:%M:%S")},
        "results": [], "notes": []}
    log(f"shoal SDK: {n} calls, {concurrency} at a time")
    # a node of its own: the warm pool must not outlive the scenario on the run's node
    async with private_client(ctx, "sbf-") as client:
        out["results"].append(await bench_shoal_sdk(client, n, concurrency, snippet, expect, warmup))
    log(f"  {out['results'][-1]['calls_per_s']} calls/s, p99 {out['results'][-1]['p99_ms']} ms")
    if p.http:
        log("shoal HTTP: starting `shoal fncall serve`")
        async with private_home("sbfh-") as home:
            with shoal_fncall_server(log_dir, pool, home) as (url, cpu):
                out["results"].append(await bench_http("shoal HTTP (/run_code)", url, n, concurrency, snippet,
                                                       expect, warmup, {"isolation": out["results"][0]["isolation"]},
                                                       cpu))
        log(f"  {out['results'][-1]['calls_per_s']} calls/s, p99 {out['results'][-1]['p99_ms']} ms")
    sf_note = {"isolation": "SandboxFusion's default config `local` (isolation: none, as its server image runs it):"
                            " a fresh temp dir and `python file.py` subprocess per call, as the server's user"}
    sf_row = None
    try:
        if sf_url:
            log(f"SandboxFusion at {sf_url}")
            sf_row = await bench_http("SandboxFusion", sf_url, n, concurrency, snippet, expect, warmup,
                                      {"isolation": "as configured on that server"})
        elif sf_dir:
            log(f"SandboxFusion: starting its server from {sf_dir}")
            with sandboxfusion_server(Path(sf_dir), log_dir) as (url, cpu):
                sf_row = await bench_http("SandboxFusion", url, n, concurrency, snippet, expect, warmup, sf_note,
                                          cpu)
        else:
            out["notes"].append("SandboxFusion not measured: pass --sf-dir (a checkout set up as in docs/fncall.md)"
                                " or --sf-url, or set SHOAL_SANDBOXFUSION_DIR / SHOAL_SANDBOXFUSION_URL")
    except RuntimeError as e:
        out["notes"].append(f"SandboxFusion could not run: {e}")
    if sf_row is not None:
        out["results"].append(sf_row)
        log(f"  {sf_row['calls_per_s']} calls/s, p99 {sf_row['p99_ms']} ms")
        sdk = out["results"][0]
        out["ratios"] = {r["system"]: round(r["calls_per_s"] / sf_row["calls_per_s"], 2)
                         for r in out["results"] if r is not sf_row}
        out["ratios_p99"] = {r["system"]: round(sf_row["p99_ms"] / r["p99_ms"], 2)
                             for r in out["results"] if r is not sf_row}
        if sf_row.get("own_cpu_ms_per_call"):
            out["ratios_cpu_cost"] = {r["system"]: round(sf_row["own_cpu_ms_per_call"] / r["own_cpu_ms_per_call"], 2)
                                      for r in out["results"] if r is not sf_row and r.get("own_cpu_ms_per_call")}
        out["target_met"] = {"500_calls_per_s": sdk["calls_per_s"] >= 500,
                             "5x_sandboxfusion": out["ratios"][sdk["system"]] >= 5}
    else:
        out["target_met"] = {"500_calls_per_s": out["results"][0]["calls_per_s"] >= 500}
    out["config"]["loadavg_after"] = os.getloadavg()[0]
    return out


def plot(res: dict[str, Any], path: Path) -> Path | None:
    """Bar charts: calls/s and p50/p99 latency per system."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = res["results"]
    names = [r["system"] for r in rows]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    colors = ["#2b7bba" if n.startswith("shoal") else "#999999" for n in names]
    a.bar(names, [r["calls_per_s"] for r in rows], color=colors)
    a.set_ylabel("calls / s (higher is better)")
    a.set_title(f"{res['config']['snippet']!r}, {res['config']['concurrency']} in flight, "
                f"{res['config']['cpus']} cores")
    for i, r in enumerate(rows):
        a.text(i, r["calls_per_s"], f"{r['calls_per_s']:.0f}", ha="center", va="bottom")
    x = range(len(rows))
    b.bar([i - 0.2 for i in x], [r["p50_ms"] for r in rows], width=0.4, label="p50", color="#7fb3d5")
    b.bar([i + 0.2 for i in x], [r["p99_ms"] for r in rows], width=0.4, label="p99", color="#1f4e79")
    b.set_xticks(list(x), names)
    b.set_ylabel("latency, ms (lower is better)")
    b.set_yscale("log")
    b.legend()
    b.set_title("latency under load (p50, p99)")
    cpu = [r.get("own_cpu_ms_per_call") or 0 for r in rows]
    c.bar(names, cpu, color=colors)
    c.set_ylabel("CPU ms per call, the system's own (lower is better)")
    c.set_title("CPU cost per call (load-independent)")
    for i, v in enumerate(cpu):
        c.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    for ax in (a, b, c):
        ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


async def docker_python_calls(ctx: BenchContext, n: int, concurrency: int = 8) -> dict[str, Any]:
    """`print(1+1)` with `docker exec python3 -c` in a pool of warm containers (Docker's fncall)."""
    assert ctx.docker is not None
    pool = [c for c in await ctx.bounded([docker_create_one(ctx) for _ in range(concurrency)], 8)
            if isinstance(c, str)]
    lat: list[float] = []
    try:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with sem:
                t = time.perf_counter()
                code, out = await ctx.docker.exec(pool[i % len(pool)], ["python3", "-c", "print(1+1)"])
                if code == 0 and out.strip() == b"2":
                    lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        with ctx.task(f"Docker: {n} python calls via exec", n):
            await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    finally:
        await docker_remove_all(ctx, pool)
    return {"n": n, "ok": len(lat), "per_s": round(len(lat) / wall, 2) if wall else None,
            "latency": latency_summary(lat)}


def rows(out: dict[str, Any]) -> list[Metric]:
    """Table rows of fncall_bench's result: calls/s, p99 and CPU per call for each shoal row; SandboxFusion."""
    rows = []
    res = out.get("results", [])
    sf = next((r for r in res if "sandboxfusion" in str(r.get("system", "")).lower()), None)
    for r in res:
        if r is sf:
            continue
        name = str(r.get("system", "?"))
        cps = r.get("calls_per_s")
        sdk = "sdk" in name.lower()
        rows += [Metric(f"{name}: python calls/s", cps, None, "/s", better="higher",
                        target="≥ 500/s (issue 9)" if sdk else "",
                        met=(cps >= 500) if sdk and isinstance(cps, (int, float)) else None),
                 Metric(f"{name}: call p99", r.get("p99_ms"), None, "ms"),
                 Metric(f"{name}: one call at a time, p50", r.get("sequential_p50_ms"), None, "ms"),
                 Metric(f"{name}: its own CPU per call", r.get("own_cpu_ms_per_call"), None, "ms")]
    if sf is not None:
        rows += [Metric("SandboxFusion (same run): calls/s", sf.get("calls_per_s"), None, "/s", better="higher"),
                 Metric("SandboxFusion: call p99", sf.get("p99_ms"), None, "ms")]
    return rows


async def run(ctx: BenchContext, p: FncallParams) -> ScenarioResult:
    """The fncall scenario (see the module docstring)."""
    res = ScenarioResult("fncall", docker=ctx.docker_status)
    out = await fncall_bench(ctx, p)
    res.data.update(out)
    res.add(*rows(out))
    res.notes += [str(n)[:300] for n in out.get("notes", [])]
    if ctx.docker:
        dk = await docker_python_calls(ctx, p.docker_n)
        res.data["docker_python_calls"] = dk
        res.add(Metric("Docker: python calls/s (docker exec python3 -c, 8 warm containers)", None, dk["per_s"], "/s",
                       better="higher"),
                Metric("Docker: python call p99", None, dk["latency"].get("p99_ms"), "ms"))
    if ctx.plot_dir:
        png = plot(out, ctx.figure_path("fncall.png"))
        if png:
            res.figures.append(str(png))
    return res


SCENARIO = Scenario("fncall", "short Python calls per second on the warm fncall pool", run, FncallParams)
