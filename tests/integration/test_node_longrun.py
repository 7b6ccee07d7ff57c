"""A node that runs for days (issue 24) on real containers: an idle sandbox costs the node no descriptor,
create/close cycles leave exactly the descriptors and threads they found, resources that run out refuse a
create by name and leave nothing, periodic passes survive churn, and closes run in parallel."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

import shoal
from shoal.backends.container import swapwatch
from shoal.host import cgroups
from shoal.node import capacity
from shoal.node.node import Node

pytestmark = [pytest.mark.root]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fd_targets() -> set[str]:
    out = set()
    for f in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{f}:{os.readlink(f'/proc/self/fd/{f}')}")
        except OSError:
            continue
    return out


def _fd_kinds() -> dict[str, int]:
    out: dict[str, int] = {}
    for f in os.listdir("/proc/self/fd"):
        try:
            t = os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            continue
        k = t.split(":", 1)[0] if not t.startswith("/") else "file"
        out[k] = out.get(k, 0) + 1
    return out


def _leftovers(node: Node, ids: list[str]) -> list[str]:
    out = [str(p) for sid in ids for p in cgroups.CGROUP_ROOT.glob(f"*/shoal/{sid}")]
    with open("/proc/self/mountinfo") as f:
        out += [ln.split()[4] for ln in f if any(sid in ln.split()[4] for sid in ids)]
    out += [e.name for e in os.scandir(node.paths.sandboxes) if e.name in ids]
    return out


async def test_idle_sandboxes_hold_no_descriptor_of_the_node_and_answer_afterwards(client: shoal.Client) -> None:
    node = client.transport.node
    n = swapwatch.BUCKET + 6  # more than one shared eventfd's worth, when sandboxes have swap
    warm = await client.create("base", memory_mb=64)
    await warm.exec("true")  # the node's own descriptors (event and command logs, …) are open now
    await warm.close()
    await node.connections.sweep()
    before = _fds()
    targets = _fd_targets()
    boxes = list(await client.create_many("base", n=n, memory_mb=64))
    assert all(isinstance(b, shoal.Sandbox) for b in boxes), boxes
    node.connections.idle_s = 0.2
    await asyncio.sleep(0.3)
    await node.connections.sweep()  # what the background sweep does every idle_s / 2
    held = _fds() - before
    sw = node.backend("container").swap_watch
    shared = sw.descriptors() if sw is not None else 0
    # no agent socket per idle sandbox; at most one eventfd per BUCKET sandboxes (cgroup v1 with swap)
    assert held == shared <= -(-n // swapwatch.BUCKET), (held, shared, _fd_kinds())
    if sw is not None and node.record(boxes[0].id).extra.get("swap_mb"):
        assert all(sw.watching(b.id) for b in boxes) and shared >= 1
    # every one answers afterwards (a connection is opened for the request, and closed again when idle)
    rs = await asyncio.gather(*(b.exec(["echo", b.id]) for b in boxes))
    assert [r.stdout.decode().strip() for r in rs] == [b.id for b in boxes]
    await asyncio.gather(*(b.close() for b in boxes))
    await node.connections.sweep()
    assert _fds() == before, (_fd_targets() - targets, targets - _fd_targets())


async def test_create_close_cycles_leave_the_same_descriptors_and_threads(client: shoal.Client) -> None:
    """The CI form of `shoal bench soak`: exact counts, not slopes."""
    node = client.transport.node

    async def cycles(k: int, batch: int) -> None:
        for _ in range(k):
            boxes = list(await client.create_many("base", n=batch, memory_mb=64))
            assert all(isinstance(b, shoal.Sandbox) for b in boxes), boxes
            rs = await asyncio.gather(*(b.exec("echo ok") for b in boxes))
            assert all(r.stdout == b"ok\n" for r in rs)
            await asyncio.gather(*(b.close() for b in boxes))

    await cycles(3, 8)  # warm up: layer mounts, the event and command logs, the swap watch
    # and every worker of the loop's thread pool (it grows on demand up to min(32, CPUs + 4), then stays)
    workers = min(32, (os.cpu_count() or 1) + 4)
    barrier = threading.Barrier(workers)
    await asyncio.gather(*(asyncio.to_thread(barrier.wait, 30) for _ in range(workers)))
    await node.connections.sweep()
    fds, threads = _fds(), threading.active_count()
    kinds = _fd_kinds()
    await cycles(12, 8)  # 96 sandboxes created, used and closed
    await node.connections.sweep()
    assert (_fds(), threading.active_count()) == (fds, threads), (kinds, _fd_kinds())


async def test_a_create_past_the_descriptor_limit_is_refused_by_name_and_leaves_nothing(
        client: shoal.Client) -> None:
    node = client.transport.node
    cap = node.capacity
    try:
        cap.limits = capacity.Limits(**{**capacity.Limits.read().__dict__, "nofile": capacity.open_descriptors() + 40})
        cap._fds_at = 0.0
        before = {e.name for e in os.scandir(node.paths.sandboxes)}
        with pytest.raises(shoal.CapacityExceeded) as ei:
            await client.create("base", memory_mb=64)
        assert ei.value.details["resource"] == "descriptors" and "RLIMIT_NOFILE" in ei.value.message
        assert {e.name for e in os.scandir(node.paths.sandboxes)} == before
        # a burst: every item refused by name, none half-made
        items = await node.create_many(shoal.SandboxSpec(image="base", memory_mb=64), 5)
        assert all(isinstance(i, shoal.CapacityExceeded) and i.details["resource"] == "descriptors" for i in items)
        assert {e.name for e in os.scandir(node.paths.sandboxes)} == before
        cap.limits = capacity.Limits(**{**capacity.Limits.read().__dict__, "pid_max": capacity.host_tasks() + 20})
        with pytest.raises(shoal.CapacityExceeded, match="out of pids"):
            await client.create("base", memory_mb=64)
    finally:
        cap.refresh()
    sb = await client.create("base", memory_mb=64)
    assert (await sb.exec("true")).exit_code == 0


async def test_resource_errors_mid_create_become_refusals_and_the_sandbox_is_undone(
        client: shoal.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resource can still run out between admission and the create's end (another process took it): the
    create is undone by its backend and the error names the resource."""
    from shoal.backends.container import backend as container

    node = client.transport.node
    made: list[str] = []
    real = container.protect_agent

    before = {e.name for e in os.scandir(node.paths.sandboxes)}

    def protect_agent(pid: int) -> None:  # the runtime started the sandbox; the next step finds no descriptor
        made.extend({e.name for e in os.scandir(node.paths.sandboxes)} - before)
        assert os.path.exists(f"/proc/{pid}")
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(container, "protect_agent", protect_agent)
    with pytest.raises(shoal.CapacityExceeded) as ei:
        await client.create("base", memory_mb=64)
    assert ei.value.details["resource"] == "descriptors"
    monkeypatch.setattr(container, "protect_agent", real)
    # the backend undid it: no cgroup, mount, directory or admission charge is left
    assert made and node.admission.snapshot().pending == 0
    assert not _leftovers(node, made)


