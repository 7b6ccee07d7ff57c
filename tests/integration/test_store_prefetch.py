"""Start records and prefetch (issue 28, item 4): the first sandbox of a layer records which chunks its start
read; a later first use of the layer on another node fetches that set in the background at once (its reads
then hit the node cache), and only once per node."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.images import prefetch
from shoal.images.store import ImageStore
from shoal.models import SandboxSpec
from tests.integration.storeutil import busybox_image, private_node
from tests.waiting import wait_for

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]
SPEC = {"memory_mb": 64}


async def test_the_first_start_is_recorded_and_later_nodes_prefetch_it_once(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    img = busybox_image(store, "bb:rec", tmp_path, filler_mib=4)
    layer = img.layers[0]
    assert prefetch.load(store.root, layer.hex) is None
    async with private_node(store.root) as a:
        info = await a.create(SandboxSpec(image="bb:rec", **SPEC))
        r = await a.exec(info.id, ["md5sum", "/data/a"])  # the first command: the start is complete
        assert r.exit_code == 0
        rec = wait_for(lambda: prefetch.load(store.root, layer.hex), what="the start record")
        touched = a.layer_mounts.daemon.touched(layer.hex)
        assert touched is not None and rec == touched[: len(rec)], "chunks in first-touch order"
        await a.close(info.id)
    async with private_node(store.root) as b:
        b.layer_mounts.daemon.readahead_kb = 0  # only the record and what is read is fetched
        info = await b.create(SandboxSpec(image="bb:rec", **SPEC))
        assert b.layer_mounts.daemon.wait_idle(60)
        st = b.layer_mounts.daemon.stats()
        # the mount itself may have read some of them first; the rest came from the record, in the background
        assert st["prefetched_chunks"] > 0 and st["fetched_chunks"] <= len(set(rec)) + 1, st
        before = st["fetched_chunks"]
        r = await b.exec(info.id, ["md5sum", "/data/a"])
        assert r.exit_code == 0
        assert b.layer_mounts.daemon.stats()["fetched_chunks"] == before, "the start's reads hit the node cache"
        again = await b.create(SandboxSpec(image="bb:rec", **SPEC))  # the layer is mounted: nothing to do
        await b.close(again.id)
        await b.close(info.id)
        # the layer was unmounted; a new first use on this node prefetches nothing: the chunks are cached
        info = await b.create(SandboxSpec(image="bb:rec", **SPEC))
        assert b.layer_mounts.daemon.wait_idle(60)
        assert b.layer_mounts.daemon.stats()["fetched_chunks"] == before, "once per node"
        await b.close(info.id)
