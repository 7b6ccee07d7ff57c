"""SandboxFusion-compatible HTTP endpoints of the fncall backend.

`POST /run_code` takes and answers exactly what SandboxFusion's does (bytedance/SandboxFusion,
`sandbox/server/sandbox_api.py`), so reward code written for SandboxFusion — its `sandbox-fusion`
client, verl's `sandbox_fusion` reward utils, plain `requests.post(url + "/run_code", json=...)` —
works against shoal unchanged:

    request:  {code, language, compile_timeout=10, run_timeout=10, memory_limit_MB=-1, stdin=None,
               files={path: base64}, fetch_files=[path]}
    response: {status: Success|Failed|SandboxError, message, compile_result, run_result,
               executor_pod_name, files={path: base64}}
    *_result: {status: Finished|TimeLimitExceeded|Error, execution_time, return_code, stdout, stderr, cpu_time}

Like SandboxFusion, every outcome of the code itself is a 200 answer; problems of the request or of
the sandbox (oversized code, a container that died) are `SandboxError` answers with a message — never an
exception from the server. A language this server does not run is, as in SandboxFusion (whose request model
types `language` as a Literal), a 422 validation error naming the field: SandboxFusion's client raises it and
verl records it as an API error, so it is never mistaken for code that ran and failed. (In
`/run_code_many` such an item gets its own SandboxError answer, so one bad item does not refuse the batch.)

Also here: `POST /run_code_many` (a list of SandboxFusion requests → a list of responses, run
concurrently), `POST /v1/run_code_many` (shoal's own `run_code_many` for the SDK's HTTP transport) and
`GET /v1/fncall/stats`.

The API server (`shoal serve`) includes `router`; `create_fusion_app(node)` makes a standalone app
(`shoal fncall serve`). Routes find their node through `app.state.shoal.node` (the API server) or
`app.state.fncall_node` (see `bind_node`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
from collections.abc import AsyncIterator
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from shoal.backends.fncall import FncallManager
from shoal.backends.fncall_languages import get_language, supported
from shoal.errors import InvalidRequest, ShoalError
from shoal.limits import MAX_RUN_CODE_BATCH
from shoal.models import RunCodeResult
from shoal.server.deps import bind_front, front_of

if TYPE_CHECKING:
    from shoal.front import Front

router = APIRouter()

#: most requests one /run_code_many call may carry
MAX_BATCH = MAX_RUN_CODE_BATCH


# ---- SandboxFusion's models (field for field) ------------------------------------------------------------
class RunStatus(StrEnum):
    """Overall outcome: Success (all steps exited 0), Failed (non-zero exit or timeout), SandboxError."""

    Success = "Success"
    Failed = "Failed"
    SandboxError = "SandboxError"


class CommandRunStatus(StrEnum):
    """Outcome of one step (compile or run)."""

    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class CommandRunResult(BaseModel):
    """One step's result, as SandboxFusion reports it."""

    status: CommandRunStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None
    cpu_time: float | None = None


class RunCodeRequest(BaseModel):
    """SandboxFusion's /run_code request (unknown fields are ignored, as there)."""

    model_config = ConfigDict(extra="ignore")
    compile_timeout: float = Field(10, description="compile timeout for compiled languages (seconds)")
    run_timeout: float = Field(10, description="code run timeout (seconds)")
    memory_limit_MB: int = Field(-1, description="maximum memory allowed in megabytes (-1: the pool default)")
    code: str = Field(..., examples=['print("hello")'], description="the code to run")
    stdin: str | None = Field(None, examples=[""], description="optional string to pass into stdin")
    language: str = Field(..., examples=["python"], description=f"one of {', '.join(supported())}")
    files: dict[str, str | None] = Field({}, description="a dict from file path to base64 encoded file content")
    fetch_files: list[str] = Field([], description="a list of file paths to fetch after code execution")


class RunCodeResponse(BaseModel):
    """SandboxFusion's /run_code response."""

    status: RunStatus
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = {}


class RunCodeManyRequest(BaseModel):
    """A batch of SandboxFusion requests, run concurrently."""

    requests: list[RunCodeRequest] = Field(..., max_length=MAX_BATCH)
    concurrency: int | None = Field(None, ge=1, le=4096)


class RunCodeManyResponse(BaseModel):
    """One SandboxFusion response per request, in order."""

    results: list[RunCodeResponse]


