"""The server side of the Connect RPC protocol with the JSON codec (what E2B's envd speaks).

- Unary: `POST /pkg.Service/Method`, `Content-Type: application/json`, the request message as JSON; the
  answer is 200 with the response message as JSON, or an error status with `{"code", "message"}`.
- Server stream: `Content-Type: application/connect+json`; the request body is one *envelope* (1 flag
  byte, a 4-byte big-endian length, the JSON message); the answer is 200 with a sequence of envelopes
  (flag 0) and one end-of-stream envelope (flag 2) carrying `{}` or `{"error": {"code", "message"}}`.
- `Connect-Timeout-Ms` is the caller's deadline.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from shoal.errors import (
    CapacityExceeded,
    FileNotFound,
    Forbidden,
    InvalidRequest,
    NotImplementedYet,
    QuotaExceeded,
    SandboxFileError,
    SandboxNotFound,
    ShellNotFound,
    ShoalError,
    Timeout,
    Unauthorized,
)

UNARY_JSON = "application/json"
STREAM_JSON = "application/connect+json"
END_STREAM = 0x02
#: Connect codes → HTTP status of a unary error answer
HTTP_OF = {"canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504, "not_found": 404,
           "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429, "failed_precondition": 400,
           "aborted": 409, "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
           "data_loss": 500, "unauthenticated": 401}


class RpcError(Exception):
    """An error answered in Connect's own shape."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def rpc_error(exc: BaseException) -> RpcError:
    """A shoal error (or a plain bug) as the Connect error the E2B SDK maps to its own exceptions."""
    if isinstance(exc, RpcError):
        return exc
    if isinstance(exc, ShoalError):
        msg = exc.message
        agent_code = exc.details.get("agent_code")
        if isinstance(exc, (SandboxNotFound, FileNotFound, ShellNotFound)):
            return RpcError("not_found", msg)
        if agent_code == "exists":
            return RpcError("already_exists", msg)
        if agent_code == "permission_denied":
            return RpcError("permission_denied", msg)
        if isinstance(exc, SandboxFileError):
            return RpcError("failed_precondition", msg)
        if isinstance(exc, InvalidRequest):
            return RpcError("invalid_argument", msg)
        if isinstance(exc, Unauthorized):
            return RpcError("unauthenticated", msg)
        if isinstance(exc, (Forbidden,)):
            return RpcError("permission_denied", msg)
        if isinstance(exc, (QuotaExceeded, CapacityExceeded)):
            return RpcError("resource_exhausted", msg)
        if isinstance(exc, Timeout):
            return RpcError("deadline_exceeded", msg)
        if isinstance(exc, NotImplementedYet):
            return RpcError("unimplemented", msg)
        return RpcError("unavailable", msg)
    return RpcError("internal", f"internal error ({type(exc).__name__}): {exc}; the server log has the traceback")


def error_response(err: RpcError) -> Response:
    """A unary error answer."""
    body = json.dumps({"code": err.code, "message": err.message}).encode()
    return Response(body, status_code=HTTP_OF.get(err.code, 500), media_type=UNARY_JSON)


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    """One length-prefixed frame of a stream."""
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_stream(err: RpcError | None = None) -> bytes:
    """The last frame of a stream (with the error that ended it, if any)."""
    body: dict[str, Any] = {}
    if err is not None:
        body["error"] = {"code": err.code, "message": err.message}
    return envelope(body, END_STREAM)


def is_stream_request(request: Request) -> bool:
    """True when the caller speaks the streaming flavour (enveloped body and answer)."""
    ctype = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    return ctype.startswith("application/connect+")


def timeout_s(request: Request) -> float | None:
    """The caller's deadline in seconds (Connect-Timeout-Ms), None when it set none."""
    raw = request.headers.get("connect-timeout-ms")
    if not raw:
        return None
    try:
        ms = int(raw)
    except ValueError:
        raise RpcError("invalid_argument", f"Connect-Timeout-Ms {raw!r} is not a number of milliseconds") from None
    return max(0.001, ms / 1000) if ms > 0 else None


