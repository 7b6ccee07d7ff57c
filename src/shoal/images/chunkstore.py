"""Chunked layers in the store: chunk objects, chunk tables and layer records.

    chunks/sha256/<aa>/<hex>.zst    one chunk: a zstd frame of the bytes whose sha256 is <hex> (0444)
    chunked/sha256/<L>.table        the chunk table of layer L (shoal.images.chunking.ChunkTable)
    chunked/sha256/<L>.json         {digest, size, created, source, format: "chunked", table, legacy}
                                    written last: a layer is visible once this exists

For a layer stored by this code, L is the sha256 of its table (`table` == `digest`): the digest pins the
table, and the table pins every chunk. A layer converted from the whole-file format keeps its old digest
(the sha256 of the whole EROFS file, still named by every manifest): its record says `legacy: true` and
names its table by the table's own digest; the conversion hashed the whole file while it chunked it, so
the table was checked against the layer digest once (shoal.images.migrate).

Identical chunks — within a layer, across layers, across images — are stored once. Every write is a temp
file and a link (or rename), so writers on several hosts sharing the store need no lock: a chunk that
exists is re-used (its mtime renewed, so gc's grace period protects it) after a check that it still holds
the right bytes; a damaged copy is replaced. Reads here (export, verify, copy) check every chunk; nodes
read chunks through shoal-chunkd (shoal.images.chunkd), which checks them too.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from shoal.errors import ImageCorrupt, ImageNotFound
from shoal.fsutil import atomic_write, atomic_write_json, read_json, tmp_name
from shoal.images.chunking import ChunkTable, iter_chunks

#: zstd level of chunk objects: ~2.6x smaller than raw EROFS on the base image, fast to decompress
ZSTD_LEVEL = 3
_WRITERS = 4
_LINK_UNSUPPORTED = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK)


def _zstd() -> Any:
    import zstandard

    return zstandard


class ChunkStats:
    """What one write did (for callers that report it, e.g. `shoal store migrate` and the benchmarks)."""

    def __init__(self) -> None:
        self.chunks = 0
        self.new_chunks = 0
        self.stored_bytes = 0  # compressed bytes written for new chunks
        self.reused_bytes = 0  # raw bytes of chunks the store already had
        self._lock = threading.Lock()

    def add(self, new: bool, raw: int, stored: int) -> None:
        """Count one chunk."""
        with self._lock:
            self.chunks += 1
            if new:
                self.new_chunks += 1
                self.stored_bytes += stored
            else:
                self.reused_bytes += raw


class ChunkStore:
    """The chunk objects and chunked-layer records of one store root."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.chunks_dir = self.root / "chunks" / "sha256"
        self.layers_dir = self.root / "chunked" / "sha256"
        self.tmp_dir = self.root / "tmp"
        # the directories are made by the first write (a store only read is left as it is)

    # ---- paths --------------------------------------------------------------------------------
    def chunk_path(self, hexd: str) -> Path:
        """Where a chunk object lives (it may not exist)."""
        return self.chunks_dir / hexd[:2] / f"{hexd}.zst"

    def table_path(self, layer_hex: str) -> Path:
        """Where a layer's chunk table lives."""
        return self.layers_dir / f"{layer_hex}.table"

    def meta_path(self, layer_hex: str) -> Path:
        """Where a layer's record lives (its presence makes the layer visible)."""
        return self.layers_dir / f"{layer_hex}.json"

    # ---- layers -------------------------------------------------------------------------------
    def has(self, layer_hex: str) -> bool:
        """True when the layer's record exists."""
        return self.meta_path(layer_hex).exists()

    def meta(self, layer_hex: str) -> dict[str, Any]:
        """A layer's record; ImageNotFound when absent or unreadable."""
        try:
            m = read_json(self.meta_path(layer_hex))
        except FileNotFoundError:
            raise ImageNotFound(f"layer sha256:{layer_hex} is not in the store at {self.root}") from None
        except ValueError as e:
            raise ImageNotFound(f"layer sha256:{layer_hex} has an unreadable record ({e}); run `shoal image gc`") \
                from None
        if not isinstance(m, dict):
            raise ImageNotFound(f"layer sha256:{layer_hex} has an unreadable record")
        return m

    def table_digest(self, layer_hex: str, meta: dict[str, Any] | None = None) -> str:
        """The digest the layer's table must hash to: the layer digest itself, or for a converted layer the
        table digest its record names."""
        m = meta if meta is not None else self.meta(layer_hex)
        t = m.get("table")
        if m.get("legacy") and isinstance(t, str) and t.startswith("sha256:") and len(t) == 71:
            return t
        return f"sha256:{layer_hex}"

    def table(self, layer_hex: str, meta: dict[str, Any] | None = None) -> ChunkTable:
        """The layer's chunk table, checked against its digest (ImageCorrupt when it does not match)."""
        want = self.table_digest(layer_hex, meta)
        try:
            data = self.table_path(layer_hex).read_bytes()
        except FileNotFoundError:
            raise ImageCorrupt(f"layer sha256:{layer_hex} has a record but no chunk table: rebuild or re-import "
                               "the images that use it") from None
        return ChunkTable.from_bytes(data, want, what=f"layer sha256:{layer_hex}")

    def list_hexes(self) -> list[str]:
        """Every layer with a record here."""
        if not self.layers_dir.is_dir():
            return []
        return sorted(p.stem for p in self.layers_dir.glob("*.json") if len(p.stem) == 64)

    def remove(self, layer_hex: str) -> None:
        """Delete a layer's record, then its table (chunks stay until gc finds them unreferenced)."""
        for p in (self.meta_path(layer_hex), self.table_path(layer_hex)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    def touch(self, layer_hex: str) -> None:
        """Mark a layer as just used (gc's grace period)."""
        with contextlib.suppress(OSError):
            os.utime(self.meta_path(layer_hex))

    # ---- chunks -------------------------------------------------------------------------------
    def read_chunk(self, hexd: str, length: int) -> bytes:
        """A chunk's bytes, checked; ImageCorrupt (naming the chunk) when missing or damaged."""
        try:
            blob = self.chunk_path(hexd).read_bytes()
        except FileNotFoundError:
            raise ImageCorrupt(f"chunk sha256:{hexd} is missing from the store") from None
        try:
            data = _zstd().ZstdDecompressor().decompress(blob, max_output_size=length)
        except Exception:
            data = b""
        if len(data) != length or hashlib.sha256(data).hexdigest() != hexd:
            raise ImageCorrupt(f"chunk sha256:{hexd} is corrupt in the store")
        return bytes(data)

    def chunk_ok(self, hexd: str, length: int) -> bool:
        """True when the stored chunk holds exactly its bytes."""
        try:
            self.read_chunk(hexd, length)
            return True
        except ImageCorrupt:
            return False

    def put_chunk(self, hexd: str, data: bytes, *, check_existing: bool = True) -> tuple[bool, int]:
        """Store one chunk (idempotent); (written now, compressed size). An existing copy is re-used after
        a check (`check_existing`) and replaced when damaged."""
        final = self.chunk_path(hexd)
        if final.exists():
            if not check_existing or self.chunk_ok(hexd, len(data)):
                with contextlib.suppress(OSError):
                    os.utime(final)  # re-used now: gc's grace period protects it
                return False, 0
            heal = True
        else:
            heal = False
        blob = _zstd().ZstdCompressor(level=ZSTD_LEVEL).compress(data)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.tmp_dir / tmp_name("chunk-")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            final.parent.mkdir(parents=True, exist_ok=True)
            if heal:
                os.rename(tmp, final)  # readers holding the damaged file keep their inode
            else:
                try:
                    os.link(tmp, final)
                except FileExistsError:
                    pass  # another writer stored it meanwhile
                except OSError as e:
                    if e.errno not in _LINK_UNSUPPORTED:
                        raise
                    os.rename(tmp, final)  # no hard links here: rename is atomic too
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return True, len(blob)

    def store_stream(self, f: BinaryIO, *, check_existing: bool = True, stats: ChunkStats | None = None,
                     whole: Any = None) -> ChunkTable:
        """Chunk a stream and store every chunk (several at once); returns its table. `whole`: a hashlib
        object fed every byte (the conversion of a whole-file layer checks its old digest with it)."""
        chunks: list[tuple[str, int]] = []
        pending: list[Future[tuple[bool, int]]] = []
        sizes: list[int] = []
        with ThreadPoolExecutor(_WRITERS, thread_name_prefix="shoal-chunks") as pool:
            for data in iter_chunks(f):
                if whole is not None:
                    whole.update(data)
                hexd = hashlib.sha256(data).hexdigest()
                chunks.append((hexd, len(data)))
                pending.append(pool.submit(self.put_chunk, hexd, bytes(data), check_existing=check_existing))
                sizes.append(len(data))
                if len(pending) >= 4 * _WRITERS:  # bound the memory of chunks in flight
                    self._collect(pending, sizes, stats)
            self._collect(pending, sizes, stats)
        return ChunkTable(size=sum(n for _, n in chunks), chunks=chunks)

    @staticmethod
    def _collect(pending: list[Future[tuple[bool, int]]], sizes: list[int], stats: ChunkStats | None) -> None:
        for fut, raw in zip(pending, sizes, strict=True):
            new, stored = fut.result()
            if stats is not None:
                stats.add(new, raw, stored)
        pending.clear()
        sizes.clear()

    def add_file(self, path: Path, source: dict[str, Any], *, legacy_digest: str | None = None,
                 stats: ChunkStats | None = None) -> tuple[str, int]:
        """Store a finished EROFS file as a chunked layer; (layer digest, size). With `legacy_digest` the
        file is a whole-file layer being converted: its bytes must hash to that digest (ImageCorrupt
        otherwise) and the layer keeps it."""
        whole = hashlib.sha256() if legacy_digest else None
        with open(path, "rb") as f:
            table = self.store_stream(f, stats=stats, whole=whole)
        if whole is not None and f"sha256:{whole.hexdigest()}" != legacy_digest:
            raise ImageCorrupt(f"layer {legacy_digest} is corrupt (its file hashes to sha256:"
                               f"{whole.hexdigest()[:16]}…): it was not converted; rebuild or re-import the "
                               "images that use it (`shoal image verify` lists them)")
        digest = legacy_digest or table.digest
        self.publish(digest[7:], table, source, legacy=bool(legacy_digest))
        return digest, table.size

    def publish(self, layer_hex: str, table: ChunkTable, source: dict[str, Any], *, legacy: bool = False,
                created: float | None = None) -> None:
        """Write a layer's table, then its record (the record last: from then on the layer is visible)."""
        self.layers_dir.mkdir(parents=True, exist_ok=True)
        tpath = self.table_path(layer_hex)
        data = table.to_bytes()
        if not (tpath.exists() and _same_bytes(tpath, data)):
            atomic_write(tpath, data, mode=0o444)
        mpath = self.meta_path(layer_hex)
        if mpath.exists():
            with contextlib.suppress(ImageNotFound, ImageCorrupt):
                m = self.meta(layer_hex)
                if m.get("table") == table.digest:
                    self.touch(layer_hex)
                    return
        atomic_write_json(mpath, {"digest": f"sha256:{layer_hex}", "size": table.size,
                                  "created": created or time.time(), "source": source, "format": "chunked",
                                  "table": table.digest, "legacy": legacy, "chunker": table.chunker})

    def export(self, layer_hex: str, out: BinaryIO, table: ChunkTable | None = None) -> int:
        """Write a layer's whole bytes (every chunk checked) to `out`; returns the size."""
        t = table or self.table(layer_hex)
        for hexd, n in t.chunks:
            out.write(self.read_chunk(hexd, n))
        return t.size

    def iter_bytes(self, layer_hex: str) -> Iterator[bytes]:
        """A layer's bytes chunk by chunk, each checked."""
        t = self.table(layer_hex)
        for hexd, n in t.chunks:
            yield self.read_chunk(hexd, n)

    def verify(self, layer_hex: str, checked: dict[str, bool] | None = None,
               on_chunk: Callable[[int], None] | None = None) -> list[tuple[str, str]]:
        """Check every chunk of a layer; [(chunk hex, "missing"|"corrupt")] for the bad ones (a bad table:
        [("table", reason)]). `checked` remembers chunks already checked (shared chunks are read once)."""
        try:
            t = self.table(layer_hex)
        except (ImageCorrupt, ImageNotFound) as e:
            return [("table", e.message)]
        bad = []
        memo = checked if checked is not None else {}
        for hexd, n in t.unique().items():
            if hexd not in memo:
                ok = self.chunk_ok(hexd, n)
                memo[hexd] = ok
                if on_chunk:
                    on_chunk(n)
            if not memo[hexd]:
                bad.append((hexd, "missing" if not self.chunk_path(hexd).exists() else "corrupt"))
        return bad

    def iter_chunk_files(self) -> Iterator[tuple[str, Path]]:
        """Every chunk object in the store: (hex, path)."""
        if not self.chunks_dir.is_dir():
            return
        for sub in self.chunks_dir.iterdir():
            if len(sub.name) != 2 or not sub.is_dir():
                continue
            for p in sub.iterdir():
                if p.name.endswith(".zst") and len(p.name) == 68:
                    yield p.name[:64], p


def _same_bytes(path: Path, data: bytes) -> bool:
    try:
        return path.read_bytes() == data
    except OSError:
        return False
