"""`density`: how many idle sandboxes stay alive on this machine, and the host memory each one costs.

Memory is measured on the host, not as RSS: `used` = MemTotal − MemFree − Buffers − Cached − SReclaimable
(so page cache does not count, but every kernel object does: slab for mounts, namespaces, cgroups,
sockets; kernel stacks; page tables; per-CPU data), plus the node agent's own memory for its
connections. The per-sandbox figure is the slope of a least-squares line through (count, used) after
each batch, which is robust to a one-off change elsewhere on the host; the plain delta ÷ count is
reported beside it. The same is done for Docker containers (`sleep infinity`), whose figure includes
dockerd, containerd and one containerd-shim per container.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.bench import host, plots
from shoal.bench.context import BenchContext
from shoal.bench.docker import process_tree_rss
from shoal.bench.results import Metric, ScenarioResult, at_least, at_most
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios import oversub
from shoal.bench.scenarios.common import close_all, docker_create_one, docker_remove_all, first_errors, spec
from shoal.bench.stats import latency_summary, linear_slope
from shoal.errors import ShoalError


@dataclass(frozen=True)
class DensityParams:
    """How far the density scenario goes."""

    target: int = param(5000, quick=200, help="idle sandboxes to reach (it stops earlier when memory runs low)")
    step: int = param(250, quick=100, help="sandboxes added between two memory readings")
    docker_target: int = param(300, quick=20, help="idle containers to reach (Docker)")
    docker_step: int = param(50, quick=10, help="containers added between two memory readings")
    docker_budget_s: float = param(180.0, quick=60.0, help="time Docker gets before it is cut short (at least 60)")
    abuse_at: int = param(2000, quick=100, help="run the abuse phase once this many idle sandboxes are alive (0: skip)")
    bombs: int = param(20, quick=4, help="memory-bomb sandboxes in the abuse phase")
    bomb_mb: int = param(256, quick=128, help="memory_mb of each bomb sandbox")
    bomb_class: str = param("interactive", help="cpu_class the bomb sandboxes are created with (batch: the "
                            "policy's best case, to compare with)")
    abuse_s: float = param(20.0, quick=8.0, help="seconds over which the bombs go off")
    probe_n: int = param(300, quick=100, help="probe execs measured before and after the bombs")
    exec_all: bool = param(True, help="exec in every sandbox once the target is reached (else a sample of 50)")
    holders: int = param(16, quick=6, help="idle sandboxes holding memory in the pressure phase (0: skip)")
    hold_mb: int = param(48, quick=32, help="MiB each holder's Python process keeps")

MIB = 2**20
#: stop adding sandboxes when the host has less memory available than this
FLOOR_BYTES = 2 * 2**30


def _node_figures() -> dict[str, Any]:
    """The node process's descriptors, threads and RSS (MiB) now."""
    from shoal.bench.scenarios.soak import process_figures

    return process_figures(["self"])


def _self_rss() -> int:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def _settle(seconds: float = 1.0) -> dict[str, int]:
    gc.collect()
    await asyncio.sleep(seconds)
    return host.memory_snapshot()


def _point(n: int, base: dict[str, int], now: dict[str, int], extra: dict[str, Any]) -> dict[str, Any]:
    p = {"n": n, "used_mib": round((now["used"] - base["used"]) / MIB, 1),
         "available_drop_mib": round((base["available"] - now["available"]) / MIB, 1)}
    for k in ("slab", "slab_unreclaimable", "kernel_stack", "page_tables", "percpu", "anon", "shmem"):
        p[f"{k}_mib"] = round((now[k] - base[k]) / MIB, 2)
    p.update(extra)
    return p


def _per_item(points: list[dict[str, Any]], key: str) -> float | None:
    xs = [p["n"] for p in points]
    ys = [p[key] for p in points]
    if len(xs) >= 2:
        s = linear_slope([0, *xs], [0.0, *ys])
        return s if s == s else None  # NaN check
    if xs and xs[0]:
        return ys[0] / xs[0]
    return None


