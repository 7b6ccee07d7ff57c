"""`lazy` (alias `image`): how little of an image a sandbox reads, layer mount times, disk writes per
sandbox (vs Docker).

- read fraction: with a cold page cache and an empty chunk cache, how much of an image's EROFS bytes the
  node's reader fetches (every chunk checked) to start a sandbox and run `python3 -c 'import json'`:
  every byte EROFS reads comes through the reader, so its counters are exact (chunks whole, read-ahead
  included). The layer is in a private store, so nobody else's reads count.
- mount time: mounting a layer (LayerMounts.acquire) with a cold and a warm page cache, file-backed and
  through a loop device.
- disk writes: bytes written per new sandbox, from the block-device counters of a private ext4
  filesystem (on a loop device) that holds SHOAL_HOME — so nothing else on the host blurs them — with
  a sync before and after; plus the growth of allocated space. The same for `docker run` of the same
  image tree (`docker import`) with Docker's data root on that filesystem, when Docker is available
  or allowed to be installed (its own private dockerd: `lazy_docker`).

`shoal bench lazy -p n=20 -p trials=3`; `run_image_bench()` returns the raw figures (a JSON-friendly dict).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.bench.context import BenchContext
from shoal.bench.diskstats import (
    ScratchFs,
    Writes,
    block_stat_path,
    disk_read_bytes,
    drop_caches,
    median,
)
from shoal.bench.results import Metric, ScenarioResult
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios.lazy_docker import docker_writes
from shoal.config import NodeConfig, Paths, Settings
from shoal.errors import BackendUnavailable
from shoal.images.mounts import LayerMounts, erofs_mode
from shoal.images.store import ImageStore

JSON_CMD = "python3 -c 'import json'"


@dataclass(frozen=True)
class LazyParams:
    """How much work the lazy scenario does."""

    image: str = param("base:latest", help="the image measured (copied into a private store first)")
    n: int = param(20, quick=10, help="sandboxes (and Docker containers) per round of the write measurement")
    trials: int = param(3, quick=2, help="cold-cache trials for the read and mount figures")
    rounds: int = param(3, quick=2, help="rounds of `n` creations for the write measurement")
    install_docker: bool = param(True, help="apt-get install docker.io when it is missing (Docker comparison)")


async def run(ctx: BenchContext, p: LazyParams) -> ScenarioResult:
    """The lazy scenario: run_image_bench beside Docker (when the run has Docker), as table rows."""
    res = ScenarioResult("lazy", docker=ctx.docker_status)
    out = await run_image_bench(ctx.node.store, image=p.image, n=p.n, trials=p.trials, rounds=p.rounds,
                                docker=ctx.docker is not None, install_docker=p.install_docker, log=ctx.log)
    res.data.update(out)
    res.add(*rows(out))
    dk = out.get("writes", {}).get("docker", {})
    if "error" in dk:
        res.notes.append(f"Docker side: {dk['error'][:300]}")
    if ctx.plot_dir:
        res.figures.append(str(plot(out, ctx.figure_path("lazy_image.png"))))
    return res


def _num(d: Any, path: str, scale: float = 1.0) -> float | None:
    for part in path.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d * scale if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def rows(out: dict[str, Any]) -> list[Metric]:
    """The table rows of run_image_bench's result."""
    frac = _num(out, "read.start_and_json_fraction", 100)
    mode = (out.get("read") or {}).get("mount_mode")
    rows = [Metric("image read to start + python3 -c 'import json' (cold cache)", frac, None, "%", target="≤ 10%",
                   met=None if frac is None else frac <= 10,
                   note=f"of {_num(out, 'image_bytes', 1 / 2**20) or 0:.0f} MiB, mount {mode}"),
            Metric("image read to start the sandbox only", _num(out, "read.start_fraction", 100), None, "%"),
            Metric("layer mount, cold (file-backed EROFS)", _num(out, "mount.file.cold_ms"), None, "ms"),
            Metric("layer mount, cold (loop device)", _num(out, "mount.loop.cold_ms"), None, "ms")]
    s, d = _num(out, "writes.shoal.bytes_written", 1 / 1024), _num(out, "writes.docker.bytes_written", 1 / 1024)
    if s is not None:
        pct = 100 * s / d if d else None
        rows.append(Metric(f"disk written per sandbox (rounds of {out.get('n_sandboxes')})", s, d, "KiB",
                           target="≤ 1% of Docker's", met=None if pct is None else pct <= 1,
                           note=f"{pct:.2f}% of Docker's" if pct is not None else ""))
        rows.append(Metric("disk space allocated per sandbox", _num(out, "writes.shoal.allocated_bytes", 1 / 1024),
                           _num(out, "writes.docker.allocated_bytes", 1 / 1024), "KiB"))
        rows.append(Metric("disk written per sandbox without disk limits (SHOAL_DISK_LIMITS=0)",
                           _num(out, "writes.shoal_no_disk_limits.bytes_written", 1 / 1024), None, "KiB"))
    return rows


