"""The optional node-local layer cache (SHOAL_LAYER_CACHE_MB): copy-and-verify on first mount, local
mounts afterwards, LRU eviction that never touches a mounted layer, corrupt layers never cached."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.config import Paths
from shoal.errors import ImageCorrupt
from shoal.images.cache import LayerCache
from shoal.images.mounts import LayerMounts, mount_source
from shoal.images.store import ImageStore, Layer
from tests.integration.storeutil import busybox_tree

pytestmark = pytest.mark.root
MIB = 1 << 20


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[ImageStore, Paths]]:
    home = Path(tempfile.mkdtemp(prefix="shc-", dir="/tmp"))
    store = ImageStore(tmp_path / "store")
    yield store, Paths(home=home, store=store.root)
    lm = LayerMounts(Paths(home=home, store=store.root))
    lm.reconcile(set())
    assert not lm.mounted()
    shutil.rmtree(home, ignore_errors=True)


def _layer(store: ImageStore, tmp: Path, tag: str, mib: int = 2) -> Layer:
    tree = busybox_tree(Path(tempfile.mkdtemp(dir=tmp)), tag, filler_mib=mib)
    return store.add_layer_from_dir(tree, {"type": "test", "desc": tag})


def _backing(mp: Path) -> str:
    src = mount_source(mp) or ""
    if src.startswith("/dev/loop"):
        return Path(f"/sys/block/{Path(src).name}/loop/backing_file").read_text().strip()
    return src


def test_first_mount_copies_and_verifies_later_mounts_hit(env: tuple[ImageStore, Paths], tmp_path: Path) -> None:
    store, paths = env
    layer = _layer(store, tmp_path, "hot")
    lm = LayerMounts(paths)
    lm.cache = LayerCache(paths.home / "layer-cache", limit_bytes=64 * MIB)
    mp = lm.acquire([layer], "sb1")[0]
    assert _backing(mp) == str(lm.cache.path(layer.hex)), "mounted from the local copy"
    assert lm.cache.copied_bytes == layer.size and lm.cache.misses == 1
    assert lm.verifier.hashed_bytes == 0, "the copy was the check: no second read"
    lm.release([layer.hex], "sb1")
    assert not lm.mounted()
    lm.acquire([layer], "sb2")
    lm.release([layer.hex], "sb2")
    assert lm.cache.hits == 1 and lm.cache.copied_bytes == layer.size, "the second mount reads no store bytes"


def test_lru_eviction_spares_mounted_layers(env: tuple[ImageStore, Paths], tmp_path: Path) -> None:
    store, paths = env
    a, b, c = (_layer(store, tmp_path, t) for t in ("a", "b", "c"))
    lm = LayerMounts(paths)
    lm.cache = LayerCache(paths.home / "layer-cache", limit_bytes=a.size + b.size + a.size // 2)
    lm.acquire([a], "keep")  # stays mounted: never evicted
    lm.acquire([b], "x")
    lm.release([b.hex], "x")
    lm.acquire([c], "y")  # needs room: b (not mounted) goes, a (mounted, older) stays
    lm.release([c.hex], "y")
    assert lm.cache.path(a.hex).exists() and lm.cache.path(c.hex).exists()
    assert not lm.cache.path(b.hex).exists() and lm.cache.evicted == 1
    assert lm.cache.usage() <= lm.cache.limit
    lm.release([a.hex], "keep")


def test_a_corrupt_layer_is_never_cached_and_a_too_big_one_mounts_from_the_store(
        env: tuple[ImageStore, Paths], tmp_path: Path) -> None:
    import os

    store, paths = env
    bad = _layer(store, tmp_path, "bad")
    os.chmod(bad.path, 0o644)
    with open(bad.path, "r+b") as f:
        f.seek(bad.size // 2)
        f.write(b"\xff" * 32)
    big = _layer(store, tmp_path, "big", mib=6)
    lm = LayerMounts(paths)
    lm.cache = LayerCache(paths.home / "layer-cache", limit_bytes=4 * MIB)
    with pytest.raises(ImageCorrupt):
        lm.acquire([bad], "sb")
    assert not list((paths.home / "layer-cache").glob("*")), "no copy, no temp file left"
    mp = lm.acquire([big], "sb")[0]
    assert _backing(mp) == str(big.path)
    lm.release([big.hex], "sb")