async def shoal_density(ctx: BenchContext, target: int, step: int, sz: DensityParams | None = None
                        ) -> dict[str, Any]:
    """Add idle sandboxes in batches until `target` (or a limit) and measure host memory after each batch;
    with `sz.abuse_at`, the abuse phase (shoal.bench.scenarios.oversub) runs once that many are alive."""
    node = ctx.node
    base = await _settle(2.0)
    base_cg = host.cgroup_memory_bytes("shoal") or 0
    base_rss = _self_rss()
    ids: list[str] = []
    points: list[dict[str, Any]] = []
    errors: list[str] = []
    stop_reason = f"reached the target of {target}"
    abuse: dict[str, Any] | None = None
    snap0 = node.admission.snapshot()
    await node.connections.sweep()
    fds0 = _node_figures()["fds"]
    t0 = time.perf_counter()
    with ctx.task(f"shoal: up to {target} idle sandboxes", target) as adv:
        while len(ids) < target:
            k = min(step, target - len(ids))
            items = await node.create_many(spec(ctx), k, on_done=lambda _r: adv())
            ok = [i.id for i in items if not isinstance(i, ShoalError)]
            bad = [str(i)[:300] for i in items if isinstance(i, ShoalError)]
            ids += ok
            errors += bad
            now = await _settle(1.0)
            cg = host.cgroup_memory_bytes("shoal")
            nf = _node_figures()
            points.append(_point(len(ids), base, now, {
                "cgroup_charged_mib": round(((cg or 0) - base_cg) / MIB, 1) if cg is not None else None,
                "node_rss_mib": round((_self_rss() - base_rss) / MIB, 1),
                "node_fds": nf["fds"], "node_threads": nf["threads"], "node_rss_total_mib": nf["rss_mib"],
                "agent_connections": len(node.connections),
                "elapsed_s": round(time.perf_counter() - t0, 1)}))
            ctx.log(f"{len(ids)} sandboxes: host used +{points[-1]['used_mib']} MiB "
                    f"({points[-1]['used_mib'] * 1024 / max(1, len(ids)):.0f} KiB each)")
            if bad and not ok:
                stop_reason = f"creates started failing: {bad[0]}"
                break
            if now["available"] < FLOOR_BYTES:
                stop_reason = f"host memory available fell below {FLOOR_BYTES // MIB} MiB"
                break
            if sz is not None and sz.abuse_at and abuse is None and len(ids) >= sz.abuse_at:
                ctx.log(f"abuse phase: {sz.bombs} memory bombs beside {len(ids)} idle sandboxes")
                abuse = await oversub.abuse(ctx, list(ids), sz.bombs, sz.bomb_mb, sz.abuse_s, sz.probe_n,
                                            bomb_class=sz.bomb_class)
                ctx.log(f"abuse: {abuse['oom_kills_in_bombs']} OOM kills in {abuse['bombs_killed']} bombs, "
                        f"{abuse['oom_kills_outside_bombs']} elsewhere, {abuse['idle_agents_lost']} agents and "
                        f"{abuse['watched_lost']} watched processes lost, probe p99 ×{abuse['probe_p99_ratio']}")
    admitted = {"created": len(ids), "refused": len(errors), "overcommit_setting": snap0.overcommit,
                "committed_mb": node.admission.snapshot().committed_mb, "total_mb": snap0.total_mb,
                "refusal_samples": first_errors(errors)}
    reach_s = time.perf_counter() - t0
    # idle: the agent connections the creates opened close after SHOAL_AGENT_IDLE_S (the node's sweep)
    await asyncio.sleep(node.connections.idle_s + 1.0)
    await node.connections.sweep()
    idle_node = {**_node_figures(), "agent_connections": len(node.connections)}
    idle_node["fds_per_sandbox"] = round((idle_node["fds"] - fds0) / max(1, len(ids)), 4)
    # are they all still alive, and do they answer?
    backend = node.backend("container")
    alive = sum(1 for i in ids if backend.alive(node.record(i)))
    sample = random.sample(ids, min(50, len(ids)))
    lat: list[float] = []
    for sid in sample:  # one at a time: the latency of a request to an idle sandbox (a new connection)
        t = time.perf_counter()
        with contextlib.suppress(ShoalError):
            r = await node.exec(sid, ["true"], timeout=30)
            if r.exit_code == 0:
                lat.append(time.perf_counter() - t)
    everyone = list(ids) if sz is None or sz.exec_all else sample
    answered = 0
    exec_errors: list[str] = []

    async def one(sid: str) -> None:
        nonlocal answered
        try:
            r = await node.exec(sid, ["true"], timeout=60)
        except ShoalError as e:
            exec_errors.append(str(e)[:300])
            return
        answered += r.exit_code == 0

    t_exec = time.perf_counter()
    with ctx.task(f"shoal: an exec in each of {len(everyone)} idle sandboxes", len(everyone)) as adv:
        await ctx.bounded([one(sid) for sid in everyone], 64, adv)
    exec_s = time.perf_counter() - t_exec
    peak_node = {**_node_figures(), "agent_connections": len(node.connections)}  # every connection open again
    final = await _settle(1.0)
    fds = len(list(Path("/proc/self/fd").iterdir()))
    # what one sandbox's own processes take (the agent), sampled
    agents = [node.record(i).init_pid for i in random.sample(ids, min(50, len(ids)))]
    agent_pss_kib = process_tree_rss([p for p in agents if p]) / 1024 / max(1, len(agents))
    close_s = await close_all(ctx, ids, f"closing {len(ids)} sandboxes")
    after = await _settle(3.0)
    return {"target": target, "created": len(ids), "alive_after_settle": alive, "stop_reason": stop_reason,
            "errors": len(errors), "error_samples": first_errors(errors), "points": points,
            "exec_sample": {"n": len(sample), "answered": len(lat), "latency": latency_summary(lat)},
            "exec_all": {"n": len(everyone), "answered": answered, "seconds": round(exec_s, 1),
                         "error_samples": first_errors(exec_errors)},
            "reach_target_s": round(reach_s, 1), "node_before": {"fds": fds0}, "node_idle": idle_node,
            "node_peak": {k: max(v, idle_node.get(k, 0)) for k, v in peak_node.items()},
            "node_peak_during_creates": {k: max((pt.get(f"node_{k}") or 0) for pt in points)
                                         for k in ("fds", "threads")},
            "per_sandbox_kib_slope": _kib(_per_item(points, "used_mib")),
            "per_sandbox_kib_delta": round((final["used"] - base["used"]) / 1024 / max(1, len(ids)), 1),
            "per_sandbox_kib_available_slope": _kib(_per_item(points, "available_drop_mib")),
            "breakdown_kib_per_sandbox": {k: _kib(_per_item(points, k)) for k in
                                          ("slab_mib", "slab_unreclaimable_mib", "kernel_stack_mib", "page_tables_mib",
                                           "percpu_mib", "anon_mib", "cgroup_charged_mib", "node_rss_mib")
                                          if all(p.get(k) is not None for p in points)},
            "agent_pss_kib": round(agent_pss_kib, 1),
            "kernel_agent_node_kib_per_sandbox": _attributable(points, agent_pss_kib),
            "node_fds_at_peak": fds, "close_all_s": round(close_s, 1),
            "close_rate_per_s": round(len(ids) / close_s, 1) if close_s else None,
            "used_after_close_mib": round((after["used"] - base["used"]) / MIB, 1),
            "admitted_with_defaults": admitted, "abuse": abuse}


