"""Scenarios owned by other parts of shoal, run through `shoal bench`: lazy images, fork/snapshot, pause,
fncall, VMs, the HTTP API.

Their code lives in the repository's `benchmarks/` directory (`bench_image.run_image_bench`,
`bench_stateful.run_fork_bench`/`run_snapshot_bench`/`run_pause_bench`, `bench_fncall.run_fncall_bench`,
`bench_vm.run_vm_bench`, `bench_api.run_api_bench`). Each is imported when present ("not available in
this build" otherwise) and called with the keyword arguments it declares among: `client` (the bench's
embedded client), `node`, `docker` (the private engine or None), `quick`, `progress`, and smaller sizes
under --quick (`n`, `reps`, …). A returned dict is shown as rows of its numeric leaves; a dict with a
`metrics` list of {name, shoal, docker, unit, better, target, met} rows is shown as those rows.

Where the other scenario does not compare with Docker itself, the Docker side of the same work is run
here (pause/unpause, commit + run, `docker exec python3 -c`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import re
import sys
import time
from pathlib import Path
from typing import Any

from shoal.bench.context import BenchContext
from shoal.bench.registry import scenario
from shoal.bench.results import Metric, ScenarioResult
from shoal.bench.scenarios.common import docker_create_one, docker_remove_all, first_errors
from shoal.bench.stats import latency_summary

_UNITS = [("_ms", "ms"), ("_mib", "MiB"), ("_kib", "KiB"), ("_pct", "%"), ("percent", "%"), ("_per_s", "/s"),
          ("per_s", "/s"), ("_bytes", "B"), ("_s", "s"), ("fraction", "")]
MAX_ROWS = 24


def benchmarks_dir() -> Path | None:
    """The repository's benchmarks/ directory (None for an installed shoal without the repository)."""
    import shoal

    d = Path(shoal.__file__).resolve().parents[2] / "benchmarks"
    return d if d.is_dir() else None


def load_bench_function(module: str, func: str) -> tuple[Any, str]:
    """(function, '') or (None, why not) for `benchmarks/<module>.py:<func>`."""
    d = benchmarks_dir()
    if d is None or not (d / f"{module}.py").exists():
        return None, f"not available in this build (benchmarks/{module}.py is missing)"
    name = f"_shoal_benchmarks_{module}"
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, d / f"{module}.py")
        if spec is None or spec.loader is None:
            return None, f"cannot load benchmarks/{module}.py"
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except Exception as e:
            sys.modules.pop(name, None)
            return None, f"benchmarks/{module}.py failed to import: {type(e).__name__}: {e}"
    fn = getattr(mod, func, None)
    if fn is None:
        return None, f"not available in this build (benchmarks/{module}.py has no {func})"
    return fn, ""


