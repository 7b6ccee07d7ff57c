"""`store`: the chunked, verified layer store on a real distributed filesystem (MooseFS, master + 2
chunkservers in network namespaces, FUSE-mounted; `shoal store dev-moosefs`), beside Docker, in one run:

- cold start (a node that never saw the image; every chunk checked as read — the default): bytes fetched
  from the chunkservers (their veths' transmit counters) to start a sandbox and run
  `python3 -c 'import json'`, as a fraction of the image; without and with the image's start record
  (prefetch); next to the earlier whole-file mount (unchecked, and with its whole-layer check) and Docker
  pulling the same image from a loopback registry;
- warm start (the node's chunk cache has the chunks, the layer is mounted afresh): the reader against the
  earlier direct whole-file mount, in ABBA rounds;
- a family of images built FROM the base, each adding its own ~50 MiB: bytes stored and fetched (one
  sandbox each) against the sum of their layers, and against Docker pushing/pulling the same images;
- a DSec-shaped burst: many distinct images × a few sandboxes each over N node agents sharing the store:
  time until all are ready and bytes fetched, against Docker pulling and running the same;
- a corrupt chunk: time from the read to the node's image_corrupt event, and what was served of it (nothing).

`shoal bench store [-p images=200 -p family=20 …]`. Root; needs moosefs-master/-chunkserver/-client.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
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
from shoal.errors import ImageCorrupt, ShoalError
from shoal.images import moosefs
from shoal.images.store import ImageConfig, ImageStore
from shoal.models import SandboxSpec

JSON_CMD = "python3 -c 'import json'"
MIB = 1 << 20


@dataclass(frozen=True)
class StoreParams:
    """How much work the store scenario does."""

    image: str = param("base:latest", help="the base image (copied into the MooseFS store)")
    trials: int = param(3, quick=1, help="cold starts per configuration (the median is reported)")
    warm_rounds: int = param(8, quick=4, help="warm starts, alternating reader / direct mount (ABBA)")
    family: int = param(20, quick=3, help="images built FROM the base, each adding its own layer")
    family_mib: int = param(50, quick=8, help="MiB each family image adds")
    nodes: int = param(3, help="node agents sharing the MooseFS store in the burst")
    images: int = param(200, quick=12, help="distinct images in the DSec-shaped burst")
    per_image: int = param(3, help="sandboxes per image in the burst (spread over the nodes)")
    docker: bool = param(True, help="Docker pulling the same images from a loopback registry")
    docker_images: int = param(200, quick=12, help="burst images Docker pulls and runs (fewer if it cannot)")
    docker_budget_s: float = param(1800.0, quick=600.0, help="seconds Docker gets for the burst")


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
    """Cold everywhere on this host: page cache (chunk objects, the chunk cache's files, layer files)."""
    from shoal.bench.diskstats import drop_caches

    drop_caches()


@contextlib.asynccontextmanager
async def _node(store_root: Path, *, source: str = "chunks", home: Path | None = None,
                prefetch: bool = True) -> Any:
    """A node agent on a private SHOAL_HOME (kept when `home` is given) over `store_root`."""
    from shoal.node.node import Node
    from shoal.node.teardown import purge_home, stop_readers, teardown_home

    own = home is None
    home = home or Path(tempfile.mkdtemp(prefix="sbs-", dir="/tmp"))
    paths = Paths(home=home, store=store_root)
    node = Node(NodeConfig(paths=paths, memory_overcommit=1000.0, min_free_memory_mb=0))
    node.layer_mounts.source = source
    node.layer_mounts.prefetch_enabled = prefetch
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
                stop_readers(paths)
            with contextlib.suppress(Exception):
                purge_home(paths)


def _spec(image: str) -> SandboxSpec:
    return SandboxSpec(image=image, memory_mb=256, cpus=1.0)


def _reader_stats(node: Any) -> dict[str, Any]:
    with contextlib.suppress(Exception):
        return dict(node.layer_mounts.daemon.stats())
    return {}


def _hash_whole(store: ImageStore, digest: str) -> None:
    """The earlier default's check: the whole layer file hashed before its first mount on a node."""
    from shoal.fsutil import sha256_file

    sha256_file(store.layer_path(digest))


async def cold_start(store: ImageStore, image: str, cluster: moosefs.MooseFsCluster | None, *,
                     source: str = "chunks", whole_check: bool = False, record: bool = False) -> dict[str, Any]:
    """One cold start: a fresh node home, page caches dropped; create + JSON_CMD. `record`: keep the image's
    start records (a later create prefetches them); else they are removed first (the image's first start)."""
    from shoal.images import prefetch

    img = store.resolve(image)
    if not record:
        for lay in img.layers:
            prefetch.remove(store.root, lay.hex)
    async with _node(store.root, source=source) as node:
        await asyncio.to_thread(_drop_caches)
        tx0 = moosefs.chunkserver_tx_bytes(cluster) if cluster else 0
        t0 = time.perf_counter()
        if whole_check:
            for lay in img.layers:
                await asyncio.to_thread(_hash_whole, store, lay.digest)
        info = await node.create(_spec(image))
        t1 = time.perf_counter()
        r = await node.exec(info.id, JSON_CMD)
        t2 = time.perf_counter()
        tx1 = moosefs.chunkserver_tx_bytes(cluster) if cluster else 0
        st = _reader_stats(node)
        from shoal.images.mounts import erofs_mode

        out = {"create_ms": (t1 - t0) * 1000, "total_ms": (t2 - t0) * 1000, "exit_code": r.exit_code,
               "fetched_bytes": tx1 - tx0, "image_bytes": img.size, "mounted": erofs_mode(),
               "reader_fetched_bytes": st.get("fetched_bytes", 0), "reader_wire_bytes": st.get("fetched_wire_bytes", 0),
               "reader_chunks": st.get("fetched_chunks", 0), "prefetched_chunks": st.get("prefetched_chunks", 0)}
        await node.close(info.id)
    out["fetched_fraction"] = out["fetched_bytes"] / max(1, img.size)
    return out


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in rows))


