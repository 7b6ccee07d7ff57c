"""Node logic on the fake backend (no root, no isolation): create/close/list/labels, exec semantics,
TTL reaping, admission, crash recovery and adoption, pause/resume, capability routing, file forks."""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

from shoal.backends.base import Capability
from shoal.backends.fake import FakeBackend
from shoal.errors import (
    BackendUnavailable,
    CapacityExceeded,
    InvalidRequest,
    SandboxError,
    SandboxNotFound,
    Unsupported,
)
from shoal.models import SandboxSpec
from shoal.node.admission import meminfo
from shoal.node.node import Node
from shoal.records import SandboxRecord, list_records
from tests.unit.conftest import add_image, fake_config
from tests.waiting import async_wait_for

FAKE = {"image": "t:1", "backend": "fake"}


def spec(**kw: object) -> SandboxSpec:
    """A spec on the fake backend."""
    return SandboxSpec(**{**FAKE, **kw})  # type: ignore[arg-type]


def proc_state(pid: int) -> str:
    """The one-letter state of a process (R, S, T, Z ...)."""
    data = Path(f"/proc/{pid}/stat").read_bytes()
    return data[data.rfind(b")") + 2:].split()[0].decode()


async def test_create_close_list_and_labels(node: Node) -> None:
    a = await node.create(spec(labels={"task": "a"}, memory_mb=64))
    b = await node.create(spec(labels={"task": "b"}, memory_mb=64, project="p2"))
    assert a.state == "running" and a.backend == "fake" and a.extra["isolation"] == "none"
    assert {i.id for i in await node.list()} == {a.id, b.id}
    assert [i.id for i in await node.list(labels={"task": "b"})] == [b.id]
    assert [i.id for i in await node.list(project="p2")] == [b.id]
    assert node.admission.snapshot().committed_mb == 128
    rec = node.record(a.id)
    await node.close(a.id)
    assert not rec.path.exists() and not rec.init_alive()
    assert not FakeBackend.socket(rec).exists()
    with pytest.raises(SandboxNotFound):
        await node.get(a.id)
    assert node.admission.snapshot().committed_mb == 64 and node.admission.snapshot().sandboxes == 1
    with pytest.raises(SandboxNotFound):
        await node.close(a.id)


