"""REST routes for sandboxes: create (one or a batch), list, get, close, exec, files, shells,
pause/resume, CPU class, snapshot, fork, restore — each scoped to the caller's project."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse
from pydantic import StringConstraints

from shoal.errors import Forbidden, InvalidRequest, SandboxError, ShoalError
from shoal.models import SandboxInfo
from shoal.server.codec import STREAM_JSON_ABOVE, b64decode_field, encode_exec_result, iter_exec_result_json
from shoal.server.deps import Namespace, ServerState, authorized, owned, require_admin, state_of
from shoal.server.policy import apply_policy
from shoal.server.responses import SANDBOX_ERRORS, errors
from shoal.server.schemas import (
    BatchIn,
    BatchOut,
    CpuClassIn,
    DirList,
    ExecIn,
    ExecOut,
    ForkIn,
    RestoreIn,
    SandboxList,
    SandboxOut,
    ShellOpenIn,
    ShellOut,
    ShellRunIn,
    SnapshotIn,
    SpecIn,
)
from shoal.server.store_quota import store_budget
from shoal.server.tokens import Principal, check_project
from shoal.spec import SandboxSpec

log = logging.getLogger("shoal.server")
router = APIRouter(prefix="/v1/sandboxes", tags=["sandboxes"])
Who = Annotated[Principal, Depends(authorized)]
SidPath = Annotated[str, PathParam(max_length=200, description="sandbox id (`<node>-<26 chars>`)")]
_SPEC_FIELDS = frozenset(SandboxSpec.model_fields)
ShellId = Annotated[str, PathParam(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="shell id from open_shell")]
LabelFilter = Annotated[str, StringConstraints(pattern=r"^[^=]+=.*$", max_length=2048)]


def _spec(st: ServerState, who: Principal, body: SpecIn) -> SandboxSpec:
    data = body.model_dump(exclude={"n"})
    project = data.pop("project", None)
    if project is not None and project != who.project:
        if not who.admin:
            raise Forbidden(f"this token creates sandboxes in project {who.project!r} only")
        check_project(project)
    data["project"] = project or who.project
    data["image"] = Namespace(who).for_read(st, data["image"])
    apply_policy(st, who, data)  # the operator's egress grants and priority classes (shoal.server.policy)
    return SandboxSpec(**{k: v for k, v in data.items() if k in _SPEC_FIELDS})


def _owner(st: ServerState, who: Principal, project: str) -> Principal:
    # an admin acting in another project is accounted to that project, with that project's quota
    if project == who.project:
        return who
    return Principal(project=project, admin=True, token_id=who.token_id, quota=st.tokens.quota(project))


async def _create_one(st: ServerState, spec: SandboxSpec) -> SandboxInfo:
    async with st.create_sem:
        t0 = time.perf_counter()
        try:
            info = await st.node.create(spec)
        except Exception:
            st.view.live.observe_create(time.perf_counter() - t0, ok=False)
            raise
    dt = time.perf_counter() - t0
    st.metrics.create_seconds.labels(spec.backend).observe(dt)
    st.view.live.observe_create(dt)
    return info


def _item(ns: Namespace, it: SandboxInfo | BaseException, st: ServerState) -> dict[str, Any]:
    if isinstance(it, SandboxInfo):
        return {"sandbox": ns.show_info(it), "error": None}
    err = it if isinstance(it, ShoalError) else SandboxError(f"create failed: {type(it).__name__}: {it}")
    st.metrics.errors.labels(err.code).inc()
    return {"sandbox": None, "error": err.to_dict()}


def _batch(items: list[dict[str, Any]]) -> dict[str, Any]:
    ok = sum(1 for i in items if i["sandbox"] is not None)
    return {"items": items, "created": ok, "failed": len(items) - ok}


_SB = "$response.body#/id"
_ON_SANDBOX = ("get_sandbox", "close_sandbox", "exec_command", "read_file", "write_file", "list_dir", "open_shell",
               "pause_sandbox", "resume_sandbox", "set_cpu_class", "snapshot_sandbox", "fork_sandbox")


def _links(status: int, base: dict[int | str, Any], targets: dict[str, dict[str, str]]) -> dict[int | str, Any]:
    """OpenAPI links from a response to the operations its values feed (for clients and stateful fuzzers)."""
    out = dict(base)
    out[status] = {"links": {op: {"operationId": op, "parameters": params} for op, params in targets.items()}}
    return out


@router.post("", status_code=201, response_model=SandboxOut, summary="Create a sandbox",
             responses=_links(201, errors(403, 404, 500, 502, 503, 504),
                              {op: {"sandbox_id": _SB} for op in _ON_SANDBOX}))
async def create_sandbox(body: SpecIn, request: Request, who: Who) -> dict[str, Any]:
    """Create one sandbox and wait until it is ready (its agent answers)."""
    st = state_of(request)
    spec = _spec(st, who, body)
    res = st.quotas.reserve(_owner(st, who, spec.project), 1, spec.cpus, spec.memory_mb)
    try:
        info = await _create_one(st, spec)
        res.commit(info.id)
    finally:
        res.release()
    return Namespace(who).show_info(info)


@router.post("/batch", response_model=BatchOut, responses=errors(403, 404, 500, 502, 503),
             summary="Create many sandboxes")
async def create_sandboxes(body: BatchIn, request: Request, who: Who) -> dict[str, Any]:
    """Create `n` sandboxes of one spec in one request; each item is a sandbox or the error it met
    (quota and capacity refusals are per item, so a burst gets as many as fit)."""
    st = state_of(request)
    if body.n > st.settings.max_batch:
        raise InvalidRequest(f"n={body.n} is over this server's batch limit of {st.settings.max_batch}",
                             errors=[{"field": "body.n", "message": f"at most {st.settings.max_batch}"}])
    spec = _spec(st, who, body)
    # a missing image fails the request, not every item (and is pulled once here, not per item)
    await st.node.resolve_image(spec.image)  # a cluster gateway only refuses what no node could get
    if body.all_or_nothing:
        return await _create_gang(st, who, spec, body.n)
    res = st.quotas.reserve(_owner(st, who, spec.project), body.n, spec.cpus, spec.memory_mb, partial=True)

    async def one() -> SandboxInfo | BaseException:
        try:
            info = await _create_one(st, spec.model_copy())
        except ShoalError as e:
            return e
        except Exception as e:
            log.exception("create in batch failed")
            return e
        res.commit(info.id)
        return info

    try:
        results: list[SandboxInfo | BaseException] = list(
            await asyncio.gather(*(one() for _ in range(res.granted))))
    finally:
        res.release()
    if res.refused is not None:
        results += [res.refused] * (body.n - res.granted)
    ns = Namespace(who)
    return _batch([_item(ns, it, st) for it in results])


@router.post("/restore", response_model=BatchOut, responses=errors(403, 404, 500, 501, 503),
             summary="Restore a memory snapshot")
async def restore_sandboxes(body: RestoreIn, request: Request, who: Who) -> dict[str, Any]:
    """`n` new sandboxes resumed from a named VM memory snapshot of this node (per-item errors, like a batch).
    Memory snapshots are named per host, not per project, so restoring one needs an admin token. A backend
    without memory snapshots answers 501; a snapshot this node does not hold, 404."""
    require_admin(who, f"restoring the memory snapshot {body.name!r}")
    st = state_of(request)
    if body.n > st.settings.max_batch:
        raise InvalidRequest(f"n={body.n} is over this server's batch limit of {st.settings.max_batch}",
                             errors=[{"field": "body.n", "message": f"at most {st.settings.max_batch}"}])
    items = await st.node.restore(body.name, body.n, backend=body.backend)
    return _batch([_item(Namespace(who), it, st) for it in items])


async def _create_gang(st: ServerState, who: Principal, spec: SandboxSpec, n: int) -> dict[str, Any]:
    """All `n` or an error: the project's quota for all of them, then the node's gang admission."""
    res = st.quotas.reserve(_owner(st, who, spec.project), n, spec.cpus, spec.memory_mb)
    try:
        infos = await st.node.create_many(spec, n, concurrency=st.settings.create_concurrency, all_or_nothing=True)
        for info in infos:
            if isinstance(info, SandboxInfo):
                res.commit(info.id)
    finally:
        res.release()
    ns = Namespace(who)
    return _batch([_item(ns, it, st) for it in infos])


@router.get("", response_model=SandboxList, responses=errors(403), summary="List sandboxes")
async def list_sandboxes(request: Request, who: Who,
                         label: Annotated[list[LabelFilter] | None,
                                          Query(description="KEY=VALUE; repeat to match all")] = None,
                         project: Annotated[str | None, Query(pattern=r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$",
                                                              description="admin tokens: only this project "
                                                              "(default: all)")] = None) -> dict[str, Any]:
    """Sandboxes of the caller's project (admin tokens: of every project), optionally matching labels."""
    st = state_of(request)
    labels = {}
    for item in label or []:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise InvalidRequest(f"label filter {item!r} must look like KEY=VALUE",
                                 errors=[{"field": "query.label", "message": "expected KEY=VALUE"}])
        labels[k] = v
    if project is not None and not who.admin and project != who.project:
        raise Forbidden(f"this token sees project {who.project!r} only")
    scope = project if project is not None else (None if who.admin else who.project)
    infos = await st.node.list(project=scope, labels=labels or None)
    ns = Namespace(who)
    return {"sandboxes": [ns.show_info(i) for i in infos]}


