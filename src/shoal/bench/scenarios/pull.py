"""`pull`: images from a registry — shoal's pull (`shoal.images.pull`) vs `docker pull`, same registry, same run.

A real `docker-registry` on 127.0.0.1 (Debian's, started here) holds:
- a big image: shoal's `base` layer plus four layers of files copied from this host's /usr (`layer_mb`
  each, so ≥ 500 MiB in ≥ 5 layers by default), pushed by `shoal image push` (gzip);
- `images` small images sharing that base, each with its own `task_mb` layer (a task's workspace).

Measured, each system starting cold (shoal: an empty private store; Docker: no image):
1. **pull** of the big image, and **pull + ready to run**: shoal pulls, links the image into the node's
   store, creates a sandbox and runs `true` in it; Docker pulls and `docker run --rm --network=none … true`.
2. the `images` small images pulled one after another: **bytes fetched** (what the registry sent to each
   client, from its own request log, by user agent) and **bytes stored** (disk space the pulled images take:
   shoal's private store vs Docker's data root, before/after).

Docker treats 127.0.0.0/8 registries as insecure (plain HTTP) by default; shoal does the same for loopback
hosts named in a reference. Both download 3 layers at a time (Docker's default, shoal's `pull_concurrency`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import stat
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult
from shoal.bench.scenario import Scenario, param

#: where the big image's file layers come from (regular files, in this order)
HOST_SOURCES = ("/usr/lib/x86_64-linux-gnu", "/usr/lib", "/usr/share", "/usr/bin", "/usr/libexec", "/opt")
SHOAL_AGENT = "shoal ("  # the User-Agent prefix of shoal's registry client
_WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu",
          "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi", "chi", "psi", "omega", "import",
          "return", "def", "class", "self", "value", "result", "error", "test", "assert"]


@dataclass(frozen=True)
class PullParams:
    """The images' sizes and how often the big pull runs."""

    layer_mb: int = param(100, quick=20, help="each of the 4 file layers on top of the base (MiB, uncompressed)")
    images: int = param(20, quick=5, help="small images sharing the base, pulled one after another")
    task_mb: int = param(2, quick=1, help="each small image's own layer (MiB)")
    rounds: int = param(2, quick=1, help="cold pulls of the big image per system (median reported)")


def _host_files(limit_bytes: int, skip: set[str]) -> list[Path]:
    """Regular files under HOST_SOURCES, up to `limit_bytes`, none in `skip` (so layers never repeat a file)."""
    out: list[Path] = []
    total = 0
    for top in HOST_SOURCES:
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames.sort()
            for name in sorted(filenames):
                p = os.path.join(dirpath, name)
                if p in skip:
                    continue
                with contextlib.suppress(OSError):
                    st = os.lstat(p)
                    if not stat.S_ISREG(st.st_mode) or st.st_size > (32 << 20) or st.st_size == 0:
                        continue
                    if not os.access(p, os.R_OK):
                        continue
                    out.append(Path(p))
                    skip.add(p)
                    total += st.st_size
                    if total >= limit_bytes:
                        return out
    return out


def _text(rng: random.Random, n: int) -> bytes:
    """`n` bytes of word soup (compresses like source code and logs do)."""
    parts: list[str] = []
    size = 0
    while size < n:
        line = " ".join(rng.choice(_WORDS) for _ in range(12)) + f" {rng.random():.6f}\n"
        parts.append(line)
        size += len(line)
    return "".join(parts).encode()[:n]


def _file_layer(root: Path, i: int, mb: int, used: set[str]) -> Path:
    """A tree of host files (`mb` MiB) under /opt/bench/l<i>; word soup fills in when the host has too few."""
    tree = root / f"tree{i}"
    dest = tree / "opt" / "bench" / f"l{i}"
    dest.mkdir(parents=True)
    total = 0
    for n, src in enumerate(_host_files(mb << 20, used)):
        with contextlib.suppress(OSError):
            shutil.copyfile(src, dest / f"{n:05d}-{src.name[:80]}")
            total += src.stat().st_size
    rng = random.Random(i)
    k = 0
    while total < (mb << 20):
        chunk = min(1 << 20, (mb << 20) - total)
        (dest / f"filler-{k:04d}.txt").write_bytes(_text(rng, chunk))
        total += chunk
        k += 1
    return tree


def _task_layer(root: Path, i: int, mb: int, nonce: str) -> Path:
    tree = root / f"task{i}"
    d = tree / "workspace"
    d.mkdir(parents=True)
    rng = random.Random(f"{nonce}-{i}")
    (d / "TASK").write_text(f"task {i} {nonce}\n")
    for k in range(max(1, mb * 16)):  # 64 KiB files
        (d / f"src{k:04d}.py").write_bytes(_text(rng, 64 << 10))
    return tree


