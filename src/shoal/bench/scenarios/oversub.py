"""Phases of the `density` scenario run while the node is oversubscribed: abuse (memory bombs beside idle
sandboxes) and pressure (idle sandboxes paused and reclaimed so that a create fits).

* **abuse** — with many idle sandboxes alive (some of them watched: each keeps a `sleep` process), a probe
  sandbox's exec latency is measured idle, then while memory bombs (`head -c 4G /dev/zero | tail -c 3G`:
  each fills its sandbox's limit, then as much swap, and is OOM-killed) go off at random moments of the
  window in sandboxes of their own, then idle again. Every bomb must be killed inside its own sandbox (its
  memory cgroup's OOM kill counter), the host's OOM kills (/proc/vmstat) must all be the bombs', no idle
  sandbox may lose its agent or its watched process, and the probe's p99 must stay within 2× of its idle
  value.
* **pressure** — sandboxes holding memory (a Python process with data structures in each) go idle;
  the node's watermark is put just above what the host then has available, so the next create only fits if
  the pressure response pauses and reclaims them (to zram when the host has it). Reported: the memory
  returned (MemAvailable before and after; what each reclaim took off its cgroup), how long it took, and
  that a paused sandbox answers its next call with its process intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from pathlib import Path
from typing import Any

from shoal.backends.container import cpuclass
from shoal.backends.container.reclaim import swap_status
from shoal.bench import host
from shoal.bench.context import BenchContext
from shoal.bench.scenarios.common import close_all, spec
from shoal.bench.stats import latency_summary, percentile
from shoal.errors import ShoalError
from shoal.host.cgroups import SandboxCgroup

MIB = 2**20
# a program that takes all the memory it can (its sandbox's limit, then as much swap): the OOM killer ends it
BOMB = "sleep {delay:.2f}; head -c 4G /dev/zero | tail -c 3G > /dev/null"


def vmstat_oom_kills() -> int:
    """OOM kills on the host since boot (global and in memory cgroups)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0


def cgroup_oom_kills(cgroup: str) -> int:
    """OOM kills inside one sandbox's memory cgroup."""
    cg = SandboxCgroup(cgroup)
    text = cg.read("memory", "memory.events" if cg.mode == "v2" else "memory.oom_control") or ""
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == "oom_kill":
            with contextlib.suppress(ValueError):
                return int(v)
    return 0


