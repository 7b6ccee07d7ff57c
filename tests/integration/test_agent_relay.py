"""The agent's `tcp_connect` relay and `watch` (inotify) operations, on the real shoal-agent binary started
as a normal process (servers on 127.0.0.1, directories under /tmp); see docs/protocol.md."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from pathlib import Path

import pytest

from shoal.agentproto import AgentClient
from shoal.agentproto import relay as R
from shoal.errors import FileNotFound, PortNotOpen, SandboxFileError
from tests.integration.test_agent_process import AGENT, agent, client  # noqa: F401  (fixtures)
from tests.waiting import async_wait_for

pytestmark = [pytest.mark.skipif(not AGENT.exists(), reason=f"{AGENT} is missing: run `make -C agent` first"),
              pytest.mark.timeout(120)]


def _free_port(family: int = socket.AF_INET) -> int:
    with socket.socket(family) as s:
        s.bind(("::1" if family == socket.AF_INET6 else "127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def _server(handler, host: str = "127.0.0.1"):  # type: ignore[no-untyped-def]
    srv = await asyncio.start_server(handler, host, 0)
    try:
        yield srv.sockets[0].getsockname()[1]
    finally:
        srv.close()
        await srv.wait_closed()


async def _read_all(ps: R.PortStream) -> bytes:
    out = []
    while chunk := await ps.read():
        out.append(chunk)
    return b"".join(out)


async def test_tcp_relay_echo_half_close_and_big_payload(client: AgentClient) -> None:  # noqa: F811
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()  # after the client's EOF

    async with _server(echo) as port:
        ps = await client.tcp_connect(port)
        assert ps.info["family"] == "ipv4"
        await ps.write(b"hello")
        assert await ps.read() == b"hello"
        big = os.urandom(5 << 20)  # more than every buffer on the way: flow control in both directions
        reader = asyncio.create_task(_read_all(ps))
        await ps.write(big)
        await ps.write_eof()
        assert await asyncio.wait_for(reader, 60) == big
        assert ps.error is None
        # the stream is over and the connection can be used no more
        with pytest.raises(Exception, match="closed"):
            await ps.write(b"x")


async def test_tcp_relay_refused_ipv6_and_abort(client: AgentClient) -> None:  # noqa: F811
    with pytest.raises(PortNotOpen, match=r"port \d+ inside the sandbox"):
        await client.tcp_connect(_free_port())
    # a server on ::1 only is found after 127.0.0.1 refuses
    if socket.has_ipv6:
        try:
            async with _server(lambda r, w: w.close(), host="::1") as port6:
                ps = await client.tcp_connect(port6)
                assert ps.info["family"] == "ipv6"
                await ps.close()
        except OSError:
            pass  # no IPv6 on this host's loopback
    # the client gives up: the server sees the connection go at once
    gone = asyncio.Event()

    async def wait_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            await reader.read()
        gone.set()

    async with _server(wait_eof) as port:
        ps = await client.tcp_connect(port)
        await ps.close()
        await asyncio.wait_for(gone.wait(), 10)


async def test_tcp_relay_ends_with_the_client_connection(agent, client: AgentClient) -> None:  # noqa: F811
    """A relay means nothing without its client: the agent drops it when the connection closes."""
    closed = asyncio.Event()

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            await reader.read()
        closed.set()

    async with _server(hold) as port:
        c2 = await agent.connect()
        await c2.tcp_connect(port)
        await c2.close()
        await asyncio.wait_for(closed.wait(), 10)


def _inotify_fds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify":
                n += 1
    return n


async def _events(w: R.WatchStream, until: str, limit: float = 10) -> list[R.WatchEvent]:
    got: list[R.WatchEvent] = []

    async def take() -> None:
        async for ev in w:
            got.append(ev)
            if ev.name == until:
                return

    await asyncio.wait_for(take(), limit)
    return got


async def test_watch_events_recursive_and_shared(agent, client: AgentClient, tmp_path: Path) -> None:  # noqa: F811
    root = tmp_path / "w"
    (root / "old").mkdir(parents=True)
    (root / "gone.txt").write_text("x")
    flat = await client.watch(str(root))
    deep = await client.watch(str(root) + "/", recursive=True)
    assert _inotify_fds(agent.pid) == 1  # both watches share the agent's one inotify instance

    (root / "a.txt").write_text("1")
    os.chmod(root / "a.txt", 0o600)
    os.rename(root / "a.txt", root / "b.txt")
    (root / "gone.txt").unlink()
    (root / "new").mkdir()
    # the agent watches a new directory when it reports its creation: files made in it from then on are seen
    early = await _events(deep, "new")
    (root / "new" / "deep.txt").write_text("2")
    (root / "old" / "o.txt").write_text("3")
    (root / "end").write_text("")

    evs = await _events(flat, "end")
    seen = {(e.name, m) for e in evs for m in (R.IN_CREATE, R.IN_MODIFY, R.IN_ATTRIB, R.IN_MOVED_FROM,
                                                  R.IN_MOVED_TO, R.IN_DELETE) if e.mask & m}
    assert {("a.txt", R.IN_CREATE), ("a.txt", R.IN_MODIFY), ("a.txt", R.IN_ATTRIB), ("a.txt", R.IN_MOVED_FROM),
            ("b.txt", R.IN_MOVED_TO), ("gone.txt", R.IN_DELETE), ("new", R.IN_CREATE)} <= seen
    assert not any("/" in e.name for e in evs)  # not recursive: nothing from below
    names = {e.name for e in early + await _events(deep, "end")}
    assert {"new/deep.txt", "old/o.txt", "b.txt"} <= names

    await flat.stop()
    (root / "again").write_text("")
    assert "again" in {e.name for e in await _events(deep, "again")}  # the other watch goes on
    await deep.stop()
    await async_wait_for(lambda: _inotify_fds(agent.pid) == 0, 10, what="the inotify instance closed")


async def test_watch_refuses_files_and_missing_paths(client: AgentClient, tmp_path: Path) -> None:  # noqa: F811
    (tmp_path / "f").write_text("")
    with pytest.raises(SandboxFileError, match="directory"):
        await client.watch(str(tmp_path / "f"))
    with pytest.raises(FileNotFound):
        await client.watch(str(tmp_path / "missing"))


async def test_watch_ends_with_the_client_connection(agent, tmp_path: Path) -> None:  # noqa: F811
    c2 = await agent.connect()
    await c2.watch(str(tmp_path))
    assert _inotify_fds(agent.pid) == 1
    await c2.close()
    await async_wait_for(lambda: _inotify_fds(agent.pid) == 0, 10, what="the inotify instance closed")