# ---- warm starts: the reader against the earlier direct mount, ABBA -------------------------------------
async def warm_rounds(chunked: ImageStore, whole: ImageStore, image: str, rounds: int) -> dict[str, Any]:
    """`rounds` create + JSON_CMD + close on one node per source, alternating A B B A …: A = the node's reader
    (its chunk cache warm), B = the layer's whole file mounted straight from the store (as before). The
    close unmounts the layer (its only user), so each round mounts afresh; page caches are dropped."""
    out: dict[str, list[float]] = {"reader": [], "direct": []}
    async with _node(chunked.root) as a, _node(whole.root, source="whole-file") as b:
        for node in (a, b):  # the first round of each fills caches: not counted
            info = await node.create(_spec(image))
            await node.exec(info.id, JSON_CMD)
            await node.close(info.id)
        order = ["reader", "direct", "direct", "reader"]
        for i in range(rounds):
            which = order[i % 4]
            node = a if which == "reader" else b
            await asyncio.to_thread(_drop_caches)
            t0 = time.perf_counter()
            info = await node.create(_spec(image))
            await node.exec(info.id, JSON_CMD)
            out[which].append((time.perf_counter() - t0) * 1000)
            await node.close(info.id)
        fetched = _reader_stats(a).get("fetched_bytes", 0)
    return {"reader_ms": out["reader"], "direct_ms": out["direct"], "reader_fetched_after_first": fetched}


# ---- Docker: a loopback registry ---------------------------------------------------------------------
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


def _docker(ctx: BenchContext, *args: str, timeout: float = 900, cwd: Path | None = None) -> str:
    assert ctx.docker is not None
    exe = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else "docker"
    env = dict(os.environ, DOCKER_BUILDKIT="0")
    r = subprocess.run([exe, "-H", f"unix://{ctx.docker.sock}", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=cwd, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])}: {r.stderr.strip()[-400:]}")
    return r.stdout


def _registry_blob_bytes(workdir: Path) -> int:
    """Bytes of every blob the registry stores (compressed layers and configs)."""
    total = 0
    for p in (workdir / "data").rglob("data"):
        if p.is_file() and "blobs" in p.parts:
            total += p.stat().st_size
    return total


