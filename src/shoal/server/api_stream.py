"""Streaming exec and shell commands over WebSocket: `GET /v1/sandboxes/{id}/stream` (upgrade).

Protocol (also in docs/api.md):
  client → server, first message (text, JSON): {"cmd": ..., "timeout", "cwd", "env", "user", "tty", "stdin"}
      or, for a persistent shell: {"shell": "<shell id>", "cmd": "...", "timeout", "max_output"}
  server → client: {"type": "started"} once the command runs; then binary frames whose first byte
      is 1 (stdout) or 2 (stderr) followed by the bytes; finally {"type": "exit", "result": {...}}
      (an ExecResult as in POST .../exec) and a normal close (1000).
  client → server while it runs: binary frames = stdin bytes; text {"type": "stdin_eof"},
      {"type": "signal", "signal": 2}, {"type": "resize", "rows": 40, "cols": 120}.
  errors: {"type": "error", "error": {"code", "message", "details"}}, then close code 4000 + HTTP status.
  A client that disconnects before the exit event kills the command (SIGKILL to its process group).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import Field, ValidationError

from shoal.errors import InvalidRequest, ShoalError, Timeout
from shoal.limits import DEFAULT_EXEC_TIMEOUT_S, MAX_EXEC_TIMEOUT_S
from shoal.server.codec import STDERR_TAG, STDOUT_TAG, encode_exec_result
from shoal.server.deps import ServerState, owned, state_of
from shoal.server.schemas import _In

log = logging.getLogger("shoal.server")
router = APIRouter(tags=["streams"])


class StreamStart(_In):
    """The first message of a stream."""

    cmd: str | list[str]
    shell: str | None = Field(None, max_length=200)
    timeout: float | None = Field(DEFAULT_EXEC_TIMEOUT_S, gt=0, le=MAX_EXEC_TIMEOUT_S)
    cwd: str | None = Field(None, max_length=4096)
    env: dict[str, str] | None = None
    user: str | None = Field(None, max_length=256)
    tty: bool = False
    stdin: bool = False
    max_output: int | None = Field(None, ge=0, le=1 << 30)


def validation_error(e: ValidationError, where: str = "body") -> InvalidRequest:
    """A pydantic error as InvalidRequest naming each field."""
    errs = [{"field": ".".join([where, *(str(x) for x in err["loc"])]), "message": err["msg"]} for err in e.errors()]
    summary = "; ".join(f"{x['field']}: {x['message']}" for x in errs[:5])
    return InvalidRequest(f"invalid request: {summary}", errors=errs)


async def _send_error(ws: WebSocket, e: ShoalError) -> None:
    with contextlib.suppress(Exception):
        async with asyncio.timeout(5.0):  # a client that reads nothing does not keep the handler
            await ws.send_json({"type": "error", "error": e.to_dict()})
            await ws.close(code=4000 + int(e.http_status))


async def _start(ws: WebSocket, st: ServerState, sandbox_id: str, who: Any) -> Any:
    try:
        msg = await asyncio.wait_for(ws.receive(), st.settings.ws_start_timeout_s)
    except TimeoutError:
        raise Timeout(f"no start message within {st.settings.ws_start_timeout_s:g}s") from None
    if msg["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(msg.get("code", 1000))
    if msg.get("text") is None:
        raise InvalidRequest("the first message must be JSON text: {\"cmd\": ...}")
    try:
        start = StreamStart.model_validate_json(msg["text"])
    except ValidationError as e:
        raise validation_error(e) from None
    rec = await owned(st, who, sandbox_id)
    if start.shell is not None:
        if not isinstance(start.cmd, str):
            raise InvalidRequest("shell commands are strings", errors=[{"field": "body.cmd", "message": "string"}])
        if start.tty or start.stdin or start.cwd or start.env or start.user:
            raise InvalidRequest("a shell command takes only cmd, timeout and max_output")
        cap = rec.spec.max_output_bytes if start.max_output is None else start.max_output
        c = await st.node.client(sandbox_id)
        return await c.shell_run_stream(start.shell, start.cmd, timeout=start.timeout, max_output=cap)
    return await st.node.stream(sandbox_id, start.cmd, timeout=start.timeout, cwd=start.cwd, env=start.env,
                                user=start.user, tty=start.tty, stdin=start.stdin)


async def _pump(ws: WebSocket, h: Any, send_timeout_s: float = 60.0) -> ShoalError | None:
    """Forward output to the client and the client's input to the command until one side ends.

    Output is never buffered here: a client that does not read holds up the command (the agent
    connection stops reading past a few MiB, see shoal.agentproto.client); one that reads nothing for
    `send_timeout_s` is dropped, and its command killed, like one that disconnects."""

    async def pump_out() -> None:
        async for ev in h:
            try:
                async with asyncio.timeout(send_timeout_s):
                    if ev.kind == "exit":
                        await ws.send_json({"type": "exit", "result": encode_exec_result(ev.result)})
                        return
                    await ws.send_bytes(bytes([STDOUT_TAG if ev.kind == "stdout" else STDERR_TAG]) + ev.data)
            except TimeoutError:
                with contextlib.suppress(Exception):
                    await h.send_signal(signal.SIGKILL)
                raise Timeout(f"the client read no output for {send_timeout_s:g}s; the command was killed") from None

    async def pump_in() -> ShoalError | None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return None
            if msg.get("bytes") is not None:
                await h.write_stdin(msg["bytes"])
                continue
            try:
                ctl = json.loads(msg.get("text") or "")
                kind = ctl.get("type")
                if kind == "stdin_eof":
                    await h.close_stdin()
                elif kind == "signal":
                    sig = int(ctl["signal"])
                    if not 1 <= sig <= 64:
                        raise ValueError("signal out of range")
                    await h.send_signal(sig)
                elif kind == "resize":
                    rows, cols = int(ctl["rows"]), int(ctl["cols"])
                    if not (0 < rows < 65536 and 0 < cols < 65536):
                        raise ValueError("rows and cols must be 1-65535")
                    await h.resize(rows, cols)
                else:
                    raise ValueError(f"unknown message type {kind!r}")
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                return InvalidRequest(f"bad control message: {e}; expected stdin_eof, signal or resize")

    out_t = asyncio.create_task(pump_out())
    in_t = asyncio.create_task(pump_in())
    try:
        done, _ = await asyncio.wait({out_t, in_t}, return_when=asyncio.FIRST_COMPLETED)
        if out_t in done:
            in_t.cancel()
            out_t.result()  # an error of the command itself (bad cwd, unknown user) is raised here
            return None
        out_t.cancel()
        problem = in_t.result()
        # the client left (or broke the protocol) before the command ended: do not leave it running
        with contextlib.suppress(Exception):
            await h.send_signal(signal.SIGKILL)
        return problem
    finally:
        for t in (out_t, in_t):
            if not t.done():
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
        aclose = getattr(h, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


@router.websocket("/v1/sandboxes/{sandbox_id}/stream")
async def stream(ws: WebSocket, sandbox_id: str) -> None:
    """Run a command (or a shell command) and stream its output; see the module doc for the protocol."""
    st = state_of(ws)
    await ws.accept()
    t0 = time.perf_counter()
    try:
        who = st.authenticate_ws(ws.headers.get("authorization"), ws.query_params.get("ticket"))
        async with st.limiter.slot(who.token_id):
            h = await _start(ws, st, sandbox_id, who)
            await ws.send_json({"type": "started"})
            problem = await _pump(ws, h, st.settings.send_timeout_s)
        if problem is not None:
            st.metrics.errors.labels(problem.code).inc()
            await _send_error(ws, problem)
            return
        st.metrics.exec_seconds.labels("stream").observe(time.perf_counter() - t0)
        st.view.live.observe_exec(time.perf_counter() - t0)
        with contextlib.suppress(Exception):
            await ws.close(code=1000)
    except WebSocketDisconnect:
        return
    except ShoalError as e:
        from shoal.server.responses import blame_request

        e = blame_request(e)
        st.metrics.errors.labels(e.code).inc()
        await _send_error(ws, e)
    except Exception as e:
        log.exception("stream failed")
        st.metrics.errors.labels("internal_error").inc()
        from shoal.errors import SandboxError

        await _send_error(ws, SandboxError(f"internal error while streaming: {type(e).__name__}: {e}"))
