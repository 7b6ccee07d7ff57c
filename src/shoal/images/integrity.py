"""Check a layer's bytes against its digest before its first mount on this node.

A layer is named by the sha256 of its bytes, so checking it is hashing the whole file once. Hashing on
every create would read every image in full for every sandbox; instead the result is remembered per
node, in `$SHOAL_HOME/verified/<hex>.json`, together with the file's identity (inode, size, mtime and
ctime in ns). Any write to the file through the filesystem changes its ctime, a replaced file has
another inode, so either makes the next mount hash it again. What the cache cannot see is corruption
below the filesystem after the check (bit rot on a disk or chunkserver that leaves the metadata alone):
that is the filesystem's own checksums' job (MooseFS, CephFS and 3FS checksum their chunks).

The first mount of a layer on a node therefore reads the whole layer once — over the network when the
store is shared — which is the price of the check (measured by `shoal bench store`); every later
sandbox on the node pays nothing. SHOAL_VERIFY_LAYERS=0 turns it off (then a layer is read on demand
only, and a corrupt superblock still fails the mount with ImageCorrupt, but corrupt data blocks would
be served as they are).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from pathlib import Path

from shoal.errors import ImageCorrupt
from shoal.fsutil import atomic_write

_BUF = 1 << 20


def verify_enabled() -> bool:
    """SHOAL_VERIFY_LAYERS (default on): check layers against their digest before their first mount."""
    from shoal.config import settings

    return bool(settings().verify_layers)


def file_identity(st: os.stat_result) -> dict[str, int]:
    """What must stay the same for an earlier check to still hold."""
    return {"ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def hash_file(path: Path, keep_cache: bool = False) -> str:
    """Hex sha256 of a file in 1 MiB reads. Unless `keep_cache`, the pages read are dropped from the page
    cache as it goes: a check must not leave a whole image in memory (sandboxes read ~5% of it, and
    file-backed directio mounts never use the file's page cache), nor make reads that a sandbox later does
    look already fetched."""
    h = hashlib.sha256()
    flags = os.O_RDONLY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | getattr(os, "O_NOATIME", 0))
    except PermissionError:
        fd = os.open(path, flags)
    try:
        off = 0
        while chunk := os.read(fd, _BUF):
            h.update(chunk)
            off += len(chunk)
            if not keep_cache and off % (8 * _BUF) == 0:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, off - 8 * _BUF, 8 * _BUF, os.POSIX_FADV_DONTNEED)
        if not keep_cache:
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return h.hexdigest()


class LayerVerifier:
    """Per-node memory of which layer files were hashed and found intact (see the module docs)."""

    def __init__(self, state_dir: Path, enabled: bool | None = None) -> None:
        self.dir = Path(state_dir)
        self.enabled = verify_enabled() if enabled is None else enabled
        self._mem: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()
        #: seconds and bytes spent hashing by this process (for benchmarks and metrics)
        self.hashed_bytes = 0
        self.hash_seconds = 0.0

    def _record(self, hexd: str) -> Path:
        return self.dir / f"{hexd}.json"

    def known_good(self, hexd: str, st: os.stat_result) -> bool:
        """True when this node already hashed this very file (same identity) and found it intact."""
        ident = file_identity(st)
        with self._lock:
            if self._mem.get(hexd) == ident:
                return True
        try:
            rec = json.loads(self._record(hexd).read_text())
        except (OSError, ValueError):
            return False
        if isinstance(rec, dict) and rec.get("identity") == ident:
            with self._lock:
                self._mem[hexd] = ident
            return True
        return False

    def check(self, digest: str, path: Path, expected_size: int | None = None) -> bool:
        """Raise ImageCorrupt unless the file at `path` hashes to `digest`; True when it was hashed now,
        False when a remembered check still holds (or checking is off)."""
        hexd = digest.split(":", 1)[1]
        if not self.enabled:
            return False
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ImageCorrupt(f"layer {digest} has metadata but no data file in the store: "
                               "rebuild or re-import the images that use it") from None
        if expected_size is not None and expected_size > 0 and st.st_size != expected_size:
            self.forget(hexd)
            raise ImageCorrupt(f"layer {digest} is truncated or damaged ({st.st_size} bytes, its metadata says "
                               f"{expected_size}): it was not mounted; rebuild or re-import the images that use it "
                               "(`shoal image verify` lists them)")
        if self.known_good(hexd, st):
            return False
        t0 = time.perf_counter()
        got = hash_file(path)
        self.hash_seconds += time.perf_counter() - t0
        self.hashed_bytes += st.st_size
        if got != hexd:
            self.forget(hexd)
            raise ImageCorrupt(f"layer {digest} is corrupt (its bytes hash to sha256:{got[:16]}…): it was not "
                               "mounted; rebuild or re-import the images that use it (`shoal image verify` lists "
                               "them)")
        st2 = os.stat(path)
        ident = file_identity(st2)
        if ident != file_identity(st):
            return True  # changed while we read it: good this time, but do not remember
        with self._lock:
            self._mem[hexd] = ident
        with contextlib.suppress(OSError):
            atomic_write(self._record(hexd), json.dumps({"digest": digest, "identity": ident,
                                                         "verified_at": time.time()}).encode(), fsync=False)
        return True

    def remember(self, digest: str, path: Path) -> None:
        """Record `path` as checked (its bytes were hashed while it was written, e.g. by the layer cache)."""
        hexd = digest.split(":", 1)[1]
        ident = file_identity(os.stat(path))
        with self._lock:
            self._mem[hexd] = ident
        with contextlib.suppress(OSError):
            atomic_write(self._record(hexd), json.dumps({"digest": digest, "identity": ident,
                                                         "verified_at": time.time()}).encode(), fsync=False)

    def forget(self, hexd: str) -> None:
        """Drop what is remembered about a layer (it will be hashed again before its next mount)."""
        with self._lock:
            self._mem.pop(hexd, None)
        with contextlib.suppress(OSError):
            self._record(hexd).unlink()
