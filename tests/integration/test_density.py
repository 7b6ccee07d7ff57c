"""Density by default (issue 16) on real containers: admission with the default settings, the host and
node agent kept out of the OOM killer's reach, memory bombs dying inside their own sandboxes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import shoal
from shoal.host import cgroups, oom
from shoal.host.memory import meminfo
from shoal.node.protect import SANDBOX_PARENT, auto_reserve_mb
from tests.waiting import async_wait_for

pytestmark = [pytest.mark.root]


def _parent_limit_mb() -> int:
    mode = cgroups.cgroup_mode()
    d = cgroups.CGROUP_ROOT / SANDBOX_PARENT if mode == "v2" else cgroups.CGROUP_ROOT / "memory" / SANDBOX_PARENT
    raw = (d / ("memory.max" if mode == "v2" else "memory.limit_in_bytes")).read_text().strip()
    return int(raw) >> 20


async def test_node_keeps_the_oom_killer_on_sandbox_processes(client: shoal.Client) -> None:
    node = client.transport.node
    prot = node.protection
    assert prot is not None and prot.cgroup_mode == cgroups.cgroup_mode()
    total_mb = meminfo()["MemTotal"] // 1024
    # the sandboxes together can never take the memory the host and the node agent run in
    assert prot.sandbox_limit_mb == total_mb - auto_reserve_mb(total_mb) == _parent_limit_mb(), prot
    if oom.can_lower():
        assert prot.node_oom_score_adj == oom.NODE_OOM_SCORE_ADJ
    else:
        assert prot.node_oom_score_adj == oom.read_adj() and any("CAP_SYS_RESOURCE" in n for n in prot.notes)
    sb = await client.create("base")
    agent = node.record(sb.id).init_pid
    # what the sandbox runs goes first in any OOM; its agent after everything it runs
    r = await sb.exec("cat /proc/self/oom_score_adj")
    assert int(r.stdout) == oom.SANDBOX_OOM_SCORE_ADJ
    assert oom.read_adj(agent) < oom.SANDBOX_OOM_SCORE_ADJ
    sh = await sb.shell()
    assert int((await sh.run("cat /proc/self/oom_score_adj")).stdout) == oom.SANDBOX_OOM_SCORE_ADJ
    # and a process cannot lower itself below the floor the runtime set (where the node may set floors)
    low = await sb.exec("echo -500 > /proc/self/oom_score_adj")
    assert low.exit_code != 0, "a sandbox process lowered its own OOM score below 0"
    if oom.can_lower():
        r = await sb.exec("echo 0 > /proc/self/oom_score_adj")
        assert r.exit_code != 0, "a sandbox process lowered its own OOM score below its floor"


def _oom_kills(cgroup: str) -> int:
    cg = cgroups.SandboxCgroup(cgroup)
    if cg.mode == "v2":
        text = cg.read("memory", "memory.events") or ""
    else:
        text = cg.read("memory", "memory.oom_control") or ""
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == "oom_kill":
            return int(v)
    return 0


async def test_memory_bombs_die_in_their_own_sandboxes(client: shoal.Client) -> None:
    """A smaller version of the benchmark's abuse phase (`shoal bench abuse`): idle sandboxes, each with a
    process of its own, beside memory bombs; every bomb is killed in its sandbox and nothing else is."""
    node = client.transport.node
    idle = [s for s in await client.create_many("base", 40) if isinstance(s, shoal.Sandbox)]
    assert len(idle) == 40
    # each idle sandbox keeps a process we can look for afterwards
    await asyncio.gather(*(s.exec("sleep 100000 >/dev/null 2>&1 &") for s in idle))
    before = {s.id: (await s.exec("pgrep -c sleep")).stdout for s in idle}
    assert set(before.values()) == {b"1\n"}
    bombs = [s for s in await client.create_many("base", 4, memory_mb=96) if isinstance(s, shoal.Sandbox)]
    bomb = "b = []\nwhile True:\n    b.append(bytearray(8 << 20))\n"
    # with swap (the node's zram), a bomb swaps through its memory_mb of swap as `batch` before the OOM: ~25 s
    # here on a quiet machine, minutes on a loaded one
    results = await asyncio.gather(*(b.exec(["python3", "-c", bomb], timeout=900) for b in bombs))
    assert [(r.exit_code, r.timed_out) for r in results] == [(137, False)] * 4, results
    for b in bombs:
        assert _oom_kills(node.record(b.id).cgroup) >= 1
        assert (await b.exec("echo alive")).stdout == b"alive\n"  # its agent survived its own OOM
    after = {s.id: (await s.exec("pgrep -c sleep")).stdout for s in idle}
    assert after == before, "an idle sandbox lost a process"
    assert all(_oom_kills(node.record(s.id).cgroup) == 0 for s in idle)
    await asyncio.gather(*(s.close() for s in idle + bombs))


@pytest.mark.slow
async def test_default_spec_is_admitted_past_the_old_promise_limit(shoal_home: Path, base_image: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With default settings, creates are admitted on measured memory: more 1 GiB sandboxes than the old
    default promise limit (4 × RAM: 96 sandboxes on a 24 GiB host) allowed.

    The node shares the session's SHOAL_HOME: sandboxes other tests (or the session's `shoal serve`) left
    alive there are adopted at its start and count too, so the test measures its own sandboxes' share of
    the commitment beside theirs."""
    monkeypatch.delenv("SHOAL_MEMORY_OVERCOMMIT", raising=False)
    async with shoal.Client() as c:
        node = c.transport.node
        adm = node.admission
        old_limit_mb = int(adm.snapshot().total_mb * 4)
        others = adm.live_ids()
        n = old_limit_mb // 1024 + 10
        if n > 400:
            pytest.skip(f"this host's RAM allowed {n - 10} sandboxes of 1 GiB at the old limit already")
        items = await c.create_many("base", n)
        ok = [s for s in items if isinstance(s, shoal.Sandbox)]
        assert len(ok) == n, [str(e) for e in items if not isinstance(e, shoal.Sandbox)][:3]
        snap = adm.snapshot()
        # ours alone are past the old limit, and the commitment is exactly theirs plus ours (nothing pending)
        assert adm.committed_to(s.id for s in ok) == n * 1024
        assert snap.committed_mb == n * 1024 + adm.committed_to(others), (snap, others)
        assert snap.committed_mb > old_limit_mb and snap.room > 0
        await asyncio.gather(*(s.close() for s in ok))


