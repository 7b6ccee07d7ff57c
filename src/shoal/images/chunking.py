"""Split a layer's bytes into content-defined chunks, and the chunk table that names them.

A layer is stored as chunks addressed by the sha256 of their bytes, plus a *chunk table* listing them in
order. The layer's digest is the sha256 of its table's canonical bytes, so a manifest that names the
layer pins every chunk and therefore every byte (a Merkle tree of depth two). A node checks each chunk
against its digest when it first reads it, never the whole layer.

Chunk boundaries are content-defined at 4 KiB-block granularity: a chunk ends after a block whose CRC-32
is divisible by DIVISOR, once it has at least MIN_BLOCKS blocks, or at MAX_BLOCKS blocks. EROFS places
file data block-aligned, so the same file in two different layers — at different offsets — yields the
same blocks and, after at most a chunk, the same chunks: stored and fetched once. Fixed-size chunks only
match when the offsets agree modulo the chunk size. Measured (docs/images.md, "Chunk size"): on three
layers sharing 80 MiB of Python files at different offsets, ~64 KiB content-defined chunks left 75% of
the bytes unique against 88% for fixed 64 KiB chunks; starting python3 and importing json in the base
image touched 10.9% of its bytes in ~64 KiB chunks (16.4% with 256 KiB chunks), 4.3% once compressed.

Table (canonical JSON, sorted keys, no spaces):

    {"chunker": "cdc4k-16-12-256", "chunks": [["<hex>", <length>], ...], "schema": "shoal.chunks/v1",
     "size": <total bytes>}
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from shoal.errors import ImageCorrupt
from shoal.fsutil import canonical_json

BLOCK = 4096
MIN_BLOCKS = 4  # 16 KiB
DIVISOR = 12  # a cut after ~12 more blocks on average: chunks of ~64 KiB
MAX_BLOCKS = 64  # 256 KiB
CHUNKER = f"cdc4k-{MIN_BLOCKS * 4}-{DIVISOR}-{MAX_BLOCKS * 4}"
SCHEMA = "shoal.chunks/v1"
#: the largest chunk a table may name (the node's reader refuses larger ones)
MAX_CHUNK = 4 << 20
_READ = 16 << 20


def iter_chunks(f: BinaryIO) -> Iterator[bytes]:
    """The chunks of a stream, in order (their concatenation is the stream)."""
    crc = zlib.crc32
    cur = bytearray()
    blocks = 0
    tail = b""
    while True:
        data = f.read(_READ)
        if not data:
            break
        if tail:
            data = tail + data
            tail = b""
        mv = memoryview(data)
        n = len(data) // BLOCK
        if len(data) % BLOCK:
            # keep a partial block for the next read (or the end)
            tail = bytes(mv[n * BLOCK:])
        start = 0
        for b in range(n):
            blocks += 1
            lo = b * BLOCK
            if blocks >= MAX_BLOCKS or (blocks >= MIN_BLOCKS and crc(mv[lo:lo + BLOCK]) % DIVISOR == 0):
                if cur:  # the chunk began in an earlier read
                    cur += mv[start:lo + BLOCK]
                    yield bytes(cur)
                    cur = bytearray()
                else:
                    yield data[start:lo + BLOCK]
                blocks = 0
                start = lo + BLOCK
        cur += mv[start:n * BLOCK]
    cur += tail
    if cur:
        yield bytes(cur)


@dataclass
class ChunkTable:
    """The ordered chunks of one layer: (sha256 hex, length) each, covering `size` bytes."""

    size: int
    chunks: list[tuple[str, int]] = field(default_factory=list)
    chunker: str = CHUNKER

    def to_bytes(self) -> bytes:
        """The canonical bytes the layer digest is computed over."""
        return canonical_json({"chunker": self.chunker, "chunks": [[h, n] for h, n in self.chunks],
                               "schema": SCHEMA, "size": self.size})

    @property
    def digest(self) -> str:
        """`sha256:<hex>` of the canonical bytes (a new layer's digest)."""
        return "sha256:" + hashlib.sha256(self.to_bytes()).hexdigest()

    def offsets(self) -> list[int]:
        """Where each chunk starts in the layer."""
        out, at = [], 0
        for _, n in self.chunks:
            out.append(at)
            at += n
        return out

    def unique(self) -> dict[str, int]:
        """Each distinct chunk once: hex -> length."""
        return dict(self.chunks)

    @classmethod
    def from_bytes(cls, data: bytes, expect_digest: str | None = None, *, what: str = "a layer") -> ChunkTable:
        """Parse (and check against `expect_digest`) a table; ImageCorrupt when it does not match or parse."""
        if expect_digest is not None and "sha256:" + hashlib.sha256(data).hexdigest() != expect_digest:
            raise ImageCorrupt(f"the chunk table of {what} is corrupt: it does not hash to {expect_digest}; "
                               "rebuild or re-import the images that use it (`shoal image verify` lists them)")
        try:
            d = json.loads(data)
            chunks = [(str(h), int(n)) for h, n in d["chunks"]]
            t = cls(size=int(d["size"]), chunks=chunks, chunker=str(d.get("chunker", "")))
        except (ValueError, KeyError, TypeError) as e:
            raise ImageCorrupt(f"the chunk table of {what} cannot be read ({e})") from None
        if sum(n for _, n in chunks) != t.size or any(n <= 0 or n > MAX_CHUNK or len(h) != 64 for h, n in chunks):
            raise ImageCorrupt(f"the chunk table of {what} is inconsistent (chunk lengths do not add up to its size)")
        return t

    def to_node_binary(self) -> bytes:
        """The form shoal-chunkd reads (chunkd/chunkd.h): a header and 48 bytes per chunk."""
        parts = [b"SHCT0001", struct.pack("<QII", self.size, len(self.chunks), 0)]
        at = 0
        for h, n in self.chunks:
            parts.append(struct.pack("<QII", at, n, 0) + bytes.fromhex(h))
            at += n
        return b"".join(parts)


def table_of_file(path: Path) -> ChunkTable:
    """The chunk table of a file (hashing every chunk; nothing is stored)."""
    with open(path, "rb") as f:
        chunks = [(hashlib.sha256(c).hexdigest(), len(c)) for c in iter_chunks(f)]
    return ChunkTable(size=sum(n for _, n in chunks), chunks=chunks)
