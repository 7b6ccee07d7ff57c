"""`cluster`: cluster mode on Ray against one node, side by side in one run on the same machine.

A Ray cluster of a head and `nodes` worker nodes on 127.0.0.1 (shoal.cluster.local), one node agent per
worker (`--home-per-node`, the run's layer store), then:
  1. placement in isolation: decisions/s of the client-side placement (shoal.sched through
     shoal.cluster.placement.ClusterView) for one create at a time and for a burst split, on `nodes` and on
     160 simulated nodes — one core, no I/O;
  2. burst: `create_many(burst)` through `shoal.Client("ray://…")` over the nodes, beside the same burst
     through the embedded client on one node, `burst_rounds` each in ABBA order; ready sandboxes per second
     over the summed wall time (the nodes share the same cores, so the ratio is the cluster's overhead,
     not a speed-up);
  3. exec: round trips of `true` in one sandbox through the cluster client (data plane: the owner node's
     HTTP endpoint), through a single-node `shoal serve` (the HTTP path), and through a Ray actor call to
     the node agent (the data plane not chosen), interleaved in rounds so machine noise hits all alike;
  4. node loss: a worker node is removed (its agent killed with it) and the time until a call on one of
     its sandboxes raises `SandboxLost` is measured (the contract: within 10 s).
Sandboxes use memory_mb=64, cpus=0.25.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import shoal
from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult, at_least, at_most
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios.common import private_home
from shoal.bench.stats import latency_summary

SPEC = {"memory_mb": 64, "cpus": 0.25, "ttl_s": 3600}
TRUE = ["true"]


@dataclass(frozen=True)
class ClusterParams:
    """How much work the cluster scenario does."""

    nodes: int = param(3, help="Ray worker nodes, each with a node agent (all on this machine)")
    burst: int = param(1000, quick=100, help="sandboxes created by one create_many, cluster and embedded")
    burst_rounds: int = param(2, quick=1, help="bursts per side, in ABBA order (cancels a drifting machine load)")
    exec_rtt: int = param(600, quick=150, help="sequential exec round trips per path (interleaved in rounds)")
    decisions: int = param(20000, quick=5000, help="placement decisions timed in isolation")
    node_loss: bool = param(True, help="remove a node and time SandboxLost")


# ---- 1. placement in isolation -----------------------------------------------------------------------
def _report(i: int) -> dict[str, Any]:
    return {"node_id": f"n{i}", "memory": {"total_mb": 1_536_000, "limit_mb": 4 * 1_536_000, "committed_mb": 0,
                                           "used_mb": 1000}, "cpus": {"count": 190, "committed": 0.0},
            "sandboxes": {}, "layers": [f"l{i % 7}", "base"]}


def placement_rate(nodes: int, decisions: int) -> dict[str, Any]:
    """Single-create decisions/s and burst-split throughput of the client's placement on `nodes` nodes."""
    from shoal.cluster.placement import ClusterView
    from shoal.models import SandboxSpec

    view = ClusterView(seed=7)
    reports = [_report(i) for i in range(nodes)]
    view.update(reports)
    spec = SandboxSpec(memory_mb=64, cpus=0.25)
    layers = ("base", "l3")
    t0 = time.process_time()
    for k in range(decisions):
        view.split(spec, 1, layers=layers)
        if k % 5000 == 4999:
            view.update(reports)  # a fresh report now and then, as the runtime gets them
    single = decisions / max(1e-9, time.process_time() - t0)
    view.update(reports)
    bursts = max(1, decisions // 1000)
    t0 = time.process_time()
    for _ in range(bursts):
        view.split(spec, 1000, layers=layers)
        view.update(reports)
    burst_s = (time.process_time() - t0) / bursts
    return {"nodes": nodes, "decisions": decisions, "single_per_s": round(single),
            "burst_1000_ms": round(burst_s * 1000, 3), "burst_sandboxes_per_s": round(1000 / burst_s)}


# ---- helpers ------------------------------------------------------------------------------------------
async def _burst(client: shoal.Client, n: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    items = await client.create_many("base", n=n, **SPEC)
    wall = time.perf_counter() - t0
    ok = [s for s in items if isinstance(s, shoal.Sandbox)]
    errs = [f"{type(e).__name__}: {e}"[:200] for e in items if not isinstance(e, shoal.Sandbox)]
    per_node: dict[str, int] = {}
    for s in ok:
        per_node[s.info.node] = per_node.get(s.info.node, 0) + 1
    t1 = time.perf_counter()
    await asyncio.gather(*(s.close() for s in ok), return_exceptions=True)
    return {"n": n, "ready": len(ok), "wall_s": round(wall, 3), "per_s": round(len(ok) / wall, 1) if wall else 0.0,
            "close_s": round(time.perf_counter() - t1, 3), "errors": len(errs), "error_samples": errs[:3],
            "per_node": per_node}


def _merge(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Several bursts of one side as one figure (ready sandboxes over the summed wall time), rounds kept."""
    ready = sum(r["ready"] for r in rounds)
    wall = sum(r["wall_s"] for r in rounds)
    per_node: dict[str, int] = {}
    for r in rounds:
        for k, v in r["per_node"].items():
            per_node[k] = per_node.get(k, 0) + v
    return {"n": rounds[0]["n"], "rounds": rounds, "ready": ready, "wall_s": round(wall, 3),
            "per_s": round(ready / wall, 1) if wall else 0.0, "errors": sum(r["errors"] for r in rounds),
            "per_node": per_node}


async def _warm(client: shoal.Client) -> None:
    # the first creates mount the image's layers on each node and probe runtimes: not what is measured
    items = await client.create_many("base", n=6, **SPEC)
    for s in items:
        if isinstance(s, shoal.Sandbox):
            await s.exec(TRUE)
            await s.close()


async def _exec_paths(ctx: BenchContext, cl: shoal.Client, http: shoal.Client, n: int) -> dict[str, Any]:
    """Interleaved rounds of `true` round trips: cluster client, single-node HTTP, Ray actor call."""
    import ray

    from shoal.cluster.raylink import NAMESPACE, agent_name
    from shoal.records import node_of

    csb = await cl.create("base", **SPEC)
    hsb = await http.create("base", **SPEC)
    actor = ray.get_actor(agent_name(node_of(csb.id)), namespace=NAMESPACE)
    lat: dict[str, list[float]] = {"cluster": [], "http": [], "ray_actor": []}
    errors = 0

    async def c_call() -> None:
        r = await csb.exec(TRUE)
        assert r.exit_code == 0

    async def h_call() -> None:
        r = await hsb.exec(TRUE)
        assert r.exit_code == 0

    async def r_call() -> None:
        res = await actor.call.remote("exec", csb.id, (TRUE,))
        assert "ok" in res and res["ok"].exit_code == 0, res

    calls = {"cluster": c_call, "http": h_call, "ray_actor": r_call}
    for fn in calls.values():  # warm connections
        for _ in range(10):
            await fn()
    rounds = max(1, n // 50)
    order = list(calls)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            for _ in range(50):
                t = time.perf_counter()
                try:
                    await calls[name]()
                except Exception:
                    errors += 1
                    continue
                lat[name].append(time.perf_counter() - t)
    await csb.close()
    await hsb.close()
    out: dict[str, Any] = {k: latency_summary(v) for k, v in lat.items()}
    out["errors"] = errors
    return out


async def _node_loss(cl: shoal.Client, lc: Any) -> dict[str, Any]:
    """Remove the node holding a fresh sandbox; seconds until a call on it raises SandboxLost."""
    import ray

    from shoal.cluster.raylink import NAMESPACE, agent_name
    from shoal.records import node_of

    items = await cl.create_many("base", n=3, **SPEC)
    sb = next(s for s in items if isinstance(s, shoal.Sandbox))
    hello = await ray.get_actor(agent_name(node_of(sb.id)), namespace=NAMESPACE).ensure_started.remote()
    await asyncio.sleep(0.5)  # let its index reach Ray's store
    t0 = time.perf_counter()
    await asyncio.to_thread(lc.remove_worker, lc.worker_by_ray_id(hello["ray_node_id"]))
    with contextlib.suppress(ProcessLookupError):
        os.kill(hello["pid"], signal.SIGKILL)  # the agent goes with its node's machine
    kind = "none"
    try:
        await sb.exec(TRUE)
    except shoal.SandboxLost:
        kind = "SandboxLost"
    except shoal.ShoalError as e:
        kind = type(e).__name__
    lost_s = time.perf_counter() - t0
    listed = {i.id: i.state for i in await cl.list()}
    for s in items:
        if isinstance(s, shoal.Sandbox):
            with contextlib.suppress(shoal.ShoalError):
                await s.close()
    return {"seconds": round(lost_s, 2), "raised": kind, "listed_as": listed.get(sb.id, "absent"),
            "lost_node": node_of(sb.id)}


# ---- the scenario -------------------------------------------------------------------------------------
async def cluster_bench(ctx: BenchContext, p: ClusterParams) -> dict[str, Any]:
    """Everything the module doc lists; JSON-friendly."""
    from shoal.cluster import control
    from shoal.cluster.local import LocalCluster
    from shoal.node.teardown import teardown_home

    out: dict[str, Any] = {"nodes": p.nodes, "cpus": os.cpu_count(), "spec": SPEC, "loadavg_before": os.getloadavg()}
    ctx.log("placement in isolation")
    out["placement"] = {"small": placement_rate(p.nodes, p.decisions), "dsec_160": placement_rate(160, p.decisions)}
    store = ctx.node.paths.store
    base = Path(tempfile.mkdtemp(prefix="shcb-", dir="/tmp"))  # short: sandbox sockets live below it
    lc = LocalCluster(p.nodes)
    try:
        ctx.log(f"starting a Ray cluster of {p.nodes} nodes on 127.0.0.1")
        t0 = time.perf_counter()
        lc.start()  # Ray starts its processes from the main thread only (signal handlers)
        rep = await asyncio.to_thread(control.up, lc.address, home=str(base), store=str(store), home_per_node=True)
        out["cluster_up_s"] = round(time.perf_counter() - t0, 2)
        out["agents"] = [h["node_id"] for h in rep.started]
        async with shoal.Client(lc.url, timeout=1800) as cl, private_home("shcb-h-") as hhome:
            await _warm(cl)
            await _warm(ctx.client)
            ctx.log(f"bursts of {p.burst}: embedded and cluster, {p.burst_rounds} each, ABBA order")
            rounds: dict[str, list[dict[str, Any]]] = {"embedded": [], "cluster": []}
            order = [("embedded", ctx.client), ("cluster", cl)]
            for i in range(p.burst_rounds):
                for side, client in (order if i % 2 == 0 else order[::-1]):
                    rounds[side].append(await _burst(client, p.burst))
            out["burst_embedded"] = _merge(rounds["embedded"])
            out["burst_cluster"] = _merge(rounds["cluster"])
            ctx.log("exec round trips: cluster / single-node HTTP / Ray actor")
            from shoal.bench.scenarios.api import _http_client

            async with _http_client(hhome, 600.0) as (http, _srv):
                await _warm(http)
                out["exec"] = await _exec_paths(ctx, cl, http, p.exec_rtt)
            if p.node_loss and p.nodes >= 2:
                ctx.log("node loss")
                out["node_loss"] = await _node_loss(cl, lc)
        await asyncio.to_thread(control.down, lc.address, force=True)
    finally:
        lc.shutdown()
        from shoal.config import Paths

        for d in sorted((base / "nodes").glob("*")) if (base / "nodes").exists() else []:
            with contextlib.suppress(Exception):
                await teardown_home(Paths.from_env(d, store), close_sandboxes=True)
        shutil.rmtree(base, ignore_errors=True)
    out["loadavg_after"] = os.getloadavg()
    return out


def rows(r: dict[str, Any]) -> list[Metric]:
    """Table rows with the issue's targets."""
    ex = r.get("exec") or {}
    c50, h50 = (ex.get("cluster") or {}).get("p50_ms"), (ex.get("http") or {}).get("p50_ms")
    ratio = round(c50 / h50, 2) if c50 and h50 else None
    be, bc = r.get("burst_embedded") or {}, r.get("burst_cluster") or {}
    brate = round(bc["per_s"] / be["per_s"], 2) if be.get("per_s") and bc.get("per_s") else None
    pl = (r.get("placement") or {}).get("small") or {}
    big = (r.get("placement") or {}).get("dsec_160") or {}
    loss = r.get("node_loss") or {}
    return [
        Metric("exec p50 through the cluster", c50, None, "ms", note=f"single-node HTTP {h50} ms; Ray actor call "
               f"{(ex.get('ray_actor') or {}).get('p50_ms')} ms"),
        Metric("exec p99 through the cluster", (ex.get("cluster") or {}).get("p99_ms"), None, "ms",
               note=f"single-node HTTP {(ex.get('http') or {}).get('p99_ms')} ms"),
        Metric("exec p50 cluster / single-node HTTP", ratio, None, "×", target="≤ 1.5",
               met=at_most(ratio, 1.5)),
        Metric(f"bursts of {bc.get('n')}: cluster ({r.get('nodes')} nodes)", bc.get("per_s"), None, "sandboxes/s",
               better="higher", note=f"embedded one node {be.get('per_s')}/s; errors {bc.get('errors')}+"
               f"{be.get('errors')}; per node {bc.get('per_node')}"),
        Metric("burst rate cluster / embedded (same cores)", brate, None, "×", better="higher", target="≥ 0.9",
               met=at_least(brate, 0.9)),
        Metric(f"placement decisions/s, one core ({pl.get('nodes')} nodes)", pl.get("single_per_s"), None, "/s",
               better="higher", target="≥ 5000", met=at_least(pl.get("single_per_s"), 5000),
               note=f"160 nodes: {big.get('single_per_s')}/s; a 1,000-burst split in {big.get('burst_1000_ms')} ms"),
        Metric("node removed → SandboxLost", loss.get("seconds"), None, "s", target="≤ 10",
               met=at_most(loss.get("seconds"), 10) if loss.get("raised") == "SandboxLost" else False if loss else None,
               note=f"raised {loss.get('raised')}, listed as {loss.get('listed_as')}" if loss else "not run"),
    ]


def plot(r: dict[str, Any], path: Path) -> Path:
    """Exec p50/p99 per path, and burst rates cluster vs embedded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    ex = r.get("exec") or {}
    names = ["http", "cluster", "ray_actor"]
    labels = ["single-node HTTP", "cluster (node endpoint)", "Ray actor call"]
    xs = range(len(names))
    a1.bar([x - 0.2 for x in xs], [(ex.get(n) or {}).get("p50_ms", 0) for n in names], 0.4, label="p50")
    a1.bar([x + 0.2 for x in xs], [(ex.get(n) or {}).get("p99_ms", 0) for n in names], 0.4, label="p99")
    a1.set_xticks(list(xs), labels, fontsize=8)
    a1.set_ylabel("ms")
    a1.set_title("exec `true` round trip")
    a1.legend()
    be, bc = r.get("burst_embedded") or {}, r.get("burst_cluster") or {}
    a2.bar([0, 1], [be.get("per_s", 0), bc.get("per_s", 0)], color=["#2ca02c", "#1f77b4"])
    a2.set_xticks([0, 1], ["embedded (1 node)", f"cluster ({r.get('nodes')} nodes)"])
    a2.set_ylabel("sandboxes ready / s")
    a2.set_title(f"create_many({bc.get('n')}) on {r.get('cpus')} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


async def run(ctx: BenchContext, p: ClusterParams) -> ScenarioResult:
    """The cluster scenario (see the module docstring)."""
    res = ScenarioResult("cluster", docker="not applicable")
    out = await cluster_bench(ctx, p)
    res.data.update(out)
    res.add(*rows(out))
    if ctx.plot_dir:
        res.figures.append(str(plot(out, ctx.figure_path("cluster.png"))))
    return res


SCENARIO = Scenario("cluster", "cluster mode on Ray: burst and exec vs one node, placement decisions/s, node loss",
                    run, ClusterParams, uses_docker=False)
