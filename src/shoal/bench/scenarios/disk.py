"""`disk`: bytes written to disk per created sandbox, shoal vs Docker.

Each system gets a fresh ext4 filesystem on its own loop device (shoal: a node whose SHOAL_HOME lives
there, upper pool included; Docker: its data root), so the device's write counter
(/sys/block/loopN/stat) sees only that system's writes — other work on the host's disk cannot leak into
the figure. Writes are counted after `sync`, so everything the create left in the page cache counts.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.bench import host, plots
from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult, at_most
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios.common import docker_create_one, docker_remove_all, first_errors, spec
from shoal.errors import ShoalError

KIB = 1024


@dataclass(frozen=True)
class DiskParams:
    """How many sandboxes the disk scenario counts writes over."""

    n: int = param(100, quick=20, help="sandboxes created (shoal)")
    n_docker: int = param(30, quick=5, help="containers created (Docker)")


async def _synced_bytes(read: Any) -> int:
    import asyncio

    await asyncio.to_thread(host.sync_disks)
    return read()


async def shoal_disk(ctx: BenchContext, n: int) -> dict[str, Any]:
    """A node on a private ext4 device: bytes written by `n` creates, and by closing them."""
    from shoal.backends.container.disk import UpperPool
    from shoal.config import NodeConfig, Paths
    from shoal.node.node import Node

    fs = host.LoopFs(Path(f"/tmp/sbdisk-{os.getpid()}"))
    fs.create()
    node = Node(NodeConfig(paths=Paths.from_env(fs.mountpoint, ctx.node.paths.store), memory_overcommit=1000.0))
    try:
        await node.start()
        # warm-up: first use makes the upper pool and mounts the layers (one-off, per host)
        w_setup0 = await _synced_bytes(fs.written_bytes)
        info = await node.create(spec(ctx))
        await node.close(info.id)
        w0 = await _synced_bytes(fs.written_bytes)
        t0 = time.perf_counter()
        with ctx.task(f"shoal: {n} creates on a private disk", n) as adv:
            items = await node.create_many(spec(ctx), n, on_done=lambda _r: adv())
        ids = [i.id for i in items if not isinstance(i, ShoalError)]
        errs = [str(i) for i in items if isinstance(i, ShoalError)]
        w1 = await _synced_bytes(fs.written_bytes)
        create_s = time.perf_counter() - t0
        with ctx.task(f"shoal: closing {len(ids)}", len(ids)) as adv:
            await ctx.bounded([node.close(i) for i in ids], 32, adv)
        w2 = await _synced_bytes(fs.written_bytes)
        await node.stop()
        return {"n": n, "ok": len(ids), "errors": first_errors(errs), "device": fs.device,
                "first_use_setup_bytes": w0 - w_setup0, "create_bytes": w1 - w0, "close_bytes": w2 - w1,
                "per_sandbox_create_kib": round((w1 - w0) / max(1, len(ids)) / KIB, 2),
                "per_sandbox_lifecycle_kib": round((w2 - w0) / max(1, len(ids)) / KIB, 2),
                "create_s": round(create_s, 2)}
    finally:
        import contextlib

        with contextlib.suppress(Exception):
            await node.close_all()
        with contextlib.suppress(Exception):
            await node.stop()
        with contextlib.suppress(Exception):
            node.layer_mounts.reconcile(set())
        with contextlib.suppress(Exception):
            UpperPool(node.paths, node.config.settings).teardown()
        fs.destroy()


async def docker_disk(ctx: BenchContext, n: int) -> dict[str, Any]:
    """`n` Docker runs: bytes written to the device holding Docker's data root (its own loop device)."""
    assert ctx.docker is not None
    fs = ctx.extra.get("docker_fs")
    if fs is None:
        return {"skipped": "Docker's data root is not on a private device in this run"}
    await docker_remove_all(ctx, [await docker_create_one(ctx)], "Docker warm-up")
    w0 = await _synced_bytes(fs.written_bytes)
    t0 = time.perf_counter()
    with ctx.task(f"Docker: {n} runs", n) as adv:
        got = await ctx.bounded([docker_create_one(ctx) for _ in range(n)], 16, adv)
    cids = [c for c in got if isinstance(c, str)]
    w1 = await _synced_bytes(fs.written_bytes)
    create_s = time.perf_counter() - t0
    await docker_remove_all(ctx, cids)
    w2 = await _synced_bytes(fs.written_bytes)
    return {"n": n, "ok": len(cids), "errors": first_errors([str(c) for c in got if not isinstance(c, str)]),
            "device": fs.device, "create_bytes": w1 - w0, "remove_bytes": w2 - w1,
            "per_container_create_kib": round((w1 - w0) / max(1, len(cids)) / KIB, 2),
            "per_container_lifecycle_kib": round((w2 - w0) / max(1, len(cids)) / KIB, 2),
            "create_s": round(create_s, 2)}


async def run(ctx: BenchContext, sz: DiskParams) -> ScenarioResult:
    """The disk scenario (see the module docstring)."""
    res = ScenarioResult("disk", docker=ctx.docker_status)
    s = await shoal_disk(ctx, sz.n)
    res.data["shoal"] = s
    dk: dict[str, Any] = {}
    if ctx.docker:
        dk = await docker_disk(ctx, sz.n_docker)
        res.data["docker"] = dk
    sk = s["per_sandbox_create_kib"]
    dkk = dk.get("per_container_create_kib")
    pct = 100.0 * sk / dkk if dkk else None
    res.add(Metric("disk written per created sandbox", sk, dkk, "KiB",
                   target="≤ 1% of Docker's", met=at_most(pct, 1.0) if pct is not None else None,
                   note=f"{pct:.2f}% of Docker's" if pct is not None else ""),
            Metric("disk written per sandbox, create + close", s["per_sandbox_lifecycle_kib"],
                   dk.get("per_container_lifecycle_kib"), "KiB"))
    if pct is not None:
        res.add(Metric("shoal's disk writes as % of Docker's", round(pct, 3), 100.0, "%", target="≤ 1%",
                       met=at_most(pct, 1.0)))
    if ctx.plot_dir and dk.get("per_container_create_kib") is not None:
        res.figures.append(plots.bars(ctx.figure_path("disk_writes.png"), ["create", "create + close"],
                                      {"shoal": [max(sk, 0.01), max(s["per_sandbox_lifecycle_kib"], 0.01)],
                                       "Docker": [dkk, dk["per_container_lifecycle_kib"]]},
                                      "bytes written to disk per sandbox (log scale)", "KiB per sandbox", log=True))
    return res


SCENARIO = Scenario("disk", "bytes written to disk per created sandbox", run, DiskParams)
