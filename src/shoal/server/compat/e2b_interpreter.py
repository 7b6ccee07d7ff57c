"""E2B's code interpreter (port 49999): `POST /execute` answering newline-delimited JSON, and contexts.

Each context is one Python process inside the sandbox (`python3` running `repl_driver.SOURCE`), kept alive
by this server between calls, so `x = 6*7` then `print(x)` works. Records stream back as the code runs, in the
order it made them: `number_of_executions`, `stdout` / `stderr` (`text`, `timestamp`), `result` (a MIME bundle:
`text`, `html`, `png`, `json`, `data`, ...; `is_main_result` for the value of a last expression, not for
`display()` or a matplotlib figure), `error` (`name`, `value`, `traceback`). A client that goes away
interrupts the running code (SIGINT). Only Python is served; contexts live as long as the server process (a
restarted server starts fresh interpreters).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from shoal.errors import InvalidRequest, SandboxError, SandboxNotFound, ShoalError
from shoal.models import ExecResult
from shoal.server.compat import common
from shoal.server.compat.repl_driver import SOURCE
from shoal.server.compat.routes import compat_router
from shoal.server.deps import ServerState, state_of

if TYPE_CHECKING:
    from shoal.server.tokens import Principal

log = logging.getLogger("shoal.server")
PREFIX = "/_e2b/interpreter"
#: every endpoint answers an error as _error() shapes it (shoal.server.compat.routes)
router = compat_router(lambda e: _error(e), prefix=PREFIX, include_in_schema=False)
LANGUAGES = ("python", "python3")
#: one result larger than this (a huge DataFrame's data, a giant image) is dropped with an error record
MAX_RECORD_BYTES = 64 << 20
DEFAULT_CONTEXT = "default"


@dataclass
class Context:
    """One interpreter process of a sandbox."""

    id: str
    sandbox_id: str
    cwd: str
    language: str = "python"
    handle: Any = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: bytes of the driver's record channel not yet split into lines
    buf: bytes = b""
    #: the last lines the driver wrote to its real stderr (why it died, if it did)
    stderr: bytes = b""
    #: dropping the rest of a record that was too large
    skipping: bool = False

    def public(self) -> dict[str, Any]:
        """E2B's Context JSON."""
        return {"id": self.id, "language": "python", "cwd": self.cwd}


class Contexts:
    """The interpreter contexts of every sandbox this server serves."""

    def __init__(self) -> None:
        self.by_key: dict[tuple[str, str], Context] = {}

    def get(self, sandbox_id: str, context_id: str | None) -> Context:
        """A context of the sandbox (the default one is made on first use)."""
        cid = context_id or DEFAULT_CONTEXT
        ctx = self.by_key.get((sandbox_id, cid))
        if ctx is None:
            if cid != DEFAULT_CONTEXT:
                raise SandboxNotFound(f"context {cid!r} not found in sandbox {sandbox_id}")
            ctx = self.by_key[(sandbox_id, cid)] = Context(id=cid, sandbox_id=sandbox_id, cwd="")
        return ctx

    def create(self, sandbox_id: str, cwd: str) -> Context:
        """A new context (its interpreter starts on first use)."""
        cid = secrets.token_hex(8)
        ctx = self.by_key[(sandbox_id, cid)] = Context(id=cid, sandbox_id=sandbox_id, cwd=cwd)
        return ctx

    def of(self, sandbox_id: str) -> list[Context]:
        """Every context of a sandbox."""
        return [c for (sid, _), c in self.by_key.items() if sid == sandbox_id]

    async def remove(self, ctx: Context) -> None:
        """End a context's interpreter and forget it."""
        self.by_key.pop((ctx.sandbox_id, ctx.id), None)
        await stop(ctx)

    def prune(self, st: ServerState) -> None:
        """Forget the contexts of sandboxes that are gone (closed by shoal's API or their TTL)."""
        for sid in {k[0] for k in self.by_key}:
            try:
                st.node.record(sid)
            except SandboxNotFound:
                for key in [k for k in self.by_key if k[0] == sid]:
                    self.by_key.pop(key, None)

    async def drop_sandbox(self, sandbox_id: str) -> None:
        """Forget every context of a sandbox (it was killed)."""
        for ctx in self.of(sandbox_id):
            self.by_key.pop((sandbox_id, ctx.id), None)
            with contextlib.suppress(Exception):
                await stop(ctx)