async def test_exec_semantics_are_the_agents(node: Node) -> None:
    info = await node.create(spec(max_output_bytes=1000))
    r = await node.exec(info.id, "cat hello.txt; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, b"hi\n", b"err\n", False)
    r = await node.exec(info.id, "sleep 30", timeout=0.3)
    assert r.timed_out and r.exit_code == 137
    r = await node.exec(info.id, "head -c 5000 /dev/zero")
    assert r.truncated and len(r.stdout) == 1000
    r = await node.exec(info.id, ["cat"], stdin=b"piped")
    assert r.stdout == b"piped"
    events = [ev async for ev in await node.stream(info.id, "echo one; echo two >&2")]
    assert events[-1].kind == "exit" and events[-1].result is not None and events[-1].result.exit_code == 0
    assert b"".join(e.data for e in events if e.kind == "stdout") == b"one\n"
    sh = await node.shell_open(info.id)
    await node.shell_run(info.id, sh, "cd /; export X=5")  # "/" is the host's: no isolation
    r = await node.shell_run(info.id, sh, "echo $X; pwd")
    assert r.stdout == b"5\n/\n"
    with pytest.raises(InvalidRequest, match="command is empty"):
        await node.exec(info.id, "  ")
    with pytest.raises(InvalidRequest, match="timeout"):
        await node.exec(info.id, "true", timeout=-1)


async def test_files_are_mapped_under_the_sandbox(node: Node) -> None:
    info = await node.create(spec())
    await node.write_file(info.id, "/work/sub/a.txt", b"data")
    assert await node.read_file(info.id, "sub/a.txt") == b"data"  # relative: from the workdir
    assert [e.name for e in await node.list_dir(info.id, "/work")] == ["hello.txt", "sub"]
    root = Path(info.extra["root"])
    assert (root / "work" / "sub" / "a.txt").read_bytes() == b"data"
    # a path that climbs out stays inside the sandbox's root
    await node.write_file(info.id, "/../../escape.txt", b"x")
    assert (root / "escape.txt").exists()


async def test_ttl_reaping(node: Node) -> None:
    short = await node.create(spec(ttl_s=0.05))
    keep = await node.create(spec(ttl_s=3600))
    expires = short.expires_at
    assert expires is not None
    await async_wait_for(lambda: time.time() >= expires, what="the short ttl to pass")
    assert await node.recovery.reap_once() == 1
    assert [i.id for i in await node.list()] == [keep.id]
    assert node.admission.snapshot().sandboxes == 1


async def test_reaper_closes_sandboxes_whose_init_died(node: Node) -> None:
    info = await node.create(spec())
    os.kill(node.record(info.id).init_pid, signal.SIGKILL)
    rec = node.record(info.id)
    await async_wait_for(lambda: not rec.init_alive(), what="the killed init to be gone")
    with pytest.raises(SandboxError, match="died"):
        await node.exec(info.id, "true")
    assert await node.recovery.reap_once() == 1
    assert await node.list() == []


async def test_admission_refusals_and_releases(fake_home: Path) -> None:
    total_mb = meminfo()["MemTotal"] // 1024
    node = Node(fake_config(fake_home, memory_overcommit=100 / total_mb))  # a 100 MiB node
    add_image(node.store, "t:1", {"/work/x": "x"})
    await node.start(reap=False)
    try:
        a = await node.create(spec(memory_mb=64))
        with pytest.raises(CapacityExceeded) as ei:
            await node.create(spec(memory_mb=64))
        assert ei.value.details["committed_mb"] == 64 and ei.value.details["limit_mb"] == 100
        assert ei.value.details["reason"] == "promised"
        assert ei.value.http_status == 429
        snap = node.admission.snapshot()
        assert (snap.committed_mb, snap.limit_mb, snap.free_mb, snap.pending) == (64, 100, 36, 0)
        # a create that fails gives its reservation back
        backend = node.backend("fake")
        assert isinstance(backend, FakeBackend)

        def boom(_spec: SandboxSpec, _n: int) -> None:
            raise SandboxError("injected failure")

        backend.before_create = boom
        with pytest.raises(SandboxError, match="injected"):
            await node.create(spec(memory_mb=16))
        backend.before_create = None
        assert node.admission.snapshot().committed_mb == 64
        assert len(list_records(node.paths.sandboxes)) == 1, "the failed create left a record"
        await node.close(a.id)
        b = await node.create(spec(memory_mb=64))  # fits again
        await node.close(b.id)
    finally:
        await node.close_all()
        await node.stop()
    node = Node(fake_config(fake_home, min_free_memory_mb=1 << 30))
    with pytest.raises(CapacityExceeded, match="available on this node"):
        await node.create(spec())


async def test_reconcile_adopts_live_sandboxes_after_a_crash(fake_home: Path) -> None:
    first = Node(fake_config(fake_home))
    add_image(first.store, "t:1", {"/work/x": "x"})
    await first.start(reap=False)
    live = await first.create(spec(memory_mb=100))
    doomed = await first.create(spec(memory_mb=50))
    # the node process "crashes": its connections go, nobody closes anything
    await first.connections.close_all()
    os.kill(first.record(doomed.id).init_pid, signal.SIGKILL)
    await async_wait_for(lambda: not first.record(doomed.id).init_alive(), what="the killed init to be gone")
    # a half-made sandbox of an owner that is gone
    rec = first.record(live.id)
    ghost = dataclasses.replace(rec, id=rec.id[:-4] + "zzzz", dir=str(rec.path)[:-4] + "zzzz", state="creating",
                                owner_pid=1, owner_start=1, init_pid=0, extra={})
    ghost.path.mkdir()
    ghost.save()
    second = Node(fake_config(fake_home))
    await second.start(reap=False)
    try:
        assert {i.id for i in await second.list()} == {live.id}
        assert not ghost.path.exists()
        assert second.admission.snapshot().committed_mb == 100
        r = await second.exec(live.id, "echo still here")
        assert r.stdout == b"still here\n"
        # adopt(record) is the public door: a dead record is refused
        assert second.recovery.adopt(second.record(live.id)).id == live.id
        dead = second.record(live.id)
        dead.state = "failed"
        with pytest.raises(SandboxError, match="cannot adopt"):
            second.recovery.adopt(dead)
    finally:
        await second.close_all()
        await second.stop()


async def test_pause_stops_processes_and_any_request_resumes(node: Node) -> None:
    info = await node.create(spec())
    pid = int((await node.exec(info.id, "sleep 300 >/dev/null 2>&1 & echo $!")).stdout)
    await node.pause(info.id)
    assert (await node.get(info.id)).state == "paused"
    assert proc_state(pid) == "T"
    await node.pause(info.id)  # idempotent
    r = await node.exec(info.id, "echo back")  # resumes transparently
    assert r.stdout == b"back\n" and (await node.get(info.id)).state == "running"
    assert proc_state(pid) != "T"
    await node.resume(info.id)  # a running sandbox: nothing to do
    assert "reclaim" not in node.record(info.id).extra  # the fake cannot reclaim memory


async def test_capabilities_route_and_refuse(node: Node) -> None:
    info = await node.create(spec())
    backend = node.backend("fake")
    assert backend.can(Capability.SNAPSHOT_FILES) and not backend.can(Capability.FORK_MEMORY)
    with pytest.raises(Unsupported, match="the fake backend cannot snapshot a sandbox's memory"):
        await node.snapshot(info.id, "x:1", memory=True)
    with pytest.raises(Unsupported, match=r"cannot fork a sandbox.s processes and memory: fork\(n\) without"):
        await node.fork(info.id, 1, memory=True)
    with pytest.raises(Unsupported, match="cannot restore"):
        await node.restore("anything", backend="fake")
    with pytest.raises(Unsupported, match="network"):
        await node.create(spec(network=True))
    with pytest.raises(Unsupported, match="run code snippets") as ei:
        node.backend("container").require(Capability.RUN_CODE)
    assert ei.value.http_status == 501 and ei.value.details["backend"] == "container"
    with pytest.raises(Unsupported, match=r"use client\.run_code"):
        await node.create(SandboxSpec(image="t:1", backend="fncall"))
    with pytest.raises(InvalidRequest, match="unknown backend 'nope'"):
        await node.create(SandboxSpec(image="t:1", backend="nope"))


async def test_fake_backend_is_refused_unless_enabled(fake_home: Path) -> None:
    cfg = fake_config(fake_home, fake_backend=False)
    node = Node(cfg)
    add_image(node.store, "t:1", {"/x": "x"})
    with pytest.raises(BackendUnavailable, match="NO isolation"):
        await node.create(spec())
    assert list_records(node.paths.sandboxes) == []


async def test_file_snapshot_and_fork(node: Node) -> None:
    parent = await node.create(spec(labels={"k": "v"}))
    await node.write_file(parent.id, "/work/state.txt", b"step 3")
    snap = await node.snapshot(parent.id, "snaps/p:1")
    assert snap["ref"] == "snaps/p:1" and snap["layer"] is not None
    assert (await node.get(parent.id)).state == "running"  # thawed after the snapshot
    kids = await node.fork(parent.id, 2, labels={"kid": "1"})
    assert all(not isinstance(k, Exception) for k in kids)
    for k in kids:
        assert not isinstance(k, Exception)
        assert await node.read_file(k.id, "state.txt") == b"step 3"
        assert k.labels == {"kid": "1", "shoal.fork_of": parent.id}
    forks = [img.ref for img in node.store.list_images() if img.ref.startswith(f"forks/{parent.id}")]
    assert len(forks) == 1
    await node.close(parent.id)  # untags the automatic fork snapshot; children run on
    assert not any(img.ref.startswith(f"forks/{parent.id}") for img in node.store.list_images())
    assert (await node.exec(kids[0].id, "cat state.txt")).stdout == b"step 3"  # type: ignore[union-attr]
    with pytest.raises(InvalidRequest, match="unknown sandbox option"):
        await node.fork(kids[0].id, 1, colour="red")  # type: ignore[union-attr]
    with pytest.raises(InvalidRequest, match="between 1 and"):
        await node.fork(kids[0].id, 0)  # type: ignore[union-attr]


async def test_warm_pool_hands_out_ready_sandboxes(node: Node) -> None:
    node.pool.configure(spec(), 2)
    await node.pool.wait_full(timeout=60)
    assert await node.list() == []  # pooled sandboxes are not listed
    info = await node.create(spec(labels={"from": "pool"}, ttl_s=60))
    assert node.pool.hits == 1 and info.labels == {"from": "pool"}
    assert [i.id for i in await node.list()] == [info.id]
    assert (await node.exec(info.id, "echo ok")).stdout == b"ok\n"
    await node.pool.close()


async def test_create_many_reports_failures_per_item(node: Node) -> None:
    backend = node.backend("fake")
    assert isinstance(backend, FakeBackend)
    start = backend.creates

    def fail_second(_spec: SandboxSpec, n: int) -> None:
        if n == start + 1:
            raise CapacityExceeded("injected refusal", retry_after_s=1.0)

    backend.before_create = fail_second
    items = await node.create_many(spec(), 3)
    assert [type(i).__name__ for i in items] == ["SandboxInfo", "CapacityExceeded", "SandboxInfo"]
    assert len(await node.list()) == 2
    with pytest.raises(InvalidRequest):
        await node.create_many(spec(), 0)


async def test_stopping_the_node_while_the_pool_refills_leaves_nothing(fake_home: Path) -> None:
    node = Node(fake_config(fake_home))
    add_image(node.store, "t:1", {"/work/x": "x"})
    await node.start(reap=False)
    node.pool.configure(spec(), 6)  # refills start at once, 4 at a time
    await async_wait_for(lambda: any(r.state == "creating" for r in list_records(node.paths.sandboxes)),
                         what="a pool refill to be under way", interval=0.001)
    await node.stop()
    # nothing of the pool may still be running once stop() returned: refills that went on after it were
    # destroyed half-made when the event loop ended (a "creating" record with its mounts, in CI)
    assert list_records(node.paths.sandboxes) == []


def _fds_under(home: Path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{home}/"):
            out.append(target)
    return out


async def test_a_stopped_node_holds_nothing_open_in_its_home(fake_home: Path) -> None:
    # an open file keeps the filesystem under SHOAL_HOME busy: a private disk (shoal bench disk) could not
    # be detached from its loop device until the process exited
    node = Node(fake_config(fake_home))
    add_image(node.store, "t:1", {"/work/x": "x"})
    await node.start(reap=False)
    info = await node.create(spec())
    await node.exec(info.id, "true")  # events and commands are logged
    await node.close(info.id)
    assert _fds_under(node.paths.home), "the event log is open while the node runs"
    await node.stop()
    assert _fds_under(node.paths.home) == []


async def test_the_reaper_scans_records_off_the_event_loop(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading every record (thousands on a dense node) must not stall the requests the node serves: the
    loop keeps running while a slow scan is under way."""
    import asyncio

    from shoal.node import recovery

    real = recovery.list_records

    def slow(d: Path) -> list[SandboxRecord]:
        time.sleep(0.3)  # a scan of many records on a busy host
        return real(d)

    monkeypatch.setattr(recovery, "list_records", slow)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    t = asyncio.ensure_future(ticker())
    try:
        assert await node.recovery.reap_once() == 0
    finally:
        t.cancel()
    assert ticks >= 5, "the event loop stood still while the reaper read the records"
