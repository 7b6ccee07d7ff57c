"""Item 5 of issue 19: client input must get a 4xx with a typed error, never a 500, and an error must
not break the client's connection.

Before the fix: an exec env over 1 MiB answered 500 "frame payload ... exceeds 1048576" (embedded: a raw
ValueError); one ~200 KB env var at create, 500 "cannot connect to the agent"; a 5 MB first WebSocket
message, close code 4500; after any 500 the server dropped the keep-alive connection without saying so
(the SDK's next call failed); an oversized upload got 413 from curl but a transport error in the SDK;
3 MB of labels were accepted."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

import shoal
from shoal.server.proc import ServerProcess
from shoal.server.tokens import TokenStore

pytestmark = [pytest.mark.root]


async def test_oversized_exec_env_is_invalid_request(any_client: shoal.Client) -> None:
    sb = await any_client.create("base", memory_mb=128)
    many = {f"V{i}": "x" * 1000 for i in range(2000)}  # 2 MB in all, each variable small
    with pytest.raises(shoal.InvalidRequest, match="bytes in all"):
        await sb.exec("true", env=many)
    with pytest.raises(shoal.InvalidRequest, match="kernel's limit"):
        await sb.exec("true", env={"BIG": "x" * 200_000})
    with pytest.raises(shoal.InvalidRequest):
        await sb.shell(env=many)
    # the same client, on the same connection, goes on working
    assert (await sb.exec("echo fine")).stdout == b"fine\n"


async def test_huge_env_var_at_create_is_invalid_request(any_client: shoal.Client) -> None:
    before = {i.id for i in await any_client.list()}
    with pytest.raises(shoal.InvalidRequest, match="kernel's limit"):
        await any_client.create("base", env={"BIG": "x" * 200_000})
    assert {i.id for i in await any_client.list()} == before  # nothing left behind
    sb = await any_client.create("base", env={"OK": "x" * 100_000}, memory_mb=128)
    assert (await sb.exec("echo ${#OK}")).stdout == b"100000\n"


async def test_labels_are_bounded(any_client: shoal.Client) -> None:
    with pytest.raises(shoal.InvalidRequest, match="at most 64"):
        await any_client.create("base", labels={f"k{i}": "v" for i in range(65)})
    with pytest.raises(shoal.InvalidRequest, match="over the limit"):
        await any_client.create("base", labels={f"k{i}": "v" * 1000 for i in range(30)})


async def test_huge_first_websocket_message_is_invalid_request(api_server: ServerProcess) -> None:
    async with shoal.Client(api_server.url, token=api_server.token) as c:
        sb = await c.create("base", memory_mb=128)
        with pytest.raises(shoal.InvalidRequest):
            async for _ in await sb.stream("true", env={f"V{i}": "y" * 1000 for i in range(5000)}):
                pass
        assert (await sb.exec("echo still")).stdout == b"still\n"


@pytest.fixture(scope="module")
def small_upload_server(shoal_home: Path, base_image: str) -> Iterator[ServerProcess]:
    token = TokenStore(shoal_home).create("uploads", name="upload limit test")
    srv = ServerProcess(log_path=shoal_home / "api-small-upload.log", token=token,
                        args=["--max-upload-mb", "1"])
    srv.start()
    yield srv
    srv.stop()


async def test_oversized_upload_gets_a_typed_error(small_upload_server: ServerProcess) -> None:
    async with shoal.Client(small_upload_server.url, token=small_upload_server.token) as c:
        sb = await c.create("base", memory_mb=128)
        for _ in range(3):  # and again, on the connection the refusal left
            with pytest.raises(shoal.InvalidRequest, match="over the limit") as e:
                await sb.write_file("/tmp/big", b"z" * (48 << 20))
            assert e.value.details.get("reason") == "payload_too_large"
            await sb.write_file("/tmp/small", b"ok")
        assert await sb.read_file("/tmp/small") == b"ok"
        await sb.close()


def test_an_internal_error_keeps_the_connection(shoal_home: Path) -> None:
    """A bug (an unexpected exception in a route) answers a JSON 500, and the keep-alive connection
    serves the next request (the server is real uvicorn with shoal's app; the route that raises is the
    test's: no input reaches a 500 any more)."""
    from shoal.node.node import Node
    from shoal.server.app import create_app
    from shoal.server.settings import ServerSettings

    app = create_app(Node(), ServerSettings(no_auth=True), manage_node=False)

    async def boom() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/v1/boom", boom)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    conns: list[object] = []
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    try:
        for _ in range(100):
            if server.started:
                break
            threading.Event().wait(0.05)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as h:
            r = h.get("/v1/boom")
            assert r.status_code == 500 and r.json()["error"]["code"] == "shoal_error"
            assert r.headers.get("connection") != "close"
            conns.append(server.server_state.connections.copy())
            assert h.get("/healthz").status_code == 200
            # one connection served both
            assert len(server.server_state.connections) == 1 and server.server_state.connections == conns[0]
    finally:
        server.should_exit = True
        t.join(timeout=10)
        sock.close()


