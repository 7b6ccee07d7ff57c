#!/usr/bin/env python3
"""HTTP API benchmark: create and exec latency through `shoal serve`, beside the embedded SDK, at 1, 100 and
1,000 concurrent clients — in one run, on the same machine.

    sudo .venv/bin/python benchmarks/bench_api.py                      # 1, 100, 1000; table + JSON + PNG
    sudo .venv/bin/python benchmarks/bench_api.py --levels 1,100 --execs 3 --out /tmp/r

For each transport (HTTP: a `shoal serve` child process with a token, reached with `shoal.Client(url,
token=…)`; embedded: `shoal.Client()` in this process) and each concurrency level c:
  1. create: c clients each create one sandbox at the same moment (c = 1: `reps` creates one after the
     other) — the latency of each create, from the call to a ready sandbox;
  2. exec: the c clients each run `execs` short commands (`echo`) in their sandbox, back to back — the
     round trip of each;
  3. close: every sandbox is closed (timed too).
Sandboxes use memory_mb=64, cpus=0.25. Every result must be right (exit 0, expected output); errors are
counted, never hidden. Each transport gets its own private SHOAL_HOME, removed at the end.

`run_api_bench(...) -> dict` is what `shoal bench api` calls. Nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

import shoal  # noqa: E402

SPEC = {"memory_mb": 64, "cpus": 0.25, "ttl_s": 3600}


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] if xs else 0.0


def _lat(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": round(_pct(xs, 50) * 1000, 2), "p99_ms": round(_pct(xs, 99) * 1000, 2),
            "mean_ms": round(statistics.fmean(xs) * 1000, 2) if xs else 0.0,
            "max_ms": round(max(xs) * 1000, 2) if xs else 0.0, "n": len(xs)}


@contextlib.asynccontextmanager
async def _private_home(prefix: str) -> AsyncIterator[Path]:
    """A SHOAL_HOME of its own (short path: agent sockets live in it); emptied and removed afterwards."""
    home = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield home
    finally:
        from shoal.config import Paths
        from shoal.node.teardown import teardown_home

        await teardown_home(Paths.from_env(home), close_sandboxes=True)  # also what a failed run left
        shutil.rmtree(home, ignore_errors=True)


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
    out = {"concurrency": c, "create": _lat(create_lat), "exec": _lat(exec_lat), "close": _lat(close_lat),
           "creates_per_s": round(len(create_lat) / create_wall, 1) if create_wall else 0.0,
           "execs_per_s": round(len(exec_lat) / exec_wall, 1) if exec_wall else 0.0,
           "close_wall_s": round(close_wall, 2), "errors": len(errors), "error_samples": errors[:5]}
    say(f"  c={c:<5} create p50 {out['create']['p50_ms']:>8.1f} ms p99 {out['create']['p99_ms']:>8.1f} ms | "
        f"exec p50 {out['exec']['p50_ms']:>7.1f} ms p99 {out['exec']['p99_ms']:>8.1f} ms | errors {len(errors)}")
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
    env = dict(os.environ, SHOAL_HOME=str(home))
    srv = ServerProcess(env=env, log_path=home / "server.log", token=token)
    await asyncio.to_thread(srv.start)
    try:
        async with shoal.Client(srv.url, token=token, timeout=timeout) as client:
            yield client, srv
    finally:
        await asyncio.to_thread(srv.stop)


async def run_api_bench(levels: tuple[int, ...] | list[int] = (1, 100, 1000), reps: int = 30, execs: int = 5,
                        quick: bool = False, log: Callable[[str], None] | None = None,
                        client: shoal.Client | None = None) -> dict[str, Any]:
    """HTTP vs embedded create/exec latency at each concurrency level; JSON-friendly dict (see module doc).

    `client` (optional) is an embedded client to measure the embedded side with (`shoal bench` passes its
    own); otherwise one is made on a private SHOAL_HOME.
    """
    say = log or (lambda s: print(s, flush=True))
    if quick:
        levels, reps, execs = tuple(x for x in levels if x <= 100) or (1,), min(reps, 10), min(execs, 3)
    result: dict[str, Any] = {"levels": list(levels), "reps_at_1": reps, "execs_per_sandbox": execs, "spec": SPEC,
                              "loadavg_before": os.getloadavg(), "cpus": os.cpu_count(), "http": {}, "embedded": {}}
    timeout = 1800.0
    async with _private_home("shab-h-") as home:
        say(f"HTTP: shoal serve (home {home})")
        async with _http_client(home, timeout) as (c, _srv):
            await _warm(c)
            for lv in levels:
                result["http"][str(lv)] = await _level(c, lv, reps, execs, say)
    say("embedded: shoal.Client()")
    if client is not None:
        await _warm(client)
        for lv in levels:
            result["embedded"][str(lv)] = await _level(client, lv, reps, execs, say)
    else:
        async with _private_home("shab-e-") as home:
            from shoal.sdk.local import LocalTransport

            async with shoal.Client(transport=LocalTransport(home=str(home))) as c:
                await _warm(c)
                for lv in levels:
                    result["embedded"][str(lv)] = await _level(c, lv, reps, execs, say)
    result["loadavg_after"] = os.getloadavg()
    result["metrics"] = _metrics(result)
    return result


def _metrics(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for lv in result["levels"]:
        h, e = result["http"].get(str(lv)), result["embedded"].get(str(lv))
        for op in ("create", "exec"):
            for q in ("p50_ms", "p99_ms"):
                rows.append({"name": f"{op} {q[:3]} @{lv} clients: HTTP (embedded in note)",
                             "shoal": h[op][q] if h else None, "docker": None, "unit": "ms", "better": "lower",
                             "note": f"embedded {e[op][q]} ms" if e else ""})
        rows.append({"name": f"errors @{lv} (HTTP + embedded)", "shoal": (h or {}).get("errors", 0) +
                     (e or {}).get("errors", 0), "docker": None, "unit": "", "better": "lower"})
    return rows


def table(result: dict[str, Any]) -> str:
    """A plain-text table of the figures."""
    lines = [f"{'clients':>8} | {'op':<6} | {'HTTP p50':>9} {'HTTP p99':>9} | {'embedded p50':>12} {'embedded p99':>12}"
             " | errors", "-" * 80]
    for lv in result["levels"]:
        h, e = result["http"][str(lv)], result["embedded"][str(lv)]
        for op in ("create", "exec"):
            lines.append(f"{lv:>8} | {op:<6} | {h[op]['p50_ms']:>9.1f} {h[op]['p99_ms']:>9.1f} | "
                         f"{e[op]['p50_ms']:>12.1f} {e[op]['p99_ms']:>12.1f} | {h['errors']}+{e['errors']}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
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
            vals = [result[tr][str(lv)][op][q] for lv in levels]
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


def main() -> None:
    """Command line: run, print a table, write JSON and PNG."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levels", default="1,100,1000", help="concurrency levels, comma-separated")
    ap.add_argument("--reps", type=int, default=30, help="sequential creates at concurrency 1")
    ap.add_argument("--execs", type=int, default=5, help="execs per sandbox")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    os.environ.setdefault("SHOAL_STORE", "/var/lib/shoal/store")
    levels = tuple(int(x) for x in a.levels.split(",") if x)
    result = asyncio.run(run_api_bench(levels, reps=a.reps, execs=a.execs, quick=a.quick))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_api.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "bench_api.png")
    print(table(result))
    print(f"wrote {out / 'bench_api.json'} and {out / 'bench_api.png'}")


if __name__ == "__main__":
    main()
