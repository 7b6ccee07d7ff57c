"""E2B's control plane (the REST API the `e2b` SDKs call at `E2B_API_URL`), mapped onto shoal sandboxes.

Served: create (`POST /sandboxes`, `POST /v2/sandboxes`), list (`GET /sandboxes`, `GET /v2/sandboxes`), get,
kill (`DELETE /sandboxes/{id}`), `timeout`, `refreshes`, `pause`, `resume`/`connect`, `fork`. The API key
(`X-API-KEY`) is a shoal token: sandboxes belong to its project and count against its quota. Errors answer
E2B's shape `{"code": <http status>, "message": "..."}`; the parts shoal does not serve answer 501 naming
what is missing.
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from shoal.errors import (
    CapacityExceeded,
    InvalidRequest,
    NotImplementedYet,
    SandboxError,
    SandboxNotFound,
    ShoalError,
)
from shoal.models import SandboxInfo
from shoal.records import SandboxRecord
from shoal.server.compat import common, e2b_list
from shoal.server.compat.routes import compat_router
from shoal.server.deps import ServerState, state_of
from shoal.server.tokens import Principal
from shoal.spec import SandboxSpec

log = logging.getLogger("shoal.server")
#: every endpoint answers an error as from_shoal() shapes it (shoal.server.compat.routes)
router = compat_router(lambda e: from_shoal(e), include_in_schema=False)

DEFAULT_TIMEOUT_S = 300  # the SDKs' own default when the caller gives none
MAX_TIMEOUT_S = 30 * 86400


def e2b_error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in E2B's shape (the SDK reads `message`)."""
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


def from_shoal(exc: BaseException) -> JSONResponse:
    """A shoal error as the E2B error the SDK maps onto its exceptions (never a bare 500 for bad input)."""
    if isinstance(exc, ShoalError):
        headers = {}
        if isinstance(exc, CapacityExceeded):
            headers["Retry-After"] = str(max(1, int(exc.retry_after_s + 0.999)))
        status = exc.http_status
        if isinstance(exc, InvalidRequest):
            status = 400  # E2B answers bad input with 400
        return e2b_error(status, exc.message, headers)
    log.exception("E2B API request failed")
    return e2b_error(500, f"internal error ({type(exc).__name__}): {exc}; the server log has the traceback")


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw.strip():
        return {}
    import json

    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body


def _caller(request: Request) -> tuple[ServerState, Principal]:
    st = state_of(request)
    return st, common.principal_from_key(st, request.headers.get("x-api-key"), request.headers.get("authorization"))


def _iso(ts: float | None) -> str:
    return datetime.fromtimestamp(ts or time.time(), UTC).isoformat().replace("+00:00", "Z")


def _timeout(value: Any, field: str = "timeout") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_TIMEOUT_S:
        raise InvalidRequest(f"{field} must be a number of seconds between 1 and {MAX_TIMEOUT_S}")
    return int(value)


