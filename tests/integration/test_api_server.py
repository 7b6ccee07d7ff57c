"""`shoal serve` as users run it: crash-only restarts, slow and greedy clients, the WebSocket stream
protocol, metrics, and the no-token loopback rule."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
from pathlib import Path

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

import shoal
from shoal.sdk.http import HttpTransport
from shoal.server.proc import ServerProcess, free_port
from shoal.server.tokens import TokenStore
from tests.integration.test_api_projects import private_home
from tests.waiting import async_wait_for, wait_for

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]
SMALL = {"memory_mb": 64}


def test_sandboxes_survive_server_kill_and_restart(shoal_home: Path) -> None:
    tok = TokenStore(shoal_home).create(f"pr-{secrets.token_hex(3)}")
    log = shoal_home / "restart.log"
    srv = ServerProcess(token=tok, log_path=log).start()
    port = srv.port
    sid = None
    try:
        async def before() -> str:
            async with shoal.Client(srv.url, token=tok, keep=True) as c:
                sb = await c.create("base", **SMALL)
                await sb.write_file("/work/progress", "step 9")
                await sb.exec("nohup sleep 1000 >/dev/null 2>&1 &")
                return sb.id

        sid = asyncio.run(before())
        srv.kill()  # kill -9: no shutdown code runs
        srv = ServerProcess(port=port, token=tok, log_path=log).start()

        async def after() -> None:
            async with shoal.Client(srv.url, token=tok, keep=True) as c:
                sb = await c.get(sid)
                assert sb.info.state == "running"
                assert (await sb.read_file("/work/progress")) == b"step 9"
                r = await sb.exec("pgrep -x sleep >/dev/null && echo alive")
                assert r.stdout == b"alive\n"  # processes kept running through the crash

        asyncio.run(after())
        srv.stop()  # graceful (SIGTERM): the shutdown runs and keeps the sandbox
        assert "shoal API stopped;" in log.read_text() and (shoal_home / "sandboxes" / sid / "record.json").exists()
        srv = ServerProcess(port=port, token=tok, log_path=log).start()
        asyncio.run(after())

        async def done() -> None:
            async with shoal.Client(srv.url, token=tok) as c:
                await (await c.get(sid)).close()

        asyncio.run(done())
        sid = None
    finally:
        srv.stop()
        if sid is not None:  # the test failed half-way: do not leak the sandbox
            asyncio.run(_close_embedded(sid))


async def _close_embedded(sid: str) -> None:
    async with shoal.Client() as c:
        await (await c.get(sid)).close()


@pytest.fixture(scope="module")
def tight_server(shoal_home: Path, base_image: str):
    """A server with tiny timeouts and per-token limits."""
    env = dict(os.environ, SHOAL_API_HEADER_TIMEOUT="1", SHOAL_API_BODY_IDLE_TIMEOUT="1",
               SHOAL_API_MAX_INFLIGHT="2", SHOAL_API_MAX_QUEUED="1")
    tok = TokenStore(shoal_home).create(f"pt-{secrets.token_hex(3)}")
    tok2 = TokenStore(shoal_home).create(f"pu-{secrets.token_hex(3)}")
    srv = ServerProcess(env=env, token=tok, log_path=shoal_home / "tight.log").start()
    srv.token2 = tok2  # type: ignore[attr-defined]
    yield srv
    srv.stop()


def _closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing, or None when it kept the connection open."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        return None
    return got


def test_slow_clients_cannot_pin_the_server(tight_server: ServerProcess) -> None:
    host, port = "127.0.0.1", tight_server.port
    idle = [socket.create_connection((host, port)) for _ in range(20)]
    partial = [socket.create_connection((host, port)) for _ in range(20)]
    for s in partial:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    try:
        # meanwhile others are served
        assert httpx.get(tight_server.url + "/healthz").status_code == 200
        for s in idle + partial:
            assert _closed_within(s, 5) == b"", "a silent or half-sent request kept its connection"
    finally:
        for s in idle + partial:
            s.close()
    # a body that stops arriving: 408, not a pinned handler
    s = socket.create_connection((host, port))
    try:
        s.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + tight_server.token.encode() + b"\r\nContent-Length: 100\r\n\r\n{")
        got = _closed_within(s, 6)
        assert got is not None and got.startswith(b"HTTP/1.1 408"), got
        assert b'"code":"timeout"' in got
    finally:
        s.close()


async def test_per_token_concurrency_is_bounded(tight_server: ServerProcess) -> None:
    async with shoal.Client(tight_server.url, token=tight_server.token) as c:
        sb = await c.create("base", **SMALL)
        t = HttpTransport(tight_server.url, token=tight_server.token, retry=False)
        await t.start()
        try:
            results = await asyncio.gather(*(t.exec(sb.id, "sleep 1") for _ in range(5)), return_exceptions=True)
        finally:
            await t.aclose()
        refused = [r for r in results if isinstance(r, shoal.CapacityExceeded)]
        ok = [r for r in results if isinstance(r, shoal.ExecResult)]
        assert len(ok) == 3 and len(refused) == 2  # 2 in progress + 1 queued; the rest refused
        assert refused[0].details["reason"] == "token_concurrency"
        # with retries (the default) every call gets through
        results = await asyncio.gather(*(sb.exec("sleep 0.3") for _ in range(5)))
        assert all(r.exit_code == 0 for r in results)
        # another token is not held up by this one's queue
        # the first token's commands sleep until the test kills them from the host: they cannot end on their
        # own while the other token is served
        marker = f"3600.{secrets.randbelow(10**6)}"
        busy = [asyncio.create_task(sb.exec(f"sleep {marker}")) for _ in range(3)]
        try:
            # two run (the token's limit), the third waits in its queue or retries
            await async_wait_for(lambda: len(_procs_with(marker)) == 2, what="two of the first token's commands to run")
            async with shoal.Client(tight_server.url, token=tight_server.token2) as other:
                assert (await other.list()) == []
            assert not any(t.done() for t in busy)
        finally:
            # release them (the third starts when one ends: kill until all have returned)
            await async_wait_for(lambda: _kill_all(marker) or all(t.done() for t in busy),
                                 what="the busy commands to end once killed")
        assert all(r.exit_code == 137 for r in await asyncio.gather(*busy))


def _procs_with(marker: str) -> list[int]:
    """Processes (of any sandbox: the host sees them all) whose argv holds `marker`."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0"):
                    out.append(int(d))
    return out


