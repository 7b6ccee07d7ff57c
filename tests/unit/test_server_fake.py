"""The HTTP API end to end: the real FastAPI app under uvicorn on 127.0.0.1, a node on the fake backend,
the SDK's HTTP transport (REST and WebSocket streams). The spec the API validates is the SDK's."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

import shoal
from shoal import limits
from shoal.node.node import Node
from shoal.server.app import create_app
from shoal.server.schemas import SpecIn
from shoal.server.settings import ServerSettings
from shoal.spec import SandboxSpec
from tests.unit.conftest import AGENT_BUILT, add_image, agents_under, fake_config

pytestmark = pytest.mark.skipif(not AGENT_BUILT, reason="the agent is not built: run `make agent`")
FAKE = {"backend": "fake"}


class Server:
    """uvicorn serving `app` on an ephemeral 127.0.0.1 port, in a thread (its own event loop)."""

    def __init__(self, app: object) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",  # type: ignore[arg-type]
                                                   lifespan="on", ws="websockets"))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            self.thread.join(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _serve(home: Path, **cfg: object) -> Server:
    node = Node(fake_config(home, **cfg))
    add_image(node.store, "t:1", {"/work/hello.txt": "hi\n"})
    return Server(create_app(node, ServerSettings(), manage_node=True))


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One server for the module (a server start is most of a test's time); nothing may be left running."""
    home = tmp_path_factory.mktemp("served")
    with _serve(home) as u:
        yield u
    left = agents_under(home)
    assert not left, f"sandbox agents left running: {left}"


@pytest.fixture
async def client(url: str) -> AsyncIterator[shoal.Client]:
    async with shoal.Client(url, timeout=30) as c:
        yield c


async def test_sandbox_life_over_http(client: shoal.Client) -> None:
    sb = await client.create("t:1", labels={"api": "yes"}, memory_mb=64, **FAKE)
    assert sb.info.backend == "fake" and sb.info.spec["memory_mb"] == 64
    r = await sb.exec("cat hello.txt; echo err >&2; exit 2")
    assert (r.exit_code, r.stdout, r.stderr) == (2, b"hi\n", b"err\n")
    assert (await sb.exec("sleep 20", timeout=0.3)).timed_out
    stream = await sb.stream("echo one; echo two")
    out = b"".join([ev.data async for ev in stream if ev.kind == "stdout"])
    assert out == b"one\ntwo\n" and stream.result is not None and stream.result.exit_code == 0
    sh = await sb.shell()
    await sh.run("export V=7")
    assert (await sh.run("echo $V")).stdout == b"7\n"
    await sb.write_file("/work/w.bin", b"\x00\x01")
    assert await sb.read_file("w.bin") == b"\x00\x01"
    await sb.pause()
    assert (await sb.refresh()).state == "paused"
    await sb.resume()
    kids = await sb.fork(2)
    assert len(kids) == 2 and await kids[0].read_file("w.bin") == b"\x00\x01"
    labelled = {i.id for i in await client.list(labels={"api": "yes"})}  # children keep the labels
    assert labelled == {sb.id, *(k.id for k in kids)}
    assert {i.id for i in await client.list(labels={"shoal.fork_of": sb.id})} == {k.id for k in kids}
    many = await client.create_many("t:1", 3, **FAKE)
    assert all(isinstance(m, shoal.Sandbox) for m in many)
    await sb.close()
    with pytest.raises(shoal.SandboxNotFound):
        await client.get(sb.id)


async def test_capability_errors_travel_typed(client: shoal.Client) -> None:
    sb = await client.create("t:1", **FAKE)
    with pytest.raises(shoal.Unsupported, match="the fake backend cannot fork a sandbox's processes"):
        await sb.fork(1, memory=True)
    with pytest.raises(shoal.Unsupported, match="network"):
        await client.create("t:1", network=True, **FAKE)
    await sb.close()


