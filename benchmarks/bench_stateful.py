"""Benchmarks of stateful sandboxes: pause/reclaim/resume, snapshot, fork (issue 4).

    sudo .venv/bin/python benchmarks/bench_stateful.py                  # everything, table + JSON
    sudo .venv/bin/python benchmarks/bench_stateful.py --only pause --n 100 --swap both

`run_pause_bench`, `run_snapshot_bench` and `run_fork_bench` are also imported by `shoal bench`; each
returns a JSON-friendly dict. Nothing here asserts timings; the numbers are for reading.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import shoal
from shoal.host.cgroups import SandboxCgroup
from shoal.node import reclaim

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


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def _lat(xs: list[float]) -> dict[str, float]:
    return {"p50_ms": round(_pct(xs, 50) * 1000, 2), "p99_ms": round(_pct(xs, 99) * 1000, 2),
            "mean_ms": round(statistics.fmean(xs) * 1000, 2) if xs else 0.0, "n": len(xs)}


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


@contextlib.asynccontextmanager
async def _client(client: shoal.Client | None) -> AsyncIterator[shoal.Client]:
    if client is not None:
        yield client
        return
    async with shoal.Client() as c:
        yield c


async def _gather_bounded(coros: list, limit: int = 8) -> list:
    sem = asyncio.Semaphore(limit)

    async def one(c: Any) -> Any:
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


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

    return await _gather_bounded([prepare(sb) for sb in sbs], 8)


def _charged(sbs: list) -> tuple[int, int]:
    mem = swap = 0
    for sb, _ in sbs:
        cg = SandboxCgroup(f"/shoal/{sb.id}")
        mem += cg.memory_bytes() or 0
        swap += reclaim._swap_bytes(cg)
    return mem, swap


async def _pause_round(client: shoal.Client, n: int, workload_mb: int, file_mb: int, memory_mb: int,
                       swap_on: bool) -> dict[str, Any]:
    node = client.transport.node
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
    await _gather_bounded([pause(sb) for sb, _ in sbs], 4)
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
    await _gather_bounded([sb.pause() for sb, _ in sbs], 4)
    resume_np: list[float] = []
    first_np: list[float] = []
    for sb, _sh in sbs:
        t = time.monotonic()
        await node.resume(sb.id, prefetch=False)
        resume_np.append(time.monotonic() - t)
        t = time.monotonic()
        await sb.exec(request)
        first_np.append(time.monotonic() - t)

    await _gather_bounded([sb.close() for sb, _ in sbs], 8)
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
        "pause": _lat(pause_lat), "pause_all_s": round(pause_all_s, 2),
        "request_running": _lat(warm), "resume_prefetch": _lat(resume_lat), "first_cmd_after_prefetch": _lat(first_cmd),
        "resume_no_prefetch": _lat(resume_np), "first_cmd_no_prefetch": _lat(first_np),
    }


async def run_pause_bench(n: int = 100, workload_mb: int | list[int] = 16, file_mb: int = 4, memory_mb: int = 256,
                          swap: str = "both", zram_size: str = "8G", zram_algorithm: str | None = None,
                          client: shoal.Client | None = None) -> dict[str, Any]:
    """Memory of `n` paused idle sandboxes before/after reclaim, with zram swap off and/or on; resume latency.

    `workload_mb` 0 = fresh sandboxes (agent + a bash session); N = plus a Python process holding N MB
    of ordinary data and N/4 MB of files it wrote; a list runs each.
    """
    loads = workload_mb if isinstance(workload_mb, list) else [workload_mb]
    had_swap = reclaim.swap_active()
    modes = {"both": [False, True], "on": [True], "off": [False]}[swap]
    out: dict[str, Any] = {"bench": "pause", "host_swap_before": had_swap, "rounds": []}
    async with _client(client) as c:
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


async def run_snapshot_bench(change_mb: int = 50, reps: int = 3, client: shoal.Client | None = None) -> dict[str, Any]:
    """Snapshot of a sandbox with `change_mb` MB of changes (30% in 2,000 small files, the rest in 4 big ones)."""
    times: list[float] = []
    frozen: list[float] = []
    sizes: list[int] = []
    names = []
    async with _client(client) as c:
        sb = await c.create("base", memory_mb=512)
        try:
            for rep in range(reps):
                small = int(change_mb * 0.3 * 2**20 / 2000)
                big_mb = max(1, int(change_mb * 0.7 / 4))
                await sb.exec(
                    f"rm -rf /work; mkdir -p /work/src && cd /work/src && "
                    f"for i in $(seq 2000); do head -c {small} /dev/urandom > f$i.txt; done && "
                    f"for j in 1 2 3 4; do head -c {big_mb << 20} /dev/urandom > /work/big$j.bin; done && "
                    f"echo {rep} > /work/rep", timeout=600)
                name = f"bench-stateful/snap:{os.getpid()}-{rep}"
                img = await sb.snapshot(name)
                names.append(name)
                times.append(img["seconds"])
                frozen.append(img["frozen_s"])
                sizes.append(img["diff_bytes"])
        finally:
            with contextlib.suppress(shoal.ShoalError):
                await sb.close()
            store = c.transport.node.store
            for nm in names:
                with contextlib.suppress(Exception):
                    store.remove_image(nm)
    return {"bench": "snapshot", "change_mb": change_mb, "reps": reps, "seconds": _lat(times),
            "frozen": _lat(frozen), "layer_mib": round(statistics.fmean(sizes) / 2**20, 1) if sizes else 0}


async def run_fork_bench(n: int = 100, change_mb: int = 10, memory_mb: int = 256,
                         client: shoal.Client | None = None) -> dict[str, Any]:
    """Time until `n` children of a snapshot are ready (agent answering), next to `n` fresh `base` sandboxes."""
    out: dict[str, Any] = {"bench": "fork", "n": n, "change_mb": change_mb}
    async with _client(client) as c:
        parent = await c.create("base", memory_mb=memory_mb)
        name = f"bench-stateful/fork:{os.getpid()}"
        try:
            await parent.exec(f"mkdir -p /work && head -c {change_mb << 20} /dev/urandom > /work/data && "
                              "echo parent > /work/who")
            t0 = time.monotonic()
            img = await parent.snapshot(name)
            snap_s = time.monotonic() - t0
            t0 = time.monotonic()
            kids = await c.create_many(name, n=n, memory_mb=memory_mb)
            children_s = time.monotonic() - t0
            ok = [k for k in kids if not isinstance(k, Exception)]
            # every child is usable and sees the parent's files
            t0 = time.monotonic()
            outs = await _gather_bounded([k.exec("cat /work/who") for k in ok], 16)
            first_exec_s = time.monotonic() - t0
            good = sum(o.stdout == b"parent\n" for o in outs)
            await _gather_bounded([k.close() for k in ok], 16)
            t0 = time.monotonic()
            fresh = await c.create_many("base", n=n, memory_mb=memory_mb)
            fresh_s = time.monotonic() - t0
            await _gather_bounded([k.close() for k in fresh if not isinstance(k, Exception)], 16)
            t0 = time.monotonic()
            forked = await parent.fork(min(n, 8), name=f"{name}-8", memory_mb=memory_mb)
            fork8_s = time.monotonic() - t0
            await _gather_bounded([k.close() for k in forked], 16)
            out.update(snapshot_s=round(snap_s, 3), layer_mib=round(img["diff_bytes"] / 2**20, 1),
                       children_ready_s=round(children_s, 3), children_ok=len(ok), children_see_parent=good,
                       children_per_s=round(len(ok) / children_s, 1), exec_all_children_s=round(first_exec_s, 3),
                       fresh_base_ready_s=round(fresh_s, 3), snapshot_plus_children_s=round(snap_s + children_s, 3),
                       fork8_total_s=round(fork8_s, 3))
        finally:
            with contextlib.suppress(shoal.ShoalError):
                await parent.close()
            for nm in (name, f"{name}-8"):
                with contextlib.suppress(Exception):
                    c.transport.node.store.remove_image(nm)
    return out


def _table(results: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="shoal stateful benchmarks")
    t.add_column("what")
    t.add_column("result")
    for r in results:
        if r["bench"] == "pause":
            for rd in r["rounds"]:
                if rd.get("skipped"):
                    t.add_row(f"pause swap={'on' if rd['swap_on'] else 'off'}", rd["skipped"])
                    continue
                tag = (f"{rd['n']} idle, {rd['workload_mb']} MB heap, "
                       f"zram {'on' if rd['swap_on'] else 'off'}")
                t.add_row(f"memory paused ({tag})",
                          f"{rd['charged_before_mib']} MiB -> {rd['charged_after_mib']} MiB charged "
                          f"+ {rd['zram_pool_growth_mib']} MiB zram pool = {rd['returned_pct']}% returned "
                          f"({rd['per_sandbox_before_mib']} -> {rd['per_sandbox_after_mib']} MiB each)")
                t.add_row(f"  charged before, by kind ({tag})",
                          ", ".join(f"{k} {v}" for k, v in rd["charged_breakdown_mib"].items()))
                t.add_row(f"  pause latency ({tag})", f"p50 {rd['pause']['p50_ms']} ms, p99 {rd['pause']['p99_ms']} ms")
                t.add_row(f"  heap-walk request, never paused ({tag})",
                          f"p50 {rd['request_running']['p50_ms']} ms, p99 {rd['request_running']['p99_ms']} ms")
                t.add_row(f"  resume + prefetch ({tag})",
                          f"p50 {rd['resume_prefetch']['p50_ms']} ms, p99 {rd['resume_prefetch']['p99_ms']} ms; "
                          f"then request p50 {rd['first_cmd_after_prefetch']['p50_ms']} ms")
                t.add_row(f"  resume, no prefetch ({tag})",
                          f"p50 {rd['resume_no_prefetch']['p50_ms']} ms, p99 {rd['resume_no_prefetch']['p99_ms']} ms; "
                          f"then request p50 {rd['first_cmd_no_prefetch']['p50_ms']} ms")
        elif r["bench"] == "snapshot":
            t.add_row(f"snapshot, {r['change_mb']} MB changed",
                      f"p50 {r['seconds']['p50_ms']} ms, max {r['seconds']['p99_ms']} ms "
                      f"(frozen p50 {r['frozen']['p50_ms']} ms), layer {r['layer_mib']} MiB")
        elif r["bench"] == "fork":
            t.add_row(f"{r['n']} children from a snapshot",
                      f"ready in {r['children_ready_s']} s ({r['children_per_s']}/s; {r['children_ok']} ok, "
                      f"{r['children_see_parent']} see the parent's files); snapshot {r['snapshot_s']} s; "
                      f"{r['n']} fresh base: {r['fresh_base_ready_s']} s; fork(8) {r['fork8_total_s']} s")
    Console().print(t)


async def _main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="pause,snapshot,fork", help="comma list of pause,snapshot,fork")
    ap.add_argument("--n", type=int, default=100, help="sandboxes for pause and fork")
    ap.add_argument("--workload-mb", default="0,16",
                    help="data held by each idle sandbox's Python (comma list; 0 = agent + bash only)")
    ap.add_argument("--swap", choices=["both", "on", "off"], default="both")
    ap.add_argument("--zram-algorithm", default=None, help="zram compression (default: the node's choice)")
    ap.add_argument("--change-mb", type=int, default=50)
    ap.add_argument("--json", default="benchmarks/results/stateful.json", help="where to write the results")
    a = ap.parse_args(argv)
    only = set(a.only.split(","))
    results = []
    t0 = time.time()
    async with shoal.Client() as c:
        if "pause" in only:
            loads = [int(x) for x in a.workload_mb.split(",")]
            results.append(await run_pause_bench(n=a.n, workload_mb=loads, swap=a.swap,
                                                 zram_algorithm=a.zram_algorithm, client=c))
        if "snapshot" in only:
            results.append(await run_snapshot_bench(change_mb=a.change_mb, client=c))
        if "fork" in only:
            results.append(await run_fork_bench(n=a.n, client=c))
    _table(results)
    out = Path(a.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"started": t0, "host": os.uname().nodename, "cpus": os.cpu_count(),
                               "results": results}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(_main(sys.argv[1:])))
