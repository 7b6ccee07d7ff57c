"""`pause` (alias `stateful`): pause/resume latency and the memory returned by pausing idle sandboxes, beside
`docker pause` (which only freezes).

`n` idle sandboxes (a bash session; with `workload_mb` > 0 also a Python process holding that much
ordinary data and files it wrote) are paused with zram swap off and/or on (`swap`); the memory charged
to them before and after (zram's own pool counted against the gain) gives the share returned. Then
resume with prefetch and the first request after it, and the same without prefetch.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import shoal
from shoal.backends.container import reclaim
from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios.common import docker_create_one, docker_remove_all, first_errors, gather_bounded
from shoal.bench.stats import latency_summary
from shoal.host.cgroups import SandboxCgroup


@dataclass(frozen=True)
class PauseParams:
    """How much work the pause scenario does."""

    n: int = param(100, quick=10, help="idle sandboxes paused (and Docker containers)")
    workload_mb: tuple[int, ...] = param((16,), help="MB of data each idle sandbox's Python holds; one round each "
                                                      "(0: agent + bash only)")
    file_mb: int = param(4, help="MB of files each sandbox wrote (its page cache)")
    memory_mb: int = param(256, help="memory limit of each sandbox")
    swap: str = param("both", help="zram swap during the pause: off, on or both")
    zram_size: str = param("8G", help="size of the zram device made for the `on` round")
    zram_algorithm: str | None = param(None, help="zram compression (default: the node's choice)")


# An idle agent sandbox: a bash session, a Python process that imported a few stdlib packages and
# holds ordinary data structures (dicts, strings, numbers: what agent tools keep in memory), and
# files it wrote (page cache of its writable layer).
_WORKLOAD = r"""
import asyncio, email.parser, http.client, json, sqlite3, sys, time, unittest, xml.dom.minidom
target = int(sys.argv[1]) << 20
items, size, i = [], 0, 0
while size < target:
    d = {"id": i, "path": f"/repo/src/module_{i % 500}/file_{i}.py", "tags": ["todo", "lint", str(i % 97)],
         "score": i * 0.37, "text": ("def f_%d(x):\n    return x * %d\n" % (i, i)) * 3}
    items.append(d)
    size += 560
    i += 1
import os
os.mkfifo("/tmp/req")
os.mkfifo("/tmp/resp")
open("/tmp/.ready", "w").close()
while True:  # one request = one walk over the whole heap (what an agent tool touching its state does)
    with open("/tmp/req") as f:
        f.read()
    total = sum(len(d["text"]) + d["id"] for d in items)
    with open("/tmp/resp", "w") as f:
        f.write(f"{total}\n")