async def run_image_bench(shared: ImageStore, *, image: str = "base:latest", n: int = 20, trials: int = 3,
                          rounds: int = 3, docker: bool = True, install_docker: bool = True,
                          log: Callable[[str], None] | None = None, work_root: Path | None = None) -> dict[str, Any]:
    """Measure `image` from the store `shared`; returns a JSON-friendly dict of results (see module docs)."""
    if os.geteuid() != 0:
        raise BackendUnavailable("the image benchmark needs root (mounts, drop_caches, sandboxes)")
    from shoal.models import SandboxSpec
    from shoal.node.node import Node

    log = log or (lambda s: None)
    src_img = shared.resolve(image)
    root = Path(tempfile.mkdtemp(prefix="sbi-", dir=str(work_root or "/var/tmp")))
    scratch = await asyncio.to_thread(ScratchFs, root)
    paths = Paths(home=scratch.mnt / "h", store=root / "store")
    store = ImageStore(paths.store)
    results: dict[str, Any] = {"image": image, "image_bytes": src_img.size, "layers": len(src_img.layers),
                               "n_sandboxes": n, "trials": trials, "write_rounds": rounds, "host": os.uname().nodename,
                               "kernel": os.uname().release, "time": time.time()}
    log(f"copying {image} ({src_img.size / 2**20:.0f} MiB) into a private store {store.root}")
    img = await asyncio.to_thread(store.copy_image_from, shared, image, "bench:latest", link=False)
    node = Node(NodeConfig(paths=paths))
    await node.start(reap=False, reconcile=False)
    spec = SandboxSpec(image="bench:latest", network=False, ttl_s=3600)
    try:
        # warm-up: runtime probes, upper pool, guest agent (then caches are dropped before measuring)
        info = await node.create(spec)
        await node.close(info.id)
        results["erofs_mount_mode"] = erofs_mode()
        results["read_modes"] = {}
        for directio in (True, False):
            r = await _read_fraction(node, spec, img, trials, log, directio)
            results["read_modes"][r["mount_mode"]] = r
        results["read"] = results["read_modes"].get(results["erofs_mount_mode"]) or r
        results["mount"] = await asyncio.to_thread(_mount_times, paths, img, trials, log)
        results["writes"] = {"shoal": await _shoal_writes(node, spec, paths, scratch, n, rounds, log)}
        # where shoal's own writes come from: the same without per-sandbox disk limits (no btrfs pool)
        results["writes"]["shoal_no_disk_limits"] = await _variant_writes(
            {"disk_limits": False}, spec, Paths(home=scratch.mnt / "h2", store=paths.store), scratch, n,
            rounds, log)
        if docker:
            try:
                results["writes"]["docker"] = await asyncio.to_thread(
                    docker_writes, node, img, root, scratch, n, rounds, install_docker, log)
            except (BackendUnavailable, subprocess.SubprocessError, OSError) as e:
                results["writes"]["docker"] = {"error": str(e)[:500]}
                log(f"docker comparison skipped: {e}")
        _ratios(results)
    finally:
        with contextlib.suppress(Exception):
            await node.close_all()
        await node.stop()
        with contextlib.suppress(Exception):
            pool = getattr(node.backend("container"), "upper_pool", None)
            if pool is not None:
                await asyncio.to_thread(pool.teardown)
        await asyncio.to_thread(_cleanup_home, paths)
        await asyncio.to_thread(scratch.close)
        shutil.rmtree(root, ignore_errors=True)
    return results


def _cleanup_home(paths: Paths) -> None:
    from shoal.host import syscalls

    for mp in syscalls.mounts_under(str(paths.home)):
        with contextlib.suppress(OSError):
            syscalls.umount(mp, detach=True)


def _fresh_reader(node: Any) -> None:
    """No layer in use: stop the node's reader and empty its chunk cache (the next use fetches everything)."""
    node.layer_mounts.stop_reader_if_unused()
    shutil.rmtree(node.layer_mounts.daemon.cache, ignore_errors=True)


