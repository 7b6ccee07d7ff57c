"""`api`: HTTP API create and exec latency through `shoal serve`, beside the embedded SDK, at 1, 100 and 1,000
concurrent clients — in one run, on the same machine.

For each transport (HTTP: a `shoal serve` child process with a token, reached with `shoal.Client(url,
token=…)`; embedded: the run's own `shoal.Client()`) and each concurrency level c:
  1. create: c clients each create one sandbox at the same moment (c = 1: `reps` creates one after the
     other) — the latency of each create, from the call to a ready sandbox;
  2. exec: the c clients each run `execs` short commands (`echo`) in their sandbox, back to back — the
     round trip of each;
  3. close: every sandbox is closed (timed too).
Sandboxes use memory_mb=64, cpus=0.25. Every result must be right (exit 0, expected output); errors are
counted, never hidden. The server gets its own private SHOAL_HOME, removed at the end. Its Docker
counterpart is the Engine API measured by the `create` and `exec` scenarios.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import shoal
from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios.common import private_home, shoal_child_env
from shoal.bench.stats import latency_summary

SPEC = {"memory_mb": 64, "cpus": 0.25, "ttl_s": 3600}


@dataclass(frozen=True)
class ApiParams:
    """How much work the api scenario does."""

    levels: tuple[int, ...] = param((1, 100, 1000), quick=(1, 100), help="concurrent clients, one level after another")
    reps: int = param(30, quick=10, help="sequential creates at concurrency 1")
    execs: int = param(5, quick=3, help="execs per sandbox")


async def _level(client: shoal.Client, c: int, reps: int, execs: int, say: Callable[[str], None]) -> dict[str, Any]:
    """One concurrency level on one client."""
    create_lat: list[float] = []
    exec_lat: list[float] = []
    close_lat: list[float] = []
    errors: list[str] = []
    sandboxes: list[shoal.Sandbox] = []

    async def create_one() -> None:
        t = time.perf_counter()
        try:
            sb = await client.create("base", **SPEC)
        except Exception as e:
            errors.append(f"create: {type(e).__name__}: {e}"[:300])
            return
        create_lat.append(time.perf_counter() - t)
        sandboxes.append(sb)

    t0 = time.perf_counter()
    if c == 1:
        for _ in range(reps):
            await create_one()
    else:
        await asyncio.gather(*(create_one() for _ in range(c)))
    create_wall = time.perf_counter() - t0

    async def exec_loop(i: int, sb: shoal.Sandbox) -> None:
        for j in range(execs):
            t = time.perf_counter()
            try:
                r = await sb.exec(["echo", f"{i}.{j}"])
            except Exception as e:
                errors.append(f"exec: {type(e).__name__}: {e}"[:300])
                continue
            dt = time.perf_counter() - t
            if r.exit_code != 0 or r.stdout != f"{i}.{j}\n".encode():
                errors.append(f"exec: wrong result {r!r}"[:300])
                continue
            exec_lat.append(dt)

    t0 = time.perf_counter()
    if c == 1:
        for i, sb in enumerate(sandboxes):
            await exec_loop(i, sb)
    else:
        await asyncio.gather(*(exec_loop(i, sb) for i, sb in enumerate(sandboxes)))
    exec_wall = time.perf_counter() - t0

    async def close_one(sb: shoal.Sandbox) -> None:
        t = time.perf_counter()
        try:
            await sb.close()
        except Exception as e:
            errors.append(f"close: {type(e).__name__}: {e}"[:300])
            return
        close_lat.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    await asyncio.gather(*(close_one(sb) for sb in sandboxes))
    close_wall = time.perf_counter() - t0
    out = {"concurrency": c, "create": latency_summary(create_lat), "exec": latency_summary(exec_lat),
           "close": latency_summary(close_lat),
           "creates_per_s": round(len(create_lat) / create_wall, 1) if create_wall else 0.0,
           "execs_per_s": round(len(exec_lat) / exec_wall, 1) if exec_wall else 0.0,
           "close_wall_s": round(close_wall, 2), "errors": len(errors), "error_samples": errors[:5]}
    cr, ex = out["create"], out["exec"]
    nan = float("nan")
    say(f"c={c:<5} create p50 {cr.get('p50_ms', nan):>8.1f} ms p99 {cr.get('p99_ms', nan):>8.1f} ms | "
        f"exec p50 {ex.get('p50_ms', nan):>7.1f} ms p99 {ex.get('p99_ms', nan):>8.1f} ms | errors {len(errors)}")
    return out


async def _warm(client: shoal.Client) -> None:
    # first create mounts the image's layers and probes runtimes: not what is being measured
    sb = await client.create("base", **SPEC)
    await sb.exec("true")
    await sb.close()


@contextlib.asynccontextmanager
async def _http_client(home: Path, timeout: float) -> AsyncIterator[tuple[shoal.Client, Any]]:
    from shoal.server.proc import ServerProcess
    from shoal.server.tokens import TokenStore

    token = TokenStore(home).create("bench", name="bench_api")
    env = shoal_child_env(SHOAL_HOME=str(home))
    srv = ServerProcess(env=env, log_path=home / "server.log", token=token)
    await asyncio.to_thread(srv.start)
    try:
        async with shoal.Client(srv.url, token=token, timeout=timeout) as client:
            yield client, srv
    finally:
        await asyncio.to_thread(srv.stop)


async def api_bench(client: shoal.Client, levels: tuple[int, ...] = (1, 100, 1000), reps: int = 30,
                    execs: int = 5, say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """HTTP vs embedded create/exec latency at each concurrency level; JSON-friendly dict (see module doc).

    `client` is the embedded client the embedded side is measured with; the HTTP side gets a `shoal serve`
    on a private SHOAL_HOME.
    """
    result: dict[str, Any] = {"levels": list(levels), "reps_at_1": reps, "execs_per_sandbox": execs, "spec": SPEC,
                              "loadavg_before": os.getloadavg(), "cpus": os.cpu_count(), "http": {}, "embedded": {}}
    timeout = 1800.0
    async with private_home("shab-h-") as home:
        say(f"HTTP: shoal serve (home {home})")
        async with _http_client(home, timeout) as (c, _srv):
            await _warm(c)
            for lv in levels:
                result["http"][str(lv)] = await _level(c, lv, reps, execs, say)
    say("embedded: shoal.Client()")
    await _warm(client)
    for lv in levels:
        result["embedded"][str(lv)] = await _level(client, lv, reps, execs, say)
    result["loadavg_after"] = os.getloadavg()
    return result


def plot(result: dict[str, Any], path: Path) -> Path:
    """Bars of p50 and p99 per op and level, HTTP beside embedded (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    levels = result["levels"]
    for ax, op in zip(axes, ("create", "exec"), strict=True):
        xs = range(len(levels))
        w = 0.2
        for k, (tr, q, color) in enumerate([("http", "p50_ms", "#1f77b4"), ("http", "p99_ms", "#aec7e8"),
                                            ("embedded", "p50_ms", "#2ca02c"), ("embedded", "p99_ms", "#98df8a")]):
            vals = [result[tr][str(lv)][op].get(q, 0) for lv in levels]
            ax.bar([x + (k - 1.5) * w for x in xs], vals, w, label=f"{tr} {q[:3]}", color=color)
        ax.set_xticks(list(xs), [str(lv) for lv in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("ms (log)")
        ax.set_yscale("log")
        ax.set_title(f"{op} latency")
        ax.legend(fontsize=8)
    fig.suptitle(f"shoal HTTP API vs embedded SDK ({result['cpus']} cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def rows(result: dict[str, Any]) -> list[Metric]:
    """Table rows: HTTP p50/p99 per op and level (the embedded figure in the note), and errors."""
    out = []
    for lv in result["levels"]:
        h, e = result["http"].get(str(lv)) or {}, result["embedded"].get(str(lv)) or {}
        for op in ("create", "exec"):
            for q in ("p50_ms", "p99_ms"):
                ev = (e.get(op) or {}).get(q)
                out.append(Metric(f"{op} {q[:3]} @{lv} clients: HTTP (embedded in note)", (h.get(op) or {}).get(q),
                                  None, "ms", note=f"embedded {ev} ms" if ev is not None else ""))
        out.append(Metric(f"errors @{lv} (HTTP + embedded)", h.get("errors", 0) + e.get("errors", 0), None, ""))
    return out


async def run(ctx: BenchContext, p: ApiParams) -> ScenarioResult:
    """The api scenario (see the module docstring)."""
    res = ScenarioResult("api", docker="not applicable")
    out = await api_bench(ctx.client, p.levels, p.reps, p.execs, ctx.log)
    res.data.update(out)
    res.add(*rows(out))
    if ctx.plot_dir:
        res.figures.append(str(plot(out, ctx.figure_path("api_latency.png"))))
    return res


SCENARIO = Scenario("api", "HTTP API create/exec latency at 1, 100 and 1,000 concurrent clients (vs embedded)", run,
                    ApiParams, uses_docker=False)
