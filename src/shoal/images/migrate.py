"""From whole-file layers to chunked ones: `shoal store migrate`, and conversion on first use.

A store written by earlier versions holds each layer as one EROFS file named by its sha256
(`layers/sha256/<hex>.erofs`). Converting a layer chunks that file into the store (shoal.images.chunkstore),
hashing the whole file on the way: only when it still hashes to the layer digest is the chunked record
published — under the same digest, so manifests, tags, caches and sandbox records stay valid. The record
says `legacy: true` and names the table by the table's own digest.

Older readers keep working: conversion leaves the whole file and its metadata in place (an older shoal
ignores `chunked/` and `chunks/`), so nodes of both versions can share a store while a cluster upgrades.
`shoal store migrate --drop-files` removes the whole files of converted layers once no older reader
remains (they can then no longer read those images). A node converts a layer on its first mount; several
nodes converting the same layer at once would each read it whole, so the first takes a claim
(`chunked/sha256/<hex>.converting`, shoal.images.claims) and the others wait for its record.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.errors import ImageCorrupt, ImageNotFound, StoreUnavailable
from shoal.images import claims
from shoal.images.chunkstore import ChunkStats

if TYPE_CHECKING:
    from shoal.images.store import ImageStore, Layer

#: how long a node waits for another node's conversion of a layer before doing it itself
WAIT_S = 600.0


def convert_layer(store: ImageStore, digest: str) -> Layer:
    """Convert one whole-file layer to chunks (a no-op for a chunked one); see the module docs."""
    lay = store.layer(digest)
    if lay.chunked:
        return lay
    hexd = lay.hex
    store.chunks.layers_dir.mkdir(parents=True, exist_ok=True)
    claim_path = store.chunks.layers_dir / f"{hexd}.converting"
    deadline = time.monotonic() + WAIT_S
    while True:
        claim = claims.Claim.try_take(claim_path)
        if claim is not None:
            break
        if store.chunks.has(hexd):
            return store.layer(digest)
        if claims.break_stale(claim_path, claims.CLAIM_TTL_S * 10):
            continue
        if time.monotonic() > deadline:
            raise StoreUnavailable(f"layer {digest} is being converted to chunks by another node for over "
                                   f"{WAIT_S:.0f} s; try again later")
        time.sleep(0.2)
    try:
        if not store.chunks.has(hexd):
            stats = ChunkStats()
            store.chunks.add_file(lay.path, lay.source, legacy_digest=digest, stats=stats)
            store.last_write = stats
    finally:
        with contextlib.suppress(FileNotFoundError):
            claim_path.unlink()
    return store.layer(digest)


def store_whole_file(store: ImageStore, path: Path, source: dict[str, Any]) -> str:
    """Store an EROFS file as a layer in the earlier whole-file format (`layers/sha256/<hex>.erofs`, named by
    the file's sha256); for benchmarks that compare with it and tests of the conversion. Returns the digest."""
    import hashlib
    import os

    from shoal.fsutil import atomic_write_json, tmp_name

    h = hashlib.sha256()
    store.layers_dir.mkdir(parents=True, exist_ok=True)
    tmp = store.layers_dir / tmp_name("whole-")
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        while b := src.read(1 << 20):
            h.update(b)
            dst.write(b)
    os.chmod(tmp, 0o444)
    final = store.layers_dir / f"{h.hexdigest()}.erofs"
    os.rename(tmp, final)
    atomic_write_json(store.layers_dir / f"{h.hexdigest()}.json",
                      {"digest": f"sha256:{h.hexdigest()}", "size": final.stat().st_size, "created": time.time(),
                       "source": source, "format": "erofs"})
    return f"sha256:{h.hexdigest()}"


@dataclass
class MigrateReport:
    """What `shoal store migrate` did."""

    converted: list[str] = field(default_factory=list)
    already: int = 0
    corrupt: list[dict[str, Any]] = field(default_factory=list)
    dropped_files: int = 0
    dropped_bytes: int = 0
    chunks_written: int = 0
    stored_bytes: int = 0
    whole_bytes: int = 0
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


def migrate_store(store: ImageStore, *, drop_files: bool = False, dry_run: bool = False,
                  progress: Callable[[str], None] | None = None) -> MigrateReport:
    """Convert every whole-file layer of the store to chunks; with `drop_files`, then delete the whole files
    of converted layers (older shoal versions can no longer read them)."""
    rep = MigrateReport(dry_run=dry_run)
    hexes = sorted(p.stem for p in store.layers_dir.glob("*.json") if len(p.stem) == 64)
    for h in hexes:
        digest = f"sha256:{h}"
        if store.chunks.has(h):
            rep.already += 1
        elif not store.layer_path(digest).exists():
            continue
        else:
            try:
                size = store.layer_path(digest).stat().st_size
            except FileNotFoundError:
                continue
            if progress:
                progress(f"converting {digest} ({size / 1048576:.0f} MiB)")
            if not dry_run:
                try:
                    convert_layer(store, digest)
                except ImageCorrupt as e:
                    rep.corrupt.append({"layer": digest, "error": e.message})
                    continue
                except ImageNotFound:
                    continue
                rep.chunks_written += store.last_write.new_chunks
                rep.stored_bytes += store.last_write.stored_bytes
            rep.whole_bytes += size
            rep.converted.append(digest)
        if drop_files and (store.chunks.has(h) or dry_run):
            f = store.layer_path(digest)
            with contextlib.suppress(OSError):
                rep.dropped_bytes += f.stat().st_size
                rep.dropped_files += 1
                if not dry_run:
                    # the whole file goes first: an older reader then sees "metadata but no data" (a clear
                    # error), never a layer that looks complete
                    f.unlink()
                    with contextlib.suppress(FileNotFoundError):
                        (store.layers_dir / f"{h}.json").unlink()
    return rep
