"""Scheduling on a real Ray cluster (`ray.cluster_utils.Cluster`, 2 worker nodes on 127.0.0.1, one node
agent each): a low-priority job's idle sandboxes are paused when a high-priority burst arrives, and they
answer again after; a gang across nodes is all or nothing."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

import shoal
from shoal.node.admission import meminfo

pytest.importorskip("ray")
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(600)]
#: each node agent promises this much memory (MiB): four 256 MiB sandboxes fill a node
NODE_PROMISE_MB = 1024


@pytest.fixture(scope="module")
def small_cluster(shoal_home: Path, base_image: str):
    from shoal.cluster import control
    from shoal.cluster.local import LocalCluster
    from shoal.config import Paths
    from shoal.node.teardown import teardown_home

    store = Paths.from_env().store
    home = shoal_home / "cs"
    total = meminfo()["MemTotal"] // 1024
    env = {"SHOAL_MEMORY_OVERCOMMIT": repr((NODE_PROMISE_MB + 0.5) / total), "SHOAL_PREEMPT_IDLE_S": "2",
           "SHOAL_TIDES": "0"}
    lc = LocalCluster(2).start()
    try:
        control.up(lc.address, home=str(home), store=str(store), home_per_node=True, env=env)
        yield lc
    finally:
        with contextlib.suppress(Exception):
            control.down(lc.address, force=True)
        lc.shutdown()
        for d in sorted((home / "nodes").glob("*")) if (home / "nodes").exists() else []:
            asyncio.run(teardown_home(Paths.from_env(d, store), close_sandboxes=True))


async def test_a_high_priority_burst_pauses_idle_low_priority_sandboxes_which_answer_after(small_cluster) -> None:
    async with shoal.Client(small_cluster.url) as client:
        batch = client.job("datagen", priority="batch")
        low = await batch.create_many("base", n=8, memory_mb=256, ttl_s=900)
        assert all(isinstance(sb, shoal.Sandbox) for sb in low), low
        assert len({sb.info.node for sb in low}) == 2  # type: ignore[union-attr]
        for sb in low:
            await sb.write_file("/tmp/state", sb.id.encode())  # type: ignore[union-attr]
        await asyncio.sleep(3)  # idle past SHOAL_PREEMPT_IDLE_S
        step = client.job("run1/step1", priority="train-rollout")
        hi = await step.create_many("base", n=4, memory_mb=256, ttl_s=900)
        assert all(isinstance(sb, shoal.Sandbox) for sb in hi), hi
        states = [(await client.get(sb.id)).info for sb in low]  # type: ignore[union-attr]
        paused = [i for i in states if i.state == "paused"]
        assert len(paused) == 4 and all(i.extra.get("paused_by") == "preempt" for i in paused)
        # every paused one answers its next call, with its files as they were
        for sb in low:
            assert await sb.read_file("/tmp/state") == sb.id.encode()  # type: ignore[union-attr]
        assert all([(await client.get(sb.id)).info.state == "running" for sb in low])  # type: ignore[union-attr]
        await step.close_all()
        await batch.close_all()


async def test_a_gang_across_the_cluster_is_all_or_nothing(small_cluster) -> None:
    async with shoal.Client(small_cluster.url) as client:
        step = client.job("run1/step2", priority="eval")
        with pytest.raises(shoal.GangUnsatisfiable) as ei:
            await step.create_many("base", n=9, memory_mb=256, all_or_nothing=True, ttl_s=900)
        assert ei.value.available == 8 and await step.list() == []
        got = await step.create_many("base", n=8, memory_mb=256, all_or_nothing=True, ttl_s=900)
        assert len(got) == 8 and all(isinstance(sb, shoal.Sandbox) for sb in got)
        assert len({sb.info.node for sb in got}) == 2  # type: ignore[union-attr]
        assert await step.close_all() == 8