def _kwargs(fn: Any, ctx: BenchContext, overrides: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(fn).parameters
    offer = {"client": ctx.client, "node": ctx.node, "docker": ctx.docker, "quick": ctx.quick,
             "progress": ctx.progress, "log": ctx.log}
    kw = {k: v for k, v in offer.items() if k in params}
    if ctx.quick:
        for k, small in (("n", ctx.sizes.external_n), ("reps", 2), ("count", ctx.sizes.external_n)):
            p = params.get(k)
            if p is not None and small is not None and isinstance(p.default, int) and p.default > small:
                kw[k] = small
    quick_over = overrides.pop("quick_overrides", {}) if ctx.quick else {}
    overrides.pop("quick_overrides", None)
    kw.update({k: v for k, v in {**overrides, **quick_over}.items() if k in params})
    return kw


async def call_bench(fn: Any, ctx: BenchContext, **overrides: Any) -> Any:
    """Call another scenario's function with the arguments it declares (async or blocking)."""
    kw = _kwargs(fn, ctx, overrides)
    if inspect.iscoroutinefunction(fn):
        return await fn(**kw)
    return await asyncio.to_thread(fn, **kw)


def _unit(key: str) -> str:
    k = key.lower()
    for suffix, unit in _UNITS:
        if k.endswith(suffix):
            return unit
    return ""


def flatten(d: Any, prefix: str = "") -> list[tuple[str, float]]:
    """Numeric leaves of nested dicts/lists as (dotted.path, value)."""
    out: list[tuple[str, float]] = []
    if isinstance(d, dict):
        for k, v in d.items():
            out += flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(d, list) and len(d) <= 8:
        for i, v in enumerate(d):
            label = next((str(v[k]) for k in ("system", "name", "label", "bench") if isinstance(v, dict)
                          and isinstance(v.get(k), str)), str(i)) if isinstance(v, dict) else str(i)
            out += flatten(v, f"{prefix}[{label}]")
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        out.append((prefix, float(d)))
    return out


# leaves that describe the run rather than measure it (they stay in the JSON)
_NOISE = re.compile(r"(^|\.)(config|spec|loadavg[a-z_]*|time|started|cpus|kernel|samples[a-z_]*)(\.|\[|$)|\[\d+\]$")


def rows_from(result: Any, label: str = "") -> list[Metric]:
    """Table rows for another scenario's result."""
    if isinstance(result, dict) and isinstance(result.get("metrics"), list):
        rows = []
        for m in result["metrics"]:
            if isinstance(m, dict) and "name" in m:
                rows.append(Metric(str(m["name"]), m.get("shoal"), m.get("docker"), m.get("unit", ""),
                                   m.get("better", "lower"), m.get("target", ""), m.get("met"), m.get("note", "")))
        return rows
    rows = [Metric(f"{label}{k}", v, None, _unit(k)) for k, v in flatten(result) if not _NOISE.search(k)]
    return rows[:MAX_ROWS]


def _g(d: Any, path: str) -> Any:
    for part in path.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def _num(d: Any, path: str, scale: float = 1.0) -> float | None:
    v = _g(d, path)
    return v * scale if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _lazy_rows(out: dict[str, Any]) -> list[Metric]:
    frac = _num(out, "read.start_and_json_fraction", 100)
    rows = [Metric("image read to start + python3 -c 'import json' (cold cache)", frac, None, "%", target="≤ 10%",
                   met=None if frac is None else frac <= 10,
                   note=f"of {_num(out, 'image_bytes', 1 / 2**20) or 0:.0f} MiB, mount {_g(out, 'read.mount_mode')}"),
            Metric("image read to start the sandbox only", _num(out, "read.start_fraction", 100), None, "%"),
            Metric("layer mount, cold (file-backed EROFS)", _num(out, "mount.file.cold_ms"), None, "ms"),
            Metric("layer mount, cold (loop device)", _num(out, "mount.loop.cold_ms"), None, "ms")]
    s, d = _num(out, "writes.shoal.bytes_written", 1 / 1024), _num(out, "writes.docker.bytes_written", 1 / 1024)
    if s is not None:
        pct = 100 * s / d if d else None
        rows.append(Metric(f"disk written per sandbox (image bench: {out.get('n_sandboxes')} per round)", s, d, "KiB",
                           target="≤ 1% of Docker's", met=None if pct is None else pct <= 1,
                           note=f"{pct:.2f}% of Docker's" if pct is not None else ""))
    return rows


def _pause_rows(out: dict[str, Any]) -> list[Metric]:
    rows = []
    for r in out.get("rounds", []):
        if "skipped" in r:
            continue
        tag = "zram swap on" if r.get("swap_on") else "no swap"
        ret = r.get("returned_pct")
        rows += [Metric(f"{r.get('n')} paused idle sandboxes: memory returned ({tag})", ret, None, "%",
                        better="higher", target="≥ 80% (issue 4)", met=None if ret is None else ret >= 80,
                        note=f"{r.get('per_sandbox_before_mib')} -> {r.get('per_sandbox_after_mib')} MiB each"),
                 Metric(f"pause p50 ({tag})", _num(r, "pause.p50_ms"), None, "ms"),
                 Metric(f"resume p50, with prefetch ({tag})", _num(r, "resume_prefetch.p50_ms"), None, "ms"),
                 Metric(f"first command after resume p50 ({tag})", _num(r, "first_cmd_after_prefetch.p50_ms"), None,
                        "ms")]
    return rows


def _fncall_rows(out: dict[str, Any]) -> list[Metric]:
    rows = []
    res = out.get("results", [])
    sf = next((r for r in res if "sandboxfusion" in str(r.get("system", "")).lower()), None)
    for r in res:
        if r is sf:
            continue
        name = str(r.get("system", "?"))
        cps = r.get("calls_per_s")
        rows += [Metric(f"{name}: python calls/s", cps, None, "/s", better="higher",
                        target="≥ 500/s (issue 9)" if "sdk" in name.lower() else "",
                        met=(cps >= 500) if "sdk" in name.lower() and isinstance(cps, (int, float)) else None),
                 Metric(f"{name}: call p99", r.get("p99_ms"), None, "ms")]
    if sf is not None:
        rows.append(Metric("SandboxFusion (same run): calls/s", sf.get("calls_per_s"), None, "/s", better="higher"))
    for n in out.get("notes", []):
        if "SandboxFusion" in str(n):
            rows.append(Metric("SandboxFusion", None, None, "", note=str(n)[:200]))
    return rows


def _snapshot_rows(out: dict[str, Any]) -> list[Metric]:
    p50 = _num(out, "seconds.p50_ms", 1 / 1000)
    return [Metric(f"snapshot of a sandbox with {out.get('change_mb')} MB of changes, p50", p50, None, "s",
                   target="≤ 2 s (issue 4)", met=None if p50 is None else p50 <= 2,
                   note=f"frozen {_num(out, 'frozen.p50_ms') or 0:.0f} ms, layer {out.get('layer_mib')} MiB")]


def _fork_rows(out: dict[str, Any]) -> list[Metric]:
    return [Metric("fork(8): snapshot + 8 children ready", out.get("fork8_total_s"), None, "s"),
            Metric(f"{out.get('n')} fresh base sandboxes ready (same run)", out.get("fresh_base_ready_s"), None, "s")]


#: readable rows for the other scenarios whose result layout is known (the JSON keeps everything)
CURATED = {"run_image_bench": _lazy_rows, "run_pause_bench": _pause_rows, "run_fncall_bench": _fncall_rows,
           "run_snapshot_bench": _snapshot_rows, "run_fork_bench": _fork_rows}


async def _external(ctx: BenchContext, name: str, calls: list[tuple[str, str, dict[str, Any]]]) -> ScenarioResult:
    res = ScenarioResult(name, docker="not applicable")
    ran = 0
    for module, func, overrides in calls:
        fn, why = load_bench_function(module, func)
        if fn is None:
            res.notes.append(f"{func}: {why}")
            continue
        t0 = time.perf_counter()
        try:
            out = await call_bench(fn, ctx, **overrides)
        except Exception as e:
            import traceback

            res.notes.append(f"{func} failed: {type(e).__name__}: {e}"[:500])
            res.data[f"{func}_traceback"] = traceback.format_exc()[-3000:]
            continue
        ran += 1
        res.data[func] = out
        res.data[f"{func}_seconds"] = round(time.perf_counter() - t0, 1)
        curated = CURATED.get(func)
        rows = None
        if curated is not None and isinstance(out, dict) and not isinstance(out.get("metrics"), list):
            try:
                rows = curated(out)
            except Exception:  # a changed layout: fall back to every number
                rows = None
        res.add(*(rows or rows_from(out, "" if len(calls) == 1 else
                                    f"{func.removeprefix('run_').removesuffix('_bench')}: ")))
    if not ran and not res.notes:
        res.notes.append("not available in this build")
    return res


# ---- Docker sides of the same work ---------------------------------------------------------------
async def docker_pause(ctx: BenchContext, n: int) -> dict[str, Any]:
    """Pause and unpause latency of `n` idle containers (the cgroup freezer, like shoal's pause)."""
    assert ctx.docker is not None
    cids = [c for c in await ctx.bounded([docker_create_one(ctx) for _ in range(n)], 8) if isinstance(c, str)]
    p_lat, r_lat, errs = [], [], []
    try:
        with ctx.task(f"Docker: pause/unpause {len(cids)} containers", len(cids)) as adv:
            for c in cids:
                t = time.perf_counter()
                r = await ctx.docker.client.post(f"/containers/{c}/pause")
                p_lat.append(time.perf_counter() - t)
                t = time.perf_counter()
                r2 = await ctx.docker.client.post(f"/containers/{c}/unpause")
                r_lat.append(time.perf_counter() - t)
                if r.status_code != 204 or r2.status_code != 204:
                    errs.append(f"{r.status_code}/{r2.status_code} {r.text[:100]}")
                adv()
    finally:
        await docker_remove_all(ctx, cids)
    return {"n": len(cids), "pause": latency_summary(p_lat), "unpause": latency_summary(r_lat),
            "errors": first_errors(errs), "memory_reclaim": "none (docker pause only freezes)"}


async def docker_fork(ctx: BenchContext, n: int, change_mb: int = 10) -> dict[str, Any]:
    """`docker commit` of a container with `change_mb` MB written, then `n` containers from the new image."""
    assert ctx.docker is not None
    d = ctx.docker
    parent = await docker_create_one(ctx)
    tag = "shoal-bench-fork:latest"
    kids: list[str] = []
    try:
        code, _ = await d.exec(parent, ["sh", "-c", f"mkdir -p /work && head -c {change_mb << 20} /dev/urandom "
                                        "> /work/data && echo parent > /work/who"])
        t0 = time.perf_counter()
        r = await d.client.post("/commit", params={"container": parent, "repo": "shoal-bench-fork", "tag": "latest"})
        commit_s = time.perf_counter() - t0
        if r.status_code != 201:
            return {"error": f"commit: {r.status_code} {r.text[:200]}"}
        base_image = d.image
        d.image = tag
        try:
            t0 = time.perf_counter()
            with ctx.task(f"Docker: {n} containers from the commit", n) as adv:
                got = await ctx.bounded([docker_create_one(ctx) for _ in range(n)], 16, adv)
            children_s = time.perf_counter() - t0
        finally:
            d.image = base_image
        kids = [c for c in got if isinstance(c, str)]
        return {"n": n, "ok": len(kids), "change_mb": change_mb, "commit_s": round(commit_s, 3),
                "children_ready_s": round(children_s, 3), "snapshot_plus_children_s": round(commit_s + children_s, 3),
                "exit": code}
    finally:
        await docker_remove_all(ctx, [*kids, parent])
        import contextlib

        with contextlib.suppress(Exception):
            await d.client.delete(f"/images/{tag}", params={"force": "1"})


async def docker_python_calls(ctx: BenchContext, n: int, concurrency: int = 8) -> dict[str, Any]:
    """`print(1+1)` with `docker exec python3 -c` in a pool of warm containers (Docker's fncall)."""
    assert ctx.docker is not None
    pool = [c for c in await ctx.bounded([docker_create_one(ctx) for _ in range(concurrency)], 8)
            if isinstance(c, str)]
    lat: list[float] = []
    try:
        sem = asyncio.Semaphore(concurrency)
        idx = iter(range(n))

        async def one(i: int) -> None:
            async with sem:
                t = time.perf_counter()
                code, out = await ctx.docker.exec(pool[i % len(pool)], ["python3", "-c", "print(1+1)"])
                if code == 0 and out.strip() == b"2":
                    lat.append(time.perf_counter() - t)

        t0 = time.perf_counter()
        with ctx.task(f"Docker: {n} python calls via exec", n):
            await asyncio.gather(*(one(i) for i in idx))
        wall = time.perf_counter() - t0
    finally:
        await docker_remove_all(ctx, pool)
    return {"n": n, "ok": len(lat), "per_s": round(len(lat) / wall, 2) if wall else None,
            "latency": latency_summary(lat)}


def _pick(d: Any, *keys: str) -> float | None:
    for k in keys:
        cur = d
        for part in k.split("."):
            cur = cur.get(part) if isinstance(cur, dict) else None
        if isinstance(cur, (int, float)) and not isinstance(cur, bool):
            return float(cur)
    return None


# ---- the scenarios -------------------------------------------------------------------------------
@scenario("lazy", "fraction of an image read to start a sandbox (image store)")
async def lazy(ctx: BenchContext) -> ScenarioResult:
    """bench_image.run_image_bench (it compares with Docker itself when given the engine)."""
    res = await _external(ctx, "lazy", [("bench_image", "run_image_bench", {})])
    res.docker = ctx.docker_status if "run_image_bench" in res.data else res.docker
    return res


@scenario("fork", "snapshot a sandbox and start children from it")
async def fork(ctx: BenchContext) -> ScenarioResult:
    """bench_stateful.run_fork_bench + run_snapshot_bench, beside docker commit + run."""
    res = await _external(ctx, "fork", [("bench_stateful", "run_fork_bench", {}),
                                        ("bench_stateful", "run_snapshot_bench", {})])
    if ctx.docker and "run_fork_bench" in res.data:
        out = res.data["run_fork_bench"]
        n = int(out.get("n") or ctx.sizes.external_n or 100)
        dk = await docker_fork(ctx, n, int(out.get("change_mb") or 10))
        res.data["docker_fork"] = dk
        res.docker = ctx.docker_status
        res.metrics.insert(0, Metric(f"snapshot + {n} children ready", _pick(out, "snapshot_plus_children_s"),
                                     _pick(dk, "snapshot_plus_children_s"), "s",
                                     note="Docker: commit + run"))
        ready = _pick(out, "children_ready_s")
        res.metrics.insert(1, Metric(f"{n} children ready (after the snapshot)", ready,
                                     _pick(dk, "children_ready_s"), "s", target="≤ 2 s (issue 4)",
                                     met=None if ready is None else ready <= 2))
    return res


@scenario("pause", "pause/resume and the memory returned by pausing idle sandboxes")
async def pause(ctx: BenchContext) -> ScenarioResult:
    """bench_stateful.run_pause_bench, beside docker pause/unpause."""
    res = await _external(ctx, "pause", [("bench_stateful", "run_pause_bench", {})])
    if ctx.docker and "run_pause_bench" in res.data:
        n = ctx.sizes.external_n or 100
        dk = await docker_pause(ctx, n)
        res.data["docker_pause"] = dk
        res.docker = ctx.docker_status
        res.add(Metric("Docker pause p50 (freezer only, no reclaim)", None, dk["pause"].get("p50_ms"), "ms"),
                Metric("Docker unpause p50", None, dk["unpause"].get("p50_ms"), "ms"))
    return res


@scenario("fncall", "short Python calls per second on the warm fncall pool")
async def fncall(ctx: BenchContext) -> ScenarioResult:
    """bench_fncall.run_fncall_bench, beside `docker exec python3 -c` on warm containers."""
    res = await _external(ctx, "fncall", [("bench_fncall", "run_fncall_bench",
                                            {"quick_overrides": {"n": 300, "warmup": 50}})])
    if ctx.docker and "run_fncall_bench" in res.data:
        n = 50 if ctx.quick else 300
        dk = await docker_python_calls(ctx, n)
        res.data["docker_python_calls"] = dk
        res.docker = ctx.docker_status
        res.add(Metric("Docker: python calls/s (docker exec python3 -c, 8 warm containers)", None, dk["per_s"], "/s",
                       better="higher"),
                Metric("Docker: python call p99", None, dk["latency"].get("p99_ms"), "ms"))
    return res


@scenario("vm", "microVM/VM boot-to-first-exec and memory per idle VM", uses_docker=False)
async def vm(ctx: BenchContext) -> ScenarioResult:
    """bench_vm.run_vm_bench (Docker runs no VMs: no comparison)."""
    return await _external(ctx, "vm", [("bench_vm", "run_vm_bench", {})])


@scenario("api", "HTTP API create/exec latency at 1, 100 and 1,000 concurrent clients", uses_docker=False)
async def api(ctx: BenchContext) -> ScenarioResult:
    """bench_api.run_api_bench (its Docker counterpart is the Engine API used in `create` and `exec`)."""
    return await _external(ctx, "api", [("bench_api", "run_api_bench", {})])
