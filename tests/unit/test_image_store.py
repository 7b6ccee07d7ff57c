"""The layer store and image index: content addressing, atomic writes, concurrent writers, tags, caches."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest

from shoal.errors import ImageNotFound, InvalidRequest
from shoal.fsutil import sha256_file
from shoal.images.refs import parse_ref
from shoal.images.store import MAX_LAYERS, ImageConfig, ImageStore


def _tree(root: Path, n: int = 20, tag: str = "x") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"f{i}").write_text(f"{tag}{i}\n" * 50)
    (root / "sub").mkdir(exist_ok=True)
    (root / "sub" / "g").write_bytes(os.urandom(0) + tag.encode())
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [dirpath, *(os.path.join(dirpath, x) for x in dirnames + filenames)]:
            os.utime(name, (1_000_000, 1_000_000), follow_symlinks=False)
    return root


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")


def test_refs_are_validated() -> None:
    assert str(parse_ref("base")) == "base:latest"
    assert str(parse_ref("team/proj:v1.2")) == "team/proj:v1.2"
    # Docker's grammar (shoal.images.reference): an empty tag ("x:") is refused as Docker refuses it
    for bad in ("", "UPPER", "a..b", "x:bad tag", "-x", "x:", "a//b", "x@sha256:abc", "/abs"):
        with pytest.raises(InvalidRequest):
            parse_ref(bad)


def test_layers_are_content_addressed_and_deduplicated(store: ImageStore, tmp_path: Path) -> None:
    a = store.add_layer_from_dir(_tree(tmp_path / "a"), {"type": "test"})
    b = store.add_layer_from_dir(_tree(tmp_path / "b"), {"type": "test"})  # same content elsewhere
    assert a.digest == b.digest and a.chunked
    assert store.last_write.new_chunks == 0, "the second add stored nothing new"
    # the digest is the sha256 of the chunk table, and the table names every chunk by its sha256
    table = store.layer_table(a.digest)
    assert table.digest == a.digest == "sha256:" + sha256_file(store.chunks.table_path(a.hex))
    whole = tmp_path / "whole.erofs"
    store.export_layer(a.digest, whole)
    assert whole.stat().st_size == a.size == table.size
    data = whole.read_bytes()
    for (h, n), at in zip(table.chunks, table.offsets(), strict=True):
        assert hashlib.sha256(data[at:at + n]).hexdigest() == h
        assert store.chunks.chunk_path(h).stat().st_mode & 0o777 == 0o444
    assert len(store.list_layers()) == 1
    meta = json.loads(store.chunks.meta_path(a.hex).read_text())
    assert set(meta) >= {"digest", "size", "created", "source", "table"} and meta["format"] == "chunked"
    assert meta["size"] == a.size
    c = store.add_layer_from_dir(_tree(tmp_path / "c", tag="y"), {"type": "test"})
    assert c.digest != a.digest
    assert not any(store.tmp_dir.iterdir()), "temp files left behind"


def test_metadata_holds_no_host_paths(store: ImageStore, tmp_path: Path) -> None:
    lay = store.add_layer_from_dir(_tree(tmp_path / "src"), {"type": "test"})
    store.put_image("p:v1", [lay.digest], ImageConfig(workdir="/work"), lineage={"note": "x"})
    for p in store.root.rglob("*"):
        if p.is_file() and p.suffix not in (".erofs", ".zst"):
            text = p.read_text()
            assert str(tmp_path) not in text, f"{p} mentions a host path"


def test_images_tags_move_and_manifests_stay(store: ImageStore, tmp_path: Path) -> None:
    l1 = store.add_layer_from_dir(_tree(tmp_path / "a"), {"type": "t"})
    l2 = store.add_layer_from_dir(_tree(tmp_path / "b", tag="b"), {"type": "t"})
    v1 = store.put_image("proj:v1", [l1.digest], ImageConfig(env={"A": "1"}, workdir="/w", user="1000",
                                                               entrypoint=["/bin/sh"], cmd=["-c", "true"]))
    got = store.resolve("proj:v1")
    assert got.digest == v1.digest and got.config.env == {"A": "1"} and got.config.cmd == ["-c", "true"]
    assert [x.digest for x in got.layers] == [l1.digest]
    v2 = store.put_image("proj:v1", [l1.digest, l2.digest])
    assert store.resolve("proj:v1").digest == v2.digest != v1.digest
    # the old version is still reachable by digest: manifests never change
    old = store.resolve(f"proj@{v1.digest}")
    assert [x.digest for x in old.layers] == [l1.digest]
    assert {(i.name, i.tag) for i in store.list_images()} == {("proj", "v1")}
    store.remove_image("proj:v1")
    with pytest.raises(ImageNotFound, match="shoal image ls"):
        store.resolve("proj:v1")
    with pytest.raises(ImageNotFound, match="shoal image build base"):
        store.resolve("base")
    with pytest.raises(ImageNotFound):
        store.remove_image("proj:v1")


def test_bad_images_are_refused(store: ImageStore, tmp_path: Path) -> None:
    lay = store.add_layer_from_dir(_tree(tmp_path / "a"), {"type": "t"})
    with pytest.raises(ImageNotFound, match="not in the store"):
        store.put_image("x:1", ["sha256:" + "0" * 64])
    with pytest.raises(InvalidRequest):
        store.put_image("x:1", [])
    with pytest.raises(InvalidRequest, match="at most"):
        store.put_image("x:1", [lay.digest] * (MAX_LAYERS + 1))
    with pytest.raises(InvalidRequest):
        store.put_image("x@sha256:" + "1" * 64, [lay.digest])
    with pytest.raises(InvalidRequest):
        store.layer("sha256:xyz")
    assert store.list_images() == []


def test_damaged_tag_and_incomplete_image_give_clear_errors(store: ImageStore, tmp_path: Path) -> None:
    lay = store.add_layer_from_dir(_tree(tmp_path / "a"), {"type": "t"})
    store.put_image("x:1", [lay.digest])
    (store.tags_dir / "x" / "1").write_text("garbage")
    with pytest.raises(ImageNotFound, match="damaged tag"):
        store.resolve("x:1")
    store.put_image("y:1", [lay.digest])
    store.chunks.meta_path(lay.hex).unlink()  # the record vanished (e.g. someone rm'ed it): incomplete
    with pytest.raises(ImageNotFound, match="incomplete"):
        store.resolve("y:1")
    assert [i.ref for i in store.list_images()] == []


def _writer(root: str, src: str, n: int, q: multiprocessing.Queue) -> None:
    st = ImageStore(Path(root))
    out = []
    for _ in range(n):
        lay = st.add_layer_from_dir(Path(src), {"type": "race"})
        out.append(lay.digest)
    q.put(out)


def _checker(root: str, writers_done: Any, q: multiprocessing.Queue) -> None:
    # whenever a layer looks complete (its record present), its table and every chunk must already be whole;
    # it watches until the writers are done and then looks once more (never for a fixed time: on a busy host
    # the writers may not have made a layer within any given window)
    st = ImageStore(Path(root))
    bad = []
    seen = 0
    while True:
        last = writers_done.is_set()
        for h in st.chunks.list_hexes():
            seen += 1
            if st.chunks.verify(h):
                bad.append(h)
        if last:
            break
    q.put((seen, bad))


def test_concurrent_builders_of_the_same_layer_never_corrupt_it(store: ImageStore, tmp_path: Path) -> None:
    src = _tree(tmp_path / "src", n=200)
    ctx = multiprocessing.get_context("spawn")
    q: multiprocessing.Queue = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(store.root), str(src), 8, q)) for _ in range(2)]
    writers_done = ctx.Event()
    checker = ctx.Process(target=_checker, args=(str(store.root), writers_done, q))
    checker.start()
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in range(2)]
    writers_done.set()
    results.append(q.get(timeout=300))
    for p in [*procs, checker]:
        p.join(timeout=60)
        assert p.exitcode == 0
    digests = {d for r in results if isinstance(r, list) for d in r}
    (seen, bad) = next(r for r in results if isinstance(r, tuple))
    assert len(digests) == 1, "the same tree must give the same layer in every process"
    assert seen > 0 and bad == []
    lay = store.layer(digests.pop())
    assert store.verify_layer(lay.digest)
    assert not any(store.tmp_dir.iterdir())


def test_add_layer_file_heals_a_damaged_copy(store: ImageStore, tmp_path: Path) -> None:
    lay = store.add_layer_from_dir(_tree(tmp_path / "a"), {"type": "t"})
    good = tmp_path / "good.erofs"
    store.export_layer(lay.digest, good)
    h = store.layer_table(lay.digest).chunks[0][0]
    chunk = store.chunks.chunk_path(h)
    blob = chunk.read_bytes()
    os.chmod(chunk, 0o644)
    chunk.write_bytes(blob[: len(blob) // 2])  # a torn copy left by a crashed writer elsewhere
    assert not store.verify_layer(lay.digest)
    tmp = store.tmp_dir / "x.erofs"
    tmp.write_bytes(good.read_bytes())
    again = store.add_layer_file(tmp, {"type": "t"})
    assert again.digest == lay.digest
    assert store.verify_layer(lay.digest)


def test_caches_and_copies(store: ImageStore, tmp_path: Path) -> None:
    key = "a" * 64
    assert store.cache_get("steps", key) is None
    store.cache_put("steps", key, {"layer": None})
    assert store.cache_get("steps", key) == {"layer": None}
    (store.cache_dir / "steps" / f"{key}.json").write_text("{not json")
    assert store.cache_get("steps", key) is None  # unreadable = miss
    with pytest.raises(InvalidRequest):
        store.cache_get("../x", key)
    with pytest.raises(InvalidRequest):
        store.cache_get("steps", "../../etc/passwd")
    lay = store.add_layer_from_dir(_tree(tmp_path / "a"), {"type": "t"})
    store.put_image("src:1", [lay.digest])
    other = ImageStore(tmp_path / "other")
    img = other.copy_image_from(store, "src:1", "dst:2")
    assert img.ref == "dst:2" and img.layers[0].digest == lay.digest
    assert other.verify_layer(lay.digest)
