"""The SDK (Client, Sandbox, SyncClient) over an embedded node on the fake backend: ownership of what a
client made, create_many's per-item errors, fork ownership, option errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import shoal
from shoal.backends.fake import FakeBackend
from shoal.node.node import Node
from shoal.sdk.local import LocalTransport
from shoal.spec import SandboxSpec
from tests.unit.conftest import AGENT_BUILT, add_image, fake_config

pytestmark = pytest.mark.skipif(not AGENT_BUILT, reason="the agent is not built: run `make agent`")
FAKE = {"backend": "fake"}


def _node(home: Path) -> Node:
    node = Node(fake_config(home))
    add_image(node.store, "t:1", {"/work/hello.txt": "hi\n"})
    return node


@pytest.fixture
async def client(fake_home: Path) -> AsyncIterator[shoal.Client]:
    node = _node(fake_home)
    async with shoal.Client(transport=LocalTransport(node=node, reap=False)) as c:
        yield c
        await node.close_all()


def fail_creates(node: Node, ordinals: set[int]) -> None:
    """Make the fake backend's creates number `ordinals` (counted from now) fail."""
    backend = node.backend("fake")
    assert isinstance(backend, FakeBackend)
    start = backend.creates

    def hook(_spec: SandboxSpec, n: int) -> None:
        if n - start in ordinals:
            raise shoal.CapacityExceeded(f"injected refusal of create {n - start}", retry_after_s=1.0)

    backend.before_create = hook


def node_of(c: shoal.Client) -> Node:
    t = c.transport
    assert isinstance(t, LocalTransport)
    return t.node


async def test_a_client_closes_what_it_made_unless_keep(fake_home: Path) -> None:
    node = _node(fake_home)
    async with shoal.Client(transport=LocalTransport(node=node, reap=False)) as c:
        sb = await c.create("t:1", **FAKE)
        r = await sb.exec("cat hello.txt")
        assert (r.exit_code, r.stdout) == (0, b"hi\n")
        assert [i.id for i in await c.list()] == [sb.id]
    assert await node.list() == [], "the client left its sandbox running"
    node = _node(fake_home)
    async with shoal.Client(transport=LocalTransport(node=node, reap=False), keep=True) as c:
        kept = await c.create("t:1", **FAKE)
    async with shoal.Client(transport=LocalTransport(node=_node(fake_home), reap=False)) as c:
        assert [i.id for i in await c.list()] == [kept.id]
        await (await c.get(kept.id)).close()
        assert await c.list() == []


async def test_unknown_options_and_bad_values_are_invalid_requests(client: shoal.Client) -> None:
    with pytest.raises(shoal.InvalidRequest, match=r"unknown sandbox option\(s\): colour; known: backend"):
        await client.create("t:1", colour="red")
    with pytest.raises(shoal.InvalidRequest, match="memory_mb") as ei:
        await client.create("t:1", memory_mb=1, **FAKE)
    assert ei.value.details["errors"][0]["field"] == "memory_mb"
    with pytest.raises(shoal.InvalidRequest, match="unknown backend 'docker'"):
        await client.create("t:1", backend="docker")
    assert await client.list() == []


async def test_create_many_reports_each_failure_and_owns_the_rest(client: shoal.Client) -> None:
    node = node_of(client)
    fail_creates(node, {0, 2})
    items = await client.create_many("t:1", 4, **FAKE)
    assert [type(i).__name__ for i in items] == ["CapacityExceeded", "Sandbox", "CapacityExceeded", "Sandbox"]
    made = [i for i in items if isinstance(i, shoal.Sandbox)]
    assert {i.id for i in await node.list()} == {s.id for s in made}
    fail_creates(node, {0})
    with pytest.raises(shoal.CapacityExceeded):
        await client.create_many("t:1", 2, return_errors=False, **FAKE)
    assert len(await node.list()) == 3  # the one that was made is still owned by the client


async def test_fork_owns_every_child_made_even_after_a_failed_one(fake_home: Path) -> None:
    node = _node(fake_home)
    async with shoal.Client(transport=LocalTransport(node=node, reap=False)) as c:
        parent = await c.create("t:1", **FAKE)
        await parent.write_file("/work/state", b"s1")
        fail_creates(node, {0})  # the first child fails, the two after it are made
        with pytest.raises(shoal.CapacityExceeded):
            await parent.fork(3)
        kids = [i for i in await node.list() if i.id != parent.id]
        assert len(kids) == 2
        for k in kids:
            assert await node.read_file(k.id, "state") == b"s1"
    # closing the client closed the good children too (before the fix they outlived it)
    assert await node.list() == []


async def test_sandbox_surface(client: shoal.Client) -> None:
    sb = await client.create("t:1", labels={"who": "sdk"}, **FAKE)
    assert sb.info.labels == {"who": "sdk"} and sb.info.backend == "fake"
    await sb.write_file("notes.txt", "text")
    assert await sb.read_file("/work/notes.txt") == b"text"
    assert "notes.txt" in [e.name for e in await sb.list_dir()]
    async with await sb.shell() as sh:
        await sh.run("export A=1")
        assert (await sh.run("echo $A")).stdout == b"1\n"
    stream = await sb.stream("echo a; echo b >&2; exit 4")
    kinds = [ev.kind async for ev in stream]
    assert kinds[-1] == "exit" and stream.result is not None and stream.result.exit_code == 4
    await sb.pause()
    assert (await sb.refresh()).state == "paused"
    assert (await sb.exec("echo up")).stdout == b"up\n"
    with pytest.raises(shoal.Unsupported, match="fake backend"):
        await sb.fork(1, memory=True)
    await sb.close()
    with pytest.raises(shoal.SandboxNotFound):
        await client.get(sb.id)


def test_sync_client(fake_home: Path) -> None:
    node = _node(fake_home)
    with shoal.SyncClient(transport=LocalTransport(node=node, reap=False)) as c:
        sb = c.create("t:1", **FAKE)
        assert sb.exec("cat hello.txt").stdout == b"hi\n"
        sb.write_file("/work/x", b"y")
        assert sb.read_file("x") == b"y"
        with sb.shell() as sh:
            sh.run("cd /tmp")
            assert sh.run("pwd").stdout == b"/tmp\n"
        items = c.create_many("t:1", 2, **FAKE)
        assert all(isinstance(i, shoal.SyncSandbox) for i in items)
        assert len(c.list()) == 3
        with pytest.raises(shoal.InvalidRequest, match="unknown sandbox option"):
            c.create("t:1", nope=1)
    assert not any(r.init_alive() for r in _records(node))


def _records(node: Node) -> list:
    from shoal.records import list_records

    return list_records(node.paths.sandboxes)
