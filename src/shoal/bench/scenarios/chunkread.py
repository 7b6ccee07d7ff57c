"""`chunkread`: what one read through the node's layer reader (shoal-chunkd, FUSE) costs against reading the
layer's whole file directly (the earlier direct mount's backing file), with every chunk already in the
node's chunk cache — the cost every read pays after a chunk's first fetch.

O_DIRECT preads at random offsets (what EROFS' directio mounts issue to their backing file), 4 KiB and
128 KiB, alternating reader / direct in ABBA rounds. `shoal bench chunkread [-p mib=64 -p reads=2000]`.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult
from shoal.bench.scenario import Scenario, param


@dataclass(frozen=True)
class ChunkReadParams:
    """How much reading the scenario does."""

    mib: int = param(64, quick=16, help="size of the layer read (random bytes)")
    reads: int = param(2000, quick=300, help="reads per round and read size")
    rounds: int = param(4, quick=2, help="ABBA rounds (reader, direct, direct, reader, …)")


def _reads(path: Path, bs: int, offsets: list[int]) -> float:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    buf = mmap.mmap(-1, bs)
    try:
        t0 = time.perf_counter()
        for off in offsets:
            os.preadv(fd, [buf], off)
        return (time.perf_counter() - t0) / len(offsets) * 1e6
    finally:
        os.close(fd)
        buf.close()


def measure(mib: int, reads: int, rounds: int) -> dict[str, Any]:
    """Median µs per read, reader vs direct, per read size; the reader's counters; the load average."""
    from shoal.images.chunkd import ChunkDaemon
    from shoal.images.store import ImageStore

    work = Path(tempfile.mkdtemp(prefix="chrc-", dir="/var/tmp"))
    home = Path(tempfile.mkdtemp(prefix="chrh-", dir="/tmp"))
    d = ChunkDaemon(home, work / "store", readahead_kb_=0)
    try:
        store = ImageStore(work / "store")
        f = store.tmp_dir / "layer.erofs"
        f.write_bytes(os.urandom(mib << 20))
        whole = work / "whole.erofs"
        shutil.copyfile(f, whole)
        lay = store.add_layer_file(f, {"type": "bench"})
        d.ensure()
        d.export(lay.hex, store.layer_table(lay.digest))
        served = d.file(lay.hex)
        with open(served, "rb") as fh:  # every chunk fetched, checked and cached: the warm case
            while fh.read(1 << 20):
                pass
        out: dict[str, Any] = {}
        for bs in (4096, 131072):
            rnd = random.Random(bs)
            offsets = [rnd.randrange(0, (mib << 20) // bs) * bs for _ in range(reads)]
            res: dict[str, list[float]] = {"reader": [], "direct": []}
            for i in range(rounds):
                for which in (("reader", "direct") if i % 2 == 0 else ("direct", "reader")):
                    res[which].append(_reads(served if which == "reader" else whole, bs, offsets))
            out[f"{bs // 1024}K"] = {k: round(statistics.median(v), 1) for k, v in res.items()}
        out["stats"] = d.stats()
        out["load"] = os.getloadavg()
        return out
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


async def run(ctx: BenchContext, p: ChunkReadParams) -> ScenarioResult:
    """The scenario (see the module docstring)."""
    res = ScenarioResult("chunkread", docker="not compared (a read path of shoal's own)")
    out = await asyncio.to_thread(measure, p.mib, p.reads, p.rounds)
    res.data.update(out)
    for size in ("4K", "128K"):
        r = out[size]
        res.add(Metric(f"one {size} O_DIRECT read, chunk cached: through the reader vs the file directly",
                       r["reader"], None, "µs", note=f"direct {r['direct']} µs (×{r['reader'] / r['direct']:.2f}); "
                       f"load {out['load'][0]:.1f}"))
    return res


SCENARIO = Scenario("chunkread", "the layer reader's cost per read against the direct file (chunks cached)", run,
                    ChunkReadParams, uses_docker=False, default_run=False)
