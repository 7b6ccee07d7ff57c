"""The load generators and meters of the `fncall` scenario: calls through the SDK and over HTTP (shoal's
`/run_code` and SandboxFusion's), the servers started for them, and the CPU each system spends per call."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

import shoal
from shoal.bench.scenarios.common import shoal_child_env


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
    from shoal.records import list_records

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
async def bench_shoal_sdk(client: shoal.Client, n: int, concurrency: int, snippet: str, expect: str, warmup: int,
                          seq_n: int = 200) -> dict[str, Any]:
    """`run_code` calls on `client`'s embedded node, `concurrency` at a time."""

    node = client.transport.node  # type: ignore[attr-defined]
    mgr = node.fncall()
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
def shoal_fncall_server(log_dir: Path, pool: int, home: Path) -> Any:
    """`shoal fncall serve` as a child process on SHOAL_HOME `home`, its python pool warmed to `pool` workers."""
    port = _free_port()
    log = log_dir / "bench_fncall-shoal-server.log"
    env = shoal_child_env(SHOAL_HOME=str(home))
    with open(log, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "shoal.cli.main", "fncall", "serve", "--port", str(port),
                                 "--warm", f"python={pool}"], stdout=logf, stderr=logf, stdin=subprocess.DEVNULL,
                                env=env)
    url = f"http://127.0.0.1:{port}"
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