def _pulled_bytes(reg: str, refs: list[str]) -> int:
    """Bytes `docker pull` of `refs` downloads into an engine that has none of their layers: each distinct
    layer blob once (sizes from the registry's manifests)."""
    seen: dict[str, int] = {}
    for ref in refs:
        repo, tag = ref.split("/", 1)[1].rsplit(":", 1)
        req = urllib.request.Request(f"http://{reg}/v2/{repo}/manifests/{tag}", headers={
            "Accept": "application/vnd.docker.distribution.manifest.v2+json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            m = json.loads(r.read())
        for lay in [*m.get("layers", []), m.get("config", {})]:
            if lay:
                seen[lay["digest"]] = int(lay["size"])
    return sum(seen.values())


async def docker_cold_starts(ctx: BenchContext, reg: str, trials: int) -> dict[str, Any]:
    """`docker pull` from the loopback registry + `docker run -d` + `docker exec python3 …`, from an engine
    that does not have the image."""
    assert ctx.docker is not None
    src = ctx.docker.image
    ref = f"{reg}/shoal-bench/base:1"
    await asyncio.to_thread(_docker, ctx, "tag", src, ref)
    await asyncio.to_thread(_docker, ctx, "push", ref)
    rows = []
    try:
        for _ in range(trials):
            await asyncio.to_thread(_docker, ctx, "rmi", "-f", ref, src)
            await asyncio.to_thread(_drop_caches)
            t0 = time.perf_counter()
            await asyncio.to_thread(_docker, ctx, "pull", ref)
            t1 = time.perf_counter()
            cid = await ctx.docker.create_start(["sleep", "infinity"], memory_mb=256, image=ref)
            code, _ = await ctx.docker.exec(cid, ["python3", "-c", "import json"])
            t2 = time.perf_counter()
            await ctx.docker.remove(cid)
            rows.append({"pull_ms": (t1 - t0) * 1000, "total_ms": (t2 - t0) * 1000, "exit_code": code})
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(_docker, ctx, "tag", ref, src)
        ctx.docker.image = src
    return {"trials": rows, "total_ms": _median(rows, "total_ms"), "pull_ms": _median(rows, "pull_ms"),
            "pulled_bytes": _pulled_bytes(reg, [ref])}


# ---- images built FROM the base ------------------------------------------------------------------------
def _own_tree(i: int, mib: int, root: Path) -> Path:
    """An image's own files: `mib` MiB of source-like data (16 letters: compresses about 2x), unique to it."""
    tree = root / f"img{i}"
    d = tree / "opt" / f"app{i}"
    d.mkdir(parents=True)
    rnd = random.Random(i * 7919 + 17)
    table = bytes.maketrans(bytes(range(256)), (b"etaoinshrdlu \n.(" * 16))
    for k in range(max(1, mib * 4)):  # 256 KiB files
        (d / f"mod{k:04d}.py").write_bytes(rnd.randbytes(256 << 10).translate(table))
    (d / "main.py").write_text(f"print('image {i}')\n")
    return tree


def make_family(store: ImageStore, base: str, n: int, mib: int, prefix: str,
                progress: Any = None) -> tuple[list[str], list[Path], dict[str, int]]:
    """`n` images: the base's layers + one layer of `mib` MiB of their own each. Returns the refs, the trees
    (kept for Docker, under /var/tmp) and what storing them took."""
    b = store.resolve(base)
    refs, trees = [], []
    work = Path(tempfile.mkdtemp(prefix="sbfam-", dir="/var/tmp"))
    stored = raw = new_chunks = reused = 0
    for i in range(n):
        tree = _own_tree(i, mib, work) if mib else _small_tree(i, work)
        lay = store.add_layer_from_dir(tree, {"type": "bench", "desc": f"{prefix} {i}"})
        stored += store.last_write.stored_bytes + len(store.chunks.table_path(lay.hex).read_bytes())
        new_chunks += store.last_write.new_chunks
        reused += store.last_write.reused_bytes
        raw += lay.size
        ref = f"{prefix}-{i}:latest"
        store.put_image(ref, [x.digest for x in b.layers] + [lay.digest], ImageConfig.from_dict(
            {"env": b.config.env, "workdir": b.config.workdir, "user": b.config.user}))
        refs.append(ref)
        trees.append(tree)
        if progress:
            progress()
    return refs, trees, {"stored_bytes": stored, "layer_bytes": raw, "new_chunks": new_chunks,
                         "reused_bytes": reused, "work": str(work)}  # type: ignore[dict-item]


def _small_tree(i: int, root: Path) -> Path:
    tree = root / f"img{i}"
    d = tree / "opt" / f"task{i}"
    d.mkdir(parents=True)
    rnd = random.Random(i)
    (d / "data.bin").write_bytes(rnd.randbytes(256 << 10))
    (d / "main.py").write_text(f"print('task {i}')\n")
    return tree


def _docker_build(ctx: BenchContext, base_ref: str, tree: Path, tag: str) -> None:
    (tree / "Dockerfile").write_text(f"FROM {base_ref}\nCOPY opt /opt\n")
    try:
        _docker(ctx, "build", "-q", "-t", tag, str(tree), timeout=1800)
    finally:
        (tree / "Dockerfile").unlink(missing_ok=True)


async def family_starts(store: ImageStore, cluster: moosefs.MooseFsCluster, refs: list[str]) -> dict[str, Any]:
    """One sandbox of each family image on one node (fresh home): bytes fetched to start each and read
    its own entry file."""
    async with _node(store.root) as node:
        await asyncio.to_thread(_drop_caches)
        tx0 = moosefs.chunkserver_tx_bytes(cluster)
        t0 = time.perf_counter()
        for i, ref in enumerate(refs):
            info = await node.create(_spec(ref))
            r = await node.exec(info.id, f"python3 /opt/app{i}/main.py")
            assert r.exit_code == 0, r
            await node.close(info.id)
        wall = time.perf_counter() - t0
        fetched = moosefs.chunkserver_tx_bytes(cluster) - tx0
        st = _reader_stats(node)
    return {"fetched_bytes": fetched, "wall_s": wall, "reader_wire_bytes": st.get("fetched_wire_bytes", 0)}


async def docker_family(ctx: BenchContext, reg: str, base_ref: str, trees: list[Path], prefix: str,
                        run_cmd: list[str] | None = None) -> dict[str, Any]:
    """Build the same images in Docker (FROM the base), push them, drop them, then pull each and run it."""
    refs = []
    for i, tree in enumerate(trees):
        ref = f"{reg}/shoal-bench/{prefix}{i}:1"
        await asyncio.to_thread(_docker_build, ctx, base_ref, tree, ref)
        await asyncio.to_thread(_docker, ctx, "push", ref)
        refs.append(ref)
    await asyncio.to_thread(_docker, ctx, "rmi", "-f", *refs)
    await asyncio.to_thread(_docker, ctx, "rmi", "-f", base_ref)
    pulled = _pulled_bytes(reg, refs)
    t0 = time.perf_counter()
    for i, ref in enumerate(refs):
        await asyncio.to_thread(_docker, ctx, "pull", ref)
        cid = await ctx.docker.create_start(["sleep", "infinity"], memory_mb=256, image=ref)  # type: ignore[union-attr]
        code, _ = await ctx.docker.exec(cid, run_cmd or ["python3", f"/opt/app{i}/main.py"])  # type: ignore[union-attr]
        await ctx.docker.remove(cid)  # type: ignore[union-attr]
        if code != 0:
            raise RuntimeError(f"docker: image {ref} ran with exit code {code}")
    wall = time.perf_counter() - t0
    with contextlib.suppress(Exception):
        await asyncio.to_thread(_docker, ctx, "rmi", "-f", *refs)
    return {"pulled_bytes": pulled, "wall_s": wall, "images": len(refs)}


# ---- the DSec-shaped burst ------------------------------------------------------------------------------
async def burst(store: ImageStore, cluster: moosefs.MooseFsCluster, refs: list[str], nodes: int, per_image: int,
                progress: Any = None) -> dict[str, Any]:
    """`nodes` node agents; each image gets `per_image` sandboxes, sandbox k on node k % nodes; all at once."""
    async with contextlib.AsyncExitStack() as stack:
        ns = [await stack.enter_async_context(_node(store.root)) for _ in range(nodes)]
        await asyncio.to_thread(_drop_caches)
        tx0 = moosefs.chunkserver_tx_bytes(cluster)
        t0 = time.perf_counter()
        sem = asyncio.Semaphore(32 * nodes)

        async def one(node: Any, ref: str) -> Any:
            async with sem:
                try:
                    return await node.create(_spec(ref))
                except ShoalError as e:
                    return e
                finally:
                    if progress:
                        progress()

        jobs = [one(ns[k % nodes], ref) for ref in refs for k in range(per_image)]
        results = await asyncio.gather(*jobs)
        wall = time.perf_counter() - t0
        fetched = moosefs.chunkserver_tx_bytes(cluster) - tx0
        ok = [r for r in results if not isinstance(r, ShoalError)]
        errs = [str(r) for r in results if isinstance(r, ShoalError)]
        wire = sum(_reader_stats(n).get("fetched_wire_bytes", 0) for n in ns)
        prefetched = sum(_reader_stats(n).get("prefetched_chunks", 0) for n in ns)
    return {"nodes": nodes, "images": len(refs), "per_image": per_image, "ok": len(ok), "n_errors": len(errs),
            "errors": errs[:3], "wall_s": wall, "fetched_bytes": fetched, "reader_wire_bytes": wire,
            "prefetched_chunks": prefetched}


async def docker_burst(ctx: BenchContext, reg: str, base_ref: str, trees: list[Path], per_image: int,
                       budget_s: float) -> dict[str, Any]:
    """Docker pulls each image and runs `per_image` containers of it, all at once (one engine: one node);
    images are built and pushed first (not timed). Stops starting new pulls when the budget runs out."""
    assert ctx.docker is not None
    # the family run dropped the base from the engine (its pulls had to fetch it): bring it back to build on
    await asyncio.to_thread(_docker, ctx, "pull", f"{reg}/shoal-bench/base:1")
    await asyncio.to_thread(_docker, ctx, "tag", f"{reg}/shoal-bench/base:1", base_ref)
    refs = []
    for i, tree in enumerate(trees):
        ref = f"{reg}/shoal-bench/burst{i}:1"
        await asyncio.to_thread(_docker_build, ctx, base_ref, tree, ref)
        await asyncio.to_thread(_docker, ctx, "push", ref)
        refs.append(ref)
    await asyncio.to_thread(_docker, ctx, "rmi", "-f", *refs)
    await asyncio.to_thread(_docker, ctx, "rmi", "-f", base_ref)
    await asyncio.to_thread(_drop_caches)
    sem = asyncio.Semaphore(32)
    cids: list[str] = []
    done_images = 0
    t0 = time.perf_counter()

    async def image(ref: str) -> None:
        nonlocal done_images
        if time.perf_counter() - t0 > budget_s:
            return
        async with sem:
            await asyncio.to_thread(_docker, ctx, "pull", ref)
        cs = await asyncio.gather(*(ctx.docker.create_start(["sleep", "infinity"], memory_mb=256,  # type: ignore[union-attr]
                                                            image=ref) for _ in range(per_image)))
        cids.extend(cs)
        done_images += 1

    results = await asyncio.gather(*(image(r) for r in refs), return_exceptions=True)
    wall = time.perf_counter() - t0
    errs = [str(r) for r in results if isinstance(r, BaseException)]
    pulled = _pulled_bytes(reg, refs[:done_images]) if done_images else 0
    await ctx.docker.remove_many(cids)
    with contextlib.suppress(Exception):
        await asyncio.to_thread(_docker, ctx, "rmi", "-f", *refs)
    return {"images": done_images, "of": len(refs), "containers": len(cids), "wall_s": wall, "pulled_bytes": pulled,
            "errors": errs[:3]}


# ---- a corrupt chunk -------------------------------------------------------------------------------------
async def corrupt_chunk_run(store: ImageStore, ref: str, tree: Path, rel: str) -> dict[str, Any]:
    """Corrupt the chunk holding `rel` (a file of the image's own layer), read it in a sandbox: the time from
    the read to the node's image_corrupt event, and what was served (nothing of the chunk; the rest intact)."""
    import zstandard

    img = store.resolve(ref)
    top = img.layers[-1]
    data = (tree / rel).read_bytes()
    whole = Path(tempfile.mkdtemp(prefix="sbcor-", dir="/var/tmp")) / "layer"
    try:
        store.export_layer(top.digest, whole)
        at = whole.read_bytes().find(data[:4096])
    finally:
        shutil.rmtree(whole.parent, ignore_errors=True)
    t = store.layer_table(top.digest)
    hexd = next(h for (h, n), off in zip(t.chunks, t.offsets(), strict=True) if off <= at < off + n)
    p = store.chunks.chunk_path(hexd)
    raw = bytearray(zstandard.ZstdDecompressor().decompress(p.read_bytes()))
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte, in a well-formed object: only the digest can tell
    os.chmod(p, 0o644)
    p.write_bytes(zstandard.ZstdCompressor(level=3).compress(bytes(raw)))
    os.chmod(p, 0o444)
    async with _node(store.root) as node:
        info = await node.create(_spec(ref))
        t_read = time.time()
        r = await node.exec(info.id, ["cat", f"/{rel}"])
        t_done = time.time()
        ev = None
        for _ in range(500):
            evs = [json.loads(x) for x in (node.paths.home / "events" / "events.jsonl").read_text().splitlines()
                   if '"image_corrupt"' in x]
            if evs:
                ev = evs[0]
                break
            await asyncio.sleep(0.01)
        # every other file of the image's own layer: its exact bytes, or EIO when it shares the bad chunk;
        # never other bytes
        others = sorted(x for x in (tree / "opt").rglob("*") if x.is_file() and str(x.relative_to(tree)) != rel)
        intact = eio = wrong = 0
        for f in others:
            rr = await node.exec(info.id, ["md5sum", f"/{f.relative_to(tree)}"])
            if rr.exit_code == 0 and rr.stdout.split()[0].decode() == hashlib.md5(f.read_bytes()).hexdigest():
                intact += 1
            elif rr.exit_code != 0 and b"Input/output error" in rr.stderr:
                eio += 1
            else:
                wrong += 1
        cached = any(x.name == hexd for x in node.layer_mounts.daemon.cache.rglob("*"))
        st = _reader_stats(node)
        await node.close(info.id)
        try:
            await node.create(_spec(ref))
            refused = False
        except ImageCorrupt:
            refused = True
    return {"exit_code": r.exit_code, "stdout_bytes": len(r.stdout), "stderr": r.stderr.decode(errors="replace")[:200],
            "read_to_event_ms": (ev["t"] - t_read) * 1000 if ev else None,
            "read_to_detect_ms": (ev["read_at"] - t_read) * 1000 if ev and ev.get("read_at") else None,
            "read_ms": (t_done - t_read) * 1000, "event": ev, "other_files": len(others), "intact": intact,
            "other_eio": eio, "other_wrong": wrong,
            "bad_chunk_cached": cached, "eio": st.get("eio"), "new_create_refused": refused, "chunk": hexd}


async def run(ctx: BenchContext, p: StoreParams) -> ScenarioResult:
    """The store scenario (see the module docstring)."""
    from shoal.images.migrate import store_whole_file

    res = ScenarioResult("store", docker=ctx.docker_status if p.docker else "skipped: -p docker=false")
    moosefs.check_installed()
    name = f"bench{os.getpid() % 100000}"
    ctx.log(f"starting MooseFS '{name}' (master + 2 chunkservers in network namespaces)")
    cluster = await asyncio.to_thread(moosefs.up, name)
    regdir = Path(tempfile.mkdtemp(prefix="sbreg-", dir="/var/tmp"))
    keep: list[Path] = []
    use_docker = p.docker and ctx.docker is not None
    try:
        mstore = ImageStore(Path(cluster.mountpoint) / "store")
        wstore = ImageStore(Path(cluster.mountpoint) / "whole")  # the earlier format, for the baselines
        t0 = time.perf_counter()
        base = await asyncio.to_thread(mstore.copy_image_from, ctx.node.store, p.image, "bench-base:latest")
        publish_s = time.perf_counter() - t0
        size = base.size
        src_img = ctx.node.store.resolve(p.image)
        wlayers = []
        for lay in src_img.layers:
            tmp = Path(tempfile.mkdtemp(prefix="sbw-", dir="/var/tmp")) / "l.erofs"
            ctx.node.store.export_layer(lay.digest, tmp)
            wlayers.append(await asyncio.to_thread(store_whole_file, wstore, tmp, lay.source))
            shutil.rmtree(tmp.parent, ignore_errors=True)
        wstore.put_image("bench-base:latest", wlayers, src_img.config)
        stored = mstore.last_write.stored_bytes
        res.data.update({"image": p.image, "image_bytes": size, "publish_to_moosefs_s": round(publish_s, 2),
                         "base_stored_bytes": stored, "load_before": os.getloadavg()})
        reg_cm = _registry(regdir) if use_docker else contextlib.nullcontext("")
        with reg_cm as reg_:
            reg = str(reg_)
            # ---- cold starts
            configs = [("chunked, checked per chunk (default), first start", mstore, "chunks", False, False),
                       ("chunked, checked per chunk (default), with the start record", mstore, "chunks", False, True),
                       ("whole file, unchecked (earlier, SHOAL_VERIFY_LAYERS=0)", wstore, "whole-file", False, False),
                       ("whole file + whole-layer check (earlier default)", wstore, "whole-file", True, False)]
            cold: dict[str, Any] = {}
            with ctx.task("cold starts", len(configs) * p.trials) as adv:
                for label, st, source, check, record in configs:
                    rows = []
                    for _ in range(p.trials):
                        rows.append(await cold_start(st, "bench-base:latest", cluster, source=source,
                                                     whole_check=check, record=record))
                        adv()
                    cold[label] = {"trials": rows, "total_ms": _median(rows, "total_ms"),
                                   "fetched_fraction": _median(rows, "fetched_fraction"),
                                   "fetched_bytes": _median(rows, "fetched_bytes"), "mounted": rows[-1]["mounted"],
                                   "reader_wire_bytes": _median(rows, "reader_wire_bytes")}
            res.data["cold"] = cold
            dk: dict[str, Any] = {}
            if use_docker:
                try:
                    dk = await docker_cold_starts(ctx, reg, p.trials)
                except Exception as e:
                    res.notes.append(f"Docker cold start failed: {e}")
            res.data["docker_cold"] = dk
            first = cold[configs[0][0]]
            rec = cold[configs[1][0]]
            unchecked = cold[configs[2][0]]
            checked = cold[configs[3][0]]
            f1 = first["fetched_fraction"] * 100
            res.add(Metric("cold start: bytes fetched from chunkservers to start + import json (default: every "
                           "chunk checked)", round(f1, 2), round(dk["pulled_bytes"] / size * 100, 1) if dk else None,
                           "% of image", target="≤ 10%", met=at_most(f1, 10.0),
                           note=f"{first['fetched_bytes'] / MIB:.1f} MiB of {size / MIB:.0f} MiB (reader: "
                                f"{first['reader_wire_bytes'] / MIB:.1f} MiB of zstd chunk objects); Docker: the "
                                "compressed layers it pulls"),
                    Metric("… with the image's start record (prefetch)", round(rec["fetched_fraction"] * 100, 2),
                           None, "% of image"),
                    Metric("… earlier: whole file, unchecked", round(unchecked["fetched_fraction"] * 100, 2), None,
                           "% of image", note="corruption would be served"),
                    Metric("… earlier default: whole file + whole-layer check",
                           round(checked["fetched_fraction"] * 100, 2), None, "% of image"),
                    Metric("cold start + import json, MooseFS (default)", round(first["total_ms"], 1),
                           round(dk["total_ms"], 1) if dk else None, "ms",
                           note="Docker: pull from a loopback registry + run + exec"),
                    Metric("… with the start record", round(rec["total_ms"], 1), None, "ms"),
                    Metric("… earlier: whole file, unchecked", round(unchecked["total_ms"], 1), None, "ms"),
                    Metric("… earlier default: whole file + whole-layer check", round(checked["total_ms"], 1), None,
                           "ms"))

            # ---- warm starts, ABBA
            warm = await warm_rounds(mstore, wstore, "bench-base:latest", p.warm_rounds)
            res.data["warm"] = warm
            wr, wd = statistics.median(warm["reader_ms"]), statistics.median(warm["direct_ms"])
            res.add(Metric("warm start (node cache has the chunks; layer mounted afresh) + import json: reader vs "
                           "earlier direct mount", round(wr, 1), None, "ms",
                           note=f"direct whole-file mount {wd:.1f} ms; ratio {wr / wd:.2f}; "
                                f"{len(warm['reader_ms'])}+{len(warm['direct_ms'])} ABBA rounds "
                                f"(reader {min(warm['reader_ms']):.0f}–{max(warm['reader_ms']):.0f}, direct "
                                f"{min(warm['direct_ms']):.0f}–{max(warm['direct_ms']):.0f} ms)"))

            # ---- the family: images FROM the base, each adding its own layer
            with ctx.task(f"{p.family} images FROM the base, {p.family_mib} MiB each", p.family) as adv:
                frefs, ftrees, fst = await asyncio.to_thread(make_family, mstore, "bench-base:latest", p.family,
                                                             p.family_mib, "bench-family", adv)
            keep.append(Path(str(fst["work"])))
            fam = await family_starts(mstore, cluster, frefs)
            total_layers = size + fst["layer_bytes"]
            dfam: dict[str, Any] = {}
            if use_docker:
                try:
                    dfam = await docker_family(ctx, reg, ctx.docker.image, ftrees, "family")  # type: ignore[union-attr]
                    dfam["registry_bytes"] = _registry_blob_bytes(regdir)
                except Exception as e:
                    res.notes.append(f"Docker family failed: {e}")
            res.data["family"] = {**fst, **fam, "images": p.family, "sum_of_layers": total_layers, "docker": dfam}
            stored_all = stored + fst["stored_bytes"]
            res.add(Metric(f"{p.family} images FROM the base (+{p.family_mib} MiB each): bytes stored",
                           round(stored_all / MIB, 1), round(dfam["registry_bytes"] / MIB, 1) if dfam else None,
                           "MiB", note=f"sum of their layers (base once + own): {total_layers / MIB:.0f} MiB; "
                                       f"{stored_all / total_layers * 100:.0f}% of it; Docker: the registry's blobs "
                                       "(gzip layers, incl. the base)"),
                    Metric("… bytes fetched to start one sandbox of each", round(fam["fetched_bytes"] / MIB, 1),
                           round(dfam["pulled_bytes"] / MIB, 1) if dfam else None, "MiB",
                           note=f"{fam['fetched_bytes'] / total_layers * 100:.1f}% of the sum of layers; Docker "
                                "pulls every layer whole"))

            # ---- the DSec-shaped burst
            with ctx.task(f"{p.images} burst images", p.images) as adv:
                brefs, btrees, bst = await asyncio.to_thread(make_family, mstore, "bench-base:latest", p.images, 0,
                                                             "bench-burst", adv)
            keep.append(Path(str(bst["work"])))
            total = p.images * p.per_image
            res.data["load_burst"] = os.getloadavg()
            with ctx.task(f"burst: {p.images} images × {p.per_image} over {p.nodes} nodes", total) as adv:
                b = await burst(mstore, cluster, brefs, p.nodes, p.per_image, progress=lambda: adv())
            res.data["burst"] = b
            db: dict[str, Any] = {}
            if use_docker:
                try:
                    db = await docker_burst(ctx, reg, ctx.docker.image, btrees[:p.docker_images],  # type: ignore[union-attr]
                                            p.per_image, p.docker_budget_s)
                except Exception as e:
                    res.notes.append(f"Docker burst failed: {e}")
            res.data["docker_burst"] = db
            res.add(Metric(f"DSec burst: {p.images} images × {p.per_image} sandboxes over {p.nodes} node agents, "
                           "all ready", round(b["wall_s"], 1), round(db["wall_s"], 1) if db else None, "s",
                           note=(f"{b['ok']}/{total} ok; Docker: {db.get('images', 0)}/{db.get('of', 0)} images, "
                                 f"{db.get('containers', 0)} containers on one engine") if db
                           else f"{b['ok']}/{total} ok"),
                    Metric("… bytes fetched", round(b["fetched_bytes"] / MIB, 1),
                           round(db["pulled_bytes"] / MIB, 1) if db else None, "MiB",
                           note=f"{b['prefetched_chunks']} chunks prefetched from start records"))
            if b["n_errors"]:
                res.notes.append(f"burst errors ({b['n_errors']}): {b['errors']}")
            if db and db.get("images", 0) < db.get("of", 0):
                res.notes.append(f"Docker finished {db['images']} of {db['of']} burst images within "
                                 f"{p.docker_budget_s:.0f} s")

            # ---- a corrupt chunk
            cc = await corrupt_chunk_run(mstore, frefs[0], ftrees[0], "opt/app0/mod0003.py")
            res.data["corrupt"] = cc
            res.add(Metric("corrupt chunk: from the read to the node's image_corrupt event",
                           round(cc["read_to_event_ms"], 1) if cc["read_to_event_ms"] is not None else None, None, "ms",
                           note=f"detected {cc['read_to_detect_ms']:.0f} ms after the exec began; the read failed "
                                f"(exit {cc['exit_code']}, EIO), {cc['stdout_bytes']} bytes served; other files: "
                                f"{cc['intact']} exact, {cc['other_eio']} EIO (share the chunk), {cc['other_wrong']} "
                                f"wrong; bad chunk cached: {cc['bad_chunk_cached']}; new create refused: "
                                f"{cc['new_create_refused']}"))
        res.data["load_after"] = os.getloadavg()
    finally:
        await asyncio.to_thread(moosefs.down, name)
        shutil.rmtree(regdir, ignore_errors=True)
        for d in keep:
            shutil.rmtree(d, ignore_errors=True)
    return res


SCENARIO = Scenario("store", "chunked verified store on MooseFS: fetch, cold/warm start, family, burst, corruption",
                    run, StoreParams, default_run=False)