def _attributable(points: list[dict[str, Any]], agent_pss_kib: float) -> float | None:
    """Kernel objects (unreclaimable slab, page tables, kernel stacks, per-CPU, shmem) + the agent's PSS + the
    node's RSS per sandbox: less exposed to other work on the host than `used`, which also moves with it."""
    # unreclaimable slab only: dentries and inodes (reclaimable slab) are not counted in `used` either
    parts = [_per_item(points, k) for k in ("slab_unreclaimable_mib", "kernel_stack_mib", "page_tables_mib",
                                             "percpu_mib", "node_rss_mib")]
    if any(p is None for p in parts):
        return None
    shm = _per_item(points, "shmem_mib") or 0.0
    return round((sum(parts) + shm) * 1024 + agent_pss_kib, 1)


def _kib(mib_per_item: float | None) -> float | None:
    return round(mib_per_item * 1024, 1) if mib_per_item is not None else None


async def docker_density(ctx: BenchContext, target: int, step: int, budget_s: float) -> dict[str, Any]:
    """The same with Docker containers running `sleep infinity`, within `budget_s` (at least 60 s)."""
    assert ctx.docker is not None
    base = await _settle(2.0)
    cids: list[str] = []
    points: list[dict[str, Any]] = []
    errors: list[str] = []
    t0 = time.perf_counter()
    budget = max(budget_s, 60.0)
    stop_reason = f"reached the target of {target}"
    with ctx.task(f"Docker: up to {target} idle containers (≤{budget:.0f}s)", target) as adv:
        while len(cids) < target:
            if time.perf_counter() - t0 > budget:
                stop_reason = f"time budget of {budget:.0f}s used up"
                break
            k = min(step, target - len(cids))
            got = await ctx.bounded([docker_create_one(ctx) for _ in range(k)], 16, adv)
            cids += [c for c in got if isinstance(c, str)]
            errors += [str(c)[:300] for c in got if not isinstance(c, str)]
            now = await _settle(1.0)
            points.append(_point(len(cids), base, now, {
                "docker_processes_pss_mib": round(process_tree_rss(ctx.docker.daemon_pids()) / MIB, 1)}))
            if now["available"] < FLOOR_BYTES:
                stop_reason = f"host memory available fell below {FLOOR_BYTES // MIB} MiB"
                break
    final = await _settle(1.0)
    shims = len(ctx.docker.shim_pids())
    rm_s = await docker_remove_all(ctx, cids)
    return {"target": target, "created": len(cids), "stop_reason": stop_reason, "errors": len(errors),
            "error_samples": first_errors(errors), "points": points, "shim_processes": shims,
            "per_container_kib_slope": _kib(_per_item(points, "used_mib")),
            "per_container_kib_delta": round((final["used"] - base["used"]) / 1024 / max(1, len(cids)), 1),
            "remove_all_s": round(rm_s, 1)}