class NativeRunCodeManyIn(BaseModel):
    """shoal's own run_code_many: items are code strings or dicts of run_code arguments."""

    model_config = ConfigDict(extra="allow")
    items: list[str | dict[str, Any]] = Field(..., max_length=MAX_BATCH)
    concurrency: int | None = Field(None, ge=1, le=4096)


# ---- finding the node ------------------------------------------------------------------------------------
def bind_node(app: FastAPI, node: Front) -> None:
    """Make `node` the one the fncall routes of `app` use (not needed inside `shoal serve`, whose app has
    its front bound already)."""
    bind_front(app, node)


async def current_manager(request: Request) -> FncallManager:
    """Dependency: the fncall manager of the app's node front (async: FastAPI would run a plain def in a
    thread); BackendUnavailable when no front is bound, Unsupported from a cluster gateway."""
    return front_of(request).fncall()


# ---- translation -------------------------------------------------------------------------------------------
def _text(b: bytes | str) -> str:
    return b.decode("utf-8", "replace") if isinstance(b, bytes) else b


def _step(timed_out: bool, duration_s: float, exit_code: int, signal: int, stdout: bytes | str,
          stderr: bytes | str, cpu_time: float | None = None) -> CommandRunResult:
    if timed_out:
        # as SandboxFusion: a step that ran out of time has no return code, but keeps its partial output
        return CommandRunResult(status=CommandRunStatus.TimeLimitExceeded, execution_time=duration_s,
                                stdout=_text(stdout), stderr=_text(stderr), cpu_time=cpu_time)
    # SandboxFusion reports a signal the way Python's subprocess does: -N
    rc = -signal if signal else exit_code
    return CommandRunResult(status=CommandRunStatus.Finished, execution_time=duration_s, return_code=rc,
                            stdout=_text(stdout), stderr=_text(stderr), cpu_time=cpu_time)


def fusion_response(r: RunCodeResult) -> RunCodeResponse:
    """Translate a RunCodeResult into SandboxFusion's response."""
    if r.status == "error":
        return RunCodeResponse(status=RunStatus.SandboxError, message=r.error or "the code could not be run",
                               executor_pod_name=r.sandbox_id or None)
    comp = None
    if r.compile is not None:
        c = r.compile
        comp = _step(c.timed_out, c.duration_s, c.exit_code, c.signal, c.stdout, c.stderr)
    run = None
    if r.status not in ("compile_error", "compile_timeout"):
        run = _step(r.timed_out, r.duration_s, r.exit_code, r.signal, r.stdout, r.stderr, r.cpu_time_s)
    status = RunStatus.Success if r.status == "success" else RunStatus.Failed
    notes = []
    if r.truncated or (r.compile is not None and r.compile.truncated):
        notes.append("output was truncated at the size limit")
    files = {k: base64.b64encode(v).decode() for k, v in r.files.items()}
    return RunCodeResponse(status=status, message="; ".join(notes), compile_result=comp, run_result=run,
                           executor_pod_name=r.sandbox_id or None, files=files)


def sandbox_error(message: str) -> RunCodeResponse:
    """A SandboxError answer (the request could not be run)."""
    return RunCodeResponse(status=RunStatus.SandboxError, message=message)


def _kwargs(req: RunCodeRequest) -> dict[str, Any]:
    """run_code arguments of a SandboxFusion request; InvalidRequest says what is wrong with it."""
    files: dict[str, bytes] = {}
    for path, b64 in (req.files or {}).items():
        if b64 is None:
            continue  # SandboxFusion skips files without content
        try:
            files[path] = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"files[{path!r}] is not valid base64") from None
    if req.run_timeout <= 0 or req.compile_timeout <= 0:
        raise InvalidRequest("run_timeout and compile_timeout must be positive numbers of seconds")
    return {"code": req.code, "language": req.language, "stdin": req.stdin, "timeout": req.run_timeout,
            "compile_timeout": req.compile_timeout,
            "memory_mb": req.memory_limit_MB if req.memory_limit_MB > 0 else None,
            "files": files, "fetch_files": list(req.fetch_files or [])}


async def run_fusion(mgr: FncallManager, req: RunCodeRequest) -> RunCodeResponse:
    """Run one SandboxFusion request; every problem becomes a SandboxError answer."""
    try:
        kw = _kwargs(req)
        r = await mgr.run_code(kw.pop("code"), kw.pop("language"), **kw)
    except ShoalError as e:
        return sandbox_error(e.message)
    except Exception as e:  # the contract is an answer, not a 500
        return sandbox_error(f"shoal could not run the code: {type(e).__name__}: {e}")
    return fusion_response(r)


