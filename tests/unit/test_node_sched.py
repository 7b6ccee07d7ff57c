"""The scheduler on one node (shoal.node.scheduling) over the fake backend: jobs and their caps,
preemption by pausing (and the transparent resume after), gangs, compute tides, the event trace, and
the SDK's job surface and all_or_nothing over the embedded and the HTTP transports."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import shoal
from shoal.backends.fake import FakeBackend
from shoal.errors import CapacityExceeded, GangUnsatisfiable, InvalidRequest, QuotaExceeded, SandboxError
from shoal.models import SandboxSpec
from shoal.node import scheduling as node_scheduling
from shoal.node.admission import meminfo
from shoal.node.node import Node
from shoal.node.tracelog import TraceLog
from shoal.records import list_records
from shoal.sched import labels_for_job
from shoal.sdk.local import LocalTransport
from shoal.sim.trace import read_trace
from tests.unit.conftest import AGENT_BUILT, add_image, fake_config

pytestmark = pytest.mark.skipif(not AGENT_BUILT, reason="the agent is not built: run `make agent`")


def spec(prio: str | None = None, job: str | None = None, mem: int = 100, **kw: object) -> SandboxSpec:
    labels = labels_for_job(job or f"job-{prio}", prio) if prio or job else {}
    labels.update(kw.pop("labels", {}))  # type: ignore[arg-type]
    return SandboxSpec(image="t:1", backend="fake", memory_mb=mem, labels=labels, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def small(fake_home: Path) -> AsyncIterator[Node]:
    """A started node whose admission takes 300 MiB of promised memory."""
    total_mb = meminfo()["MemTotal"] // 1024
    node = Node(fake_config(fake_home, memory_overcommit=300 / total_mb))
    add_image(node.store, "t:1", {"/work/x": "x"})
    await node.start(reap=False)
    try:
        yield node
    finally:
        await node.close_all()
        await node.stop()


def idle(node: Node, *ids: str, ago: float = 3600.0) -> None:
    """Pretend these sandboxes last served a call `ago` seconds ago."""
    for sid in ids:
        node.scheduling.last_used[sid] = time.time() - ago


async def test_a_higher_class_create_pauses_the_longest_idle_lower_one_which_answers_after(small: Node) -> None:
    old = await small.create(spec("batch"))
    older = await small.create(spec("batch"))
    busy = await small.create(spec("interactive"))
    idle(small, old.id, ago=600)
    idle(small, older.id, ago=3600)
    hi = await small.create(spec("train-rollout"))  # the node is full: one batch sandbox must pause
    assert hi.state == "running"
    assert (await small.get(older.id)).state == "paused"
    assert small.record(older.id).extra["paused_by"] == "preempt"
    assert (await small.get(old.id)).state == "running" and (await small.get(busy.id)).state == "running"
    snap = small.admission.snapshot()
    assert (snap.committed_mb, snap.paused_mb) == (300, 100)
    # its next call resumes it transparently (the node goes over its promise: a resume is never refused)
    r = await small.exec(older.id, "echo back")
    assert r.stdout == b"back\n" and (await small.get(older.id)).state == "running"
    assert "paused_by" not in small.record(older.id).extra
    assert small.admission.snapshot().committed_mb == 400


async def test_no_preemption_of_busy_sandboxes_or_of_the_same_class(small: Node) -> None:
    a = await small.create(spec("batch"))
    b = await small.create(spec("train-rollout"))
    c = await small.create(spec("train-rollout"))
    idle(small, b.id, c.id)  # idle, but of the same class as the request
    with pytest.raises(CapacityExceeded):
        await small.create(spec("train-rollout"))  # a is busy (just created), b and c are its equals
    with pytest.raises(CapacityExceeded):
        await small.create(spec("batch"))  # nobody below batch
    idle(small, a.id)
    small.scheduling.preempt_enabled = False
    with pytest.raises(CapacityExceeded):
        await small.create(spec("train-rollout"))  # SHOAL_PREEMPT=0
    assert all([(await small.get(s.id)).state == "running" for s in (a, b, c)])


async def test_gang_is_all_or_nothing_on_the_node(small: Node) -> None:
    with pytest.raises(GangUnsatisfiable) as ei:
        await small.create_many(spec("eval"), 4, all_or_nothing=True)
    assert ei.value.available == 3 and ei.value.requested == 4 and ei.value.http_status == 429
    assert list_records(small.paths.sandboxes) == [] and small.admission.snapshot().committed_mb == 0
    got = await small.create_many(spec("eval"), 3, all_or_nothing=True)
    assert len(got) == 3 and all(i.state == "running" for i in got)  # type: ignore[union-attr]
    await small.close_all()
    # one start fails: the others are closed and its error is the answer
    backend = small.backend("fake")
    assert isinstance(backend, FakeBackend)
    calls = []

    def second_fails(_spec: SandboxSpec, _n: int) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise SandboxError("injected failure")

    backend.before_create = second_fails
    with pytest.raises(SandboxError, match="injected"):
        await small.create_many(spec("eval"), 3, all_or_nothing=True, concurrency=1)
    backend.before_create = None
    assert list_records(small.paths.sandboxes) == [] and small.admission.snapshot().committed_mb == 0


async def test_a_gang_pauses_idle_lower_classes_when_that_makes_room_for_all(small: Node) -> None:
    low = [await small.create(spec("batch")) for _ in range(2)]
    idle(small, *(s.id for s in low))
    got = await small.create_many(spec("train-rollout"), 3, all_or_nothing=True)
    assert len(got) == 3 and all([(await small.get(s.id)).state == "paused" for s in low])
    await small.close(got[0].id)  # type: ignore[union-attr]
    # an idle interactive sandbox is not enough for a gang of 3 eval sandboxes: nothing is paused
    with pytest.raises(GangUnsatisfiable) as ei:
        await small.create_many(spec("eval"), 3, all_or_nothing=True)
    assert ei.value.available == 1


async def test_job_caps_fail_with_quota_exceeded(small: Node) -> None:
    s = spec(job="step-1", labels={"shoal.max-sandboxes": "2"}, mem=16)
    a = await small.create(s)
    await small.create(s)
    with pytest.raises(QuotaExceeded, match="step-1"):
        await small.create(s)
    with pytest.raises(QuotaExceeded):
        await small.create_many(s, 2)
    await small.close(a.id)
    await small.create(s)
    with pytest.raises(InvalidRequest, match=r"shoal\.priority"):
        await small.create(spec(labels={"shoal.priority": "urgent"}))


async def test_tides_pause_idle_sandboxes_while_memory_is_tight_and_they_resume_on_use(
        small: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    a = await small.create(spec("batch", mem=16))
    b = await small.create(spec("interactive", mem=16))
    c = await small.create(spec("interactive", mem=16))
    idle(small, a.id, b.id, ago=3600)
    assert await small.scheduling.tide_once() == []  # the host is not short of memory
    total = meminfo()["MemTotal"] // 1024
    monkeypatch.setattr(node_scheduling, "_meminfo_mb", lambda: (total, int(total * 0.05)))
    paused = await small.scheduling.tide_once()
    # lowest class first; the busy one (c) is never paused
    assert paused == [a.id, b.id]
    assert small.record(a.id).extra["paused_by"] == "tides" and (await small.get(c.id)).state == "running"
    assert (await small.exec(a.id, "echo hi")).stdout == b"hi\n"
    assert (await small.get(a.id)).state == "running"


async def test_the_node_records_its_events_for_shoal_sim(small: Node, tmp_path: Path) -> None:
    small.scheduling.trace = TraceLog(tmp_path / "events.jsonl", small.config.node_id)
    a = await small.create(spec("eval", job="e1", mem=32))
    b = await small.create(spec(mem=16))
    await small.pause(a.id)
    await small.exec(a.id, "true")
    await small.close(a.id)
    await small.close(b.id)
    kinds = [line.split('"event":"')[1].split('"')[0] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert kinds == ["create", "create", "pause", "resume", "close", "close"]
    recs = read_trace(tmp_path / "events.jsonl")
    assert [(r.priority, r.job, r.memory_mb) for r in recs] == [("eval", "e1", 32), ("", "", 16)]
    assert recs[0].t == 0.0 and recs[0].lifetime > 0 and recs[0].layers and recs[0].image == "t:1"


async def test_sdk_job_surface_and_gangs_on_the_embedded_client(small: Node) -> None:
    async with shoal.Client(transport=LocalTransport(small, reap=False)) as client:
        step = client.job("run1/step3", priority="train-rollout", max_sandboxes=8)
        boxes = await step.create_many("t:1", n=2, backend="fake", memory_mb=50, all_or_nothing=True)
        assert all(isinstance(b, shoal.Sandbox) for b in boxes)
        info = boxes[0].info  # type: ignore[union-attr]
        assert info.labels["shoal.job"] == "run1/step3" and info.labels["shoal.priority"] == "train-rollout"
        assert info.labels["shoal.max-sandboxes"] == "8"
        assert {i.id for i in await step.list()} == {b.id for b in boxes}  # type: ignore[union-attr]
        with pytest.raises(GangUnsatisfiable) as ei:
            await step.create_many("t:1", n=5, backend="fake", memory_mb=50, all_or_nothing=True)
        assert ei.value.available == 4
        with pytest.raises(InvalidRequest, match="contradicts"):
            await step.create("t:1", backend="fake", labels={"shoal.job": "other"})
        assert await step.close_all() == 2 and await step.list() == []
        with pytest.raises(InvalidRequest, match="max_sandboxes"):
            client.job("x", max_sandboxes=0)


def test_an_unsatisfiable_gang_over_http_is_a_429_before_anything_starts(fake_home: Path) -> None:
    from shoal.server.app import create_app
    from shoal.server.settings import ServerSettings

    total_mb = meminfo()["MemTotal"] // 1024
    node = Node(fake_config(fake_home, memory_overcommit=300 / total_mb))
    add_image(node.store, "t:1", {"/work/x": "x"})
    app = create_app(node, ServerSettings(), manage_node=True)
    with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as http:
        # the HTTP API offers the real backends only; admission refuses before any container would start
        body = {"image": "t:1", "memory_mb": 100, "n": 4, "all_or_nothing": True}
        r = http.post("/v1/sandboxes/batch", json=body)
        assert r.status_code == 429 and "Retry-After" in r.headers
        err = r.json()["error"]
        assert err["code"] == "gang_unsatisfiable" and err["details"]["available"] == 3
        assert list_records(node.paths.sandboxes) == []
        r = http.post("/v1/sandboxes/batch", json={**body, "all_or_nothing": "yes please"})
        assert r.status_code == 422


async def test_pressure_pauses_the_longest_idle_sandboxes_before_refusing_a_create(
        fake_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pressure response (shoal.node.scheduling.relieve): admission would refuse a create because the
    host's available memory is at its watermark; idle sandboxes are paused first and the create fits.
    The host's memory is simulated: each paused sandbox gives back 300 MiB."""
    from shoal.host.memory import MemorySample

    node = Node(fake_config(fake_home, min_free_memory_mb=512))
    add_image(node.store, "t:1", {"/work/x": "x"})
    await node.start(reap=False)
    total = 24 * 1024
    state = {"base": 16 * 1024}

    def available() -> int:
        paused = sum(1 for r in list_records(node.paths.sandboxes) if r.state == "paused")
        return state["base"] + 300 * paused

    node.admission.sampler = lambda: MemorySample(total_mb=total, available_mb=available(), free_mb=available())
    monkeypatch.setattr(node_scheduling, "_meminfo_mb", lambda: (total, available()))
    try:
        a = await node.create(spec("batch"))
        b = await node.create(spec("interactive"))
        c = await node.create(spec("interactive"))
        idle(node, a.id, ago=3600)
        idle(node, b.id, ago=600)
        state["base"] = 515  # at the watermark: a new sandbox's expected working set does not fit
        d = await node.create(spec("interactive"))
        assert d.state == "running"
        assert node.record(a.id).extra["paused_by"] == "pressure"
        assert (await node.get(c.id)).state == "running", "a busy sandbox was paused"
        assert node.scheduling.last_tide["by"] == "pressure" and a.id in node.scheduling.last_tide["paused"]
        # nothing idle left to pause: refused, saying why and what was tried
        idle(node, c.id, d.id, ago=0)
        for sid in (a.id, b.id):
            if (await node.get(sid)).state == "paused":
                await node.resume(sid)
        idle(node, a.id, b.id, ago=0)
        with pytest.raises(CapacityExceeded, match="no sandbox was idle for 30 s") as ei:
            await node.create(spec("interactive"))
        assert ei.value.details["reason"] == "memory" and ei.value.details["paused_for_room"] == 0
        assert "SHOAL_MIN_FREE_MB" in ei.value.message
        # a paused sandbox answers its next call
        idle(node, a.id, ago=3600)
        node.scheduling.rearm()
        await node.create(spec("interactive"))
        assert (await node.get(a.id)).state == "paused"
        assert (await node.exec(a.id, "echo back")).stdout == b"back\n"
        assert (await node.get(a.id)).state == "running"
    finally:
        await node.close_all()
        await node.stop()