async def test_cpu_class_over_http_keeps_the_capability_error(client: shoal.Client, url: str) -> None:
    # the fake backend has no CPU classes (container only): the node's Unsupported travels typed, as 501
    sb = await client.create("t:1", **FAKE)
    with pytest.raises(shoal.Unsupported, match="CPU class"):
        await sb.set_cpu_class("batch")
    r = httpx.post(f"{url}/v1/sandboxes/{sb.id}/cpu_class", json={"cpu_class": "batch"})
    assert r.status_code == 501 and r.json()["error"]["code"] == "unsupported"
    with pytest.raises(shoal.InvalidRequest):
        await sb.set_cpu_class("realtime")
    assert (await sb.refresh()).spec["cpu_class"] == "interactive"
    await sb.close()


async def test_a_gateway_relays_set_cpu_class_to_a_node_server(client: shoal.Client, url: str,
                                                                 tmp_path: Path) -> None:
    # ClusterFront -> ClusterTransport -> the node agent's HTTP API (here: this module's server, as the agent)
    from shoal.cluster.gateway import ClusterFront
    from shoal.cluster.transport import _Agent
    from shoal.records import node_of
    from shoal.sdk.http import HttpTransport

    sb = await client.create("t:1", **FAKE)
    front = ClusterFront("ray://127.0.0.1:1", home=str(tmp_path / "h"), store=str(tmp_path / "s"))
    http = HttpTransport(url, timeout=30)
    await http.start()
    try:
        front.transport._agents[node_of(sb.id)] = _Agent(node_of(sb.id), None, {}, http)
        with pytest.raises(shoal.Unsupported, match="cannot put sandboxes in CPU classes"):
            await front.set_cpu_class(sb.id, "batch")
    finally:
        await http.aclose()
        await sb.close()


async def test_restore_over_http_keeps_the_capability_error(client: shoal.Client) -> None:
    # the fake backend has no memory snapshots: Unsupported over HTTP (501), typed in the SDK
    with pytest.raises(shoal.Unsupported, match="restore"):
        await client.restore("snap", backend="fake")


def test_spec_errors_are_422_per_field(url: str) -> None:
    r = httpx.post(url + "/v1/sandboxes", json={"image": "t:1", "memory_mb": 1, "backend": "docker", "x": 1})
    assert r.status_code == 422
    fields = {e["field"] for e in r.json()["error"]["details"]["errors"]}
    assert {"body.memory_mb", "body.backend", "body.x"} <= fields
    assert "unknown backend 'docker'" in r.text


def test_a_server_refuses_the_fake_backend_unless_enabled(fake_home: Path) -> None:
    with _serve(fake_home, fake_backend=False) as u:
        r = httpx.post(u + "/v1/sandboxes", json={"image": "t:1", "backend": "fake"})
        assert r.status_code == 503 and "NO isolation" in r.json()["error"]["message"]
        assert httpx.get(u + "/v1/sandboxes").json()["sandboxes"] == []


def test_the_http_spec_is_the_sdk_spec(url: str) -> None:
    # same fields, defaults and limits in /openapi.json as in SandboxSpec
    api = httpx.get(url + "/openapi.json").json()["components"]["schemas"]["SpecIn"]["properties"]
    sdk = SandboxSpec.model_json_schema()["properties"]
    assert set(api) == set(sdk)
    def norm(prop: dict) -> dict:  # FastAPI leaves out `"default": null`
        return {k: v for k, v in prop.items() if not (k == "default" and v is None)}

    for name, prop in sdk.items():
        if name != "project":
            assert norm(api[name]) == norm(prop), name
    assert api["memory_mb"]["default"] == limits.DEFAULT_MEMORY_MB
    assert api["ttl_s"]["anyOf"][0]["maximum"] == limits.MAX_TTL_S
    assert issubclass(SpecIn, SandboxSpec)
    ex = httpx.get(url + "/openapi.json").json()["components"]["schemas"]["ExecIn"]["properties"]
    assert ex["timeout"]["default"] == limits.DEFAULT_EXEC_TIMEOUT_S
