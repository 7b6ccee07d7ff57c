#!/usr/bin/env python3
"""fncall benchmark: short python snippets per second and latency, shoal vs SandboxFusion, in one run.

    sudo .venv/bin/python benchmarks/bench_fncall.py [--n 3000] [--concurrency 32] [--sf-dir DIR | --sf-url URL]

Measures, one after the other on the same machine, each after a warm-up:
  * shoal SDK      — `Client().run_code_many` on an embedded node (what an RL trainer in-process does);
  * shoal HTTP     — `shoal fncall serve` (started here), SandboxFusion's `/run_code` request over HTTP;
  * SandboxFusion  — the bytedance/SandboxFusion server from a checkout (`--sf-dir`, started here with its
                     default config, as its Docker image runs it) or an already running one (`--sf-url`).
Every call runs the same snippet (default `print(1+1)`) and must print the right answer; each HTTP row
uses the same client (httpx, `--concurrency` requests in flight). Writes DIR/bench_fncall.json and
DIR/bench_fncall.png (default DIR: benchmarks/results).

`--sf-dir` expects the layout of docs/fncall.md ("Benchmark"): DIR/src (the repository),
DIR/conda/envs/sandbox/bin/python (its server's Python with its dependencies), DIR/conda/condabin and
DIR/conda/bin/activate (what its python runner looks for), DIR/conda/envs/sandbox-runtime (the Python
that runs snippets).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]


# ---- measurement helpers -------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine, to report how much CPU a phase used."""
    with open("/proc/stat") as f:
        parts = [float(x) for x in f.readline().split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts) - idle, sum(parts)