def _str_map(value: Any, field: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise InvalidRequest(f"{field} must map strings to strings")
    return dict(value)


def _metadata(labels: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if not k.startswith(common.LABEL_PREFIX)}


def _public_traffic(body: dict[str, Any]) -> tuple[bool | None, dict[str, Any]]:
    """`network.allowPublicTraffic` of a create request (whether its ports need the traffic access token),
    and the body without it (any other network option is still refused)."""
    net = body.get("network")
    if not isinstance(net, dict) or "allowPublicTraffic" not in net:
        return None, body
    net = dict(net)
    public = net.pop("allowPublicTraffic")
    if public is not None and not isinstance(public, bool):
        raise InvalidRequest("network.allowPublicTraffic must be a boolean")
    return public, {**body, "network": net or None}


def created(st: ServerState, who: Principal, info: SandboxInfo | SandboxRecord) -> dict[str, Any]:
    """The answer to create/connect/resume (E2B's `Sandbox` object)."""
    labels = info.labels or {}
    token = common.access_token(st, who, info.id) if st.auth_required() else None
    out: dict[str, Any] = {"templateID": labels.get(common.TEMPLATE_LABEL) or info.image, "sandboxID": info.id,
                           "clientID": st.node.config.node_id, "envdVersion": common.ENVD_VERSION,
                           "domain": None}
    if token:
        out["envdAccessToken"] = token
        out["trafficAccessToken"] = token
    return out


def detail(st: ServerState, rec: SandboxRecord, *, listed: bool = False) -> dict[str, Any]:
    """E2B's `SandboxDetail` / `ListedSandbox` for a shoal record."""
    spec = rec.spec
    state = "paused" if rec.state == "paused" else "running"
    out: dict[str, Any] = {
        "templateID": rec.labels.get(common.TEMPLATE_LABEL) or rec.image, "sandboxID": rec.id,
        "clientID": st.node.config.node_id, "startedAt": _iso(rec.created_at),
        "endAt": _iso(rec.expires_at if rec.expires_at else rec.created_at + MAX_TIMEOUT_S),
        "cpuCount": max(1, round(float(spec.cpus))), "memoryMB": int(spec.memory_mb),
        "diskSizeMB": int(spec.disk_mb), "state": state, "envdVersion": common.ENVD_VERSION,
        "metadata": _metadata(rec.labels),
    }
    if not listed:
        out["allow_internet_access"] = bool(spec.network)
        out["domain"] = None
    return out


async def _create(request: Request) -> Response:
    st, who = _caller(request)
    body = await _json_body(request)
    template = body.get("templateID")
    if not isinstance(template, str) or not template.strip():
        raise InvalidRequest("templateID is required (an E2B template ID or a shoal image name)")
    public, body = _public_traffic(body)
    for unsupported, what in (("mcp", "MCP servers"), ("volumeMounts", "volume mounts"), ("iam", "workload identity"),
                              ("network", "network rules (allow_out/deny_out)")):
        if body.get(unsupported):
            raise NotImplementedYet(f"{what} ({unsupported}) are not supported by shoal's E2B API; create the "
                                    f"sandbox without them")
    if body.get("autoPause") is True or body.get("autoResume"):
        raise NotImplementedYet("auto-pause on timeout is not supported by shoal's E2B API: a sandbox past its "
                                "timeout is killed (pause it explicitly with Sandbox.pause())")
    timeout = _timeout(body["timeout"]) if body.get("timeout") is not None else DEFAULT_TIMEOUT_S
    labels = _str_map(body.get("metadata"), "metadata")
    labels[common.TEMPLATE_LABEL] = template
    if public is not None:
        labels[common.PUBLIC_PORTS_LABEL] = "true" if public else "false"
    env = _str_map(body.get("envVars"), "envVars")
    net = body.get("allow_internet_access")
    network = common.default_network() if net is None else bool(net)
    image = common.resolve_template(st, who, template)
    from shoal.server.policy import apply_policy

    spec = SandboxSpec(**apply_policy(st, who, {"image": image, "ttl_s": float(timeout), "env": env, "labels": labels,
                                                "network": network, "project": who.project}))
    from shoal.server.api_sandboxes import _create_one

    async with common.slot(st, who):
        res = st.quotas.reserve(who, 1, spec.cpus, spec.memory_mb)
        try:
            info = await _create_one(st, spec)
            res.commit(info.id)
        finally:
            res.release()
    prune(st)
    track(st, info.id)
    return JSONResponse(created(st, who, info), status_code=201)


def track(st: ServerState, sandbox_id: str) -> None:
    """Start sampling an E2B sandbox's metrics (shoal.server.compat.e2b_metrics)."""
    from shoal.server.compat import e2b_metrics

    with contextlib.suppress(Exception):
        e2b_metrics.recorder(st).track(st.node.record(sandbox_id))


def prune(st: ServerState) -> None:
    """Forget what the compat layer holds for sandboxes that are gone (closed elsewhere, or by their TTL)."""
    from shoal.server.compat import e2b_interpreter, e2b_watch, swerex

    with contextlib.suppress(Exception):
        e2b_interpreter.contexts(st).prune(st)
    with contextlib.suppress(Exception):
        e2b_watch.watchers(st).prune(st)
    with contextlib.suppress(Exception):
        swerex.prune(st)


@router.post("/sandboxes")
@router.post("/v2/sandboxes")
async def create_sandbox(request: Request) -> Response:
    """Create a sandbox from a template (E2B `Sandbox.create`)."""
    return await _create(request)


def _listed(st: ServerState, who: Principal) -> list[dict[str, Any]]:
    """Every running or paused sandbox of the caller's project (admin: all) as E2B's ListedSandbox."""
    from shoal.records import list_records

    out = []
    for rec in list_records(st.node.paths.sandboxes):
        if (not who.admin and rec.project != who.project) or rec.extra.get("pool"):
            continue
        if rec.state in ("running", "paused"):
            out.append(detail(st, rec, listed=True))
    return out


@router.get("/v2/sandboxes")
async def list_sandboxes(request: Request) -> Response:
    """A page of the caller's sandboxes (E2B `Sandbox.list`): `limit`, `nextToken` → `X-Next-Token`, `order`,
    filters `state`, `metadata`, `startedAfter`, `template` (shoal.server.compat.e2b_list)."""
    st, who = _caller(request)
    q = e2b_list.parse_query(request.query_params)
    items, token, running = e2b_list.page(_listed(st, who), q)
    headers = {}
    if token is not None:
        headers["X-Next-Token"] = token
    if running is not None:
        headers["X-Total-Running"] = str(running)
    return JSONResponse(items, headers=headers)


@router.get("/sandboxes")
async def list_sandboxes_v1(request: Request) -> Response:
    """The caller's running sandboxes, newest first, filtered by `metadata` (E2B's legacy list: no pages)."""
    st, who = _caller(request)
    raw = request.query_params.get("metadata")
    q = e2b_list.ListQuery(states=("running",), metadata=e2b_list.parse_metadata(raw) if raw else ())
    items = [d for d in _listed(st, who) if e2b_list.matches(d, q)]
    e2b_list.sort_listed(items, ascending=False)
    return JSONResponse(items)


@router.get("/sandboxes/metrics")
async def sandboxes_metrics(request: Request) -> Response:
    """The latest metrics of each of `sandbox_ids` (comma-separated, at most 100) the caller may see."""
    from shoal.server.compat import e2b_metrics

    st, who = _caller(request)
    raw = request.query_params.get("sandbox_ids") or ""
    ids = list(dict.fromkeys(x.strip() for x in raw.split(",") if x.strip()))
    if not ids:
        raise InvalidRequest("sandbox_ids is required: comma-separated sandbox IDs")
    if len(ids) > 100:
        raise InvalidRequest("at most 100 sandbox_ids per request")
    out = {}
    for sid in ids:
        with contextlib.suppress(SandboxNotFound):
            rec = common.sandbox_of(st, who, sid)
            latest = e2b_metrics.recorder(st).latest(rec)
            if latest is not None:
                out[sid] = latest
    return JSONResponse({"sandboxes": out})


@router.get("/sandboxes/{sandbox_id}/metrics")
async def sandbox_metrics(sandbox_id: str, request: Request) -> Response:
    """A sandbox's CPU, memory and disk series between `start` and `end` (unix seconds; default: its whole
    life) — E2B `Sandbox.get_metrics`."""
    from shoal.server.compat import e2b_metrics

    st, who = _caller(request)
    start = e2b_metrics.parse_time(request.query_params.get("start"), "start")
    end = e2b_metrics.parse_time(request.query_params.get("end"), "end")
    rec = common.sandbox_of(st, who, sandbox_id)
    return JSONResponse(e2b_metrics.recorder(st).query(rec, start, end))


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(sandbox_id: str, request: Request) -> Response:
    """One sandbox (E2B `Sandbox.get_info`)."""
    st, who = _caller(request)
    rec = common.sandbox_of(st, who, sandbox_id)
    d = detail(st, rec)
    if st.auth_required():
        d["envdAccessToken"] = common.access_token(st, who, rec.id)
    return JSONResponse(d)


@router.delete("/sandboxes/{sandbox_id}")
async def kill_sandbox(sandbox_id: str, request: Request) -> Response:
    """Destroy a sandbox (E2B `Sandbox.kill`; 404 when it does not exist)."""
    st, who = _caller(request)
    common.sandbox_of(st, who, sandbox_id)
    async with common.slot(st, who):
        await forget_sandbox(st, sandbox_id)
        await st.node.close(sandbox_id)
    st.quotas.forget(sandbox_id)
    return Response(status_code=204)


async def forget_sandbox(st: ServerState, sandbox_id: str) -> None:
    """Drop what the compat layer keeps in memory for a sandbox (processes, interpreter contexts, watchers)."""
    from shoal.server.compat import e2b_interpreter, e2b_procs, e2b_watch

    with contextlib.suppress(Exception):
        await e2b_procs.table(st).drop(sandbox_id)
    with contextlib.suppress(Exception):
        await e2b_watch.watchers(st).drop(sandbox_id)
    with contextlib.suppress(Exception):
        await e2b_interpreter.contexts(st).drop_sandbox(sandbox_id)


async def set_ttl(st: ServerState, sandbox_id: str, seconds: float, *, only_extend: bool = False) -> None:
    """Make the sandbox expire `seconds` from now (shoal's reaper closes it then)."""
    await st.node.set_ttl(sandbox_id, seconds, only_extend=only_extend)


@router.post("/sandboxes/{sandbox_id}/timeout")
async def set_timeout(sandbox_id: str, request: Request) -> Response:
    """Reset the sandbox's time to live to `timeout` seconds from now (E2B `Sandbox.set_timeout`)."""
    st, who = _caller(request)
    body = await _json_body(request)
    seconds = _timeout(body.get("timeout"))
    common.sandbox_of(st, who, sandbox_id)
    await set_ttl(st, sandbox_id, seconds)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes")
async def refresh(sandbox_id: str, request: Request) -> Response:
    """Keep the sandbox alive `duration` seconds more (never shortens it)."""
    st, who = _caller(request)
    body = await _json_body(request)
    seconds = _timeout(body.get("duration", 60), "duration")
    common.sandbox_of(st, who, sandbox_id)
    await set_ttl(st, sandbox_id, seconds, only_extend=True)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/pause")
async def pause(sandbox_id: str, request: Request) -> Response:
    """Freeze the sandbox (shoal's pause: processes stop, memory is reclaimed); 409 when already paused."""
    st, who = _caller(request)
    body = await _json_body(request)
    rec = common.sandbox_of(st, who, sandbox_id)
    if rec.state == "paused":
        return e2b_error(409, f"sandbox {sandbox_id} is already paused")
    if body.get("memory") is False:
        raise NotImplementedYet("filesystem-only pause is not supported: shoal pauses keep the processes")
    async with common.slot(st, who):
        await st.node.pause(sandbox_id)
    return Response(status_code=204)


async def _connect(sandbox_id: str, request: Request) -> Response:
    st, who = _caller(request)
    body = await _json_body(request)
    rec = common.sandbox_of(st, who, sandbox_id)
    if rec.state not in ("running", "paused"):
        raise SandboxError(f"sandbox {sandbox_id} is {rec.state}; create a new one")
    if body.get("memory") is False:
        raise NotImplementedYet("on_resume='reboot' is not supported: shoal resumes the frozen processes")
    status = 200
    async with common.slot(st, who):
        if rec.state == "paused":
            await st.node.resume(sandbox_id)
            status = 201
    if body.get("timeout") is not None:
        await set_ttl(st, sandbox_id, _timeout(body["timeout"]), only_extend=True)
    track(st, sandbox_id)
    return JSONResponse(created(st, who, st.node.record(sandbox_id)), status_code=status)


@router.post("/sandboxes/{sandbox_id}/connect")
@router.post("/v2/sandboxes/{sandbox_id}/connect")
@router.post("/sandboxes/{sandbox_id}/resume")
async def connect(sandbox_id: str, request: Request) -> Response:
    """Resume a paused sandbox (or just reach a running one) and hand out its envd access (E2B `connect`)."""
    return await _connect(sandbox_id, request)


@router.post("/sandboxes/{sandbox_id}/fork")
async def fork(sandbox_id: str, request: Request) -> Response:
    """`count` children from the sandbox's current files (shoal's fork), one result per child."""
    try:
        st, who = _caller(request)
        body = await _json_body(request)
        rec = common.sandbox_of(st, who, sandbox_id)
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= st.settings.max_batch:
            raise InvalidRequest(f"count must be an integer between 1 and {st.settings.max_batch}")
        timeout = _timeout(body["timeout"]) if body.get("timeout") is not None else DEFAULT_TIMEOUT_S
        opts: dict[str, Any] = {"ttl_s": float(timeout)}
        from shoal.server.deps import Namespace

        ns = Namespace(who)
        if ns.prefix is not None:
            from shoal.node.snapshot import fork_image_name

            opts["name"] = ns.for_write(fork_image_name(sandbox_id))
        async with common.slot(st, who):
            res = st.quotas.reserve(who, count, float(rec.spec.cpus), int(rec.spec.memory_mb))
            try:
                from shoal.server.store_quota import store_budget

                async with store_budget(st.node.store, who, f"a fork of {sandbox_id}") as budget:
                    if budget is not None:
                        opts["store_budget"] = budget  # the project's max_store_mb bounds the fork's snapshot
                    items = await st.node.fork(sandbox_id, count, **opts)
                for it in items:
                    if isinstance(it, SandboxInfo):
                        res.commit(it.id)
            finally:
                res.release()
        out = []
        for it in items:
            if isinstance(it, SandboxInfo):
                track(st, it.id)
                out.append({"sandbox": created(st, who, it)})
            else:
                status = it.http_status if isinstance(it, ShoalError) else 500
                out.append({"error": {"code": status, "message": str(it)}})
        return JSONResponse(out, status_code=201)
    except TypeError as e:
        return e2b_error(400, f"bad fork options: {e}")


_UNSUPPORTED = {
    "logs": "sandbox logs", "network": "changing a sandbox's network rules",
    "snapshots": "named snapshots through the E2B API (use shoal's POST /v1/sandboxes/{id}/snapshot)",
}


@router.api_route("/sandboxes/{sandbox_id}/{what}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
@router.api_route("/v2/sandboxes/{sandbox_id}/{what}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
async def unsupported_sandbox_op(sandbox_id: str, what: str, request: Request) -> Response:
    """Sandbox operations shoal does not serve: 501 naming the operation (405 for a wrong method)."""
    served = {"timeout": "POST", "refreshes": "POST", "pause": "POST", "resume": "POST", "connect": "POST",
              "fork": "POST"}
    if what in served:
        return e2b_error(405, f"{request.method} is not allowed on {request.url.path} (use {served[what]})",
                         {"Allow": served[what]})
    name = _UNSUPPORTED.get(what, f"the sandbox operation {what!r}")
    return e2b_error(501, f"{name} is not supported by shoal's E2B API (see docs/compat.md)")


_UNSUPPORTED_ROOTS = {
    "templates": "building or managing templates (build a shoal image: `shoal image build`, then use its name "
                 "as the template ID or alias it with SHOAL_E2B_TEMPLATES)",
    "default-templates": "listing E2B's default templates",
    "snapshots": "E2B snapshots (use shoal's snapshot API)",
    "volumes": "E2B volumes", "secrets": "E2B secrets", "teams": "E2B teams", "access-tokens": "access tokens",
    "api-keys": "API keys (make shoal tokens with `shoal token create`)", "nodes": "cluster nodes",
}


def _unsupported_root(root: str) -> Any:
    async def handler(request: Request) -> Response:
        return e2b_error(501, f"{_UNSUPPORTED_ROOTS[root]} is not supported by shoal's E2B API (see docs/compat.md)")

    return handler


for _root in _UNSUPPORTED_ROOTS:
    for _prefix in ("", "/v2", "/v3"):
        for _path in (f"{_prefix}/{_root}", f"{_prefix}/{_root}/{{rest:path}}"):
            router.add_api_route(_path, _unsupported_root(_root), methods=["GET", "POST", "PUT", "DELETE", "PATCH"],
                                 include_in_schema=False)


def sandbox_gone(sandbox_id: str) -> SandboxNotFound:
    """The error for a sandbox that does not exist (E2B's proxy words it 'was not found')."""
    return SandboxNotFound(f"The sandbox {sandbox_id} was not found")
