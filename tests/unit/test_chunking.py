"""Chunked layers without root: the content-defined chunker, chunk tables and their digests, chunk objects
(dedup, checks, healing), converting whole-file layers (`shoal store migrate`), corrupt marks, start
records, and gc of chunks. The node's reader (FUSE, root) is tested in tests/integration/test_store_chunks.py."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import time
from pathlib import Path

import pytest

from shoal.errors import ImageCorrupt
from shoal.images import corruption, prefetch
from shoal.images.chunking import BLOCK, MAX_BLOCKS, MIN_BLOCKS, ChunkTable, iter_chunks, table_of_file
from shoal.images.gc import collect_garbage
from shoal.images.migrate import migrate_store
from shoal.images.store import ImageStore


def _bytes(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def test_chunks_cover_the_stream_on_block_boundaries_within_their_bounds() -> None:
    data = _bytes(3 << 20, 1) + b"\0" * (1 << 20) + b"tail"
    chunks = list(iter_chunks(io.BytesIO(data)))
    assert b"".join(chunks) == data
    for c in chunks[:-1]:
        assert len(c) % BLOCK == 0 and MIN_BLOCKS * BLOCK <= len(c) <= MAX_BLOCKS * BLOCK
    # the same bytes give the same chunks however the stream is read
    class Trickle(io.BytesIO):
        def read(self, n: int = -1) -> bytes:
            return super().read(min(n, 10_000) if n and n > 0 else 10_000)

    assert list(iter_chunks(Trickle(data))) == chunks


def test_the_same_data_at_another_block_offset_gives_the_same_chunks() -> None:
    """Why content-defined: a file placed at another offset in another layer shares its chunks (after the
    first), where fixed-size chunks would share none unless the offsets agree modulo the chunk size."""
    file = _bytes(4 << 20, 7)
    a = list(iter_chunks(io.BytesIO(_bytes(5 * BLOCK, 1) + file)))
    b = list(iter_chunks(io.BytesIO(_bytes(11 * BLOCK, 2) + file)))
    ha = {hashlib.sha256(c).digest() for c in a}
    shared = sum(len(c) for c in b if hashlib.sha256(c).digest() in ha)
    assert shared > 0.8 * len(file), shared / len(file)
    fixed = 64 << 10
    fa = {hashlib.sha256((_bytes(5 * BLOCK, 1) + file)[i:i + fixed]).digest() for i in range(0, len(file), fixed)}
    fb = [(_bytes(11 * BLOCK, 2) + file)[i:i + fixed] for i in range(0, len(file), fixed)]
    assert not any(hashlib.sha256(c).digest() in fa for c in fb), "fixed chunks miss the shift"


def test_a_table_digest_pins_every_chunk_and_a_bad_table_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(_bytes(1 << 20, 3))
    t = table_of_file(p)
    assert t.size == 1 << 20 and sum(n for _, n in t.chunks) == t.size
    again = ChunkTable.from_bytes(t.to_bytes(), t.digest)
    assert again == t and again.digest == t.digest
    changed = ChunkTable(size=t.size, chunks=[("0" * 64, t.chunks[0][1]), *t.chunks[1:]])
    assert changed.digest != t.digest, "a different chunk is a different layer"
    with pytest.raises(ImageCorrupt, match="does not hash"):
        ChunkTable.from_bytes(changed.to_bytes(), t.digest)
    bad = json.loads(t.to_bytes())
    bad["size"] += 1
    with pytest.raises(ImageCorrupt, match="inconsistent"):
        ChunkTable.from_bytes(json.dumps(bad).encode())
    binary = t.to_node_binary()
    assert binary[:8] == b"SHCT0001" and len(binary) == 24 + 48 * len(t.chunks)


def _layer(store: ImageStore, tmp_path: Path, data: bytes, name: str = "l.erofs") -> str:
    f = store.tmp_dir / name
    f.write_bytes(data)
    return store.add_layer_file(f, {"type": "test"}).digest


def test_identical_chunks_across_layers_are_stored_once(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    shared = _bytes(2 << 20, 5)
    _layer(store, tmp_path, _bytes(8 * BLOCK, 1) + shared)
    first = store.last_write
    _layer(store, tmp_path, _bytes(3 * BLOCK, 2) + shared)
    second = store.last_write
    assert second.reused_bytes > 0.8 * len(shared), second.reused_bytes
    assert second.stored_bytes < 0.3 * first.stored_bytes
    objs = list(store.chunks.iter_chunk_files())
    assert len(objs) == len({h for h, _ in objs})


def test_a_damaged_chunk_is_detected_on_read_and_replaced_by_a_rewrite(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    data = _bytes(1 << 20, 9)
    d = _layer(store, tmp_path, data)
    h, n = store.layer_table(d).chunks[1]
    p = store.chunks.chunk_path(h)
    os.chmod(p, 0o644)
    import zstandard

    raw = bytearray(zstandard.ZstdDecompressor().decompress(p.read_bytes()))
    raw[100] ^= 1
    p.write_bytes(zstandard.ZstdCompressor().compress(bytes(raw)))
    with pytest.raises(ImageCorrupt, match=h):
        store.chunks.read_chunk(h, n)
    assert store.chunks.verify(d[7:]) == [(h, "corrupt")]
    p.unlink()
    assert store.chunks.verify(d[7:]) == [(h, "missing")]
    with pytest.raises(ImageCorrupt):
        store.export_layer(d, tmp_path / "out")
    _layer(store, tmp_path, data)  # the same layer again (a rebuild or re-import)
    assert store.chunks.verify(d[7:]) == [] and store.verify_layer(d)


def _legacy_layer(store: ImageStore, data: bytes) -> str:
    """A layer as an earlier shoal stored it: one whole file named by its sha256, and its metadata."""
    hexd = hashlib.sha256(data).hexdigest()
    f = store.layers_dir / f"{hexd}.erofs"
    f.write_bytes(data)
    os.chmod(f, 0o444)
    (store.layers_dir / f"{hexd}.json").write_text(json.dumps({"digest": f"sha256:{hexd}", "size": len(data),
                                                              "created": time.time(), "source": {"t": 1},
                                                              "format": "erofs"}))
    return f"sha256:{hexd}"


def test_a_whole_file_layer_converts_in_place_keeping_its_digest_and_its_file(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    data = _bytes(1 << 20, 11)
    d = _legacy_layer(store, data)
    img = store.put_image("old:1", [d])
    lay = store.layer(d)
    assert not lay.chunked and store.verify_layer(d)
    conv = store.convert_layer(d)
    assert conv.chunked and conv.digest == d and conv.table != d
    assert store.resolve("old:1").digest == img.digest, "manifests and tags unchanged"
    assert lay.path.read_bytes() == data, "older readers still find the whole file"
    out = tmp_path / "out"
    store.export_layer(d, out)
    assert out.read_bytes() == data
    # the record cannot redirect a converted layer to another table silently: the table is checked
    meta = json.loads(store.chunks.meta_path(d[7:]).read_text())
    meta["table"] = "sha256:" + "1" * 64
    store.chunks.meta_path(d[7:]).write_text(json.dumps(meta))
    with pytest.raises(ImageCorrupt, match="does not hash"):
        store.layer_table(d)


def test_store_migrate_converts_everything_and_refuses_a_corrupt_whole_file(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    good = _legacy_layer(store, _bytes(300_000, 1))
    bad = _legacy_layer(store, _bytes(300_000, 2))
    f = store.layer_path(bad)
    os.chmod(f, 0o644)
    with open(f, "r+b") as fh:
        fh.seek(1000)
        fh.write(b"\xff\xfe")
    rep = migrate_store(store)
    assert rep.converted == [good] and [c["layer"] for c in rep.corrupt] == [bad]
    assert store.layer(good).chunked and not store.layer(bad).chunked
    assert not store.chunks.has(bad[7:]), "a file that does not hash to its digest is never published"
    rep = migrate_store(store, drop_files=True)
    assert rep.already == 1 and rep.dropped_files == 1
    assert not store.layer_path(good).exists() and store.layer(good).chunked and store.verify_layer(good)


def test_corrupt_marks_refuse_images_with_a_typed_error_and_clear(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = ImageStore(root)
    d = _layer(store, tmp_path, _bytes(200_000, 4))
    corruption.check_layers(root, [d])
    corruption.mark(root, d[7:], "c" * 64, "corrupt")
    with pytest.raises(ImageCorrupt) as ei:
        corruption.check_layers(root, [d], what="image x:1")
    assert d in ei.value.message and "sha256:" + "c" * 64 in ei.value.message
    assert str(tmp_path) not in ei.value.message
    assert corruption.clear(root, d[7:]) and not corruption.read_marks(root)
    corruption.check_layers(root, [d])


def test_start_records_first_writer_wins(tmp_path: Path) -> None:
    h = "ab" * 32
    assert prefetch.load(tmp_path, h) is None
    assert prefetch.save(tmp_path, h, [3, 1, 2], 3 << 16)
    assert not prefetch.save(tmp_path, h, [9], 1 << 16)
    assert prefetch.load(tmp_path, h) == [3, 1, 2]
    prefetch.remove(tmp_path, h)
    assert prefetch.load(tmp_path, h) is None


def test_gc_removes_chunks_no_layer_names_and_keeps_shared_ones(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    shared = _bytes(1 << 20, 6)
    a = _layer(store, tmp_path, _bytes(4 * BLOCK, 1) + shared)
    b = _layer(store, tmp_path, _bytes(6 * BLOCK, 2) + shared)
    store.put_image("a:1", [a])
    store.put_image("b:1", [b])
    only_b = {h for h, _ in store.layer_table(b).chunks} - {h for h, _ in store.layer_table(a).chunks}
    assert only_b
    store.remove_image("b:1")
    dry = collect_garbage(store, grace_s=0, dry_run=True)
    assert dry.removed_layers == [b] and dry.removed_chunks == len(only_b)
    assert store.has_layer(b), "a dry run removes nothing"
    rep = collect_garbage(store, grace_s=0)
    assert rep.removed_layers == [b] and rep.removed_chunks == len(only_b) and rep.freed_bytes > 0
    left = {h for h, _ in store.chunks.iter_chunk_files()}
    assert not (left & only_b) and store.verify_layer(a)
    # a chunk re-used by a writer just now is young: gc's grace period keeps it even when no table names it yet
    c = _layer(store, tmp_path, _bytes(4 * BLOCK, 1) + shared)  # == a
    assert c == a
    assert collect_garbage(store, grace_s=3600).removed_chunks == 0