"""
_REQUEST = "echo go > /tmp/req; cat /tmp/resp"
_REQUEST_NO_WORKLOAD = "echo go > /dev/null"


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = int(v.split()[0]) * 1024
    return out


def _host_used() -> int:
    m = _meminfo()
    return m["MemTotal"] - m["MemFree"]


def _zram_bytes() -> int:
    return sum(z.mem_used_total for z in reclaim.zram_devices())


async def _make_idle(client: shoal.Client, n: int, workload_mb: int, file_mb: int, memory_mb: int) -> list:
    items = await client.create_many("base", n=n, memory_mb=memory_mb, ttl_s=3600, labels={"bench": "stateful"})
    sbs = [s for s in items if not isinstance(s, Exception)]
    if len(sbs) < n:
        errs = [e for e in items if isinstance(e, Exception)]
        raise RuntimeError(f"only {len(sbs)}/{n} sandboxes were created: {errs[0]}")

    async def prepare(sb: Any) -> Any:
        if not workload_mb:  # a fresh idle sandbox: the agent and a bash session only
            sh = await sb.shell()
            await sh.run("export STEP=1; ls >/dev/null")
            return sb, sh
        await sb.write_file("/tmp/workload.py", _WORKLOAD)
        await sb.exec(f"nohup python3 /tmp/workload.py {workload_mb} >/dev/null 2>&1 &")
        if file_mb:
            await sb.exec(f"mkdir -p /work && head -c {file_mb << 20} /dev/urandom | base64 > /work/notes.txt")
        sh = await sb.shell(cwd="/work" if file_mb else "/")
        await sh.run("export STEP=1; ls >/dev/null")
        for _ in range(300):
            if (await sb.exec("test -e /tmp/.ready")).exit_code == 0:
                break
            await asyncio.sleep(0.1)
        return sb, sh

    return await gather_bounded([prepare(sb) for sb in sbs], 8)


def _charged(sbs: list) -> tuple[int, int]:
    mem = swap = 0
    for sb, _ in sbs:
        cg = SandboxCgroup(f"/shoal/{sb.id}")
        mem += cg.memory_bytes() or 0
        swap += reclaim._swap_bytes(cg)
    return mem, swap


async def _pause_round(client: shoal.Client, n: int, workload_mb: int, file_mb: int, memory_mb: int,
                       swap_on: bool) -> dict[str, Any]:
    node = client.transport.node  # type: ignore[attr-defined]
    request = _REQUEST if workload_mb else _REQUEST_NO_WORKLOAD
    if not workload_mb:
        file_mb = 0
    base_used = _host_used()
    t0 = time.monotonic()
    sbs = await _make_idle(client, n, workload_mb, file_mb, memory_mb)
    setup_s = time.monotonic() - t0
    warm: list[float] = []
    for sb, _ in sbs:
        t = time.monotonic()
        await sb.exec(request)
        warm.append(time.monotonic() - t)
    await asyncio.sleep(1.0)
    mem_before, _ = _charged(sbs)
    used_before = _host_used()
    zram_before = _zram_bytes()

    pause_lat: list[float] = []

    async def pause(sb: Any) -> None:
        t = time.monotonic()
        await sb.pause()
        pause_lat.append(time.monotonic() - t)

    t0 = time.monotonic()
    await gather_bounded([pause(sb) for sb, _ in sbs], 4)
    pause_all_s = time.monotonic() - t0
    await asyncio.sleep(0.5)
    mem_after, swap_after = _charged(sbs)
    used_after = _host_used()
    zram_growth = max(0, _zram_bytes() - zram_before)
    breakdown: dict[str, int] = {}
    for sb, _ in sbs:
        for k, v in (node.record(sb.id).extra.get("reclaim", {}).get("stat_before") or {}).items():
            breakdown[k] = breakdown.get(k, 0) + v

    # resume latency (prefetch + thaw), then the first shell command after it
    resume_lat: list[float] = []
    first_cmd: list[float] = []
    for sb, _sh in sbs:
        t = time.monotonic()
        await sb.resume()
        resume_lat.append(time.monotonic() - t)
        t = time.monotonic()
        await sb.exec(request)
        first_cmd.append(time.monotonic() - t)
    # the same without prefetch: thaw only, pages fault back in on demand
    await gather_bounded([sb.pause() for sb, _ in sbs], 4)
    resume_np: list[float] = []
    first_np: list[float] = []
    for sb, _sh in sbs:
        t = time.monotonic()
        await node.resume(sb.id, prefetch=False)
        resume_np.append(time.monotonic() - t)
        t = time.monotonic()
        await sb.exec(request)
        first_np.append(time.monotonic() - t)

    await gather_bounded([sb.close() for sb, _ in sbs], 8)
    sandbox_mem = max(1, mem_before)
    net_returned = mem_before - mem_after - zram_growth
    return {
        "swap_on": swap_on, "n": len(sbs), "workload_mb": workload_mb, "file_mb": file_mb, "setup_s": round(setup_s, 2),
        "charged_before_mib": round(mem_before / 2**20, 1), "charged_after_mib": round(mem_after / 2**20, 1),
        "in_swap_mib": round(swap_after / 2**20, 1), "zram_pool_growth_mib": round(zram_growth / 2**20, 1),
        "per_sandbox_before_mib": round(mem_before / len(sbs) / 2**20, 2),
        "per_sandbox_after_mib": round((mem_after + zram_growth) / len(sbs) / 2**20, 2),
        "returned_pct": round(100 * net_returned / sandbox_mem, 1),
        "host_used_delta_before_mib": round((used_before - base_used) / 2**20, 1),
        "host_used_delta_after_mib": round((used_after - base_used) / 2**20, 1),
        "charged_breakdown_mib": {k: round(v / 2**20, 1) for k, v in breakdown.items()},
        "pause": latency_summary(pause_lat), "pause_all_s": round(pause_all_s, 2),
        "request_running": latency_summary(warm), "resume_prefetch": latency_summary(resume_lat),
        "first_cmd_after_prefetch": latency_summary(first_cmd),
        "resume_no_prefetch": latency_summary(resume_np), "first_cmd_no_prefetch": latency_summary(first_np),
    }


async def pause_bench(c: shoal.Client, n: int = 100, workload_mb: int | list[int] = 16, file_mb: int = 4,
                      memory_mb: int = 256, swap: str = "both", zram_size: str = "8G",
                      zram_algorithm: str | None = None) -> dict[str, Any]:
    """Memory of `n` paused idle sandboxes before/after reclaim, with zram swap off and/or on; resume latency.

    `workload_mb` 0 = fresh sandboxes (agent + a bash session); N = plus a Python process holding N MB
    of ordinary data and N/4 MB of files it wrote; a list runs each.
    """
    loads = workload_mb if isinstance(workload_mb, list) else [workload_mb]
    had_swap = reclaim.swap_active()
    modes = {"both": [False, True], "on": [True], "off": [False]}[swap]
    out: dict[str, Any] = {"bench": "pause", "host_swap_before": had_swap, "rounds": []}
    for on in modes:
        made = False
        if on and not had_swap:
            z = reclaim.setup_zram_swap(zram_size, algorithm=zram_algorithm)
            out["zram"] = {"device": z.name, "algorithm": z.algorithm, "size": z.disksize}
            made = True
        if not on and had_swap:
            out["rounds"].append({"swap_on": False, "skipped": "the host already has swap on; not turning it off"})
            continue
        try:
            for w in loads:
                out["rounds"].append(await _pause_round(c, n, w, file_mb, memory_mb, on))
        finally:
            if made:
                reclaim.teardown_zram_swap()
    return out


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


def rows(out: dict[str, Any]) -> list[Metric]:
    """Table rows of pause_bench's result: one block per round."""
    rows = []
    for r in out.get("rounds", []):
        if "skipped" in r:
            continue
        tag = ("zram swap on" if r.get("swap_on") else "no swap") + f", {r.get('workload_mb')} MB heap"
        ret = r.get("returned_pct")
        rows += [Metric(f"{r.get('n')} paused idle sandboxes: memory returned ({tag})", ret, None, "%",
                        better="higher", target="≥ 80% (issue 4)", met=None if ret is None else ret >= 80,
                        note=f"{r.get('per_sandbox_before_mib')} -> {r.get('per_sandbox_after_mib')} MiB each"),
                 Metric(f"pause p50 ({tag})", r["pause"].get("p50_ms"), None, "ms"),
                 Metric(f"resume p50, with prefetch ({tag})", r["resume_prefetch"].get("p50_ms"), None, "ms"),
                 Metric(f"first command after resume p50 ({tag})", r["first_cmd_after_prefetch"].get("p50_ms"), None,
                        "ms"),
                 Metric(f"resume p50, no prefetch ({tag})", r["resume_no_prefetch"].get("p50_ms"), None, "ms")]
    return rows


async def run(ctx: BenchContext, p: PauseParams) -> ScenarioResult:
    """The pause scenario (see the module docstring)."""
    if p.swap not in ("both", "on", "off"):
        raise ValueError(f"swap must be both, on or off, not {p.swap!r}")
    res = ScenarioResult("pause", docker=ctx.docker_status)
    out = await pause_bench(ctx.client, p.n, list(p.workload_mb), p.file_mb, p.memory_mb, p.swap, p.zram_size,
                            p.zram_algorithm)
    res.data["pause"] = out
    res.add(*rows(out))
    for r in out["rounds"]:
        if "skipped" in r:
            res.notes.append(f"swap {'on' if r['swap_on'] else 'off'}: {r['skipped']}")
    if ctx.docker:
        dk = await docker_pause(ctx, p.n)
        res.data["docker_pause"] = dk
        res.add(Metric("Docker pause p50 (freezer only, no reclaim)", None, dk["pause"].get("p50_ms"), "ms"),
                Metric("Docker unpause p50", None, dk["unpause"].get("p50_ms"), "ms"))
    return res


SCENARIO = Scenario("pause", "pause/resume, and the memory returned by pausing idle sandboxes", run, PauseParams)
