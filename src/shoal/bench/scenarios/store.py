"""`store`: the layer store on a real distributed filesystem (MooseFS, master + 2 chunkservers in network
namespaces, FUSE-mounted; `shoal store dev-moosefs`), measured in one run:

- bytes fetched from the chunkservers (their veths' transmit counters) to start a sandbox and run
  `python3 -c 'import json'`, as a fraction of the image: file-backed EROFS (directio) and loop mounts,
  with and without the first-mount integrity check (which reads the whole layer once per node);
- cold start (create + that command, fresh node home, layer page caches dropped) from the MooseFS store,
  from a local store, and Docker pulling the same image from Debian's `docker-registry` on loopback and
  starting it (`docker pull` + `run` + `exec`);
- N node agents (own SHOAL_HOMEs, one MooseFS store) starting `per_node` sandboxes each from `images`
  different images (base + one small layer each) at once;
- the optional node-local layer cache: rounds of create / exec / close (the last close unmounts the
  layer) with the cache off and on — when it pays.

`shoal bench store [-p trials=3 -p per_node=100 …]`. Root; needs moosefs-master/-chunkserver/-client.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult, at_most
from shoal.bench.scenario import Scenario, param
from shoal.config import NodeConfig, Paths
from shoal.errors import ShoalError
from shoal.images import moosefs
from shoal.images.store import ImageConfig, ImageStore
from shoal.models import SandboxSpec

JSON_CMD = "python3 -c 'import json'"
MIB = 1 << 20


@dataclass(frozen=True)
class StoreParams:
    """How much work the store scenario does."""

    image: str = param("base:latest", help="the image measured (copied into the MooseFS and a local store)")
    trials: int = param(3, quick=1, help="cold starts per configuration (the median is reported)")
    nodes: int = param(3, help="node agents sharing the MooseFS store in the burst")
    per_node: int = param(100, quick=10, help="sandboxes each node agent starts in the burst")
    images: int = param(10, quick=5, help="different images the burst's sandboxes come from")
    cache_rounds: int = param(3, quick=2, help="create/exec/close rounds with the layer cache off and on")
    docker: bool = param(True, help="Docker pulling the image from a loopback registry (when the run has Docker)")


WARMUP = "bench-store-warmup:latest"


def _warmup_image(store: ImageStore) -> None:
    """A tiny image whose first sandbox makes a fresh node home ready (upper pool, helpers), so that the
    timed create measures the image, not the node's one-off setup."""
    if store.exists(WARMUP):
        return
    tree = Path(tempfile.mkdtemp(prefix="sbwarm-", dir="/var/tmp"))
    try:
        for d in ("etc", "tmp", "root"):
            (tree / d).mkdir()
        (tree / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
        (tree / "etc" / "group").write_text("root:x:0:\n")
        lay = store.add_layer_from_dir(tree, {"type": "bench", "desc": "store bench warm-up"})
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    store.put_image(WARMUP, [lay.digest])


def _drop_caches() -> None:
    """Cold everywhere: this host's page cache (the local store, the chunkservers' chunk files) and the
    layer files' pages on the FUSE mount."""
    from shoal.bench.diskstats import drop_caches

    drop_caches()


def _drop_file_cache(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@contextlib.asynccontextmanager
async def _node(store_root: Path, *, mode: str = "auto", verify: bool = True, cache_mb: int = 0,
                home: Path | None = None) -> Any:
    """A node agent on a private SHOAL_HOME (kept when `home` is given) over `store_root`."""
    from shoal.images.cache import LayerCache
    from shoal.node.node import Node
    from shoal.node.teardown import purge_home, teardown_home

    own = home is None
    home = home or Path(tempfile.mkdtemp(prefix="sbs-", dir="/tmp"))
    paths = Paths(home=home, store=store_root)
    node = Node(NodeConfig(paths=paths, memory_overcommit=1000.0))
    node.layer_mounts.mode = mode
    node.layer_mounts.verifier.enabled = verify
    node.layer_mounts.cache = LayerCache(home / "layer-cache", limit_bytes=cache_mb * MIB)
    try:
        await node.start()
        _warmup_image(node.store)
        info = await node.create(_spec(WARMUP))
        await node.close(info.id)
        yield node
    finally:
        with contextlib.suppress(Exception):
            await node.close_all()
        with contextlib.suppress(Exception):
            await node.stop()
        if own:
            with contextlib.suppress(Exception):
                await teardown_home(paths, close_sandboxes=True)
            with contextlib.suppress(Exception):
                purge_home(paths)


def _spec(image: str) -> SandboxSpec:
    return SandboxSpec(image=image, memory_mb=256, cpus=1.0)


async def cold_start(store: ImageStore, image: str, cluster: moosefs.MooseFsCluster | None, *,
                     mode: str = "auto", verify: bool = True) -> dict[str, Any]:
    """One cold start: a fresh node home, the layers' page cache dropped; create + JSON_CMD."""
    img = store.resolve(image)
    async with _node(store.root, mode=mode, verify=verify) as node:
        for lay in img.layers:
            _drop_file_cache(lay.path)
        await asyncio.to_thread(_drop_caches)
        tx0 = moosefs.chunkserver_tx_bytes(cluster) if cluster else 0
        t0 = time.perf_counter()
        info = await node.create(_spec(image))
        t1 = time.perf_counter()
        r = await node.exec(info.id, JSON_CMD)
        t2 = time.perf_counter()
        tx1 = moosefs.chunkserver_tx_bytes(cluster) if cluster else 0
        from shoal.images.mounts import erofs_mode

        out = {"create_ms": (t1 - t0) * 1000, "total_ms": (t2 - t0) * 1000, "exit_code": r.exit_code,
               "fetched_bytes": tx1 - tx0, "image_bytes": img.size, "mounted": erofs_mode(),
               "hashed_bytes": node.layer_mounts.verifier.hashed_bytes}
        await node.close(info.id)
    out["fetched_fraction"] = out["fetched_bytes"] / max(1, img.size)
    return out


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


# ---- Docker: the same image pulled from a registry on loopback ---------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _registry(workdir: Path) -> Any:
    """Debian's docker-registry on a free loopback port; yields 'host:port'."""
    exe = shutil.which("docker-registry")
    if not exe:
        raise RuntimeError("docker-registry is not installed (apt-get install docker-registry)")
    port = _free_port()
    cfg = workdir / "registry.yml"
    cfg.write_text(f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n"
                   f"    rootdirectory: {workdir / 'data'}\nhttp:\n  addr: 127.0.0.1:{port}\n")
    with open(workdir / "registry.log", "wb") as log:
        proc = subprocess.Popen([exe, "serve", str(cfg)], stdout=subprocess.DEVNULL, stderr=log)
    try:
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            raise RuntimeError(f"docker-registry did not start: {(workdir / 'registry.log').read_text()[-300:]}")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _docker(ctx: BenchContext, *args: str, timeout: float = 900) -> str:
    assert ctx.docker is not None
    exe = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else "docker"
    r = subprocess.run([exe, "-H", f"unix://{ctx.docker.sock}", *args], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)}: {r.stderr.strip()[-400:]}")
    return r.stdout


async def docker_cold_starts(ctx: BenchContext, trials: int) -> dict[str, Any]:
    """`docker pull` from the loopback registry + `docker run -d` + `docker exec python3 …`, from an engine
    that does not have the image; the engine's own image tag is restored afterwards."""
    assert ctx.docker is not None
    src = ctx.docker.image
    work = Path(tempfile.mkdtemp(prefix="sbreg-", dir="/var/tmp"))
    rows = []
    try:
        with _registry(work) as reg:
            ref = f"{reg}/shoal-bench/base:1"
            await asyncio.to_thread(_docker, ctx, "tag", src, ref)
            t0 = time.perf_counter()
            await asyncio.to_thread(_docker, ctx, "push", ref)
            push_s = time.perf_counter() - t0
            await asyncio.to_thread(_docker, ctx, "rmi", src, ref)
            for i in range(trials):
                t0 = time.perf_counter()
                await asyncio.to_thread(_docker, ctx, "pull", ref)
                t1 = time.perf_counter()
                ctx.docker.image = ref
                cid = await ctx.docker.create_start(["sleep", "infinity"], memory_mb=256)
                code, _ = await ctx.docker.exec(cid, ["python3", "-c", "import json"])
                t2 = time.perf_counter()
                await ctx.docker.remove(cid)
                rows.append({"pull_ms": (t1 - t0) * 1000, "total_ms": (t2 - t0) * 1000, "exit_code": code})
                if i < trials - 1:
                    await asyncio.to_thread(_docker, ctx, "rmi", ref)
            await asyncio.to_thread(_docker, ctx, "tag", ref, src)
            ctx.docker.image = src
            with contextlib.suppress(Exception):
                await asyncio.to_thread(_docker, ctx, "rmi", ref)
        return {"push_s": push_s, "trials": rows, "total_ms": _median(rows, "total_ms"),
                "pull_ms": _median(rows, "pull_ms")}
    finally:
        ctx.docker.image = src
        shutil.rmtree(work, ignore_errors=True)


# ---- N node agents on one shared store ---------------------------------------------------------------
def _make_images(store: ImageStore, base: str, n: int) -> list[str]:
    """`n` images: the base's layers + one small layer of their own each (as a workspace would add)."""
    b = store.resolve(base)
    out = []
    for i in range(n):
        tree = Path(tempfile.mkdtemp(prefix="sbimg-", dir="/var/tmp"))
        try:
            (tree / "etc").mkdir()
            (tree / "etc" / "bench-image").write_text(f"image {i}\n" + "x" * 4096)
            lay = store.add_layer_from_dir(tree, {"type": "bench", "desc": f"store bench image {i}"})
        finally:
            shutil.rmtree(tree, ignore_errors=True)
        ref = f"bench-store-{i}:latest"
        store.put_image(ref, [x.digest for x in b.layers] + [lay.digest], ImageConfig.from_dict(
            {"env": b.config.env, "workdir": b.config.workdir, "user": b.config.user}))
        out.append(ref)
    return out


async def burst(store: ImageStore, cluster: moosefs.MooseFsCluster, images: list[str], nodes: int,
                per_node: int, progress: Any = None) -> dict[str, Any]:
    """`nodes` node agents start `per_node` sandboxes each, spread over `images`, all at once."""
    async with contextlib.AsyncExitStack() as stack:
        ns = [await stack.enter_async_context(_node(store.root)) for _ in range(nodes)]
        for ref in images:
            for lay in store.resolve(ref).layers:
                _drop_file_cache(lay.path)
        await asyncio.to_thread(_drop_caches)
        tx0 = moosefs.chunkserver_tx_bytes(cluster)
        t0 = time.perf_counter()

        async def one_node(node: Any) -> list[Any]:
            k = len(images)
            counts = [per_node // k + (1 if i < per_node % k else 0) for i in range(k)]
            parts = await asyncio.gather(*(node.create_many(_spec(images[i]), counts[i], on_done=progress)
                                           for i in range(k) if counts[i]))
            return [x for p in parts for x in p]

        results = await asyncio.gather(*(one_node(n) for n in ns))
        wall = time.perf_counter() - t0
        tx1 = moosefs.chunkserver_tx_bytes(cluster)
        ok = sum(1 for r in results for x in r if not isinstance(x, ShoalError))
        errs = [str(x) for r in results for x in r if isinstance(x, ShoalError)]
        # every sandbox answers a command
        probe_ok = 0
        for node, r in zip(ns, results, strict=True):
            infos = [x for x in r if not isinstance(x, ShoalError)][:3]
            for info in infos:
                if (await node.exec(info.id, "cat /etc/bench-image")).exit_code == 0:
                    probe_ok += 1
        hashed = sum(n.layer_mounts.verifier.hashed_bytes for n in ns)
        return {"nodes": nodes, "per_node": per_node, "images": len(images), "ok": ok, "errors": errs[:3],
                "n_errors": len(errs), "wall_s": wall, "rate_per_s": ok / wall if wall else 0.0,
                "fetched_bytes": tx1 - tx0, "verified_bytes": hashed, "spot_checks_ok": probe_ok}


# ---- the layer cache: when does it pay? ----------------------------------------------------------------
async def cache_rounds(store: ImageStore, image: str, cluster: moosefs.MooseFsCluster, rounds: int,
                       cache_mb: int) -> list[dict[str, Any]]:
    """`rounds` of create + JSON_CMD + close on one node (the close unmounts the layer: its only user)."""
    home = Path(tempfile.mkdtemp(prefix="sbc-", dir="/tmp"))
    out = []
    try:
        img = store.resolve(image)
        async with _node(store.root, cache_mb=cache_mb, home=home) as node:
            for _ in range(rounds):
                for lay in img.layers:
                    _drop_file_cache(lay.path)
                await asyncio.to_thread(_drop_caches)
                tx0 = moosefs.chunkserver_tx_bytes(cluster)
                t0 = time.perf_counter()
                info = await node.create(_spec(image))
                await node.exec(info.id, JSON_CMD)
                t1 = time.perf_counter()
                await node.close(info.id)
                out.append({"total_ms": (t1 - t0) * 1000,
                            "fetched_bytes": moosefs.chunkserver_tx_bytes(cluster) - tx0})
    finally:
        from shoal.node.teardown import purge_home, teardown_home

        paths = Paths(home=home, store=store.root)
        with contextlib.suppress(Exception):
            await teardown_home(paths, close_sandboxes=True)
        with contextlib.suppress(Exception):
            purge_home(paths)
    return out


async def run(ctx: BenchContext, p: StoreParams) -> ScenarioResult:
    """The store scenario (see the module docstring)."""
    res = ScenarioResult("store", docker=ctx.docker_status if p.docker else "skipped: -p docker=false")
    moosefs.check_installed()
    name = f"bench{os.getpid() % 100000}"
    local_root = Path(tempfile.mkdtemp(prefix="sbst-", dir="/var/tmp")) / "store"
    ctx.log(f"starting MooseFS '{name}' (master + 2 chunkservers in network namespaces)")
    cluster = await asyncio.to_thread(moosefs.up, name)
    try:
        mstore = ImageStore(Path(cluster.mountpoint) / "store")
        lstore = ImageStore(local_root)
        t0 = time.perf_counter()
        await asyncio.to_thread(mstore.copy_image_from, ctx.node.store, p.image, "bench-base:latest", link=False)
        publish_s = time.perf_counter() - t0
        await asyncio.to_thread(lstore.copy_image_from, ctx.node.store, p.image, "bench-base:latest", link=False)
        size = mstore.resolve("bench-base:latest").size
        res.data.update({"image": p.image, "image_bytes": size, "publish_to_moosefs_s": round(publish_s, 2)})

        configs = [("moosefs file-backed, no check", mstore, cluster, "auto", False),
                   ("moosefs loop, no check", mstore, cluster, "loop", False),
                   ("moosefs file-backed + first-mount check", mstore, cluster, "auto", True),
                   ("local file-backed, no check", lstore, None, "auto", False),
                   ("local file-backed + first-mount check", lstore, None, "auto", True)]
        cold: dict[str, Any] = {}
        with ctx.task("cold starts", len(configs) * p.trials) as adv:
            for label, st, cl, mode, verify in configs:
                rows = []
                for _ in range(p.trials):
                    rows.append(await cold_start(st, "bench-base:latest", cl, mode=mode, verify=verify))
                    adv()
                cold[label] = {"trials": rows, "total_ms": _median(rows, "total_ms"),
                               "fetched_fraction": _median(rows, "fetched_fraction"),
                               "fetched_bytes": _median(rows, "fetched_bytes"), "mounted": rows[-1]["mounted"]}
        res.data["cold"] = cold
        dk: dict[str, Any] = {}
        if p.docker and ctx.docker is not None:
            try:
                dk = await docker_cold_starts(ctx, p.trials)
            except Exception as e:
                res.notes.append(f"Docker registry comparison failed: {e}")
        res.data["docker"] = dk

        f_file = cold["moosefs file-backed, no check"]["fetched_fraction"] * 100
        f_loop = cold["moosefs loop, no check"]["fetched_fraction"] * 100
        f_chk = cold["moosefs file-backed + first-mount check"]["fetched_fraction"] * 100
        res.add(Metric("bytes fetched from chunkservers to start + import json, file-backed", round(f_file, 2),
                       None, "% of image", target="≤ 10%", met=at_most(f_file, 10.0),
                       note=f"{cold['moosefs file-backed, no check']['fetched_bytes'] / MIB:.1f} MiB of "
                            f"{size / MIB:.0f} MiB; mounted {cold['moosefs file-backed, no check']['mounted']}"),
                Metric("… through a loop device", round(f_loop, 2), None, "% of image", target="≤ 10%",
                       met=at_most(f_loop, 10.0)),
                Metric("… with the first-mount integrity check (once per node)", round(f_chk, 2), None,
                       "% of image", note="the check hashes the whole layer; later sandboxes on the node pay 0"))
        mfs_ms = cold["moosefs file-backed + first-mount check"]["total_ms"]
        res.add(Metric("cold start + import json, MooseFS store (default: checked)", round(mfs_ms, 1),
                       round(dk["total_ms"], 1) if dk else None, "ms",
                       note="Docker: pull from a loopback registry + run + exec"),
                Metric("… MooseFS, no check", round(cold["moosefs file-backed, no check"]["total_ms"], 1),
                       round(dk["total_ms"], 1) if dk else None, "ms"),
                Metric("… MooseFS loop, no check", round(cold["moosefs loop, no check"]["total_ms"], 1), None, "ms"),
                Metric("… local store (default: checked)",
                       round(cold["local file-backed + first-mount check"]["total_ms"], 1),
                       round(dk["total_ms"], 1) if dk else None, "ms"),
                Metric("… local store, no check", round(cold["local file-backed, no check"]["total_ms"], 1), None,
                       "ms"))

        images = await asyncio.to_thread(_make_images, mstore, "bench-base:latest", p.images)
        total = p.nodes * p.per_node
        with ctx.task(f"{p.nodes} nodes × {p.per_node} sandboxes from {p.images} images", total) as adv:
            b = await burst(mstore, cluster, images, p.nodes, p.per_node, progress=lambda _r: adv())
        res.data["burst"] = b
        res.add(Metric(f"{p.nodes} node agents × {p.per_node} sandboxes ({p.images} images), all ready",
                       round(b["wall_s"], 2), None, "s", note=f"{b['ok']}/{total} ok, {b['rate_per_s']:.0f}/s"),
                Metric("… bytes fetched from the chunkservers", round(b["fetched_bytes"] / MIB, 1), None, "MiB",
                       note=f"of which the first-mount checks hashed {b['verified_bytes'] / MIB:.0f} MiB "
                            f"({p.nodes} nodes × the image)"))
        if b["n_errors"]:
            res.notes.append(f"burst errors ({b['n_errors']}): {b['errors']}")

        off = await cache_rounds(mstore, "bench-base:latest", cluster, p.cache_rounds, 0)
        on = await cache_rounds(mstore, "bench-base:latest", cluster, p.cache_rounds, 4096)
        res.data["cache"] = {"off": off, "on": on}
        res.add(Metric("layer cache off: first / later round (create+json+close, layer remounted)",
                       round(off[0]["total_ms"], 1), None, "ms",
                       note=f"later: {statistics.median(r['total_ms'] for r in off[1:]):.0f} ms, "
                            f"{statistics.median(r['fetched_bytes'] for r in off[1:]) / MIB:.1f} MiB fetched"
                       if len(off) > 1 else ""),
                Metric("layer cache on: first / later round", round(on[0]["total_ms"], 1), None, "ms",
                       note=f"later: {statistics.median(r['total_ms'] for r in on[1:]):.0f} ms, "
                            f"{statistics.median(r['fetched_bytes'] for r in on[1:]) / MIB:.1f} MiB fetched"
                       if len(on) > 1 else ""))
        if ctx.plot_dir:
            res.figures.append(_plot(res.data, ctx.figure_path("store.png")))
    finally:
        await asyncio.to_thread(moosefs.down, name)
        shutil.rmtree(local_root.parent, ignore_errors=True)
    return res


def _plot(data: dict[str, Any], path: Path | None) -> str:
    from shoal.bench.plots import _plt

    plt = _plt()
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8), dpi=100)
    cold = data["cold"]
    labels = ["MooseFS\nchecked", "MooseFS", "MooseFS\nloop", "local\nchecked", "local"]
    keys = ["moosefs file-backed + first-mount check", "moosefs file-backed, no check", "moosefs loop, no check",
            "local file-backed + first-mount check", "local file-backed, no check"]
    vals = [cold[k]["total_ms"] for k in keys]
    if data.get("docker"):
        labels.append("Docker\npull+run")
        vals.append(data["docker"]["total_ms"])
    ax[0].bar(labels, vals, color=["#2e6f95"] * 5 + ["#c2553a"] * (len(vals) - 5))
    ax[0].set_yscale("log")
    ax[0].set_ylabel("ms: create + python3 -c 'import json'")
    ax[0].set_title("cold start")
    fkeys = {"file-backed": "moosefs file-backed, no check", "loop": "moosefs loop, no check",
             "file-backed\n+ check": "moosefs file-backed + first-mount check"}
    ax[1].bar(list(fkeys), [cold[k]["fetched_fraction"] * 100 for k in fkeys.values()], color="#5b8c5a")
    ax[1].axhline(10, color="#999", ls="--", lw=1)
    ax[1].set_ylabel("% of the image fetched from chunkservers")
    ax[1].set_title("bytes fetched over the network")
    fig.tight_layout()
    assert path is not None
    fig.savefig(path)
    plt.close(fig)
    return str(path)


SCENARIO = Scenario("store", "shared layer store (MooseFS): bytes fetched, cold start vs Docker pull, N nodes, cache",
                    run, StoreParams, default_run=False)
