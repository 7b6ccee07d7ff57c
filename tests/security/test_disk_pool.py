"""Item 7 of issue 19: the upper pool is shared; sandboxes' disk limits add up to more than it holds.

Before the fix, with the pool full a bystander's 6-byte write failed with ENOSPC and new creates still
succeeded but could not write. Now a create that cannot get its disk is refused with CapacityExceeded,
and when the pool runs into its reserve every sandbox is clamped at what it holds (plus a little
slack): the writer filling the pool gets EDQUOT, the bystander's small write succeeds
(shoal.backends.container.disk_guard). The test runs in a private SHOAL_HOME whose pool is 1 GiB."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

import pytest

from shoal.backends.container.disk import UpperPool
from shoal.config import NodeConfig, Paths, settings
from shoal.errors import CapacityExceeded
from shoal.models import SandboxSpec
from shoal.node.node import Node
from shoal.node.teardown import purge_home, teardown_home

pytestmark = [pytest.mark.root, pytest.mark.timeout(600)]


@pytest.fixture
def small_pool_home(base_image: str) -> Paths:
    home = Path(tempfile.mkdtemp(prefix="shd-", dir="/tmp"))
    paths = Paths(home=home, store=Path(os.environ["SHOAL_STORE"]))
    pool = UpperPool(paths, settings(), size_gb=1)
    if not pool.ensure():
        pytest.skip(f"disk limits are not enforced here: {pool.reason}")
    yield paths
    asyncio.run(teardown_home(paths, close_sandboxes=True))
    purge_home(paths)


async def test_full_pool_refuses_creates_and_spares_bystanders(small_pool_home: Paths) -> None:
    async with Node(NodeConfig(paths=small_pool_home)) as node:
        st = os.statvfs(node.backend("container").upper_pool.mountpoint)
        capacity, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
        room_mb = (free - max(256 << 20, capacity // 20)) >> 20  # the default reserve: 5%, at least 256 MiB
        bystander = await node.create(SandboxSpec(image="base", disk_mb=64, memory_mb=128))
        # two writers, each admitted on its own, together promised more than the pool holds
        writers = [await node.create(SandboxSpec(image="base", disk_mb=room_mb - 64, memory_mb=256))
                   for _ in range(2)]
        rs = []
        for w in writers:
            rs.append(await node.exec(w.id, "dd if=/dev/zero of=/root/fill bs=1M count=4000 conv=fsync 2>&1; "
                                      "sync", timeout=600))
        assert any(b"Disk quota exceeded" in r.stdout for r in rs), [r.stdout[-300:] for r in rs]
        # the bystander still writes (6 bytes, and a little more), reads it back, and makes 20,000 new files:
        # metadata still has room (a 1 GiB pool without mixed block groups left data chunks holding all of the
        # disk and 8 MiB of metadata: ENOSPC at the 13,038th file, or at the first under load)
        r = await node.exec(bystander.id, "echo hello > /root/six && head -c 4M /dev/urandom > /root/more "
                            "&& sync && cat /root/six && mkdir /root/many && cd /root/many "
                            "&& seq 20000 | xargs touch && ls | wc -l")
        assert (r.exit_code, r.stdout) == (0, b"hello\n20000\n"), r
        assert "disk_clamped_mb" in (await node.get(writers[1].id)).extra
        # the pool is in its reserve: new creates are refused, not handed a disk they cannot write
        with pytest.raises(CapacityExceeded, match=r"disk pool has \d+ MiB free.*disk_mb=64"):
            await node.create(SandboxSpec(image="base", disk_mb=64, memory_mb=128))
        # space comes back: the clamps are lifted
        for w in writers:
            await node.exec(w.id, "rm -f /root/fill; sync")
        for _ in range(100):
            if "disk_clamped_mb" not in (await node.get(writers[1].id)).extra:
                break
            await asyncio.sleep(0.2)
        assert "disk_clamped_mb" not in (await node.get(writers[1].id)).extra
        assert (await node.exec(writers[1].id, "head -c 32M /dev/zero > /root/again && echo ok")).stdout == b"ok\n"
        # a create asking for more than the pool can give is refused up front
        with pytest.raises(CapacityExceeded, match="disk pool"):
            await node.create(SandboxSpec(image="base", disk_mb=room_mb + 512, memory_mb=128))
        await node.close_all()


async def test_hard_promises_with_disk_overcommit_1(small_pool_home: Paths) -> None:
    """disk_overcommit=1.0: the disk_mb of live sandboxes never adds up to more than the pool, so every
    sandbox can always write its whole disk_mb; closing one gives its promise back."""
    async with Node(NodeConfig(paths=small_pool_home)) as node:
        guard = node.backend("container").upper_pool.guard
        guard.overcommit = 1.0
        capacity, _ = guard.space()
        half = (capacity >> 20) // 2 - 16
        a = await node.create(SandboxSpec(image="base", disk_mb=half, memory_mb=128))
        b = await node.create(SandboxSpec(image="base", disk_mb=half, memory_mb=128))
        with pytest.raises(CapacityExceeded, match=r"promised \d+ MiB of disk; disk_mb=64 more"):
            await node.create(SandboxSpec(image="base", disk_mb=64, memory_mb=128))
        await node.close(b.id)
        c = await node.create(SandboxSpec(image="base", disk_mb=64, memory_mb=128))
        await node.close(c.id)
        await node.close(a.id)