async def test_pressure_pauses_and_reclaims_idle_sandboxes_before_a_refusal(client: shoal.Client) -> None:
    """Real pause + reclaim by the pressure response. The watermark is put above what this host has free
    (so the outcome does not depend on what else runs here): the idle sandboxes are paused and reclaimed,
    the create is still refused and says so, and the paused ones answer their next call."""
    node = client.transport.node
    idle_boxes = [await client.create("base", memory_mb=128) for _ in range(3)]
    busy = await client.create("base", memory_mb=128)
    for sb in idle_boxes:  # something to give back: 32 MiB of shared memory each (swap-backed)
        r = await sb.exec("head -c 32M /dev/zero > /dev/shm/blob && echo ok")
        assert r.stdout == b"ok\n"
    for sb in idle_boxes:
        node.scheduling.last_used[sb.id] = 0.0  # idle since forever
    saved = node.config.min_free_memory_mb
    node.config.min_free_memory_mb = node.admission.snapshot().available_mb + (64 << 10)
    node.scheduling.rearm()
    try:
        with pytest.raises(shoal.CapacityExceeded, match="idle sandboxes were paused and reclaimed first") as ei:
            await client.create("base", memory_mb=128)
        assert ei.value.details["reason"] == "memory" and ei.value.details["paused_for_room"] == 3
    finally:
        node.config.min_free_memory_mb = saved
    for sb in idle_boxes:
        rec = node.record(sb.id)
        assert rec.state == "paused" and rec.extra["paused_by"] == "pressure"
        assert rec.extra["reclaim"]["before"] > rec.extra["reclaim"]["after"], rec.extra["reclaim"]
    assert node.record(busy.id).state == "running"
    for sb in idle_boxes:  # resumed by their next call, their memory as it was
        assert (await sb.exec("wc -c < /dev/shm/blob")).stdout == b"33554432\n"
        assert node.record(sb.id).state == "running"
    await asyncio.gather(*(s.close() for s in [*idle_boxes, busy]))