async def read_message(request: Request, limit: int = 16 << 20) -> dict[str, Any]:
    """The request message: plain JSON (unary) or the first envelope (streams)."""
    body = await request.body()
    if len(body) > limit:
        raise RpcError("resource_exhausted", f"request message larger than {limit} bytes")
    if is_stream_request(request):
        ctype = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
        if ctype != STREAM_JSON:
            raise RpcError("unimplemented", f"codec {ctype!r} is not supported: shoal's envd speaks JSON only "
                                            "(application/connect+json)")
        if len(body) < 5:
            raise RpcError("invalid_argument", "stream request without an envelope")
        flags, n = struct.unpack(">BI", body[:5])
        if flags & 0x01:
            raise RpcError("unimplemented", "compressed messages are not supported")
        data = body[5:5 + n]
        if len(data) != n:
            raise RpcError("invalid_argument", "truncated envelope")
    else:
        ctype = (request.headers.get("content-type") or UNARY_JSON).split(";", 1)[0].strip().lower()
        if ctype not in (UNARY_JSON, ""):
            raise RpcError("unimplemented", f"codec {ctype!r} is not supported: shoal's envd speaks JSON only "
                                            "(application/json)")
        data = body
    if not data.strip():
        return {}
    try:
        msg = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise RpcError("invalid_argument", f"request message is not valid JSON: {e}") from None
    if not isinstance(msg, dict):
        raise RpcError("invalid_argument", "request message must be a JSON object")
    return msg


async def unary(request: Request, handler: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]) -> Response:
    """Answer a unary call: decode, run `handler`, encode its answer or its error."""
    try:
        if is_stream_request(request):
            raise RpcError("unimplemented", "this method is unary: send Content-Type application/json")
        msg = await read_message(request)
        out = await handler(msg)
    except Exception as e:  # every failure gets Connect's error shape, never a bare 500
        err = rpc_error(e)
        if err.code == "internal":
            import logging

            logging.getLogger("shoal.server").exception("envd call %s failed", request.url.path)
        return error_response(err)
    return Response(json.dumps(out, separators=(",", ":")).encode(), media_type=UNARY_JSON)


async def server_stream(request: Request,
                        handler: Callable[[dict[str, Any]], Awaitable[AsyncIterator[dict[str, Any]]]]) -> Response:
    """Answer a server-streaming call: every message `handler` yields is one envelope; errors end the stream."""
    if not is_stream_request(request):
        return error_response(RpcError("unimplemented", "this method streams: send Content-Type "
                                                        "application/connect+json with an enveloped message"))
    try:
        msg = await read_message(request)
        it = await handler(msg)
    except Exception as e:
        err = rpc_error(e)

        async def failed() -> AsyncIterator[bytes]:
            yield end_stream(err)

        return StreamingResponse(failed(), media_type=STREAM_JSON)

    async def frames() -> AsyncIterator[bytes]:
        try:
            async for m in it:
                yield envelope(m)
        except Exception as e:
            yield end_stream(rpc_error(e))
            return
        finally:
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()
        yield end_stream()

    return StreamingResponse(frames(), media_type=STREAM_JSON)


async def _envelopes(request: Request, limit: int = 16 << 20) -> AsyncIterator[dict[str, Any]]:
    """The messages of an enveloped (streaming) request body, as they arrive."""
    buf = b""
    async for chunk in request.stream():
        buf += chunk
        while len(buf) >= 5:
            flags, n = struct.unpack(">BI", buf[:5])
            if n > limit:
                raise RpcError("resource_exhausted", f"request message larger than {limit} bytes")
            if len(buf) < 5 + n:
                break
            data, buf = buf[5:5 + n], buf[5 + n:]
            if flags & 0x01:
                raise RpcError("unimplemented", "compressed messages are not supported")
            if flags & END_STREAM:
                return
            try:
                msg = json.loads(data) if data.strip() else {}
            except (ValueError, UnicodeDecodeError) as e:
                raise RpcError("invalid_argument", f"request message is not valid JSON: {e}") from None
            if not isinstance(msg, dict):
                raise RpcError("invalid_argument", "request message must be a JSON object")
            yield msg
    if buf:
        raise RpcError("invalid_argument", "truncated envelope at the end of the request stream")


async def client_stream(request: Request,
                        handler: Callable[[AsyncIterator[dict[str, Any]]], Awaitable[dict[str, Any]]]) -> Response:
    """Answer a client-streaming call: `handler` consumes the request messages and returns one answer, sent as
    one envelope and the end of the stream (errors end the stream instead)."""
    if not is_stream_request(request):
        return error_response(RpcError("unimplemented", "this method takes a stream: send Content-Type "
                                                        "application/connect+json with enveloped messages"))
    ctype = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
    try:
        if ctype != STREAM_JSON:
            raise RpcError("unimplemented", f"codec {ctype!r} is not supported: shoal's envd speaks JSON only")
        out = await handler(_envelopes(request))
        body = envelope(out) + end_stream()
    except Exception as e:
        body = end_stream(rpc_error(e))
    return Response(body, media_type=STREAM_JSON)
