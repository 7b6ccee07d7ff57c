"""A shared store that goes away (issue 14, "Outage"), on the session's MooseFS cluster: creates fail fast
with StoreUnavailable; running sandboxes keep the pages they have read (and the node's chunk cache keeps the
chunks); a read of a chunk never fetched fails with EIO within the client's bound (mfstimeout) instead of
hanging, and is never taken for corruption; when the servers come back, the same read works in the same
sandbox, and creates work again; nothing leaks (mounts, loop devices, processes).

Every wait here is bounded (pytest timeout per test, bounded retry loops)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from shoal.errors import StoreUnavailable
from shoal.images import moosefs as mfs
from shoal.images.store import ImageStore
from shoal.models import SandboxSpec
from tests.integration.storeutil import busybox_image, loops_backed_by, private_node

pytestmark = [pytest.mark.root, pytest.mark.timeout(240)]
SPEC = {"memory_mb": 64}
T = TypeVar("T")


async def _eventually(fn: Callable[[], Awaitable[T]], within_s: float = 60.0) -> T:
    """Retry `fn` until it returns without raising (the servers need a moment to re-register)."""
    end = time.monotonic() + within_s
    while True:
        try:
            return await fn()
        except Exception:
            if time.monotonic() > end:
                raise
            await asyncio.sleep(0.5)


def _failed_cleanly(r: object) -> bool:
    """A read of a page the store could not deliver: EIO reported by the program — or SIGBUS when the
    program's own code page was not in memory (evicted under memory pressure, or never read)."""
    return r.exit_code != 0 and (b"Input/output error" in r.stderr or r.signal == 7)  # type: ignore[attr-defined]


@pytest.fixture
def mfs_store(moosefs: mfs.MooseFsCluster) -> object:
    root = Path(tempfile.mkdtemp(prefix="store-", dir=moosefs.mountpoint))
    yield root
    mfs.ensure_running(moosefs)  # a failed test must not leave the session's cluster down
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("mode", ["loop", "file"])
async def test_chunkservers_stop_during_a_run(moosefs: mfs.MooseFsCluster, mfs_store: Path, tmp_path: Path,
                                              mode: str) -> None:
    """Layers recover in place when the servers return, file-backed or through a loop device: the node's
    reader opens a chunk's object afresh for every fetch, so a handle MooseFS' client poisoned during the
    outage is never used again; a failed fetch is a store error (retried), not a corrupt chunk."""
    store = ImageStore(mfs_store)
    busybox_image(store, "bb:outage", tmp_path)
    busybox_image(store, "bb:other", tmp_path, filler_mib=1)
    async with private_node(mfs_store) as node:
        node.layer_mounts.mode = mode
        node.store_health.timeout_s = 2.0
        info = await node.create(SandboxSpec(image="bb:outage", **SPEC))
        before = await node.exec(info.id, ["md5sum", "/data/a"])
        assert before.exit_code == 0
        # every page of the sandbox's one program, error paths included (see below)
        assert (await node.exec(info.id, ["md5sum", "/bin/busybox"])).exit_code == 0
        for cs in moosefs.chunkservers:
            mfs.stop_chunkserver(moosefs, cs, kill=True)
        try:
            # pages the sandbox read before the outage are still there
            again = await node.exec(info.id, ["md5sum", "/data/a"], timeout=60)
            assert again.exit_code == 0 and again.stdout == before.stdout
            # a page never fetched: an I/O error after the client's bound, not a hang. (The program's code
            # is all in memory; a program that faults on a code page never fetched dies of SIGBUS instead:
            # without the warm-up above, busybox's error path did.)
            r = await node.exec(info.id, ["md5sum", "/data/z"], timeout=120)
            assert _failed_cleanly(r), r
            assert (await node.exec(info.id, ["echo", "alive"])).stdout == b"alive\n"
            # a new create (another image: its layer is not mounted here) fails fast and typed
            with pytest.raises(StoreUnavailable, match="SHOAL_STORE"):
                await node.create(SandboxSpec(image="bb:other", **SPEC))
        finally:
            mfs.ensure_running(moosefs)

        async def read_z() -> bytes:
            r = await node.exec(info.id, ["wc", "-c", "/data/z"], timeout=60)
            assert r.exit_code == 0, r
            return r.stdout

        assert (await _eventually(read_z)).split()[0] == b"65536", "the sandbox recovers"
        st = node.layer_mounts.daemon.stats()
        assert st["store_errors"] >= 1 and st["corrupt_chunks"] == 0 and st["missing_chunks"] == 0
        assert not (mfs_store / "corrupt").exists(), "an outage is not corruption: nothing is marked"
        # the servers are back: a create of the other image (its layer read from the store) succeeds again
        other = await _eventually(lambda: node.create(SandboxSpec(image="bb:other", **SPEC)))
        assert (await node.exec(other.id, ["cat", "/data/tag"])).exit_code == 0
        await node.close(other.id)
        await node.close(info.id)
        assert not node.layer_mounts.mounted()
    assert not loops_backed_by(str(mfs_store))
    assert len(mfs._mfsmount_pids(Path(moosefs.mountpoint))) == 1


async def test_creates_fail_fast_while_the_master_is_down(moosefs: mfs.MooseFsCluster, mfs_store: Path,
                                                          tmp_path: Path) -> None:
    """With the metadata server gone even resolving an image is impossible: a create fails with
    StoreUnavailable (a bounded probe, off the event loop); after a restart, creates work again."""
    store = ImageStore(mfs_store)
    busybox_image(store, "bb:master", tmp_path, filler_mib=1)
    async with private_node(mfs_store) as node:
        node.store_health.timeout_s = 2.0
        mfs.stop_master(moosefs)
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await node.create(SandboxSpec(image="bb:master", **SPEC))
            first = time.monotonic() - t0
            # the node agent's loop stayed responsive meanwhile (the probe ran in a thread)
            assert await node.list() == []
            with pytest.raises(StoreUnavailable):
                await node.create(SandboxSpec(image="bb:master", **SPEC))
        finally:
            mfs.ensure_running(moosefs)
        info = await _eventually(lambda: node.create(SandboxSpec(image="bb:master", **SPEC)))
        assert (await node.exec(info.id, ["cat", "/data/tag"])).exit_code == 0
        await node.close(info.id)
    print(f"first refusal after {first:.1f} s")