async def _read_fraction(node: Any, spec: Any, img: Any, trials: int, log: Callable[[str], None],
                         directio: bool) -> dict:
    """Cold-cache bytes read from the image to start a sandbox and to run JSON_CMD in it."""
    total = img.size
    node.layer_mounts.directio = directio
    disk = block_stat_path(node.paths.store)
    start, after, create_s, disk_reads = [], [], [], []
    mode = "?"
    for t in range(trials):
        # two cold runs per trial: measuring walks every file of the layer (reading all its metadata),
        # so the start and the command are measured from separate cold starts
        for phase in ("start", "json"):
            await asyncio.to_thread(_fresh_reader, node)
            drop_caches()
            d0 = disk_read_bytes(disk)
            t0 = time.perf_counter()
            info = await node.create(spec)
            if phase == "start":
                create_s.append(time.perf_counter() - t0)
            mode = erofs_mode()
            try:
                if phase == "json":
                    r = await node.exec(info.id, JSON_CMD)
                    if r.exit_code != 0:
                        raise RuntimeError(f"{JSON_CMD} failed in the sandbox: {r.stderr[-500:]!r}")
                    disk_reads.append(disk_read_bytes(disk) - d0)
                got = int(node.layer_mounts.daemon.stats()["fetched_bytes"])
            finally:
                await node.close(info.id)
            (start if phase == "start" else after).append(got)
        log(f"read trial {t + 1} ({mode}): start {start[-1] / 2**20:.2f} MiB, +import json "
            f"{after[-1] / 2**20:.2f} MiB of {total / 2**20:.0f} MiB ({after[-1] / total:.1%}); whole-disk reads "
            f"meanwhile {disk_reads[-1] / 2**20:.1f} MiB; cold create {create_s[-1] * 1000:.0f} ms")
    node.layer_mounts.directio = True
    return {"mount_mode": mode, "image_bytes": total, "start_bytes": median(start),
            "start_and_json_bytes": median(after), "start_fraction": median(start) / total,
            "start_and_json_fraction": median(after) / total, "cold_create_s": median(create_s),
            "samples_bytes": after, "disk_read_bytes_whole_machine": median(disk_reads), "command": JSON_CMD}


def _mount_times(paths: Paths, img: Any, trials: int, log: Callable[[str], None]) -> dict:
    out: dict[str, Any] = {}
    layer = max(img.layers, key=lambda x: x.size)
    for mode in ("file", "loop"):
        lm = LayerMounts(paths, mode=mode)
        lm.keep_reader = True  # the node's reader runs on (started once): what is timed is the mount
        cold, warm = [], []
        try:
            for _ in range(trials):
                drop_caches()
                t0 = time.perf_counter()
                lm.acquire([layer], "bench-mount")
                cold.append(time.perf_counter() - t0)
                lm.release([layer.hex], "bench-mount")
            for _ in range(max(10, trials)):
                t0 = time.perf_counter()
                lm.acquire([layer], "bench-mount")
                warm.append(time.perf_counter() - t0)
                lm.release([layer.hex], "bench-mount")
        except Exception as e:  # e.g. no loop devices in this container
            out[mode] = {"error": str(e)[:300]}
            continue
        finally:
            lm.keep_reader = False
            lm.stop_reader_if_unused()
        out[mode] = {"cold_ms": median(cold) * 1000, "warm_ms": median(warm) * 1000,
                     "cold_samples_ms": [x * 1000 for x in cold]}
        log(f"mount ({mode}): cold {out[mode]['cold_ms']:.2f} ms, warm {out[mode]['warm_ms']:.2f} ms")
    return out


async def _shoal_writes(node: Any, spec: Any, paths: Paths, scratch: ScratchFs, n: int, rounds: int,
                        log: Callable[[str], None]) -> dict:
    parts = {"sandbox dirs (records, bundles)": paths.sandboxes}
    pool = paths.home / "uppers.btrfs"  # the node's upper pool, when it uses one (shoal.backends.container.disk)
    if pool.exists():
        parts["upper pool"] = pool
    w = Writes(scratch.stat, [paths.home], parts)
    t_create = []
    for _ in range(rounds):
        await asyncio.to_thread(w.begin)
        ids = []
        for _ in range(n):
            t0 = time.perf_counter()
            ids.append((await node.create(spec)).id)
            t_create.append(time.perf_counter() - t0)
        await asyncio.to_thread(w.end, n)
        for sid in ids:
            await node.close(sid)
    res = w.summary()
    res["create_s_median"] = median(t_create)
    log(f"shoal: {res['bytes_written'] / 1024:.1f} KiB written per sandbox (raw {res['bytes_written_raw'] / 1024:.1f} "
        f"KiB, idle {res['idle_write_rate_Bps'] / 1024:.0f} KiB/s); {res['allocated_bytes'] / 1024:.1f} KiB allocated "
        f"({', '.join(f'{k}: {v / 1024:.1f} KiB' for k, v in res['allocated_bytes_by_part'].items())})")
    return res