def disk_usage(path: Path) -> int:
    """Bytes allocated on disk under `path`, each inode once (hard links shared)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
                total += st.st_blocks * 512
    return total


def _docker(ctx: BenchContext, *args: str, timeout: float = 3600) -> str:
    assert ctx.docker is not None
    exe = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else "docker"
    r = subprocess.run([exe, "-H", f"unix://{ctx.docker.sock}", *args], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])}…: {r.stderr.strip()[-600:]}")
    return r.stdout


def _fetched(reqs: list[Any], agent_prefix: str) -> int:
    """Bytes the registry sent (blobs and manifests) to clients whose User-Agent starts with `agent_prefix`."""
    return sum(r.written for r in reqs if r.agent.startswith(agent_prefix) and r.method == "GET"
               and r.status in (200, 206) and ("/blobs/" in r.uri or "/manifests/" in r.uri))


def _med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 2) if xs else None


async def _prepare(ctx: BenchContext, work: Path, reg: Any, p: PullParams, nonce: str) -> tuple[str, list[str],
                                                                                                dict[str, Any]]:
    """Build the big image and the small ones in a scratch store and push them; their references."""
    from shoal.config import Paths
    from shoal.images.export import push_image
    from shoal.images.store import ImageStore

    src = ImageStore(work / "src")
    paths = Paths.from_env(ctx.home, src.root)  # the run's own home: its layer reader for the scratch store
    base = await asyncio.to_thread(src.copy_image_from, ctx.node.store, f"{ctx.image}:latest"
                                   if ":" not in ctx.image else ctx.image, "bench-src/base:1")
    used: set[str] = set()
    layers = [lay.digest for lay in base.layers]
    with ctx.task("pull: making the image layers from host files", 4) as adv:
        for i in range(4):
            tree = await asyncio.to_thread(_file_layer, work, i, p.layer_mb, used)
            lay = await asyncio.to_thread(src.add_layer_from_dir, tree, {"type": "bench-pull", "i": i})
            await asyncio.to_thread(shutil.rmtree, tree, True)
            layers.append(lay.digest)
            adv()
    big = await asyncio.to_thread(src.put_image, "bench-src/big:1", layers, base.config)
    big_ref = f"{reg.host}/bench/big:{nonce}"
    info = {"big_layers": len(big.layers), "big_mib_uncompressed": round(big.size / 2**20, 1)}
    with ctx.task("pull: pushing the images to the loopback registry", 1 + p.images) as adv:
        rep = await asyncio.to_thread(push_image, src, "bench-src/big:1", big_ref, work_dir=work, paths=paths)
        info["big_mib_compressed"] = round(rep.bytes / 2**20, 1)
        adv()
        smalls = []
        for i in range(p.images):
            tree = await asyncio.to_thread(_task_layer, work, i, p.task_mb, nonce)
            lay = await asyncio.to_thread(src.add_layer_from_dir, tree, {"type": "bench-pull-task", "i": i})
            await asyncio.to_thread(shutil.rmtree, tree, True)
            await asyncio.to_thread(src.put_image, f"bench-src/task-{i}:1", [*layers[:len(base.layers)], lay.digest],
                                    base.config)
            ref = f"{reg.host}/bench/task-{i}:{nonce}"
            await asyncio.to_thread(push_image, src, f"bench-src/task-{i}:1", ref, work_dir=work, paths=paths)
            smalls.append(ref)
            adv()
    return big_ref, smalls, info


async def run(ctx: BenchContext, p: PullParams) -> ScenarioResult:
    """The pull scenario (see the module docstring)."""
    from shoal.bench.loopback_registry import LoopbackRegistry, available
    from shoal.images.pull import pull_image
    from shoal.images.store import ImageStore

    res = ScenarioResult("pull", docker=ctx.docker_status)
    missing = available()
    if missing:
        res.docker = f"skipped: {missing}"
        res.notes.append(f"not run: {missing}")
        return res
    work = Path(tempfile.mkdtemp(prefix="sbp-", dir="/var/tmp"))
    nonce = f"{int(time.time())}"
    reg = LoopbackRegistry(work / "registry").start()
    loads: list[float] = []
    made: list[str] = []
    times: dict[str, list[float]] = {k: [] for k in ("shoal_pull", "shoal_ready", "docker_pull", "docker_ready")}
    try:
        big_ref, smalls, info = await _prepare(ctx, work, reg, p, nonce)
        res.data.update(info)
        # ---- 1. the big image, cold, p.rounds times each
        with ctx.task("pull: the big image, cold (shoal, docker)", p.rounds) as adv:
            for r in range(p.rounds):
                loads.append(os.getloadavg()[0])
                dst = ImageStore(Path(tempfile.mkdtemp(prefix="bench-pull-", dir=ctx.node.store.tmp_dir)))
                try:
                    t0 = time.perf_counter()
                    rep = await asyncio.to_thread(pull_image, dst, big_ref, work_dir=ctx.home / "tmp")
                    t1 = time.perf_counter()
                    name = f"bench-pull-big:{nonce}-{r}"
                    await asyncio.to_thread(ctx.node.store.copy_image_from, dst, big_ref, name)
                    made.append(name)
                    sb = await ctx.client.create(name, memory_mb=256)
                    try:
                        ok = (await sb.exec(["true"])).exit_code == 0
                    finally:
                        t2 = time.perf_counter()
                        await sb.close()
                    if not ok:
                        raise RuntimeError("`true` failed in the pulled image")
                    times["shoal_pull"].append(t1 - t0)
                    times["shoal_ready"].append(t2 - t0)
                    res.data.setdefault("shoal_big_bytes_fetched", rep.bytes_fetched)
                    res.data.setdefault("shoal_big_bytes_stored", disk_usage(dst.root))
                finally:
                    await asyncio.to_thread(shutil.rmtree, dst.root, True)
                if ctx.docker is not None:
                    with contextlib.suppress(RuntimeError):
                        await asyncio.to_thread(_docker, ctx, "rmi", "-f", big_ref)
                    t0 = time.perf_counter()
                    await asyncio.to_thread(_docker, ctx, "pull", "-q", big_ref)
                    t1 = time.perf_counter()
                    await asyncio.to_thread(_docker, ctx, "run", "--rm", "--network=none", big_ref, "true")
                    t2 = time.perf_counter()
                    times["docker_pull"].append(t1 - t0)
                    times["docker_ready"].append(t2 - t0)
                    await asyncio.to_thread(_docker, ctx, "rmi", "-f", big_ref)
                adv()
        # ---- 2. images sharing a base, one after another
        loads.append(os.getloadavg()[0])
        dst = ImageStore(Path(tempfile.mkdtemp(prefix="bench-pull-", dir=ctx.node.store.tmp_dir)))
        try:
            empty = disk_usage(dst.root)
            mark = len(reg.requests())
            t0 = time.perf_counter()
            with ctx.task(f"pull: {p.images} images sharing a base (shoal)", p.images) as adv:
                for ref in smalls:
                    await asyncio.to_thread(pull_image, dst, ref, work_dir=ctx.home / "tmp")
                    adv()
            times["shoal_many"] = [time.perf_counter() - t0]
            await asyncio.sleep(0.5)  # the registry logs a request just after answering it
            res.data["shoal_many_bytes_fetched"] = _fetched(reg.requests()[mark:], SHOAL_AGENT)
            res.data["shoal_many_bytes_stored"] = disk_usage(dst.root) - empty
        finally:
            await asyncio.to_thread(shutil.rmtree, dst.root, True)
        if ctx.docker is not None:
            data_root = ctx.docker.dir / "data"
            before = await asyncio.to_thread(disk_usage, data_root)
            mark = len(reg.requests())
            t0 = time.perf_counter()
            with ctx.task(f"pull: {p.images} images sharing a base (docker)", p.images) as adv:
                for ref in smalls:
                    await asyncio.to_thread(_docker, ctx, "pull", "-q", ref)
                    adv()
            times["docker_many"] = [time.perf_counter() - t0]
            await asyncio.sleep(0.5)
            res.data["docker_many_bytes_fetched"] = _fetched(reg.requests()[mark:], "docker/")
            res.data["docker_many_bytes_stored"] = await asyncio.to_thread(disk_usage, data_root) - before
            await asyncio.to_thread(_docker, ctx, "rmi", "-f", *smalls)
    finally:
        for name in made:
            with contextlib.suppress(Exception):
                ctx.node.store.remove_image(name)
        reg.stop()
        shutil.rmtree(work, ignore_errors=True)
    res.data["seconds"] = {k: [round(x, 2) for x in v] for k, v in times.items()}
    res.data["load_avg_1m"] = [round(x, 2) for x in loads]
    docker = ctx.docker is not None
    mib = 2**20
    res.add(
        Metric(f"pull the big image ({info['big_layers']} layers, {info['big_mib_uncompressed']:.0f} MiB; "
               f"{info['big_mib_compressed']:.0f} MiB gzip)", _med(times["shoal_pull"]),
               _med(times["docker_pull"]) if docker else None, "s"),
        Metric("pull + ready to run (sandbox created, `true` ran)", _med(times["shoal_ready"]),
               _med(times["docker_ready"]) if docker else None, "s"),
        Metric(f"{p.images} images sharing a base: bytes fetched", round(res.data["shoal_many_bytes_fetched"] / mib, 1),
               round(res.data["docker_many_bytes_fetched"] / mib, 1) if docker else None, "MiB"),
        Metric(f"{p.images} images sharing a base: bytes stored", round(res.data["shoal_many_bytes_stored"] / mib, 1),
               round(res.data["docker_many_bytes_stored"] / mib, 1) if docker else None, "MiB"),
        Metric(f"{p.images} images sharing a base: time", _med(times["shoal_many"]),
               _med(times.get("docker_many", [])) if docker else None, "s"),
    )
    res.notes.append(f"load average (1 min) at each phase's start: {', '.join(f'{x:.1f}' for x in loads)}")
    res.notes.append("bytes fetched: what the registry's own log says it sent to each client (blobs + manifests); "
                     "bytes stored: disk blocks the pulled images take (shoal: a private store of EROFS layers; "
                     "Docker: growth of its data root, overlay2)")
    return res


SCENARIO = Scenario("pull", "registry pulls vs docker pull: a big image to ready-to-run; 20 images sharing a base",
                    run, PullParams)
