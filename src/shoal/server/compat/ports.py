"""Ports of a sandbox behind `shoal serve`: what E2B's `get_host(port)` reaches (HTTP and WebSocket).

A request is for a sandbox port when the router (shoal.server.compat.routing) finds one in it — a
`<port>-<sandbox id>.<domain>` Host, or `E2b-Sandbox-Id` + `E2b-Sandbox-Port` headers — other than envd's
(49983) and the interpreter's (49999). The node then connects to that port *from inside the sandbox*: its agent
opens the TCP connection on the sandbox's own loopback and relays the bytes (`Node.open_port`, the agent's
`tcp_connect`), so this works for sandboxes without a network, in gVisor, and in VMs, and never opens the
sandbox's network. HTTP requests go through a pool of such connections (keep-alive per sandbox and port,
bodies streamed both ways); WebSockets are relayed message by message.

Access: when the server needs tokens, a port request must carry the sandbox's traffic access token
(`e2b-traffic-access-token`, the `trafficAccessToken` of the create answer; or `X-Access-Token`) or a shoal token
of its project (`X-API-KEY`); these headers are not passed on. `SHOAL_E2B_PUBLIC_PORTS=1` makes ports public
(E2B's default: whoever knows the sandbox id can reach them). Errors answer in E2B's proxy shape,
`{"sandboxId", "message", "port", "code"}`: 502 for a closed port or a sandbox that is gone, 403 without a token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpcore

from shoal.config import settings
from shoal.errors import PortNotOpen, SandboxNotFound, ShoalError, Timeout, Unauthorized
from shoal.limits import AGENT_CONNECT_TIMEOUT_S
from shoal.server.compat import common

if TYPE_CHECKING:
    from shoal.agentproto.relay import PortStream
    from shoal.server.deps import ServerState

log = logging.getLogger("shoal.server")

#: headers that only route or authorize the request here: never passed to the sandbox's server
_OURS = {b"e2b-sandbox-id", b"e2b-sandbox-port", b"e2b-traffic-access-token", b"x-access-token", b"x-api-key"}
#: hop-by-hop headers (RFC 9110 §7.6.1): about one connection, not the message
_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
        b"upgrade", b"proxy-connection"}
CONNECT_TIMEOUT_S = AGENT_CONNECT_TIMEOUT_S


# ---- access -----------------------------------------------------------------------------------------
def _public(rec: Any) -> bool:
    """Whether the sandbox's ports answer without a token: its create request said so (E2B's
    allow_public_traffic), else SHOAL_E2B_PUBLIC_PORTS."""
    asked = rec.labels.get(common.PUBLIC_PORTS_LABEL)
    return asked == "true" if asked is not None else bool(settings().e2b_public_ports)


def _check_access(st: ServerState, sid: str, headers: dict[str, str]) -> None:
    """Raise Unauthorized (no or a bad token) or SandboxNotFound (not the caller's, or gone)."""
    from shoal.records import check_sandbox_id

    check_sandbox_id(sid)
    rec = st.node.record(sid)
    if st.auth_required() and not _public(rec):
        creds = {k: v for k, v in headers.items() if k in ("e2b-traffic-access-token", "x-access-token",
                                                            "x-api-key")}
        if not creds:
            raise Unauthorized("Sandbox is secured with traffic access token. Token header "
                               "'e2b-traffic-access-token' is missing (see docs/compat.md, Ports)")
        rec = common.sandbox_of(st, common.principal_for_sandbox(st, sid, creds), sid)
    if rec.state not in ("running", "paused") or rec.extra.get("pool"):
        raise SandboxNotFound(f"sandbox {sid} is {rec.state}")


def _error_body(sid: str, port: int, status: int, message: str) -> bytes:
    return json.dumps({"sandboxId": sid, "message": message, "port": port, "code": status}).encode()


def _classify(exc: BaseException, sid: str, port: int) -> tuple[int, str]:
    if isinstance(exc, PortNotOpen):
        return 502, "The sandbox is running but port is not open"
    if isinstance(exc, Unauthorized):
        return 403, exc.message
    if isinstance(exc, SandboxNotFound):
        return 502, f"The sandbox {sid} was not found"
    if isinstance(exc, (Timeout, httpcore.TimeoutException)):
        return 504, f"port {port} of the sandbox did not answer in time"
    if isinstance(exc, ShoalError):
        return 502, exc.message
    if isinstance(exc, httpcore.ProtocolError):
        return 502, f"the server on port {port} sent a malformed HTTP answer: {exc}"
    log.exception("proxying to port %s of %s failed", port, sid)
    return 502, f"proxying to port {port} failed ({type(exc).__name__}): {exc}"


# ---- HTTP through a pool of agent-relayed connections -------------------------------------------------
class _RelayStream(httpcore.AsyncNetworkStream):
    """httpcore's view of one relayed connection."""

    def __init__(self, ps: PortStream) -> None:
        self.ps = ps
        self._held = b""

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if not self._held:
            try:
                self._held = await asyncio.wait_for(self.ps.read(), timeout) if timeout else await self.ps.read()
            except TimeoutError:
                raise httpcore.ReadTimeout(f"no answer within {timeout}s") from None
        out, self._held = self._held[:max_bytes], self._held[max_bytes:]
        return out

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        try:
            await self.ps.write(buffer)
        except ShoalError as e:
            raise httpcore.WriteError(str(e)) from e

    async def aclose(self) -> None:
        await self.ps.close()

    async def start_tls(self, ssl_context: Any, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("TLS to a sandbox port is not supported: the relay carries plain TCP")

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":  # an idle pooled connection with something to read was closed by its server
            return bool(self._held) or self.ps.readable()
        return None


class _RelayBackend(httpcore.AsyncNetworkBackend):
    """Connections to `<sandbox id>:<port>` are agent relays into that sandbox."""

    def __init__(self, st: ServerState) -> None:
        self.st = st

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None, socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        ps = await self.st.node.open_port(host, port, timeout=timeout or CONNECT_TIMEOUT_S)
        return _RelayStream(ps)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("not used")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def pool(st: ServerState) -> httpcore.AsyncConnectionPool:
    """This server's pool of relayed connections (keep-alive per sandbox and port)."""
    return common.server_local(st, "port_pool", lambda: httpcore.AsyncConnectionPool(
        network_backend=_RelayBackend(st), max_connections=1024, max_keepalive_connections=256,
        keepalive_expiry=5.0, retries=0))


async def close_pool(st: ServerState) -> None:
    """Close the pooled relays (server shutdown)."""
    p = st.compat.pop("port_pool", None)
    if p is not None:
        with contextlib.suppress(Exception):
            await p.aclose()


def _request_headers(scope: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    out = []
    for k, v in scope.get("headers", ()):
        lk = k.lower()
        if lk in _OURS or lk in _HOP:
            continue
        out.append((k, v))
    return out


async def _body(receive: Any) -> AsyncIterator[bytes]:
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        chunk = msg.get("body", b"")
        if chunk:
            yield chunk
        if not msg.get("more_body", False):
            return


async def _send_error(send: Any, sid: str, port: int, exc: BaseException) -> None:
    status, message = _classify(exc, sid, port)
    body = _error_body(sid, port, status, message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def proxy_http(st: ServerState, scope: dict[str, Any], receive: Any, send: Any, sid: str, port: int) -> None:
    """Answer one HTTP request with what the server on `port` inside sandbox `sid` answers."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
    try:
        _check_access(st, sid, headers)
    except Exception as e:
        await _send_error(send, sid, port, e)
        return
    path = scope.get("raw_path") or scope.get("path", "/").encode()
    if scope.get("query_string"):
        path += b"?" + scope["query_string"]
    url = httpcore.URL(scheme=b"http", host=sid.encode(), port=port, target=path)
    has_body = any(k in ("content-length", "transfer-encoding") for k in headers)
    body_sent = asyncio.Event()
    if not has_body:
        body_sent.set()
    started = False

    async def body() -> AsyncIterator[bytes]:
        async for chunk in _body(receive):
            yield chunk
        body_sent.set()

    async def relay() -> None:
        nonlocal started
        async with pool(st).stream(scope["method"], url, headers=_request_headers(scope),
                                   content=body() if has_body else None,
                                   extensions={"timeout": {"connect": CONNECT_TIMEOUT_S, "read": None,
                                                           "write": 60.0, "pool": 30.0}}) as resp:
            out_headers = [(k, v) for k, v in resp.headers if k.lower() not in _HOP
                           and k.lower() != b"transfer-encoding"]
            await send({"type": "http.response.start", "status": resp.status, "headers": out_headers})
            started = True
            async for chunk in resp.aiter_stream():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def client_gone() -> None:
        # once the request body is in, the next message is the client's disconnect: an endless response
        # (server-sent events, a long poll) must not outlive its client
        await body_sent.wait()
        while (await receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.create_task(relay()), asyncio.create_task(client_gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled():
        return  # the client went away: the relay was dropped with it
    err = work.exception()
    if err is not None and not started:
        await _send_error(send, sid, port, err)
    # an error after the start: the response is cut; the client sees the connection end


# ---- WebSocket ---------------------------------------------------------------------------------------
async def proxy_websocket(st: ServerState, scope: dict[str, Any], receive: Any, send: Any, sid: str,
                          port: int) -> None:
    """Relay one WebSocket to the server on `port` inside sandbox `sid`, message by message."""
    from websockets.client import ClientProtocol
    from websockets.frames import Close, Frame, Opcode
    from websockets.http11 import Response
    from websockets.uri import parse_uri

    msg = await receive()
    if msg["type"] != "websocket.connect":
        return
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
    ps = None
    try:
        _check_access(st, sid, headers)
        ps = await st.node.open_port(sid, port, timeout=CONNECT_TIMEOUT_S)
        path = (scope.get("raw_path") or scope.get("path", "/").encode()).decode("latin-1")
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        host = headers.get("host") or f"localhost:{port}"
        proto = ClientProtocol(parse_uri(f"ws://{host}{path}"),
                               subprotocols=list(scope.get("subprotocols") or []) or None)
        req = proto.connect()
        for name in ("origin", "cookie", "authorization", "user-agent"):
            if name in headers and name not in req.headers:
                req.headers[name] = headers[name]
        proto.send_request(req)
        for data in proto.data_to_send():
            await ps.write(data)
        handshake: Response | None = None
        while handshake is None:
            chunk = await asyncio.wait_for(ps.read(), CONNECT_TIMEOUT_S)
            if not chunk:
                raise PortNotOpen(f"the server on port {port} closed the connection during the WebSocket handshake")
            proto.receive_data(chunk)
            for ev in proto.events_received():
                if isinstance(ev, Response):
                    handshake = ev
        if handshake.status_code != 101:
            raise PortNotOpen(f"the server on port {port} refused the WebSocket upgrade "
                              f"({handshake.status_code} {handshake.reason_phrase})")
    except Exception as e:
        if ps is not None:
            await ps.close()
        status, message = _classify(e, sid, port)
        if "websocket.http.response" in (scope.get("extensions") or {}):
            body = _error_body(sid, port, status, message)
            await send({"type": "websocket.http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await send({"type": "websocket.close", "code": 1011, "reason": message[:120]})
        return
    await send({"type": "websocket.accept", "subprotocol": handshake.headers.get("Sec-WebSocket-Protocol")})

    async def flush() -> None:
        for data in proto.data_to_send():
            if data:
                await ps.write(data)
            else:
                await ps.write_eof()

    async def client_to_server() -> None:
        while True:
            m = await receive()
            if m["type"] == "websocket.disconnect":
                with contextlib.suppress(Exception):
                    proto.send_close(m.get("code", 1000))
                    await flush()
                return
            if m.get("text") is not None:
                proto.send_text(m["text"].encode())
            elif m.get("bytes") is not None:
                proto.send_binary(m["bytes"])
            await flush()

    async def server_to_client() -> None:
        parts: list[bytes] = []
        kind = Opcode.TEXT
        while True:
            chunk = await ps.read()
            if not chunk:
                proto.receive_eof()
            else:
                proto.receive_data(chunk)
            for ev in proto.events_received():
                if not isinstance(ev, Frame):
                    continue
                if ev.opcode in (Opcode.TEXT, Opcode.BINARY):
                    kind, parts = ev.opcode, [bytes(ev.data)]
                elif ev.opcode == Opcode.CONT:
                    parts.append(bytes(ev.data))
                elif ev.opcode == Opcode.CLOSE:
                    close = Close.parse(ev.data) if ev.data else Close(1000, "")
                    with contextlib.suppress(Exception):
                        await send({"type": "websocket.close", "code": close.code, "reason": close.reason})
                    return
                else:
                    continue  # ping/pong: the protocol answers pings itself (flushed below)
                if ev.fin:
                    data = b"".join(parts)
                    if kind == Opcode.TEXT:
                        await send({"type": "websocket.send", "text": data.decode("utf-8", "replace")})
                    else:
                        await send({"type": "websocket.send", "bytes": data})
            await flush()
            if not chunk:
                with contextlib.suppress(Exception):
                    await send({"type": "websocket.close", "code": 1006})
                return

    tasks = [asyncio.create_task(client_to_server()), asyncio.create_task(server_to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        await ps.close()


async def serve(st: ServerState, scope: dict[str, Any], receive: Any, send: Any, sid: str, port: int) -> None:
    """Proxy one HTTP request or WebSocket to a sandbox port."""
    if not 1 <= port <= 65535:
        await _send_error(send, sid, port, PortNotOpen(f"{port} is not a TCP port"))
        return
    if scope["type"] == "websocket":
        await proxy_websocket(st, scope, receive, send, sid, port)
    else:
        await proxy_http(st, scope, receive, send, sid, port)