async def _variant_writes(changes: dict[str, object], spec: Any, paths: Paths, scratch: ScratchFs, n: int,
                          rounds: int, log: Callable[[str], None]) -> dict:
    """_shoal_writes with a node of its own whose settings differ by `changes` ({setting: value})."""
    from shoal.config import settings
    from shoal.node.node import Node

    node = Node(NodeConfig(settings=settings().replace(**changes), paths=paths))
    try:
        await node.start(reap=False, reconcile=False)
        info = await node.create(spec)  # warm-up
        await node.close(info.id)
        log(f"variant {changes}:")
        res = await _shoal_writes(node, spec, paths, scratch, n, rounds, log)
        res["env"] = {Settings.env_name(k): v for k, v in changes.items()}  # the key earlier results used
        return res
    finally:
        with contextlib.suppress(Exception):
            await node.close_all()
        await node.stop()
        await asyncio.to_thread(_cleanup_home, paths)


# ---- docker, for the side-by-side comparison ------------------------------------------------------
def _ratios(results: dict[str, Any]) -> None:
    w = results.get("writes", {})
    s, dk = w.get("shoal", {}), w.get("docker", {})
    targets = results.setdefault("targets", {})
    if s and dk and "error" not in dk:
        def ratio(a: float, b: float) -> float | None:
            return a / b if b > 0 else None

        results["ratios"] = {
            "written_shoal_over_docker": ratio(s["bytes_written"], dk["bytes_written"]),
            "written_raw_shoal_over_docker": ratio(s["bytes_written_raw"], dk["bytes_written_raw"]),
            "allocated_shoal_over_docker": ratio(s["allocated_bytes"], dk["allocated_bytes"]),
        }
        if results["ratios"]["written_shoal_over_docker"] is not None:
            targets["written_le_1pct_of_docker"] = results["ratios"]["written_shoal_over_docker"] <= 0.01
    r = results.get("read", {})
    if r:
        targets["read_fraction_le_10pct"] = r["start_and_json_fraction"] <= 0.10


def plot(results: dict[str, Any], out: Path) -> Path:
    """A PNG with the three figures (read fraction, mount times, bytes written per sandbox)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    modes = results.get("read_modes", {})
    if modes:
        labels, vals = [], []
        for mode, r in modes.items():
            short = {"file-backed+directio": "directio", "file-backed": "buffered"}.get(mode, mode)
            labels += [f"{short}\nstart", f"{short}\n+ import json"]
            vals += [r["start_fraction"] * 100, r["start_and_json_fraction"] * 100]
        ax[0].bar(labels, vals, color=["#7aa6c2", "#2e6f95"] * len(modes))
        ax[0].tick_params(axis="x", labelsize=8)
        ax[0].axhline(10, color="red", ls="--", lw=1, label="target 10%")
        ax[0].set_ylabel("% of image bytes read (cold cache)")
        ax[0].set_title(f"{results['image']} ({results['image_bytes'] / 2**20:.0f} MiB)")
        ax[0].legend()
    m = results.get("mount", {})
    labels, vals = [], []
    for mode in ("file", "loop"):
        if "cold_ms" in m.get(mode, {}):
            labels += [f"{mode}\ncold", f"{mode}\nwarm"]
            vals += [m[mode]["cold_ms"], m[mode]["warm_ms"]]
    ax[1].bar(labels, vals, color="#5b8c5a")
    ax[1].set_ylabel("ms to mount one layer")
    ax[1].set_title("layer mount time")
    w = results.get("writes", {})
    names, kib = [], []
    if "shoal" in w:
        names.append("shoal")
        kib.append(max(w["shoal"]["bytes_written"], 1) / 1024)
    if "bytes_written" in w.get("docker", {}):
        names.append("docker run")
        kib.append(max(w["docker"]["bytes_written"], 1) / 1024)
    ax[2].bar(names, kib, color=["#2e6f95", "#c2553a"][: len(names)])
    ax[2].set_yscale("log")
    ax[2].set_ylabel("KiB written to disk per new sandbox")
    ax[2].set_title("disk bytes written per new sandbox")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


SCENARIO = Scenario("lazy", "fraction of an image read to start a sandbox; mount times; disk writes vs Docker", run,
                    LazyParams)
