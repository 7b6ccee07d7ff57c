"""The scheduler on a real node (crun/runc containers): jobs and gangs over both transports, preemption
that really pauses (freezer + reclaim) idle lower-priority sandboxes which answer again after, and a
compute-tide pass."""

from __future__ import annotations

import time

import pytest

import shoal
from shoal.host.cgroups import SandboxCgroup
from shoal.node import scheduling as node_scheduling
from shoal.node.admission import meminfo

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]
SMALL = {"memory_mb": 64}


def _frozen(sb_id: str) -> bool:
    st = SandboxCgroup(f"/shoal/{sb_id}").read("freezer", "freezer.state")
    if st is None:  # cgroup v2
        st = SandboxCgroup(f"/shoal/{sb_id}").read("memory", "cgroup.freeze")
        return (st or "").strip() == "1"
    return st.strip() in ("FROZEN", "FREEZING")


async def test_jobs_and_gangs_over_both_transports(any_client: shoal.Client) -> None:
    step = any_client.job(f"it-step-{time.monotonic_ns()}", priority="train-rollout", max_sandboxes=16)
    boxes = await step.create_many("base", n=3, all_or_nothing=True, **SMALL)
    assert len(boxes) == 3 and all(isinstance(b, shoal.Sandbox) for b in boxes)
    for b in boxes:
        assert b.info.labels["shoal.job"] == step.name and b.info.labels["shoal.priority"] == "train-rollout"
        assert (await b.exec("echo ok")).stdout == b"ok\n"  # type: ignore[union-attr]
    assert len(await step.list()) == 3
    # more than the node can promise (4,096 × 1 TiB, past SHOAL_MEMORY_OVERCOMMIT × RAM): refused at once,
    # nothing created
    big = any_client.job(f"it-big-{time.monotonic_ns()}", priority="train-rollout")
    with pytest.raises(shoal.GangUnsatisfiable) as ei:
        await big.create_many("base", n=4096, all_or_nothing=True, memory_mb=1 << 20)
    assert ei.value.requested == 4096 and ei.value.available < 4096
    assert await big.list() == []
    assert len(await step.list()) == 3
    assert await step.close_all() == 3
    # past the job's cap
    capped = any_client.job(f"it-capped-{time.monotonic_ns()}", max_sandboxes=1)
    await capped.create("base", **SMALL)
    with pytest.raises(shoal.QuotaExceeded):
        await capped.create("base", **SMALL)
    await capped.close_all()


async def test_preemption_pauses_idle_low_priority_sandboxes_and_they_answer_after(client: shoal.Client) -> None:
    node = client.transport.node  # type: ignore[attr-defined]
    batch = client.job("it-batch", priority="batch")
    low = [await batch.create("base", memory_mb=128) for _ in range(2)]
    for i, sb in enumerate(low):
        await sb.write_file("/tmp/state", f"step {i}\n".encode())
    node.scheduling.last_used[low[0].id] = time.time() - 3600  # idle an hour
    node.scheduling.last_used[low[1].id] = time.time() - 600
    total = meminfo()["MemTotal"] // 1024
    saved = node.config.memory_overcommit
    # shrink the node's promise to what is committed now plus 128 MiB: the next create does not fit
    node.config.memory_overcommit = (node.admission.snapshot().committed_mb + 128) / total
    try:
        rollout = client.job("it-rollout", priority="train-rollout")
        await rollout.create("base", memory_mb=64)  # fits
        hi = await rollout.create("base", memory_mb=128)  # needs the longest-idle batch sandbox's room
        assert hi.info.state == "running"
        info = await client.get(low[0].id)
        assert info.info.state == "paused" and _frozen(low[0].id)
        assert node.record(low[0].id).extra["paused_by"] == "preempt"
        assert (await client.get(low[1].id)).info.state == "running"
        with pytest.raises(shoal.CapacityExceeded):
            await client.job("it-batch-2", priority="batch").create("base", memory_mb=128)  # no one below batch
    finally:
        node.config.memory_overcommit = saved
    # the paused one answers its next call, with its files as they were
    assert (await low[0].read_file("/tmp/state")) == b"step 0\n"
    assert (await client.get(low[0].id)).info.state == "running" and not _frozen(low[0].id)


async def test_a_tide_pass_pauses_idle_sandboxes_when_memory_is_tight(client: shoal.Client,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    node = client.transport.node  # type: ignore[attr-defined]
    idle = await client.create("base", memory_mb=128, labels={"shoal.priority": "batch"})
    busy = await client.create("base", memory_mb=128, labels={"shoal.priority": "batch"})
    await idle.exec("head -c 20000000 /dev/urandom > /tmp/blob")  # page cache charged to it
    node.scheduling.last_used[idle.id] = time.time() - 3600
    total = meminfo()["MemTotal"] // 1024
    monkeypatch.setattr(node_scheduling, "_meminfo_mb", lambda: (total, int(total * 0.05)))
    paused = await node.scheduling.tide_once()
    assert idle.id in paused and busy.id not in paused
    rec = node.record(idle.id)
    assert rec.state == "paused" and rec.extra["paused_by"] == "tides" and "reclaim" in rec.extra
    assert (await idle.exec("wc -c < /tmp/blob")).stdout == b"20000000\n"
    assert (await client.get(idle.id)).info.state == "running"
