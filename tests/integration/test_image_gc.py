"""`shoal image gc`: removes what nothing references, never a layer in use, never a young layer."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from shoal.config import NodeConfig, Paths
from shoal.images.gc import collect_garbage
from shoal.images.mounts import LayerMounts
from shoal.images.store import ImageConfig, ImageStore, Layer

pytestmark = pytest.mark.root
OLD = time.time() - 10 * 86400


def _layer(store: ImageStore, tmp: Path, tag: str) -> Layer:
    d = tmp / f"tree-{tag}"
    d.mkdir(parents=True)
    (d / "file").write_text(tag)
    return store.add_layer_from_dir(d, {"type": "test", "desc": tag})


def _age(store: ImageStore, *digests: str) -> None:
    """Make layers (their record, table and chunks) and every manifest look old, as if written days ago."""
    for dg in digests:
        meta = store.chunks.meta_path(dg[7:])
        m = json.loads(meta.read_text())
        m["created"] = OLD
        os.chmod(meta, 0o644)
        meta.write_text(json.dumps(m))
        for p in (meta, store.chunks.table_path(dg[7:]), *_chunk_files(store, dg)):
            os.utime(p, (OLD, OLD))
    for p in store.manifests_dir.glob("*.json"):
        os.utime(p, (OLD, OLD))


def _chunk_files(store: ImageStore, digest: str) -> list[Path]:
    return [store.chunks.chunk_path(h) for h in store.layer_table(digest).unique()]


def test_gc_removes_only_what_nothing_references(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    paths = Paths(home=tmp_path / "home", store=store.root)
    keep = _layer(store, tmp_path, "keep")
    gone = _layer(store, tmp_path, "gone")
    loose = _layer(store, tmp_path, "loose")
    store.put_image("app:1", [keep.digest], ImageConfig())
    untagged = store.put_manifest([keep.digest, gone.digest])
    store.cache_put("steps", "c" * 64, {"layer": gone.digest})
    store.cache_put("steps", "d" * 64, {"layer": keep.digest})
    (store.tmp_dir / ".tmp-crashed").write_bytes(b"x" * 100)
    os.utime(store.tmp_dir / ".tmp-crashed", (OLD, OLD))
    _age(store, keep.digest, gone.digest, loose.digest)

    dry = collect_garbage(store, paths, grace_s=3600, dry_run=True)
    assert set(dry.removed_layers) == {gone.digest, loose.digest} and dry.removed_manifests == [untagged]
    assert store.has_layer(gone.digest) and store.has_layer(loose.digest), "a dry run removes nothing"

    kept = set(_chunk_files(store, keep.digest))
    freed = {p for d in (gone.digest, loose.digest) for p in _chunk_files(store, d)} - kept
    freed_bytes = sum(p.stat().st_size for p in freed)
    assert dry.freed_bytes == freed_bytes and dry.removed_chunks == len(freed)
    rep = collect_garbage(store, paths, grace_s=3600)
    assert set(rep.removed_layers) == {gone.digest, loose.digest}
    assert rep.removed_chunks == len(freed) > 0 and rep.freed_bytes == freed_bytes
    assert not any(p.exists() for p in freed) and all(p.exists() for p in kept)
    assert store.has_layer(keep.digest) and not store.has_layer(gone.digest) and not store.has_layer(loose.digest)
    assert store.list_manifests() == [store.resolve("app:1").digest]
    assert store.cache_get("steps", "c" * 64) is None and store.cache_get("steps", "d" * 64) is not None
    assert list(store.tmp_dir.iterdir()) == []
    assert store.resolve("app:1").layers[0].digest == keep.digest
    # nothing else to do the second time
    again = collect_garbage(store, paths, grace_s=3600)
    assert again.removed_layers == [] and again.removed_manifests == []


def test_gc_keeps_young_and_recently_used_layers(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    paths = Paths(home=tmp_path / "home", store=store.root)
    fresh = _layer(store, tmp_path, "fresh")  # maybe another host is about to tag it
    reused = _layer(store, tmp_path, "reused")
    _age(store, reused.digest)
    store.touch_layer(reused.digest)  # a build just found it in its cache
    busy = tmp_path / "store" / "tmp" / ".tmp-import-other-host"
    (busy / "layer0" / "deep").mkdir(parents=True)
    os.utime(busy, (OLD, OLD))
    (busy / "layer0" / "deep" / "file").write_text("being written")
    os.utime(busy / "layer0", (OLD, OLD))
    rep = collect_garbage(store, paths, grace_s=3600)
    assert rep.removed_layers == []
    assert set(rep.kept_young) == {fresh.digest, reused.digest}
    assert busy.exists(), "a temp dir with recent writes deep inside is an import in progress"
    assert collect_garbage(store, paths, grace_s=0).removed_layers != []


def test_gc_never_removes_a_layer_in_use(shoal_home: Path, base_image: str, tmp_path: Path) -> None:
    from shoal.images.compose import compose_images
    from shoal.models import SandboxSpec
    from shoal.node.node import Node

    store = ImageStore(tmp_path / "store")
    store.copy_image_from(ImageStore(Path(os.environ["SHOAL_STORE"])), "base:latest")
    top = _layer(store, tmp_path, "top")
    store.put_image("top:1", [top.digest])
    compose_images(store, "app:1", ["base", "top:1"])
    paths = Paths(home=shoal_home, store=store.root)

    async def go() -> None:
        async with Node(NodeConfig(paths=paths)) as node:
            info = await node.create(SandboxSpec(image="app:1"))
            try:
                store.remove_image("app:1")
                store.remove_image("top:1")
                _age(store, top.digest)
                rep = collect_garbage(store, paths, grace_s=0)
                assert top.digest in rep.kept_in_use and top.digest not in rep.removed_layers
                assert store.has_layer(top.digest)
                r = await node.exec(info.id, "cat /file")
                assert r.stdout == b"top"
                # a second SHOAL_HOME on this host (no records of ours) still sees the mount
                other = collect_garbage(store, Paths(home=tmp_path / "elsewhere", store=store.root), grace_s=0)
                assert top.digest in other.kept_in_use
            finally:
                await node.close(info.id)
        rep = collect_garbage(store, paths, grace_s=0)
        assert top.digest in rep.removed_layers, "after the last sandbox closed, the layer goes"
        assert store.exists("base")

    asyncio.run(go())


def test_gc_honours_leases_of_other_hosts(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    paths = Paths(home=tmp_path / "home", store=store.root)
    theirs = _layer(store, tmp_path, "theirs")
    mine = _layer(store, tmp_path, "mine")
    _age(store, theirs.digest, mine.digest)
    lease = store.leases_dir / theirs.hex / "otherhost-0123456789ab"
    lease.parent.mkdir(parents=True)
    lease.write_text(json.dumps({"host": "otherhost", "mountpoint": "/var/lib/shoal/layers/x", "since": OLD}))
    # a lease of this host whose mount is gone (crash): stale, dropped, and the layer is collected
    stale = store.leases_dir / mine.hex / LayerMounts(paths).lease_key
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"mountpoint": str(tmp_path / "gone")}))
    rep = collect_garbage(store, paths, grace_s=0)
    assert theirs.digest in rep.kept_in_use and store.has_layer(theirs.digest)
    assert mine.digest in rep.removed_layers and rep.stale_leases_removed == 1
    os.utime(lease, (OLD, OLD))
    rep = collect_garbage(store, paths, grace_s=0, lease_max_age_s=86400)
    assert theirs.digest in rep.removed_layers, "a lease older than --lease-max-age belongs to a dead host"


def test_gc_cleans_orphans(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    paths = Paths(home=tmp_path / "home", store=store.root)
    lay = _layer(store, tmp_path, "orphan")
    chunks = _chunk_files(store, lay.digest)
    _age(store, lay.digest)
    store.chunks.meta_path(lay.hex).unlink()  # a writer crashed between the table and the record
    rep = collect_garbage(store, paths, grace_s=3600)
    assert rep.removed_orphans == 1 and not store.chunks.table_path(lay.hex).exists()
    assert rep.removed_chunks == len(chunks) and not any(p.exists() for p in chunks)