def _cpu_cgroup(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if "cpu" in ctrls.split(",") or (cgroups.cgroup_mode() == "v2" and ctrls == ""):
            return path
    return ""


async def test_cpu_classes_place_batch_work_on_idle_cpu_time(client: shoal.Client) -> None:
    from shoal.backends.container import cpuclass

    node = client.transport.node
    with pytest.raises(shoal.InvalidRequest, match="cpu_class='urgent'"):
        await client.create("base", cpu_class="urgent")
    inter = await client.create("base")  # the documented default
    batch = await client.create("base", cpu_class="batch", cpus=0.5)
    assert node.record(inter.id).spec.cpu_class == "interactive"
    v2 = cgroups.cgroup_mode() == "v2"
    agent = node.record(batch.id).init_pid
    await batch.exec("sleep 1000 >/dev/null 2>&1 &")
    procs = cgroups.SandboxCgroup(node.record(batch.id).cgroup).pids()  # host pids: the agent and the sleep
    assert len(procs) == 2 and agent in procs
    pid = next(p for p in procs if p != agent)
    if v2:
        d = cgroups.CGROUP_ROOT / "shoal" / batch.id
        assert (d / "cpu.idle").read_text().strip() == "1"
    else:
        # batch work runs under the idle cgroup beside the sandboxes' parent; the rest of its cgroups stay
        want = f"/{cpuclass.BATCH_PARENT}/{batch.id}"
        assert _cpu_cgroup(agent) == want and _cpu_cgroup(pid) == want
        parent = cgroups.CGROUP_ROOT / "cpu" / cpuclass.BATCH_PARENT
        assert (parent / "cpu.idle").read_text().strip() == "1"
        assert (parent / batch.id / "cpu.cfs_quota_us").read_text().strip() == "50000"
        assert (cgroups.CGROUP_ROOT / "memory" / "shoal" / batch.id).is_dir()
        # interactive sandboxes keep their quota and may burst one period of it
        d = cgroups.CGROUP_ROOT / "cpu" / "shoal" / inter.id
        assert (d / "cpu.cfs_burst_us").read_text().strip() == (d / "cpu.cfs_quota_us").read_text().strip()
        # a class changes live: everything it runs moves with it
        got = await batch.set_cpu_class("interactive")  # the SDK's Sandbox method (an embedded node here)
        assert got["class"] == "interactive" and not got["idle"]
        assert _cpu_cgroup(pid) == f"/shoal/{batch.id}" and not (parent / batch.id).exists()
        await node.set_cpu_class(batch.id, "batch")
        assert _cpu_cgroup(pid) == want
    info = await client.get(batch.id)
    assert info.info.extra["cpu"]["class"] == "batch"
    await batch.close()
    await inter.close()
    if not v2:
        assert not (cgroups.CGROUP_ROOT / "cpu" / cpuclass.BATCH_PARENT / batch.id).exists()


async def test_a_sandbox_swapping_past_its_limit_runs_as_batch_until_it_stops(client: shoal.Client) -> None:
    """shoal.backends.container.swapwatch: memory + swap past memory_mb + 16 MiB moves the sandbox to the batch class;
    back under it (here: the holder killed), it returns to its own class; page cache never counts."""
    from shoal.backends.container import cpuclass, swapwatch
    from shoal.backends.container.reclaim import sandbox_swap_mb

    node = client.transport.node
    if cgroups.cgroup_mode() == "v2" or not swapwatch.supported():
        pytest.skip("swap thresholds need the cgroup v1 memory controller with swap accounting")
    if node.backend("container").swap_watch is None or not sandbox_swap_mb(64, node.config.settings.sandbox_swap):
        pytest.skip("no swap for sandboxes on this host")
    sb = await client.create("base", memory_mb=64)
    assert node.backend("container").swap_watch.watching(sb.id)
    away = f"/{cpuclass.BATCH_PARENT}/{sb.id}"
    # 100 MiB of page cache in a 64 MiB sandbox: reclaimed, never swapped, so it stays interactive
    r = await sb.exec("head -c 100M /dev/urandom > /tmp/cache && cat /tmp/cache > /dev/null && rm /tmp/cache")
    assert r.exit_code == 0, r
    agent = node.record(sb.id).init_pid
    assert _cpu_cgroup(agent) == f"/shoal/{sb.id}"
    # a process holding 100 MiB of anonymous memory: 36 MiB of it in swap, past the line
    await sb.exec("head -c 100M /dev/zero | tail -c 100M | sleep 600 >/dev/null 2>&1 &")
    await async_wait_for(lambda: _cpu_cgroup(agent) == away, timeout=30, what="the swapping sandbox moved to batch")
    info = await client.get(sb.id)
    assert "cpu_demoted" in info.info.extra
    holder = next(p for p in cgroups.SandboxCgroup(node.record(sb.id).cgroup).pids() if p != agent
                  and Path(f"/proc/{p}/comm").read_text().strip() == "tail")
    assert _cpu_cgroup(holder) == away
    assert (await sb.exec("pkill tail; echo ok")).stdout == b"ok\n"
    await async_wait_for(lambda: _cpu_cgroup(agent) == f"/shoal/{sb.id}", timeout=30,
                   what="the sandbox back in its own class once it stopped swapping")
    assert "cpu_demoted" not in (await client.get(sb.id)).info.extra
    await async_wait_for(lambda: not cpuclass.batch_cgroup(sb.id).exists(), timeout=30,
                         what="its batch cgroup removed once the killed processes were reaped")
    # and demoted at close: nothing is left behind
    await sb.exec("head -c 100M /dev/zero | tail -c 100M | sleep 600 >/dev/null 2>&1 &")
    await async_wait_for(lambda: _cpu_cgroup(agent) == away, timeout=30, what="demoted again")
    await sb.close()
    assert not (cgroups.CGROUP_ROOT / "cpu" / cpuclass.BATCH_PARENT / sb.id).exists()
    assert not node.backend("container").swap_watch.watching(sb.id)
