"""Guards that keep slow or greedy clients from pinning the server.

- `GuardedHttpToolsProtocol`: a connection must finish sending request headers within
  `header_timeout_s` (uvicorn alone waits forever: slowloris).
- `BodyGuard` (ASGI middleware): request bodies have a size limit (413) and must keep arriving
  (idle and total deadlines, 408); a response write that a client never reads gives up.
- `TokenLimiter`: bounded requests in progress per token; beyond that a bounded queue; beyond that 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.exceptions import HTTPException
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from shoal.errors import CapacityExceeded
from shoal.server.settings import ServerSettings

#: a refused request body is still read (and dropped) up to this size, so the client sees the answer
DRAIN_MAX = 256 << 20


class BodyTooLarge(HTTPException):
    """The request body passed its size limit (413)."""

    def __init__(self, limit: int) -> None:
        # the rest of the body may still come: close the connection rather than parse it as a request
        super().__init__(413, f"request body larger than {limit} bytes: send less (files: split them, or raise "
                              "the server's --max-upload-mb)", headers={"Connection": "close"})
        self.limit = limit


class BodyTimeout(HTTPException):
    """The client stopped sending its request body (408)."""

    def __init__(self, what: str) -> None:
        super().__init__(408, f"request body not received in time ({what}); the client must send it promptly",
                         headers={"Connection": "close"})


def make_guarded_protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with a deadline on receiving request headers."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()  # a connection that never sends a request goes away too

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            # idle keep-alive connections are closed by uvicorn's own keep-alive timer
            self._disarm()
            super().on_response_complete()

    return GuardedHttpToolsProtocol


def _error_body(status: int, code: str, message: str, details: dict[str, Any]) -> bytes:
    return json.dumps({"error": {"code": code, "message": message, "details": details}}).encode()


class BodyGuard:
    """ASGI middleware: request-body size limits and deadlines, and response-write deadlines."""

    def __init__(self, app: Any, settings: ServerSettings) -> None:
        self.app = app
        self.s = settings

    def _limit(self, scope: dict[str, Any]) -> tuple[int, float]:
        """(size limit, total deadline) of this request's body."""
        path = scope.get("path", "")
        if scope.get("method") == "PUT" and path.endswith("/files"):
            return self.s.max_upload_bytes, self.s.body_total_timeout_s
        if scope.get("method") == "POST" and (path == "/_e2b/envd/files" or
                                              (path.startswith("/swerex/") and path.endswith("/upload"))):
            # file uploads of the E2B and SWE-ReX compatible APIs (multipart adds a little framing)
            return self.s.max_upload_bytes + (64 << 10), self.s.body_total_timeout_s
        if path == "/v1/images/import":
            # image tarballs are big: only the idle deadline applies
            return self.s.max_import_bytes, float("inf")
        return self.s.max_request_bytes, self.s.body_total_timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, total_s = self._limit(scope)
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    declared = int(v)
                except ValueError:
                    declared = -1
                if declared > limit:
                    # read the body first: a client still sending when the answer comes and the connection
                    # closes sees a broken pipe, not the 413 (httpx raised ReadError/WriteError)
                    drained = declared <= DRAIN_MAX and await self._drain(receive)
                    await self._refuse(send, 413, "invalid_request",
                                       f"request body of {declared} bytes is over the limit of {limit} bytes",
                                       {"limit_bytes": limit, "reason": "payload_too_large"}, close=not drained)
                    return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + total_s
        state = {"got": 0, "done": False}

        async def guarded_receive() -> dict[str, Any]:
            if state["done"]:
                return await receive()  # waiting for a disconnect is not a body read
            left = deadline - loop.time()
            if left <= 0:
                raise BodyTimeout(f"over {total_s:g}s in total")
            try:
                async with asyncio.timeout(min(self.s.body_idle_timeout_s, left)):  # no extra task, unlike wait_for
                    msg = await receive()
            except TimeoutError:
                raise BodyTimeout(f"nothing for {self.s.body_idle_timeout_s:g}s") from None
            if msg["type"] == "http.request":
                state["got"] += len(msg.get("body", b""))
                if state["got"] > limit:
                    if msg.get("more_body", False):
                        # the rest is read and dropped, so the client gets to read the 413 (see __call__)
                        await self._drain(receive, state["got"])
                    state["done"] = True
                    raise BodyTooLarge(limit)
                if not msg.get("more_body", False):
                    state["done"] = True
            else:
                state["done"] = True
            return msg

        async def guarded_send(msg: dict[str, Any]) -> None:
            try:
                async with asyncio.timeout(self.s.send_timeout_s):
                    await send(msg)
            except TimeoutError:
                raise ConnectionAbortedError("client did not read the response in time") from None

        await self.app(scope, guarded_receive, guarded_send)

    async def _drain(self, receive: Any, got: int = 0) -> bool:
        """Read and drop the rest of a refused body (at most DRAIN_MAX bytes in all, idle deadline as
        usual). True when it was read to its end."""
        try:
            while got <= DRAIN_MAX:
                async with asyncio.timeout(self.s.body_idle_timeout_s):
                    msg = await receive()
                if msg["type"] != "http.request":
                    return False
                got += len(msg.get("body", b""))
                if not msg.get("more_body", False):
                    return True
        except TimeoutError:
            pass
        return False

    @staticmethod
    async def _refuse(send: Any, status: int, code: str, message: str, details: dict[str, Any],
                      close: bool = True) -> None:
        body = _error_body(status, code, message, details)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class TokenLimiter:
    """At most `inflight` requests in progress per token, `queued` more waiting; the rest get 429."""

    def __init__(self, inflight: int, queued: int) -> None:
        self.inflight = max(1, inflight)
        self.queued = max(0, queued)
        self._sems: dict[str, asyncio.Semaphore] = {}
        self._waiting: dict[str, int] = {}

    @contextlib.asynccontextmanager
    async def slot(self, token_id: str) -> AsyncIterator[None]:
        """Hold one in-progress slot of `token_id` for the duration of the block."""
        sem = self._sems.get(token_id)
        if sem is None:
            sem = self._sems[token_id] = asyncio.Semaphore(self.inflight)
        if sem.locked():
            if self._waiting.get(token_id, 0) >= self.queued:
                raise CapacityExceeded(
                    f"this token already has {self.inflight} requests in progress and {self.queued} waiting; "
                    "slow down or use more tokens", retry_after_s=1.0, reason="token_concurrency",
                    inflight=self.inflight)
            self._waiting[token_id] = self._waiting.get(token_id, 0) + 1
            try:
                await sem.acquire()
            finally:
                self._waiting[token_id] -= 1
        else:
            await sem.acquire()
        try:
            yield
        finally:
            sem.release()

    def stats(self) -> dict[str, int]:
        """Requests in progress per token (for metrics)."""
        return {t: self.inflight - s._value for t, s in self._sems.items()}