def _proc_cpu_s(pid: int, children: bool = True) -> float:
    """CPU seconds of a process (and of its reaped children)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(rest[11]) + int(rest[12]) + ((int(rest[13]) + int(rest[14])) if children else 0)
    return ticks / os.sysconf("SC_CLK_TCK")


def _self_cpu_s() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _sandboxes_cpu_s(home: Path, owner_pid: int | None = None, ids: set[str] | None = None) -> float:
    """CPU seconds used so far by pooled sandboxes (their cgroups: agent, worker and every call)."""
    from shoal.backends.fncall_pool import POOL_LABEL
    from shoal.node.records import list_records

    total = 0.0
    for rec in list_records(home / "sandboxes"):
        if POOL_LABEL not in rec.labels or not rec.cgroup:
            continue
        if (owner_pid is not None and rec.owner_pid != owner_pid) or (ids is not None and rec.id not in ids):
            continue
        v1 = Path(f"/sys/fs/cgroup/cpuacct{rec.cgroup}/cpuacct.usage")
        v2 = Path(f"/sys/fs/cgroup{rec.cgroup}/cpu.stat")
        with contextlib.suppress(OSError, ValueError):
            if v1.exists():
                total += int(v1.read_text()) / 1e9
            elif v2.exists():
                total += int(v2.read_text().split("usage_usec")[1].split()[0]) / 1e6
    return total


def _seq(lat: list[float]) -> dict[str, Any]:
    return {"sequential_p50_ms": round(_pct(lat, 0.5) * 1000, 2), "sequential_p99_ms": round(_pct(lat, 0.99) * 1000, 2)}


def _pct(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))] if ys else float("nan")


def _summary(name: str, lat: list[float], wall: float, ok: int, n: int, cpu: tuple[float, float],
             own_cpu_s: float, client_cpu_s: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    busy = cpu[0]
    ncpu = os.cpu_count() or 1
    return {
        "system": name, "calls": n, "ok": ok, "seconds": round(wall, 3), "calls_per_s": round(n / wall, 1),
        "p50_ms": round(_pct(lat, 0.50) * 1000, 2), "p90_ms": round(_pct(lat, 0.90) * 1000, 2),
        "p99_ms": round(_pct(lat, 0.99) * 1000, 2), "max_ms": round(max(lat) * 1000, 2) if lat else None,
        # CPU the system under test used per call (its processes and containers; for HTTP rows without the
        # load-generating client), and the rate that CPU cost allows when it has every core to itself
        "own_cpu_ms_per_call": round(own_cpu_s / n * 1000, 3),
        "cpu_bound_calls_per_s": round(ncpu / (own_cpu_s / n), 1) if own_cpu_s > 0 else None,
        "client_cpu_ms_per_call": round(client_cpu_s / n * 1000, 3),
        # machine-wide CPU while the phase ran (includes anything else running on the host)
        "machine_cpu_ms_per_call": round(busy / n * 1000, 3), "machine_cpu_utilization": round(busy / (wall * ncpu), 3),
        "loadavg_after": os.getloadavg()[0], **(extra or {}),
    }


class _Phase:
    def __init__(self) -> None:
        self.t0 = 0.0
        self.c0 = (0.0, 0.0)

    def __enter__(self) -> _Phase:
        self.c0 = _cpu_busy()
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.monotonic() - self.t0
        c1 = _cpu_busy()
        hz = os.sysconf("SC_CLK_TCK")
        self.cpu = ((c1[0] - self.c0[0]) / hz, (c1[1] - self.c0[1]) / hz)


# ---- shoal in-process ----------------------------------------------------------------------------------------
async def bench_shoal_sdk(n: int, concurrency: int, snippet: str, expect: str, warmup: int,
                          seq_n: int = 200) -> dict[str, Any]:
    """`run_code` calls on an embedded node, `concurrency` at a time."""
    import shoal
    from shoal.backends.fncall import get_pool_manager

    async with shoal.Client() as client:
        node = client.transport.node
        mgr = get_pool_manager(node)
        await mgr.warm("python", mgr.config.max_size)
        await client.run_code_many([snippet] * warmup, concurrency=concurrency)
        lat: list[float] = []
        ok = 0
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            nonlocal ok
            async with sem:
                t = time.monotonic()
                r = await client.run_code(snippet)
                lat.append(time.monotonic() - t)
                ok += r.ok and r.stdout.decode().strip() == expect

        seq: list[float] = []
        for _ in range(seq_n):  # one call at a time: latency without queueing
            t = time.monotonic()
            await client.run_code(snippet)
            seq.append(time.monotonic() - t)
        ids = set(mgr.sandbox_ids())
        home = node.paths.home
        own0 = _self_cpu_s() + _sandboxes_cpu_s(home, ids=ids)
        with _Phase() as ph:
            await asyncio.gather(*(one() for _ in range(n)))
        own = _self_cpu_s() + _sandboxes_cpu_s(home, ids=ids) - own0
        pool = mgr.stats()["pools"]
    return _summary("shoal SDK (in-process)", lat, ph.wall, ok, n, ph.cpu, own, 0.0,
                    {**_seq(seq), "pool_size": sum(p["idle"] + p["busy"] for p in pool), "isolation":
                     "pooled container; fresh process forked from a warm interpreter, uid nobody, own session; "
                     "tmp, working dir, IPC and processes cleaned after every call"})


# ---- HTTP (shoal fncall serve, SandboxFusion) ------------------------------------------------------------------
async def bench_http(name: str, url: str, n: int, concurrency: int, snippet: str, expect: str, warmup: int,
                     extra: dict[str, Any] | None = None, own_cpu: Any = None, seq_n: int = 200) -> dict[str, Any]:
    """SandboxFusion `/run_code` requests, `concurrency` in flight, sent with aiohttp (what SandboxFusion's own
    async client uses; lighter than httpx, and the load generator shares the machine's cores)."""
    import aiohttp

    body = {"code": snippet, "language": "python", "compile_timeout": 10, "run_timeout": 10}
    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base_url=url, connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as http:
        sem = asyncio.Semaphore(concurrency)
        lat: list[float] = []
        ok = 0
        errors: dict[str, int] = {}

        async def one(record: bool = True) -> None:
            nonlocal ok
            async with sem:
                t = time.monotonic()
                try:
                    async with http.post("/run_code", json=body) as resp:
                        r = await resp.json()
                except Exception as e:
                    errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                    return
                if record:
                    lat.append(time.monotonic() - t)
                    good = r.get("status") == "Success" and (r.get("run_result") or {}).get("stdout", "").strip() \
                        == expect
                    ok += good
                    if not good:
                        key = str(r.get("message") or r.get("status"))[:80]
                        errors[key] = errors.get(key, 0) + 1

        await asyncio.gather(*(one(False) for _ in range(warmup)))
        seq: list[float] = []
        for _ in range(seq_n):  # one call at a time: latency without queueing
            t = time.monotonic()
            async with http.post("/run_code", json=body) as resp:
                await resp.read()
            seq.append(time.monotonic() - t)
        own0, client0 = (own_cpu() if own_cpu else 0.0), _self_cpu_s()
        with _Phase() as ph:
            await asyncio.gather(*(one() for _ in range(n)))
        own, client = (own_cpu() if own_cpu else 0.0) - own0, _self_cpu_s() - client0
    return _summary(name, lat, ph.wall, ok, n, ph.cpu, own, client, {**(extra or {}), **_seq(seq), "errors": errors})


def _wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    body = {"code": "print(1)", "language": "python"}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        with contextlib.suppress(httpx.HTTPError, ValueError):
            if httpx.post(url + "/run_code", json=body, timeout=30).json().get("status") == "Success":
                return
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not answer within {timeout}s: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def shoal_fncall_server(log_dir: Path, pool: int) -> Any:
    """`shoal fncall serve` as a child process, its python pool warmed to `pool` workers."""
    port = _free_port()
    log = log_dir / "bench_fncall-shoal-server.log"
    with open(log, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "shoal.cli.main", "fncall", "serve", "--port", str(port),
                                 "--warm", f"python={pool}"], stdout=logf, stderr=logf, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    home = Path(os.environ.get("SHOAL_HOME") or "/var/lib/shoal")
    try:
        _wait_http(url, proc, "shoal fncall serve", 180, log)
        yield url, lambda: _proc_cpu_s(proc.pid) + _sandboxes_cpu_s(home, owner_pid=proc.pid)
    finally:
        _stop(proc)


@contextlib.contextmanager
def sandboxfusion_server(sf_dir: Path, log_dir: Path) -> Any:
    """The SandboxFusion server from a checkout, run as its Docker image runs it (uvicorn, config `local`)."""
    py = sf_dir / "conda" / "envs" / "sandbox" / "bin" / "python"
    src = sf_dir / "src"
    if not py.exists() or not (src / "sandbox" / "server" / "server.py").exists():
        raise RuntimeError(f"{sf_dir} does not hold a SandboxFusion checkout and its Python (see the docstring)")
    (src / "docs" / "build").mkdir(parents=True, exist_ok=True)  # its app mounts the (unbuilt) doc site
    port = _free_port()
    log = log_dir / "bench_fncall-sandboxfusion.log"
    env = dict(os.environ, SANDBOX_CONFIG="local")
    with open(log, "wb") as logf:
        proc = subprocess.Popen([str(py), "-m", "uvicorn", "sandbox.server.server:app", "--host", "127.0.0.1",
                                 "--port", str(port)], cwd=src, env=env, stdout=logf, stderr=logf,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url, proc, "SandboxFusion", 180, log)
        # the server and every process it started (reaped children count in its own accounting)
        yield url, lambda: _proc_cpu_s(proc.pid)
    finally:
        _stop(proc)


# ---- the whole benchmark ---------------------------------------------------------------------------------------
async def run_fncall_bench(n: int = 3000, concurrency: int = 32, snippet: str = "print(1+1)", expect: str = "2",
                           warmup: int = 200, sf_dir: str | Path | None = None, sf_url: str | None = None,
                           http: bool = True, log_dir: str | Path | None = None,
                           log: Any = None) -> dict[str, Any]:
    """Run every phase and return {config, results: [row per system], ratios, notes}.

    Without `sf_dir`/`sf_url`, the environment's SHOAL_SANDBOXFUSION_DIR / SHOAL_SANDBOXFUSION_URL are used
    (so `shoal bench` includes SandboxFusion when they are set)."""
    import tempfile

    sf_dir = sf_dir or os.environ.get("SHOAL_SANDBOXFUSION_DIR") or None
    sf_url = sf_url or os.environ.get("SHOAL_SANDBOXFUSION_URL") or None

    log = log or (lambda s: None)
    # the servers' logs are for debugging a run, not results: they go to the temp dir unless asked otherwise
    log_dir = Path(log_dir or tempfile.gettempdir())
    log_dir.mkdir(parents=True, exist_ok=True)
    from shoal.backends.fncall import FncallConfig

    pool = FncallConfig().max_size
    out: dict[str, Any] = {
        "config": {"n": n, "concurrency": concurrency, "snippet": snippet, "warmup": warmup, "cpus": os.cpu_count(),
                   "pool_max_size": pool, "loadavg_before": os.getloadavg()[0],
                   "kernel": os.uname().release, "time": time.strftime("%Y-%m-%d %H:%M:%S")},
        "results": [], "notes": []}
    log(f"shoal SDK: {n} calls, {concurrency} at a time")
    out["results"].append(await bench_shoal_sdk(n, concurrency, snippet, expect, warmup))
    log(f"  {out['results'][-1]['calls_per_s']} calls/s, p99 {out['results'][-1]['p99_ms']} ms")
    if http:
        log("shoal HTTP: starting `shoal fncall serve`")
        with shoal_fncall_server(log_dir, pool) as (url, cpu):
            out["results"].append(await bench_http("shoal HTTP (/run_code)", url, n, concurrency, snippet, expect,
                                                   warmup, {"isolation": out["results"][0]["isolation"]}, cpu))
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3000, help="measured calls per system")
    ap.add_argument("--concurrency", type=int, default=32, help="calls in flight")
    ap.add_argument("--warmup", type=int, default=200, help="unmeasured calls first")
    ap.add_argument("--snippet", default="print(1+1)")
    ap.add_argument("--expect", default="2", help="what the snippet must print")
    ap.add_argument("--sf-dir", type=Path, help="SandboxFusion checkout + Pythons (see above)")
    ap.add_argument("--sf-url", help="an already running SandboxFusion server")
    ap.add_argument("--no-http", action="store_true", help="skip the shoal HTTP row")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--logs", type=Path, help="where the servers' logs go (default: the temp dir)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_fncall needs root (containers)", file=sys.stderr)
        return 2

    def _term(*_: object) -> None:
        raise KeyboardInterrupt  # unwind: pools and the servers this run started are closed on the way out

    signal.signal(signal.SIGTERM, _term)
    res = asyncio.run(run_fncall_bench(n=args.n, concurrency=args.concurrency, snippet=args.snippet,
                                       expect=args.expect, warmup=args.warmup, sf_dir=args.sf_dir,
                                       sf_url=args.sf_url, http=not args.no_http, log_dir=args.logs,
                                       log=lambda s: print(s, file=sys.stderr, flush=True)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_fncall.json").write_text(json.dumps(res, indent=1) + "\n")
    png = plot(res, args.out / "bench_fncall.png")
    print(f"{'system':24s} {'calls/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s} {'seq p50':>8s} {'seq p99':>8s} "
          f"{'own cpu ms':>10s} {'cpu-bound/s':>11s} {'client ms':>9s} {'ok':>6s}")
    for r in res["results"]:
        print(f"{r['system']:24s} {r['calls_per_s']:8.1f} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
              f"{r['sequential_p50_ms']:8.2f} {r['sequential_p99_ms']:8.2f} "
              f"{r['own_cpu_ms_per_call']:10.3f} {r['cpu_bound_calls_per_s'] or 0:11.1f} "
              f"{r['client_cpu_ms_per_call']:9.3f} {r['ok']:>6d}")
    for k, v in (res.get("ratios") or {}).items():
        print(f"{k} / SandboxFusion: {v}x calls/s, {res['ratios_p99'][k]}x lower p99, "
              f"{(res.get('ratios_cpu_cost') or {}).get(k, '?')}x less CPU per call")
    for note in res["notes"]:
        print("note:", note)
    print(f"load average before/after: {res['config']['loadavg_before']:.2f} / {res['config']['loadavg_after']:.2f}")
    print(f"wrote {args.out / 'bench_fncall.json'}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
