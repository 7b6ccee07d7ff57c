"""Marks of corrupt chunks in the store, so that every node refuses images whose bytes are known bad.

    <store>/corrupt/<layer hex>/<chunk hex>    one JSON line: the event (reason, time, which process)

shoal-chunkd writes a mark the moment a chunk it fetched fails its check or is missing (chunkd/ctl.c),
before the read that found it fails with EIO. From then on, a create of any image using that layer raises
ImageCorrupt on every node sharing the store (`check_layers`, called by Node.resolve_image and before a
layer is mounted), until the layer is repaired: rebuilding or re-importing it rewrites the damaged chunk
(ChunkStore.put_chunk replaces a bad copy) and `shoal image verify` then finds it clean and clears the
mark; `shoal image verify --remove-corrupt` removes the damaged chunks and the layers that use them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from shoal.errors import ImageCorrupt

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
#: creates read the marks at most this often per store (a bounded cost on a shared filesystem)
TTL_S = 1.0

_cache: dict[str, tuple[float, dict[str, list[str]]]] = {}
_lock = threading.Lock()


def marks_dir(store_root: Path) -> Path:
    """Where a store's marks live."""
    return Path(store_root) / "corrupt"


def read_marks(store_root: Path) -> dict[str, list[str]]:
    """Every mark in the store: layer hex -> chunk hexes (read now)."""
    out: dict[str, list[str]] = {}
    d = marks_dir(store_root)
    try:
        layers = os.listdir(d)
    except FileNotFoundError:
        return out
    for h in layers:
        if not _HEX64.match(h):
            continue
        with contextlib.suppress(OSError):
            chunks = sorted(c for c in os.listdir(d / h) if _HEX64.match(c))
            if chunks:
                out[h] = chunks
    return out


def marks(store_root: Path, max_age_s: float = TTL_S) -> dict[str, list[str]]:
    """The store's marks, re-read when the last read is older than `max_age_s`."""
    key = str(store_root)
    now = time.monotonic()
    with _lock:
        hit = _cache.get(key)
        if hit and now - hit[0] < max_age_s:
            return hit[1]
    m = read_marks(Path(store_root))
    with _lock:
        _cache[key] = (now, m)
    return m


def forget_cached() -> None:
    """Drop what this process remembers (the next check reads the store)."""
    with _lock:
        _cache.clear()


def check_layers(store_root: Path, digests: list[str], what: str = "the image") -> None:
    """Raise ImageCorrupt (typed, digests only, no host paths) when any of the layers is marked."""
    m = marks(store_root)
    if not m:
        return
    for d in digests:
        chunks = m.get(d.split(":", 1)[-1])
        if chunks:
            raise ImageCorrupt(f"{what} uses layer {d}, whose chunk sha256:{chunks[0]} failed its check when a node "
                               "read it: it is not served; rebuild or re-import the image (that rewrites the chunk), "
                               "or run `shoal image verify --remove-corrupt`", layer=d, chunk=f"sha256:{chunks[0]}")


def mark(store_root: Path, layer_hex: str, chunk_hex: str, reason: str, **extra: Any) -> None:
    """Mark a chunk of a layer as bad (what shoal-chunkd writes; also `shoal image verify`)."""
    d = marks_dir(store_root) / layer_hex
    d.mkdir(parents=True, exist_ok=True)
    line = {"event": "image_corrupt", "layer": f"sha256:{layer_hex}", "chunk": f"sha256:{chunk_hex}",
            "reason": reason, "t": time.time(), **extra}
    (d / chunk_hex).write_text(json.dumps(line) + "\n")
    forget_cached()


def clear(store_root: Path, layer_hex: str) -> bool:
    """Remove a layer's marks; True when there were any."""
    d = marks_dir(store_root) / layer_hex
    if not d.exists():
        return False
    shutil.rmtree(d, ignore_errors=True)
    forget_cached()
    return True
