"""What one read through the node's layer reader (shoal-chunkd, FUSE) costs against reading the layer's
whole file directly (the earlier direct mount), with every chunk already in the node's cache: the cost
every read pays after the first fetch. Root. Usage:

    sudo .venv/bin/python benchmarks/chunk_read_cost.py [--mib 64] [--reads 2000] [--rounds 4]

Prints medians per read size for O_DIRECT preads at random offsets (what EROFS' directio mounts issue to
their backing file), alternating reader / direct in ABBA rounds, and the load average.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from shoal.images.chunkd import ChunkDaemon
from shoal.images.store import ImageStore


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reads", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="chrc-", dir="/var/tmp"))
    home = Path(tempfile.mkdtemp(prefix="chrh-", dir="/tmp"))
    d = ChunkDaemon(home, work / "store", readahead_kb_=0)
    try:
        store = ImageStore(work / "store")
        f = store.tmp_dir / "layer.erofs"
        f.write_bytes(os.urandom(a.mib << 20))
        whole = work / "whole.erofs"
        shutil.copyfile(f, whole)
        lay = store.add_layer_file(f, {"type": "bench"})
        d.ensure()
        d.export(lay.hex, store.layer_table(lay.digest))
        served = d.file(lay.hex)
        with open(served, "rb") as fh:  # every chunk fetched, checked and cached: the warm case
            while fh.read(1 << 20):
                pass
        out: dict[str, dict[str, float]] = {}
        for bs in (4096, 131072):
            rnd = random.Random(bs)
            offsets = [rnd.randrange(0, (a.mib << 20) // bs) * bs for _ in range(a.reads)]
            res: dict[str, list[float]] = {"reader": [], "direct": []}
            for i in range(a.rounds):
                for which in (("reader", "direct") if i % 2 == 0 else ("direct", "reader")):
                    res[which].append(_reads(served if which == "reader" else whole, bs, offsets))
            out[f"{bs // 1024}K"] = {k: round(statistics.median(v), 1) for k, v in res.items()}
            out[f"{bs // 1024}K"]["ratio"] = round(out[f"{bs // 1024}K"]["reader"] / out[f"{bs // 1024}K"]["direct"], 2)
        print(json.dumps({"us_per_read": out, "stats": {k: v for k, v in d.stats().items()
                                                        if k in ("reads", "hits", "misses", "fetched_chunks")},
                          "load": os.getloadavg()}, indent=1))
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