@router.get("/{sandbox_id}", response_model=SandboxOut, responses=errors(404), summary="Get a sandbox")
async def get_sandbox(sandbox_id: SidPath, request: Request, who: Who) -> dict[str, Any]:
    """One sandbox's state, spec and expiry."""
    st = state_of(request)
    await owned(st, who, sandbox_id)
    return Namespace(who).show_info(await st.node.get(sandbox_id))


@router.delete("/{sandbox_id}", status_code=204, responses=SANDBOX_ERRORS, summary="Close a sandbox")
async def close_sandbox(sandbox_id: SidPath, request: Request, who: Who) -> Response:
    """Destroy the sandbox and everything it had on the host."""
    st = state_of(request)
    await owned(st, who, sandbox_id)
    await st.node.close(sandbox_id)
    st.quotas.forget(sandbox_id)
    return Response(status_code=204)


@router.post("/{sandbox_id}/exec", response_model=ExecOut, response_model_exclude_none=True,
             responses=SANDBOX_ERRORS, summary="Run a command to completion")
async def exec_command(sandbox_id: SidPath, body: ExecIn, request: Request, who: Who) -> Any:
    """Run a command; the answer carries exit code, output, duration and whether it timed out."""
    st = state_of(request)
    await owned(st, who, sandbox_id)
    stdin = b64decode_field(body.stdin, "stdin")
    t0 = time.perf_counter()
    r = await st.node.exec(sandbox_id, body.cmd, timeout=body.timeout, cwd=body.cwd, env=body.env,
                           user=body.user, stdin=stdin, max_output=body.max_output)
    st.metrics.exec_seconds.labels("exec").observe(time.perf_counter() - t0)
    st.view.live.observe_exec(time.perf_counter() - t0)
    return _exec_response(r)