def _kill_all(marker: str) -> bool:
    """SIGKILL every process whose argv holds `marker`; False (so callers poll on)."""
    for pid in _procs_with(marker):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return False


async def _ws(url: str, token: str | None) -> object:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return await connect(url.replace("http", "ws", 1), additional_headers=headers)


async def test_stream_protocol_errors(api_server: ServerProcess) -> None:
    base = f"{api_server.url}/v1/sandboxes"
    async with shoal.Client(api_server.url, token=api_server.token) as c:
        sb = await c.create("base", **SMALL)
        cases = [
            (None, json.dumps({"cmd": "id"}), 4401, "unauthorized"),
            (api_server.token, b"\x00binary", 4422, "invalid_request"),
            (api_server.token, json.dumps({"cmd": "id", "nonsense": 1}), 4422, "invalid_request"),
            (api_server.token, "{", 4422, "invalid_request"),
        ]
        for token, first, code, err in cases:
            ws = await _ws(f"{base}/{sb.id}/stream", token)
            with contextlib.suppress(ConnectionClosed):  # a bad token is refused before the first message
                await ws.send(first)
            msg = json.loads(await ws.recv())
            assert msg["type"] == "error" and msg["error"]["code"] == err, msg
            await ws.wait_closed()
            assert ws.close_code == code
        ws = await _ws(f"{base}/n0-{'a' * 26}/stream", api_server.token)
        await ws.send(json.dumps({"cmd": "id"}))
        assert json.loads(await ws.recv())["error"]["code"] == "sandbox_not_found"
        await ws.wait_closed()
        assert ws.close_code == 4404
        # a client that goes away mid-command does not leave the command running
        marker = f"{secrets.randbelow(10**6)}.{secrets.randbelow(10**3)}"
        ws = await _ws(f"{base}/{sb.id}/stream", api_server.token)
        await ws.send(json.dumps({"cmd": ["sleep", marker]}))
        assert json.loads(await ws.recv()) == {"type": "started"}
        assert (await sb.exec(f"pgrep -f 'sleep {marker}'")).exit_code == 0
        await ws.close()

        async def ended() -> bool:
            return (await sb.exec(f"pgrep -f 'sleep {marker}'")).exit_code != 0

        await async_wait_for(ended, what="the command to end with its stream")
        # a broken control message ends the stream with an error (and the command)
        ws = await _ws(f"{base}/{sb.id}/stream", api_server.token)
        await ws.send(json.dumps({"cmd": "sleep 30", "stdin": True}))
        assert json.loads(await ws.recv()) == {"type": "started"}
        await ws.send(json.dumps({"type": "teleport"}))
        msg = json.loads(await ws.recv())
        assert msg["error"]["code"] == "invalid_request" and "teleport" in msg["error"]["message"]
        await ws.wait_closed()
        # a persistent shell command streams too
        sh = await sb.shell()
        await sh.run("export Z=zed")
        s = await c.transport.shell_stream(sb.id, sh.id, "for i in 1 2; do echo $Z$i; done")
        r = await s.wait()
        assert r.stdout == b"zed1\nzed2\n" and r.exit_code == 0