# ---- routes ---------------------------------------------------------------------------------------------
def unknown_language(req: RunCodeRequest) -> JSONResponse | None:
    """The 422 SandboxFusion answers for a language it does not know (FastAPI's validation-error shape: a
    `detail` list locating `body.language`), or None when shoal runs `req.language`."""
    try:
        get_language(req.language)
    except InvalidRequest as e:
        also = ("; SandboxFusion itself knows it, but shoal's fncall images do not have its runtime"
                if req.language in SANDBOX_FUSION_LANGUAGES else "")
        return JSONResponse({"detail": [{"type": "literal_error", "loc": ["body", "language"],
                                         "msg": f"{e.message}{also}", "input": req.language,
                                         "ctx": {"expected": ", ".join(repr(x) for x in supported())}}]},
                            status_code=422)
    return None


#: the `language` values SandboxFusion's own server accepts (its runners' Literal type)
SANDBOX_FUSION_LANGUAGES = frozenset((
    "python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql", "rust",
    "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit", "kotlin_script", "jest",
    "verilog", "python_gpu", "lean", "swift", "racket"))


@router.post("/run_code", response_model=RunCodeResponse, tags=["fncall"],
             summary="Run code (SandboxFusion-compatible)",
             responses={422: {"description": "a language this server does not run (or another invalid field)"}})
async def run_code(req: RunCodeRequest, mgr: FncallManager = Depends(current_manager)) -> Response:
    """Run a snippet in a fresh process of a warm pooled container; SandboxFusion's request and answer."""
    bad = unknown_language(req)
    if bad is not None:
        return bad
    r = await run_fusion(mgr, req)
    # serialized once here: the answer is already the validated model (this is the hot path of reward loops)
    return Response(r.model_dump_json(), media_type="application/json")


@router.post("/run_code_many", response_model=RunCodeManyResponse, tags=["fncall"],
             summary="Run many SandboxFusion requests concurrently")
async def run_code_many(body: RunCodeManyRequest,
                        mgr: FncallManager = Depends(current_manager)) -> RunCodeManyResponse:
    """`/run_code` for a list of requests in one round trip; one answer per request, in order."""
    sem = asyncio.Semaphore(body.concurrency or mgr.config.many_concurrency)

    async def one(req: RunCodeRequest) -> RunCodeResponse:
        async with sem:
            return await run_fusion(mgr, req)

    return RunCodeManyResponse(results=list(await asyncio.gather(*(one(r) for r in body.requests))))


@router.post("/v1/run_code_many", tags=["fncall"], summary="shoal's run_code_many (SDK HTTP transport)")
async def native_run_code_many(body: NativeRunCodeManyIn,
                               mgr: FncallManager = Depends(current_manager)) -> dict[str, Any]:
    """Body: {items: [code | {run_code args}], concurrency?, **defaults} → {results: [RunCodeResult dict]}.

    File contents in items and defaults are strings (UTF-8) here; results carry output as text and
    fetched files as base64 (decode with `RunCodeResult.from_dict`).
    """
    defaults = dict(body.model_extra or {})
    results = await mgr.run_code_many(body.items, concurrency=body.concurrency, **defaults)
    return {"results": [r.to_dict() for r in results]}


@router.get("/v1/fncall/stats", tags=["fncall"], summary="fncall pools: sizes and counters")
async def stats(mgr: FncallManager = Depends(current_manager)) -> dict[str, Any]:
    """Every pool of this node: idle, busy, starting and waiting counts; calls, starts and replacements."""
    return mgr.stats()


# ---- a standalone app (`shoal fncall serve`, tests) ----------------------------------------------------
def create_fusion_app(node: Front | None = None, *, warm: dict[str, int] | None = None) -> FastAPI:
    """A FastAPI app serving only the fncall routes. Without `node` it runs its own (started and
    stopped with the app, which closes every pooled container); `warm` ({language: n}) pre-starts pools."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from shoal.node.node import Node

        own = node is None
        n: Front = Node() if node is None else node
        if own:
            await n.start()
        bind_node(app, n)
        try:
            for lang, count in (warm or {}).items():
                await n.fncall().warm(lang, count)
            yield
        finally:
            if own:
                await n.stop()
            else:
                await n.fncall().close()

    app = FastAPI(title="shoal fncall (SandboxFusion-compatible)", lifespan=lifespan)

    @app.exception_handler(ShoalError)
    async def _shoal_error(request: Request, exc: ShoalError) -> JSONResponse:
        return JSONResponse({"error": exc.to_dict()}, status_code=exc.http_status)

    app.include_router(router)
    return app
