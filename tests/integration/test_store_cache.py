"""The node's chunk cache (SHOAL_CHUNK_CACHE_MB): one cache of verified chunks for every layer of the node,
so a chunk two layers share is fetched once; bounded and LRU; chunks of layers not in use go first, and
chunks of a layer in use only while the store answers (they can be fetched again)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.config import Paths
from shoal.images.mounts import LayerMounts
from shoal.images.store import ImageStore, Layer
from shoal.node.teardown import stop_readers
from tests.integration.storeutil import busybox_tree

pytestmark = pytest.mark.root
MIB = 1 << 20


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[ImageStore, LayerMounts]]:
    home = Path(tempfile.mkdtemp(prefix="shc-", dir="/tmp"))
    store = ImageStore(tmp_path / "store")
    lm = LayerMounts(Paths(home=home, store=store.root))
    lm.keep_reader = True
    lm.daemon.readahead_kb = 0
    yield store, lm
    lm.reconcile(set())
    assert not lm.mounted()
    stop_readers(Paths(home=home, store=store.root))
    shutil.rmtree(home, ignore_errors=True)


def _layer(store: ImageStore, tmp: Path, tag: str, mib: int = 2, shared: bytes | None = None) -> Layer:
    tree = busybox_tree(Path(tempfile.mkdtemp(dir=tmp)), tag, filler_mib=mib)
    if shared is not None:
        (tree / "data" / "shared").write_bytes(shared)
    return store.add_layer_from_dir(tree, {"type": "test", "desc": tag})


def _cached_hexes(lm: LayerMounts) -> set[str]:
    return {p.name for p in lm.daemon.cache.rglob("*") if p.is_file() and len(p.name) == 64}


def test_a_chunk_two_layers_share_is_fetched_once(env: tuple[ImageStore, LayerMounts], tmp_path: Path) -> None:
    store, lm = env
    shared = os.urandom(3 * MIB)
    a = _layer(store, tmp_path, "a", mib=1, shared=shared)
    b = _layer(store, tmp_path, "b-longer-tag", mib=2, shared=shared)  # the file sits elsewhere in b
    (ma,) = lm.acquire([a], "sa")
    assert (ma / "data" / "shared").read_bytes() == shared
    before = lm.daemon.stats()["fetched_bytes"]
    (mb,) = lm.acquire([b], "sb")
    assert (mb / "data" / "shared").read_bytes() == shared
    again = lm.daemon.stats()["fetched_bytes"] - before
    assert again < len(shared) * 0.25, f"{again} bytes fetched again of {len(shared)} shared"
    lm.release([a.hex], "sa")
    lm.release([b.hex], "sb")


def test_the_cache_is_bounded_lru_and_prefers_to_keep_layers_in_use(env: tuple[ImageStore, LayerMounts],
                                                                      tmp_path: Path) -> None:
    store, lm = env
    used = _layer(store, tmp_path, "used", mib=3)
    idle = _layer(store, tmp_path, "idle", mib=3)
    (mi,) = lm.acquire([idle], "si")
    (mi / "data" / "m-filler").read_bytes()
    lm.release([idle.hex], "si")  # idle's chunks stay cached, its layer is no longer in use
    (mu,) = lm.acquire([used], "su")
    filler = (mu / "data" / "m-filler").read_bytes()
    idle_chunks = {h for h, _ in store.layer_table(idle.digest).chunks} & _cached_hexes(lm)
    used_chunks = {h for h, _ in store.layer_table(used.digest).chunks} & _cached_hexes(lm)
    assert idle_chunks and used_chunks
    st = lm.daemon.stats()
    # room for a bit more than the layer in use: idle's chunks go, the used layer's stay
    lm.daemon.set_limit(st["cache_bytes_of_open_layers"] // MIB + 1)
    st = lm.daemon.stats()
    left = _cached_hexes(lm)
    assert st["cache_bytes"] <= st["cache_limit"] and st["evicted_chunks"] > 0
    assert used_chunks <= left, "only chunks of the layer not in use went"
    assert len((idle_chunks - used_chunks) - left) == st["evicted_chunks"]
    # smaller than the layer in use: its least recently used chunks go too (the store can give them back),
    # and reads stay correct
    lm.daemon.set_limit(1)
    assert lm.daemon.stats()["cache_bytes"] <= MIB
    assert (mu / "data" / "z").read_bytes()  # metadata and z, fetched again as needed
    os.posix_fadvise(os.open(mu / "data" / "m-filler", os.O_RDONLY), 0, 0, os.POSIX_FADV_DONTNEED)
    assert (mu / "data" / "m-filler").read_bytes() == filler
    lm.release([used.hex], "su")


def test_chunks_of_a_layer_in_use_stay_while_the_store_fails(env: tuple[ImageStore, LayerMounts],
                                                            tmp_path: Path) -> None:
    """When the store stops answering, the chunks a mounted layer has in the cache are the only copy the node
    can get: they are not evicted, even past the limit (the cache waits for the store to answer again)."""
    store, lm = env
    used = _layer(store, tmp_path, "used", mib=3)
    other = _layer(store, tmp_path, "other", mib=1)
    (mu,) = lm.acquire([used], "su")
    (mu / "data" / "m-filler").read_bytes()
    held = {h for h, _ in store.layer_table(used.digest).chunks} & _cached_hexes(lm)
    # the store fails (not "missing", not "corrupt": an I/O error) for a chunk of another layer
    i, h = next((i, h) for i, (h, _) in enumerate(store.layer_table(other.digest).chunks) if h not in held)
    p = store.chunks.chunk_path(h)
    p.unlink()
    p.mkdir()  # reading a directory: EISDIR, as from a store whose servers fail
    lm.verify([other])  # its table goes to the reader (no mount)
    assert lm.daemon.prefetch(other.hex, [i]) == 1 and lm.daemon.wait_idle(60)
    st = lm.daemon.stats()
    assert not st["store_ok"] and st["store_errors"] >= 1 and st["corrupt_chunks"] == 0
    lm.daemon.set_limit(1)
    assert held <= _cached_hexes(lm), "a layer in use keeps its chunks while the store fails"
    assert lm.daemon.stats()["cache_bytes"] > MIB
    lm.release([used.hex], "su")