async def _probe(ctx: BenchContext, sid: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        with contextlib.suppress(ShoalError):
            r = await ctx.node.exec(sid, ["true"], timeout=30)
            if r.exit_code == 0:
                out.append(time.perf_counter() - t)
        await asyncio.sleep(0.01)
    return out


async def abuse(ctx: BenchContext, idle_ids: list[str], bombs: int, bomb_mb: int, seconds: float, probe_n: int,
                watch: int = 200, bomb_class: str = "interactive") -> dict[str, Any]:
    """The abuse phase (see the module docstring), beside `idle_ids`."""
    node = ctx.node
    probe = (await node.create(spec(ctx, memory_mb=256))).id
    pick = random.sample(idle_ids, min(watch, len(idle_ids)))
    started = await asyncio.gather(*(node.exec(s, "sleep 1000000 >/dev/null 2>&1 &") for s in pick),
                                   return_exceptions=True)
    watched = [s for s, r in zip(pick, started, strict=True) if not isinstance(r, BaseException) and r.exit_code == 0]
    watch_errors = [str(r)[:200] for r in started if isinstance(r, BaseException)]
    made = await node.create_many(spec(ctx, memory_mb=bomb_mb, cpu_class=bomb_class), bombs)
    bomb_ids = [i.id for i in made if not isinstance(i, ShoalError)]
    try:
        await _probe(ctx, probe, 20)  # warm the probe's path
        before = await _probe(ctx, probe, probe_n)
        vm0 = vmstat_oom_kills()
        kills0 = {b: cgroup_oom_kills(node.record(b).cgroup) for b in bomb_ids}
        t0 = time.perf_counter()
        # the bombs go off at random moments of the window (a wave of them at once is a CPU burst, not the
        # memory abuse measured here: CPU contention is the qos scenario's subject)
        rng = random.Random(1)
        running = [asyncio.ensure_future(node.exec(b, BOMB.format(delay=rng.uniform(0, seconds * 0.8)),
                                                   timeout=seconds + 120)) for b in bomb_ids]
        during: list[float] = []
        demoted: set[str] = set()  # bombs seen running as batch while they swapped (shoal.backends.container.swapwatch)
        while time.perf_counter() - t0 < seconds or not all(r.done() for r in running):
            during += await _probe(ctx, probe, 20)
            demoted |= {b for b in bomb_ids if cpuclass.batch_cgroup(b).exists()}
        results = await asyncio.gather(*running, return_exceptions=True)
        kills = {b: cgroup_oom_kills(node.record(b).cgroup) - kills0[b] for b in bomb_ids}
        vm1 = vmstat_oom_kills()
        after = await _probe(ctx, probe, probe_n)
        backend = node.backend("container")
        lost_agents = [s for s in idle_ids if not backend.alive(node.record(s))]
        counts = await asyncio.gather(*(node.exec(s, "pgrep -c sleep") for s in watched), return_exceptions=True)
        lost_watched = [s for s, c in zip(watched, counts, strict=True)
                        if isinstance(c, BaseException) or c.stdout.strip() != b"1"]
        bombs_alive = sum(1 for b in bomb_ids if backend.alive(node.record(b)))
    finally:
        await close_all(ctx, [probe, *bomb_ids], "closing the probe and the bombs")
        await asyncio.gather(*(node.exec(s, "pkill sleep") for s in watched), return_exceptions=True)
    idle_p99 = max(percentile(before, 99), percentile(after, 99))
    dur_p99 = percentile(during, 99)
    return {"idle_alive": len(idle_ids), "bombs": len(bomb_ids), "bomb_mb": bomb_mb, "bomb_class": bomb_class,
            "seconds": seconds,
            "bomb_errors": [str(r)[:200] for r in results if isinstance(r, BaseException)][:3],
            "oom_kills_in_bombs": sum(kills.values()), "bombs_killed": sum(1 for k in kills.values() if k > 0),
            "bomb_agents_alive": bombs_alive, "host_oom_kills": vm1 - vm0,
            "oom_kills_outside_bombs": max(0, (vm1 - vm0) - sum(kills.values())),
            "idle_agents_lost": len(lost_agents), "watched": len(watched), "watched_lost": len(lost_watched),
            "watch_setup_errors": watch_errors[:3], "watch_setup_failed": len(watch_errors),
            "probe_idle_before": latency_summary(before), "probe_during": latency_summary(during),
            "probe_idle_after": latency_summary(after),
            "probe_p99_ratio": round(dur_p99 / idle_p99, 2) if idle_p99 else None,
            "bombs_seen_demoted": len(demoted)}


def _zram_used() -> int:
    """RAM used by the host's zram devices (compressed pages plus their metadata), bytes."""
    from shoal.backends.container.reclaim import zram_devices

    return sum(z.mem_used_total for z in zram_devices())


# an idle agent sandbox's memory, as it is: a Python process holding data structures (dicts, strings, ints)
_HOLDER = ("import os, time\n"
           "d, n = [], 0\n"
           "while int(open('/proc/self/statm').read().split()[1]) * 4096 < {mb} << 20:\n"
           "    d.append([{{'step': n + i, 'path': '/work/src/m%d.py' % (n + i), 'ok': (n + i) % 3 == 0}}"
           " for i in range(1000)])\n"
           "    n += 1000\n"
           "open('/tmp/ready', 'w').write(str(n))\n"
           "time.sleep(1e7)\n")


def _hold(mb: int) -> str:
    """A shell command that leaves a Python process holding `mb` MiB in the sandbox, then says ok."""
    return (f"cat > /tmp/hold.py <<'EOF'\n{_HOLDER.format(mb=mb)}EOF\n"
            "nohup python3 /tmp/hold.py >/dev/null 2>&1 &\n"
            "while [ ! -s /tmp/ready ]; do sleep 0.1; done; echo ok")


async def pressure(ctx: BenchContext, holders: int, hold_mb: int) -> dict[str, Any]:
    """The pressure phase (see the module docstring)."""
    node = ctx.node
    sched = node.scheduling
    made = await node.create_many(spec(ctx, memory_mb=hold_mb * 2 + 64), holders)
    ids = [i.id for i in made if not isinstance(i, ShoalError)]
    new_id = None
    try:
        filled = await asyncio.gather(*(node.exec(s, _hold(hold_mb), timeout=300) for s in ids))
        assert all(r.stdout == b"ok\n" for r in filled), filled[:2]
        for s in ids:
            sched.last_used[s] = time.time() - 3600  # an hour without a call
        await asyncio.sleep(1.0)
        before = host.memory_snapshot()
        swap0 = host.meminfo_kib()
        saved = node.config.min_free_memory_mb
        # the watermark above what is available now by an eighth of what the holders keep: the next create fits only
        # once the pressure response has given that much back
        avail_mb = before["available"] // MIB
        node.config.min_free_memory_mb = avail_mb + holders * hold_mb // 8
        zram0 = _zram_used()
        sched.rearm()  # a fresh pass for the measurement, whatever the last one found
        t0 = time.perf_counter()
        try:
            new_id = (await node.create(spec(ctx))).id
            ok, err = True, ""
        except ShoalError as e:
            ok, err = False, str(e)[:300]
        relief_s = time.perf_counter() - t0
        node.config.min_free_memory_mb = saved
        after = host.memory_snapshot()
        swap1 = host.meminfo_kib()
        zram_cost = _zram_used() - zram0
        paused = [s for s in ids if node.record(s).state == "paused"]
        rec_stats = [node.record(s).extra.get("reclaim", {}) for s in paused]
        reclaimed = sum(max(0, r.get("before", 0) - r.get("after", 0)) for r in rec_stats)
        # a paused holder answers its next call, its memory intact
        back = None
        if paused:
            t = time.perf_counter()
            r = await node.exec(paused[0], "pgrep -f hold.py >/dev/null && cat /tmp/ready")
            back = {"first_call_s": round(time.perf_counter() - t, 3), "intact": r.exit_code == 0}
    finally:
        await close_all(ctx, [*ids, *([new_id] if new_id else [])], "closing the pressure sandboxes")
    held = holders * hold_mb
    returned = (after["available"] - before["available"]) / MIB
    return {"holders": len(ids), "hold_mb": hold_mb, "held_mb": held, "create_admitted": ok, "refusal": err,
            "relief_s": round(relief_s, 2), "paused": len(paused), "paused_by": sched.last_tide.get("by"),
            "available_before_mb": before["available"] // MIB, "available_after_mb": after["available"] // MIB,
            "memory_returned_mb": round(returned, 1),
            "returned_pct_of_held": round(100 * returned / held, 1) if held else None,
            "reclaimed_from_cgroups_mb": round(reclaimed / MIB, 1),
            # what the compressed copies cost in RAM: reclaimed − this is what the host got back for good
            "zram_memory_delta_mb": round(zram_cost / MIB, 1),
            "net_returned_mb": round((reclaimed - zram_cost) / MIB, 1),
            "net_returned_pct_of_held": round(100 * (reclaimed - zram_cost) / MIB / held, 1) if held else None,
            "swap_used_delta_mb": round(((swap0.get("SwapFree", 0) - swap1.get("SwapFree", 0)) / 1024), 1),
            "swap": swap_status(), "resume": back}