async def test_periodic_passes_run_while_sandboxes_come_and_go(client: shoal.Client,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    node = client.transport.node
    sch = node.scheduling
    stop = asyncio.Event()
    passes = {"tide": 0, "sample": 0, "sweep": 0, "reap": 0}

    async def passes_loop() -> None:
        while not stop.is_set():
            await sch.tide_once(need_mb=1.0, idle_s=1e9, by="test")  # a full pass (view + plan), pausing nobody
            passes["tide"] += 1
            await asyncio.to_thread(sch.sample_working_sets, 8, list(sch.last_used))
            passes["sample"] += 1
            await node.connections.sweep()
            passes["sweep"] += 1
            await node.recovery.reap_once()
            passes["reap"] += 1
            await asyncio.sleep(0)

    async def churn() -> None:
        for _ in range(6):
            boxes = list(await client.create_many("base", n=6, memory_mb=64))
            await asyncio.gather(*(b.exec("true") for b in boxes if isinstance(b, shoal.Sandbox)))
            await asyncio.gather(*(b.close() for b in boxes if isinstance(b, shoal.Sandbox)))

    runner = asyncio.ensure_future(passes_loop())
    try:
        await churn()
    finally:
        stop.set()
        await runner
    assert all(v >= 2 for v in passes.values()), passes
    bad = [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")
           and ("failed" in r.getMessage() or "could not" in r.getMessage())]
    assert not bad, bad


async def test_close_all_closes_in_parallel_and_leaves_nothing(client: shoal.Client,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    node = client.transport.node
    boxes = list(await client.create_many("base", n=24, memory_mb=64))
    ids = [b.id for b in boxes]
    backend = node.backend("container")
    real = backend.destroy
    now = peak = 0

    async def destroy(rec):
        nonlocal now, peak
        now += 1
        peak = max(peak, now)
        try:
            await real(rec)
        finally:
            now -= 1

    monkeypatch.setattr(backend, "destroy", destroy)
    done: list[str] = []
    await node.close_many(ids, concurrency=8, on_done=lambda sid, err: done.append(sid))
    assert sorted(done) == sorted(ids) and 1 < peak <= 8, peak
    assert not _leftovers(node, ids)


def test_shoal_rm_all_closes_every_sandbox_of_the_home(base_image: str) -> None:
    import subprocess
    import sys
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="shr-", dir="/tmp"))  # short: Unix sockets live in it
    env = {**os.environ, "SHOAL_HOME": str(home)}

    def shoal_cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "shoal.cli.main", *args], capture_output=True, text=True,
                              env=env, timeout=300)

    try:
        r = shoal_cli("create", "base", "-n", "3", "--memory-mb", "64")
        assert r.returncode == 0 and len(r.stdout.split()) == 3, r.stderr
        r = shoal_cli("rm", "--all")
        assert r.returncode == 0 and "removed 3 sandbox(es)" in r.stderr, r.stderr
        assert shoal_cli("ls").stdout.count("n0-") == 0
    finally:
        r = shoal_cli("node", "teardown", "--close-sandboxes", "--purge")
    assert r.returncode == 0, r.stderr
    assert not home.exists()
