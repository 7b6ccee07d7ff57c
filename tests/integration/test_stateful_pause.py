"""pause()/resume() with memory reclaim and working-set prefetch, on real cgroups (issue 4, item 3)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import shoal
from shoal.backends.container import reclaim
from shoal.config import settings
from shoal.host.cgroups import SandboxCgroup
from tests.conftest import runtime_containers
from tests.waiting import async_wait_for

pytestmark = [pytest.mark.root]


def _node(client: shoal.Client):  # the embedded node behind the client
    return client.transport.node


def _frozen(sb_id: str) -> bool:
    st = SandboxCgroup(f"/shoal/{sb_id}").read("freezer", "freezer.state")
    if st is None:  # cgroup v2
        st = SandboxCgroup(f"/shoal/{sb_id}").read("memory", "cgroup.freeze")
        return (st or "").strip() == "1"
    return st.strip() in ("FROZEN", "FREEZING")


def _leftovers(sb_id: str) -> list[str]:
    out = [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/shoal/{sb_id}")]
    out += [c for c in runtime_containers() if sb_id in c]
    with open("/proc/self/mountinfo") as f:
        out += [ln.split()[4] for ln in f if sb_id in ln.split()[4]]
    return out


@pytest.fixture
def zram_swap(client: shoal.Client) -> Iterator[None]:
    """Swap for the test, as users get it: from the node (SHOAL_ZRAM_SWAP=auto makes zram on a host without
    swap; shoal.backends.container.swap), never from what earlier runs left on the machine."""
    node = client.transport.node
    if not reclaim.swap_active():
        pytest.skip(f"no swap: the node could not set it up here ({node.backend('container').swap})")
    yield


async def _count(sb: shoal.Sandbox, at_least: int) -> bool:
    r = await sb.exec("cat /tmp/counter")
    return r.exit_code == 0 and int(r.stdout or 0) >= at_least


async def _ready(sb: shoal.Sandbox) -> bool:
    return (await sb.exec("test -e /tmp/ready")).exit_code == 0


async def test_pause_freezes_and_any_request_resumes(client: shoal.Client) -> None:
    sb = await client.create("base")
    await sb.exec("echo 1 > /tmp/counter; nohup sh -c 'while :; do n=$(cat /tmp/counter); "
                  "echo $((n+1)) > /tmp/counter; sleep 0.05; done' >/dev/null 2>&1 &")
    # the counter runs (so a still counter below means frozen, not "never started")
    await async_wait_for(lambda: _count(sb, 3), what="the counter loop to count")
    await sb.pause()
    assert _frozen(sb.id)
    info = await sb.refresh()
    assert info.state == "paused"
    assert "reclaim" in info.extra and info.extra["reclaim"].get("method")
    # nothing runs while paused: the counter does not move
    upper = Path(_node(client).backend("container").upper_dir(_node(client).record(sb.id)))
    c1 = (upper / "tmp" / "counter").read_text()
    # an observation window, not a synchronisation: the running loop counts 10 in it
    await asyncio.sleep(0.5)
    assert (upper / "tmp" / "counter").read_text() == c1
    # an exec resumes it transparently
    r = await sb.exec("cat /tmp/counter")
    assert r.exit_code == 0
    assert not _frozen(sb.id)
    assert (await sb.refresh()).state == "running"
    await async_wait_for(lambda: _count(sb, int(r.stdout) + 1), what="the counter to move again after resume")
    # pause twice / resume twice are no-ops
    await sb.pause()
    await sb.pause()
    await sb.resume()
    await sb.resume()
    assert not _frozen(sb.id)


async def test_concurrent_requests_to_a_paused_sandbox(client: shoal.Client) -> None:
    sb = await client.create("base")
    sh = await sb.shell()
    await sh.run("cd /etc")
    await sb.pause()
    # several requests race to resume it: exactly one thaw, all of them answered, shell state intact
    results = await asyncio.wait_for(asyncio.gather(
        *(sb.exec(f"echo {i}") for i in range(6)), sh.run("pwd"), sb.read_file("/etc/hostname")), 30)
    assert [r.stdout for r in results[:6]] == [f"{i}\n".encode() for i in range(6)]
    assert results[6].stdout == b"/etc\n"
    assert results[7]
    assert (await sb.refresh()).state == "running"


async def test_pause_returns_page_cache_and_resume_prefetches(client: shoal.Client) -> None:
    sb = await client.create("base")
    # 40 MiB of page cache charged to the sandbox, and a process with a working set
    await sb.exec("head -c 41943040 /dev/urandom > /tmp/blob && cat /tmp/blob > /dev/null")
    await sb.exec("nohup python3 -c 'import time; x = bytes(range(256)) * 20000; open(\"/tmp/ready\", \"w\"); "
                  "time.sleep(3600)' >/dev/null 2>&1 &")
    await async_wait_for(lambda: _ready(sb), what="the python process to hold its memory")
    cg = SandboxCgroup(f"/shoal/{sb.id}")
    before = cg.memory_bytes()
    await sb.pause()
    rc = (await sb.refresh()).extra["reclaim"]
    assert "error" not in rc, rc
    assert rc["before"] >= 40 << 20
    # the page cache is gone whatever the swap situation
    assert rc["stat_after"].get("cache", rc["stat_after"].get("file", 0)) < 4 << 20, rc
    assert cg.memory_bytes() < before - (36 << 20)
    assert rc["working_set_pages"] > 100
    ws_file = Path(_node(client).record(sb.id).path) / reclaim.WORKING_SET_FILE
    assert ws_file.exists()
    await sb.resume()
    info = await sb.refresh()
    # only swapped pages are read ahead; without swap there may be none
    assert info.extra["resume"]["prefetched_pages"] >= 0
    assert not ws_file.exists()
    assert (await sb.exec("python3 -c 'print(1)'")).stdout == b"1\n"


@pytest.mark.slow
async def test_pause_moves_anonymous_memory_to_zram(client: shoal.Client, zram_swap: None) -> None:
    sb = await client.create("base", memory_mb=512)
    # 64 MiB of anonymous memory, compressible like real program data (not all zeros)
    await sb.exec("nohup python3 -c 'import os, time; x = bytearray(os.urandom(1 << 20) * 64); "
                  "open(\"/tmp/ready\", \"w\").close(); time.sleep(3600)' >/dev/null 2>&1 &")
    await async_wait_for(lambda: _ready(sb), what="the python process to hold its 64 MiB")
    cg = SandboxCgroup(f"/shoal/{sb.id}")
    assert cg.memory_bytes() > 64 << 20
    await sb.pause()
    rc = (await sb.refresh()).extra["reclaim"]
    assert rc["swap_on"] is True
    assert rc["after"] < rc["before"] * 0.2, rc
    assert rc["swap_after"] >= 60 << 20, rc
    await sb.resume()
    info = await sb.refresh()
    # the working set came back from swap before the thaw
    assert info.extra["resume"]["prefetched_pages"] * reclaim.PAGE >= 60 << 20
    assert cg.memory_bytes() > 60 << 20
    r = await sb.exec("pgrep -f 'os.urandom' >/dev/null && echo alive")
    assert r.stdout == b"alive\n"


async def test_pause_without_reclaim_and_close_while_paused(client: shoal.Client) -> None:
    node = _node(client)
    sb = await client.create("base")
    await node.pause(sb.id, reclaim=False)
    assert _frozen(sb.id)
    assert "reclaim" not in node.record(sb.id).extra
    await node.resume(sb.id, prefetch=False)
    await sb.pause()
    # closing a frozen sandbox cleans up everything
    await sb.close()
    assert _leftovers(sb.id) == []
    with pytest.raises(shoal.SandboxNotFound):
        await client.get(sb.id)


async def test_pause_errors(client: shoal.Client) -> None:
    with pytest.raises(shoal.SandboxNotFound):
        await _node(client).pause("n0-" + "a" * 26)
    with pytest.raises(shoal.SandboxNotFound):
        await _node(client).resume("../../etc")


def test_swap_policy_for_running_sandboxes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_SANDBOX_SWAP", "0")
    expect_none = not reclaim.swap_active()
    pol = settings().sandbox_swap
    assert (reclaim.sandbox_swap_mb(256, pol) is None) == expect_none
    if not expect_none:
        assert reclaim.sandbox_swap_mb(256, pol) == 0
    assert os.environ["SHOAL_SANDBOX_SWAP"] == "0"


@pytest.mark.slow
async def test_memsw_limit_allows_swap_when_swap_is_on(client: shoal.Client, zram_swap: None) -> None:
    sb = await client.create("base", memory_mb=128)
    cg = SandboxCgroup(f"/shoal/{sb.id}")
    if cg.mode == "v2":
        assert int(cg.read("memory", "memory.swap.max") or 0) == 128 << 20
    else:
        assert int(cg.read("memory", "memory.memsw.limit_in_bytes")) == 256 << 20
    # a running sandbox may now go past its RAM limit into swap instead of being OOM-killed
    # (past its line it runs as `batch` while it swaps: slow on a loaded machine, hence the long timeout)
    r = await sb.exec("python3 -c 'x = bytearray(160 << 20); x[::4096] = b\"a\" * (40 << 10); print(len(x) >> 20)'",
                      timeout=900)
    assert r.stdout == b"160\n", r


def test_close_during_pause_does_not_deadlock(shoal_home: Path, base_image: str) -> None:
    """A close racing a pause in the same process must not block the event loop on the state lock."""
    import threading

    result: dict[str, object] = {}

    async def race() -> None:
        async with shoal.Client() as c:
            sb = await c.create("base")
            await sb.exec("head -c 30000000 /dev/urandom > /tmp/cache && cat /tmp/cache > /dev/null")
            pause = asyncio.create_task(sb.pause())
            await asyncio.sleep(0)  # the pause holds the lock while it freezes and reclaims
            await sb.close()
            with contextlib.suppress(shoal.ShoalError):
                await pause
            result["leftovers"] = _leftovers(sb.id)

    # a deadlock would block the loop itself, so watch it from another thread
    t = threading.Thread(target=lambda: asyncio.run(race()), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "close() and pause() deadlocked"
    assert result["leftovers"] == []


async def test_a_node_gives_a_host_without_swap_zram_and_keeps_swap_it_finds(client: shoal.Client) -> None:
    """The default (SHOAL_ZRAM_SWAP=auto): a node start leaves the host with swap — made by this or an earlier
    node process (zram of half the RAM, at most 8 GiB), or the host's own, which it keeps."""
    from shoal.backends.container import swap

    node = client.transport.node
    swapped = node.backend("container").swap  # what the container backend's host_start did
    assert swapped is not None and swapped.action in ("made", "kept"), swapped
    assert reclaim.swap_active() and os.getpid() in swap.live_users()
    made = swap.made_by_node()
    if swapped.action == "made":
        assert made is not None and made["device"] == swapped.device and made["size"] == swap.auto_size()
        assert any(z.name == swapped.device and z.swap and z.disksize == swap.auto_size()
                   for z in reclaim.zram_devices())


@pytest.mark.slow
def test_zram_swap_is_made_sized_and_removed_by_name() -> None:
    """The zram path itself (a device of its own beside whatever swap this machine has: others use that)."""
    try:
        z = reclaim.setup_zram_swap("64M", priority=1, new=True)  # below the node's: not used meanwhile
    except shoal.BackendUnavailable as e:
        pytest.skip(f"no zram here: {e.message}")
    try:
        assert z.swap and z.disksize == 64 << 20 and f"/dev/{z.name}" in {s.path for s in reclaim.swap_devices()}
    finally:
        assert reclaim.teardown_zram_swap(devices=[z.name]) == [z.name]
    assert f"/dev/{z.name}" not in {s.path for s in reclaim.swap_devices()}