def contexts(st: ServerState) -> Contexts:
    """The context table of this server."""
    return common.server_local(st, "contexts", Contexts)


async def stop(ctx: Context) -> None:
    """Kill a context's interpreter process (its namespace is lost)."""
    h, ctx.handle, ctx.buf = ctx.handle, None, b""
    if h is not None:
        with contextlib.suppress(Exception):
            await h.send_signal(signal.SIGKILL)
        with contextlib.suppress(Exception):
            await h.aclose()


async def _ensure(st: ServerState, ctx: Context) -> None:
    if ctx.handle is not None:
        return
    # max_output=0: the driver lives as long as the context; its records are streamed, never held
    ctx.handle = await st.node.stream(ctx.sandbox_id, ["python3", "-c", SOURCE], timeout=None,
                                      cwd=ctx.cwd or None, stdin=True, max_output=0)
    ctx.buf, ctx.stderr = b"", b""


def _now_ns() -> int:
    return time.time_ns()


def _line_record(line: bytes) -> dict[str, Any]:
    try:
        rec = json.loads(line)
    except ValueError:
        rec = None
    if not isinstance(rec, dict) or not isinstance(rec.get("type"), str):
        # not the driver's: something wrote to the channel itself (it is the exec's stdout)
        return {"type": "stdout", "text": line.decode("utf-8", "replace") + "\n", "timestamp": _now_ns()}
    return rec


async def _records(ctx: Context, rid: str) -> AsyncIterator[tuple[str, Any]]:
    """('record', dict) of execution `rid` as the driver sends them, until its `end` record; ('exit', result)
    when the interpreter died. Records of earlier executions (one whose client went away) are skipped."""
    while True:
        while True:
            nl = ctx.buf.find(b"\n")
            if nl < 0:
                break
            line, ctx.buf = ctx.buf[:nl], ctx.buf[nl + 1:]
            if ctx.skipping:
                ctx.skipping = False
                continue
            if not line.strip():
                continue
            rec = _line_record(line)
            if rec.get("id", rid) != rid:
                continue
            rec.pop("id", None)
            if rec["type"] == "end":
                return
            yield "record", rec
        if ctx.skipping:
            ctx.buf = b""
        elif len(ctx.buf) > MAX_RECORD_BYTES:
            ctx.buf, ctx.skipping = b"", True
            yield "record", {"type": "error", "name": "OutputTooLarge",
                             "value": f"one output of the code was larger than {MAX_RECORD_BYTES} bytes and was "
                                      "dropped", "traceback": ""}
        try:
            ev = await ctx.handle.__anext__()
        except StopAsyncIteration:
            ev = None
        if ev is None or ev.kind == "exit":
            ctx.handle = None
            yield "exit", (ev.result if ev is not None else None)
            return
        if ev.kind == "stdout":
            ctx.buf += ev.data
        else:  # the driver's own stderr: only Python itself writes there (a crash before it took over fd 2)
            ctx.stderr = (ctx.stderr + ev.data)[-4000:]


def _target(request: Request) -> tuple[ServerState, Principal, str]:
    st = state_of(request)
    from shoal.server.compat.e2b_envd import SCOPE_SANDBOX

    sid = request.scope.get(SCOPE_SANDBOX) or ""
    who = common.principal_for_sandbox(st, sid, request.headers)
    try:
        common.sandbox_of(st, who, sid)
    except SandboxNotFound:
        raise SandboxNotFound(f"The sandbox {sid} was not found") from None
    return st, who, sid


def _error(e: BaseException) -> Response:
    """Errors as plain text with the status the SDK maps (404 → NotFoundException, 502 → sandbox gone)."""
    if isinstance(e, SandboxNotFound):
        status = 502 if "was not found" in e.message and "context" not in e.message else 404
        return PlainTextResponse(e.message, status_code=status)
    if isinstance(e, ShoalError):
        status = 400 if isinstance(e, InvalidRequest) else e.http_status
        if status >= 500:
            status = 502 if isinstance(e, SandboxError) else 503
        return PlainTextResponse(e.message, status_code=status)
    log.exception("code interpreter request failed")
    return PlainTextResponse(f"internal error ({type(e).__name__}): {e}", status_code=500)


