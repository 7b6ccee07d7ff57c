"""An optional node-local cache of hot layers (SHOAL_LAYER_CACHE_MB > 0; off by default).

With the cache on, a layer's first mount on a node copies its file from the (shared) store to
`$SHOAL_HOME/layer-cache/<hex>.erofs`, hashing it on the way (the copy *is* the integrity check: one read
of the store), and mounts the local copy. Later mounts of the layer on this node — after its last
sandbox closed and it was unmounted — read local disk instead of the network, and keep working while
the store is unreachable. The cache holds at most SHOAL_LAYER_CACHE_MB; the least recently mounted
layers that are not mounted right now go first. A layer larger than the whole cache is not cached.

The trade (measured by `shoal bench store`): the first mount reads and writes the whole layer, while a
sandbox reads only a few % of it on demand. It pays for layers mounted again and again on a node (a hot
base image whose sandboxes come and go), a slow or distant store, or riding out store outages; it does
not for images used by one to three sandboxes (DSec's median), which on-demand reads serve best.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from pathlib import Path

from shoal.errors import ImageCorrupt
from shoal.fsutil import tmp_name

_BUF = 1 << 20


def cache_limit_bytes() -> int:
    """SHOAL_LAYER_CACHE_MB in bytes (0: the cache is off)."""
    from shoal.config import settings

    return int(settings().layer_cache_mb) << 20


class LayerCache:
    """Node-local copies of store layers, LRU by last mount, bounded in bytes."""

    def __init__(self, root: Path, limit_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.limit = cache_limit_bytes() if limit_bytes is None else int(limit_bytes)
        self._lock = threading.Lock()
        #: statistics of this process (benchmarks): hits, misses, bytes copied in, layers evicted
        self.hits = 0
        self.misses = 0
        self.copied_bytes = 0
        self.evicted = 0

    @property
    def enabled(self) -> bool:
        """True when the cache has room for anything."""
        return self.limit > 0

    def path(self, hexd: str) -> Path:
        """Where a layer's local copy lives (it may not exist)."""
        return self.root / f"{hexd}.erofs"

    def get(self, digest: str, store_file: Path, size: int, in_use: set[str]) -> tuple[Path | None, bool]:
        """(local copy of a layer, whether it was copied — and so verified — just now); (None, False) when
        it cannot be cached (too big for the cache). `in_use`: layer hexes mounted now (never evicted)."""
        hexd = digest.split(":", 1)[1]
        if not self.enabled or size > self.limit:
            return None, False
        local = self.path(hexd)
        if local.exists():
            with contextlib.suppress(OSError):
                os.utime(local)  # most recently used
            self.hits += 1
            return local, False
        self.root.mkdir(parents=True, exist_ok=True)
        self.misses += 1
        self._make_room(size, in_use | {hexd})
        tmp = self.root / (tmp_name("cache-") + ".erofs")
        h = hashlib.sha256()
        try:
            with open(store_file, "rb") as src, open(tmp, "wb") as dst:
                while chunk := src.read(_BUF):
                    h.update(chunk)
                    dst.write(chunk)
                with contextlib.suppress(OSError):
                    os.posix_fadvise(src.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            if h.hexdigest() != hexd:
                raise ImageCorrupt(f"layer {digest} is corrupt (its bytes hash to sha256:{h.hexdigest()[:16]}…): "
                                   "it was not mounted; rebuild or re-import the images that use it "
                                   "(`shoal image verify` lists them)")
            os.chmod(tmp, 0o444)
            os.rename(tmp, local)
            self.copied_bytes += size
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return local, True

    def _make_room(self, need: int, keep: set[str]) -> None:
        with self._lock:
            entries = []
            total = 0
            for p in self.root.glob("*.erofs"):
                with contextlib.suppress(OSError):
                    st = p.stat()
                    total += st.st_size
                    entries.append((st.st_mtime, p, st.st_size))
            for _, p, sz in sorted(entries):
                if total + need <= self.limit:
                    break
                if p.stem in keep:
                    continue
                with contextlib.suppress(OSError):
                    p.unlink()
                    total -= sz
                    self.evicted += 1

    def usage(self) -> int:
        """Bytes the cache holds now."""
        total = 0
        for p in self.root.glob("*.erofs"):
            with contextlib.suppress(OSError):
                total += p.stat().st_size
        return total