async def run(ctx: BenchContext, sz: DensityParams) -> ScenarioResult:
    """The density scenario (see the module docstring)."""
    res = ScenarioResult("density", docker=ctx.docker_status)
    res.data["limits"] = host.kernel_limits()
    s = await shoal_density(ctx, sz.target, sz.step, sz)
    res.data["shoal"] = s
    pr: dict[str, Any] | None = None
    if sz.holders:
        ctx.log(f"pressure phase: {sz.holders} idle sandboxes holding {sz.hold_mb} MiB each")
        pr = res.data["pressure"] = await oversub.pressure(ctx, sz.holders, sz.hold_mb)
    dk: dict[str, Any] = {}
    if ctx.docker:
        dk = await docker_density(ctx, sz.docker_target, sz.docker_step, sz.docker_budget_s)
        res.data["docker"] = dk
    per = s["per_sandbox_kib_slope"]
    per_mib = per / 1024 if per is not None else None
    dper = dk.get("per_container_kib_slope")
    res.add(Metric("idle sandboxes alive at once", s["alive_after_settle"], dk.get("created") if dk else None, "",
                   better="higher", target=f"≥ {min(5000, sz.target)}",
                   met=at_least(s["alive_after_settle"], min(5000, sz.target)),
                   note=f"shoal: {s['stop_reason']}" + (f"; Docker: {dk['stop_reason']}" if dk else "")),
            Metric("host memory per idle sandbox (slope)", per_mib, dper / 1024 if dper is not None else None, "MiB",
                   target="≤ 1 MiB", met=at_most(per_mib, 1.0)),
            Metric("host memory per idle sandbox (delta ÷ count)", s["per_sandbox_kib_delta"] / 1024,
                   dk["per_container_kib_delta"] / 1024 if dk else None, "MiB"),
            Metric("kernel objects + agent + node per sandbox (slope)",
                   (s["kernel_agent_node_kib_per_sandbox"] or 0) / 1024 or None, None, "MiB",
                   note=f"agent PSS {s['agent_pss_kib']} KiB"),
            Metric(f"exec p50 with {s['created']} sandboxes alive", s["exec_sample"]["latency"].get("p50_ms"), None,
                   "ms"),
            Metric(f"idle sandboxes answering an exec afterwards (of {s['exec_all']['n']})",
                   s["exec_all"]["answered"], None, "", better="higher", target=f"= {s['exec_all']['n']}",
                   met=s["exec_all"]["answered"] == s["exec_all"]["n"],
                   note=f"in {s['exec_all']['seconds']} s, 64 at a time"),
            Metric("node descriptors per idle sandbox", s["node_idle"]["fds_per_sandbox"], None, "fds",
                   target="≪ 2", met=at_most(s["node_idle"]["fds_per_sandbox"], 0.5),
                   note=f"{s['node_before']['fds']} → {s['node_idle']['fds']} with {s['created']} idle "
                        f"({s['node_idle']['agent_connections']} agent connections open)"),
            Metric(f"node at the peak ({s['created']} sandboxes): descriptors", s["node_peak"]["fds"], None, "",
                   note=f"threads {s['node_peak']['threads']}, RSS {s['node_peak']['rss_mib']} MiB; during the "
                        f"creates at most {s['node_peak_during_creates']['fds']} fds, "
                        f"{s['node_peak_during_creates']['threads']} threads"),
            Metric(f"time to {s['created']} idle sandboxes", s["reach_target_s"], None, "s"))
    adm = s["admitted_with_defaults"]
    res.add(Metric(f"default-spec sandboxes admitted with default settings (of {sz.target})", adm["created"], None,
                   "", better="higher", target=f"= {sz.target}", met=adm["created"] >= sz.target,
                   note=f"{adm['committed_mb'] // 1024:,} GiB promised on {adm['total_mb'] // 1024} GiB of RAM; "
                        f"{adm['refused']} refused"))
    ab = s.get("abuse")
    if ab:
        clean = ab["bombs_killed"] == ab["bombs"] and not ab["oom_kills_outside_bombs"] and \
            not ab["idle_agents_lost"] and not ab["watched_lost"]
        res.add(Metric(f"abuse: bombs OOM-killed in their own sandboxes (of {ab['bombs']}), {ab['idle_alive']} idle "
                       "alive", ab["bombs_killed"], None, "", better="higher", target=f"= {ab['bombs']}, nothing else",
                       met=clean, note=f"{ab['oom_kills_in_bombs']} kills in bombs, {ab['oom_kills_outside_bombs']} "
                       f"elsewhere on the host; agents lost {ab['idle_agents_lost']}, watched processes lost "
                       f"{ab['watched_lost']} of {ab['watched']}"),
                Metric("abuse: probe exec p99 during the bombs ÷ idle", ab["probe_p99_ratio"], None, "×",
                       target="≤ 2×", met=at_most(ab["probe_p99_ratio"], 2.0),
                       note=f"idle p99 {ab['probe_idle_before'].get('p99_ms')}/{ab['probe_idle_after'].get('p99_ms')} "
                            f"ms (before/after), during {ab['probe_during'].get('p99_ms')} ms"))
    if pr:
        res.add(Metric("pressure: memory returned by pausing idle sandboxes (net of zram)", pr["net_returned_mb"],
                       None, "MiB", better="higher",
                       note=f"{pr['paused']} paused in {pr['relief_s']} s; {pr['net_returned_pct_of_held']}% of the "
                            f"{pr['held_mb']} MiB held; reclaimed off "
                            f"their cgroups {pr['reclaimed_from_cgroups_mb']} MiB, zram grew "
                            f"{pr['zram_memory_delta_mb']} MiB; "
                            f"MemAvailable {pr['memory_returned_mb']:+} MiB (the whole host); create admitted: "
                            f"{pr['create_admitted']}"),
                Metric("pressure: first call to a paused sandbox (resume + prefetch)",
                       (pr.get("resume") or {}).get("first_call_s"), None, "s",
                       note=f"its process intact: {(pr.get('resume') or {}).get('intact')}"))
    res.notes.append("per-sandbox breakdown (KiB, slopes): " + ", ".join(
        f"{k.removesuffix('_mib')} {v}" for k, v in s["breakdown_kib_per_sandbox"].items()))
    if dk and dk["created"] < sz.docker_target:
        res.notes.append(f"Docker stopped at {dk['created']} containers: {dk['stop_reason']}")
    if ctx.plot_dir:
        series = {"shoal": ([p["n"] for p in s["points"]], [p["used_mib"] for p in s["points"]])}
        if dk:
            series["Docker"] = ([p["n"] for p in dk["points"]], [p["used_mib"] for p in dk["points"]])
        res.figures.append(plots.memory_vs_count(ctx.figure_path("density_memory.png"), series,
                                                 "host memory used vs idle sandboxes (page cache excluded)"))
    return res


SCENARIO = Scenario("density", "idle sandboxes alive at once, and the host memory each costs", run, DensityParams)