def _exec_response(r: Any) -> Any:
    # a big result goes out in pieces, never as one whole JSON copy in memory (see codec)
    if len(r.stdout) + len(r.stderr) > STREAM_JSON_ABOVE:
        return StreamingResponse(iter_exec_result_json(r), media_type="application/json")
    return encode_exec_result(r)


_OCTET = {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}


@router.get("/{sandbox_id}/files", response_class=Response, summary="Download a file",
            responses={200: {"content": _OCTET, "description": "the file's bytes"}, **SANDBOX_ERRORS})
async def read_file(sandbox_id: SidPath, request: Request, who: Who,
                    path: Annotated[str, Query(min_length=1, max_length=4096, pattern=r"^[^\x00]+$",
                                               description="absolute, or relative to the workdir")]) -> Response:
    """A file's bytes (application/octet-stream)."""
    st = state_of(request)
    await owned(st, who, sandbox_id)
    data = await st.node.read_file(sandbox_id, path)
    return Response(content=data, media_type="application/octet-stream")


@router.put("/{sandbox_id}/files", status_code=204, summary="Upload a file",
            responses=SANDBOX_ERRORS,
            openapi_extra={"requestBody": {"required": True, "content": _OCTET}})
async def write_file(sandbox_id: SidPath, request: Request, who: Who,
                     path: Annotated[str, Query(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")],
                     mode: Annotated[str, Query(pattern=r"^0?[0-7]{3,4}$", description="octal, e.g. 0644")] = "0644",
                     ) -> Response:
    """Write the request body to `path` atomically (parent directories are created)."""
    st = state_of(request)
    await owned(st, who, sandbox_id)
    data = await request.body()
    await st.node.write_file(sandbox_id, path, data, int(mode, 8))
    return Response(status_code=204)


@router.get("/{sandbox_id}/dir", response_model=DirList, responses=SANDBOX_ERRORS, summary="List a directory")
async def list_dir(sandbox_id: SidPath, request: Request, who: Who,
                   path: Annotated[str, Query(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")] = ".",
                   ) -> dict[str, Any]:
    """A directory's entries, sorted by name."""
    st = state_of(request)
    await owned(st, who, sandbox_id)
    entries = await st.node.list_dir(sandbox_id, path)
    return {"entries": [e.__dict__ for e in entries]}


@router.post("/{sandbox_id}/shells", status_code=201, response_model=ShellOut, summary="Open a persistent shell",
             responses=_links(201, SANDBOX_ERRORS, {op: {"sandbox_id": "$request.path.sandbox_id",
                                                         "shell_id": "$response.body#/shell_id"}
                                                    for op in ("run_in_shell", "close_shell")}))
async def open_shell(sandbox_id: SidPath, body: ShellOpenIn, request: Request, who: Who) -> dict[str, Any]:
    """Start a bash session whose cwd, environment and functions persist between commands."""
    st = state_of(request)
    await owned(st, who, sandbox_id)
    return {"shell_id": await st.node.shell_open(sandbox_id, cwd=body.cwd, env=body.env, user=body.user)}


@router.post("/{sandbox_id}/shells/{shell_id}/run", response_model=ExecOut, response_model_exclude_none=True,
             responses=SANDBOX_ERRORS, summary="Run a command in a shell")
async def run_in_shell(sandbox_id: SidPath, shell_id: ShellId, body: ShellRunIn, request: Request,
                       who: Who) -> Any:
    """Run one command in the session (a timeout interrupts the command; the shell lives on)."""
    st = state_of(request)
    await owned(st, who, sandbox_id)
    t0 = time.perf_counter()
    r = await st.node.shell_run(sandbox_id, shell_id, body.cmd, timeout=body.timeout, max_output=body.max_output)
    st.metrics.exec_seconds.labels("shell").observe(time.perf_counter() - t0)
    st.view.live.observe_exec(time.perf_counter() - t0)
    return _exec_response(r)


@router.delete("/{sandbox_id}/shells/{shell_id}", status_code=204, responses=SANDBOX_ERRORS,
               summary="Close a shell")
async def close_shell(sandbox_id: SidPath, shell_id: ShellId, request: Request, who: Who) -> Response:
    """End the session and what still runs in it."""
    st = state_of(request)
    await owned(st, who, sandbox_id)
    await st.node.shell_close(sandbox_id, shell_id)
    return Response(status_code=204)


@router.post("/{sandbox_id}/pause", response_model=SandboxOut, responses=SANDBOX_ERRORS, summary="Pause")
async def pause_sandbox(sandbox_id: SidPath, request: Request, who: Who) -> dict[str, Any]:
    """Freeze the sandbox (any later request resumes it)."""
    st = state_of(request)
    await owned(st, who, sandbox_id)
    await st.node.pause(sandbox_id)
    return Namespace(who).show_info(await st.node.get(sandbox_id))


@router.post("/{sandbox_id}/resume", response_model=SandboxOut, responses=SANDBOX_ERRORS, summary="Resume")
async def resume_sandbox(sandbox_id: SidPath, request: Request, who: Who) -> dict[str, Any]:
    """Thaw a paused sandbox."""
    st = state_of(request)
    await owned(st, who, sandbox_id)
    await st.node.resume(sandbox_id)
    return Namespace(who).show_info(await st.node.get(sandbox_id))


@router.post("/{sandbox_id}/cpu_class", response_model=dict[str, Any], summary="Change the CPU class",
             responses=errors(404, 409, 500, 501, 503, 504))
async def set_cpu_class(sandbox_id: SidPath, body: CpuClassIn, request: Request, who: Who) -> dict[str, Any]:
    """Move the running sandbox to another CPU class (`interactive` or `batch`), e.g. around a test suite it
    runs; the answer is what was set. Backends without CPU classes answer 501 (only the container backend has
    them)."""
    st = state_of(request)
    await owned(st, who, sandbox_id)
    return await st.node.set_cpu_class(sandbox_id, body.cpu_class)


@router.post("/{sandbox_id}/snapshot", response_model=dict[str, Any], summary="Snapshot into a new image",
             responses=_links(200, errors(403, 404, 409, 500, 501, 503),
                              {op: {"ref": "$response.body#/ref"} for op in ("get_image", "remove_image")}))
async def snapshot_sandbox(sandbox_id: SidPath, body: SnapshotIn, request: Request, who: Who) -> dict[str, Any]:
    """Pack the sandbox's writable layer into a new image `name` (of the caller's project)."""
    st = state_of(request)
    await owned(st, who, sandbox_id)
    ns = Namespace(who)
    name = ns.for_write(body.name)
    async with store_budget(st.node.store, who, f"a snapshot of {sandbox_id}") as budget:
        out = await st.node.snapshot(sandbox_id, name, store_budget=budget)
    return ns.show_image(out)


@router.post("/{sandbox_id}/fork", response_model=BatchOut, responses=errors(403, 404, 500, 501, 503),
             summary="Fork into n children")
async def fork_sandbox(sandbox_id: SidPath, body: ForkIn, request: Request, who: Who) -> dict[str, Any]:
    """`n` independent children starting from this sandbox's current files (per-item errors)."""
    st = state_of(request)
    rec = await owned(st, who, sandbox_id)
    ns = Namespace(who)
    opts = dict(body.options)
    if "store_budget" in opts:
        raise InvalidRequest("store_budget is not a fork option (the project's max_store_mb quota sets it)")
    if "project" in opts and opts["project"] != rec.project and not who.admin:
        raise Forbidden(f"forks stay in project {rec.project!r}")
    if "name" in opts and opts["name"] is not None:
        opts["name"] = ns.for_write(str(opts["name"]))
    elif ns.prefix is not None:
        from shoal.node.snapshot import fork_image_name

        opts["name"] = ns.for_write(fork_image_name(sandbox_id))
    cpus = float(opts.get("cpus", rec.spec.cpus))
    mem = int(opts.get("memory_mb", rec.spec.memory_mb))
    owner = _owner(st, who, rec.project)
    if body.n > st.settings.max_batch:
        raise InvalidRequest(f"n={body.n} is over this server's batch limit of {st.settings.max_batch}")
    res = st.quotas.reserve(owner, body.n, cpus, mem)
    try:
        try:
            async with store_budget(st.node.store, who, f"a fork of {sandbox_id}") as budget:
                if budget is not None:
                    opts["store_budget"] = budget
                items = await st.node.fork(sandbox_id, body.n, **opts)
        except TypeError as e:
            raise InvalidRequest(f"bad fork options: {e}") from None
        for it in items:
            if isinstance(it, SandboxInfo):
                res.commit(it.id)
    finally:
        res.release()
    return _batch([_item(ns, it, st) for it in items])