def _language(value: Any) -> None:
    if value not in (None, "", *LANGUAGES):
        raise InvalidRequest(f"language {value!r} is not supported by shoal's code interpreter: only Python runs "
                             "(run other languages with sandbox.commands.run)")


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


@router.post("/execute")
async def execute(request: Request) -> Response:
    """Run code in a context; the answer streams NDJSON records as the code runs."""
    st, _who, sid = _target(request)
    body = await _body(request)
    code = body.get("code")
    if not isinstance(code, str):
        raise InvalidRequest("code must be a string")
    _language(body.get("language"))
    env = body.get("env_vars") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise InvalidRequest("env_vars must map strings to strings")
    cid = body.get("context_id")
    if cid is not None and not isinstance(cid, str):
        raise InvalidRequest(f"context_id must be a string (a context's id), not {type(cid).__name__}")
    ctx = contexts(st).get(sid, cid)

    async def lines() -> AsyncIterator[bytes]:
        async with ctx.lock:
            finished = False
            rid = secrets.token_hex(8)
            try:
                try:
                    await _ensure(st, ctx)
                    await ctx.handle.write_stdin((json.dumps({"id": rid, "code": code, "env": env}) + "\n").encode())
                except ShoalError as e:
                    finished = True
                    yield _line({"type": "error", "name": "SandboxError", "value": e.message, "traceback": ""})
                    return
                try:
                    async for kind, v in _records(ctx, rid):
                        if kind == "record":
                            yield _line(v)
                        else:
                            yield _line(_exited(ctx, v))
                except ShoalError as e:  # the sandbox died under the interpreter
                    ctx.handle = None
                    yield _line({"type": "error", "name": "SandboxError", "value": e.message, "traceback": ""})
                finished = True
            finally:
                if not finished and ctx.handle is not None:
                    # the client went away mid-run: interrupt the code; the next call skips what is left of it
                    with contextlib.suppress(Exception):
                        await ctx.handle.send_signal(signal.SIGINT)

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _exited(ctx: Context, result: Any) -> dict[str, Any]:
    """The error record for an interpreter that died mid-execution."""
    code = result.exit_code if isinstance(result, ExecResult) else None  # None: the stream ended without one
    why = f"exit code {code}" if code is not None else "its output stream ended"
    tail = ctx.stderr.decode("utf-8", "replace").strip()
    return {"type": "error", "name": "InterpreterExited",
            "value": f"the Python process ended ({why}); its state is lost and the next run starts a fresh one"
                     + (f": {tail.splitlines()[-1]}" if tail else ""), "traceback": tail}


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8", "replace")


@router.post("/contexts")
async def create_context(request: Request) -> Response:
    """A new context (its own Python namespace)."""
    st, _who, sid = _target(request)
    body = await _body(request)
    _language(body.get("language"))
    cwd = body.get("cwd") or ""
    if not isinstance(cwd, str):
        raise InvalidRequest("cwd must be a string")
    return JSONResponse(contexts(st).create(sid, cwd).public())


@router.get("/contexts")
async def list_contexts(request: Request) -> Response:
    """The sandbox's contexts."""
    st, _who, sid = _target(request)
    contexts(st).get(sid, None)
    return JSONResponse([c.public() for c in contexts(st).of(sid)])


@router.delete("/contexts/{context_id}")
async def remove_context(context_id: str, request: Request) -> Response:
    """End a context and its interpreter."""
    st, _who, sid = _target(request)
    t = contexts(st)
    await t.remove(t.get(sid, context_id))
    return Response(status_code=204)


@router.post("/contexts/{context_id}/restart")
async def restart_context(context_id: str, request: Request) -> Response:
    """Start the context's interpreter afresh (its variables are gone)."""
    st, _who, sid = _target(request)
    ctx = contexts(st).get(sid, context_id)
    async with ctx.lock:
        await stop(ctx)
    return Response(status_code=204)


@router.get("/health")
async def health(request: Request) -> Response:
    """The interpreter answers (interpreters start on first use)."""
    _target(request)
    return Response(status_code=204)


@router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
async def unsupported(rest: str, request: Request) -> Response:
    """Code-interpreter endpoints shoal does not serve: 501 naming them."""
    return PlainTextResponse(f"{request.method} /{rest} is not supported by shoal's code interpreter "
                             "(see docs/compat.md)", status_code=501)