async def test_metrics_after_use(api_server: ServerProcess, shoal_home: Path) -> None:
    admin = TokenStore(shoal_home).create("ops", admin=True)
    async with shoal.Client(api_server.url, token=api_server.token) as c:
        sb = await c.create("base", **SMALL)
        await sb.exec("true")
        with pytest.raises(shoal.SandboxNotFound):
            await c.get("n0-" + "b" * 26)
        text = httpx.get(api_server.url + "/metrics", headers={"Authorization": f"Bearer {admin}"}).text
    assert 'shoal_sandboxes{state="running"}' in text
    assert 'shoal_create_seconds_count{backend="container"}' in text
    assert 'shoal_exec_seconds_count{kind="exec"}' in text
    assert 'shoal_api_errors_total{code="sandbox_not_found"}' in text
    assert 'route="/v1/sandboxes/{sandbox_id}/exec"' in text  # templates, not raw IDs
    assert sb.id not in text


def test_without_tokens_it_binds_loopback_only() -> None:
    with private_home() as home:
        import subprocess
        import sys

        env = dict(os.environ, SHOAL_HOME=str(home))
        port = free_port()
        log = open(home / "server.log", "wb")  # noqa: SIM115
        p = subprocess.Popen([sys.executable, "-m", "shoal.cli.main", "serve", "--host", "0.0.0.0", "--port",
                              str(port)], env=env, stdout=log, stderr=log)
        try:
            wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200,
                     what="the server to answer /healthz")
            listening = _listen_addrs(port)
            assert listening == {"127.0.0.1"}, listening
            text = (home / "server.log").read_text()
            assert "binding 127.0.0.1 instead of 0.0.0.0" in text and "shoal token create" in text
            assert httpx.get(f"http://127.0.0.1:{port}/healthz").json()["auth"] is False
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(30)
            log.close()


def _listen_addrs(port: int) -> set[str]:
    out = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for ln in f:
            parts = ln.split()
            local, st = parts[1], parts[3]
            ip_hex, port_hex = local.split(":")
            if st == "0A" and int(port_hex, 16) == port:
                out.add(socket.inet_ntoa(bytes.fromhex(ip_hex)[::-1]))
    return out
