"""The API server's app factory: `create_app(node, settings) -> FastAPI`.

One process serves one node agent (its sandboxes, mounts and agent connections live in this process);
run it with `shoal serve` (uvicorn, uvloop, httptools). Extend it with `app.include_router(...)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from shoal import __version__
from shoal.errors import CapacityExceeded, ShoalError
from shoal.front import Front
from shoal.node.node import Node
from shoal.records import list_records
from shoal.server import api_images, api_observe, api_sandboxes, api_stream, ui
from shoal.server.deps import ServerState, authorized, bind_front, require_admin, state_of
from shoal.server.limits import BodyGuard, TokenLimiter
from shoal.server.metrics import Metrics
from shoal.server.quotas import QuotaTracker
from shoal.server.responses import MALFORMED_HTTP, blame_request, errors
from shoal.server.schemas import Health
from shoal.server.settings import ServerSettings
from shoal.server.tokens import Principal, TokenStore

log = logging.getLogger("shoal.server")

_HTTP_CODES = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
               405: "method_not_allowed", 408: "timeout", 413: "invalid_request", 415: "invalid_request",
               429: "capacity_exceeded"}

DESCRIPTION = """\
shoal's HTTP API: isolated, stateful sandboxes for agentic RL. Authenticate with
`Authorization: Bearer <token>` (from `shoal token create`). Streaming exec and shell commands use a
WebSocket at `/v1/sandboxes/{id}/stream` (protocol in docs/api.md). Every error answers
`{"error": {"code", "message", "details"}}`; `code` names the `shoal.errors` class the SDK raises.
"""


class SafeJSONResponse(JSONResponse):
    """JSON that always encodes: text from inside a sandbox (an agent's message, a path) may carry lone
    surrogates from undecodable bytes; they become U+FFFD instead of a failed response."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
            "utf-8", "replace")


def error_response(status: int, err: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSON error response in the one shape the API uses."""
    return SafeJSONResponse({"error": err}, status_code=status, headers=headers)


def _install_handlers(app: FastAPI) -> None:
    def count(request: Request, code: str) -> None:
        with contextlib.suppress(Exception):
            state_of(request).metrics.errors.labels(code).inc()

    @app.exception_handler(ShoalError)
    async def on_shoal_error(request: Request, exc: ShoalError) -> JSONResponse:
        exc = blame_request(exc)
        count(request, exc.code)
        headers = {}
        if isinstance(exc, CapacityExceeded):
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        elif exc.http_status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return error_response(exc.http_status, exc.to_dict(), headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = []
        for e in exc.errors():
            loc = [str(x) for x in e.get("loc", ())]
            errs.append({"field": ".".join(loc), "message": str(e.get("msg", "invalid"))})
        summary = "; ".join(f"{x['field']}: {x['message']}" for x in errs[:5])
        count(request, "invalid_request")
        return error_response(422, {"code": "invalid_request", "message": f"invalid request: {summary}",
                                    "details": {"errors": errs}})

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        code = _HTTP_CODES.get(status, "invalid_request" if status < 500 else "shoal_error")
        msg = str(exc.detail)
        details: dict[str, Any] = {}
        headers = dict(exc.headers or {})
        if status == 400:
            # FastAPI's "error parsing the body" (e.g. not UTF-8): invalid input like any other, 422
            status, msg = 422, f"request body is not valid JSON text: {msg}"
            details = {"errors": [{"field": "body", "message": "not valid JSON (UTF-8)"}]}
        elif status == 404 and msg == "Not Found":
            msg = f"no route {request.method} {request.url.path}: see /openapi.json"
        elif status == 405:
            allowed = _allowed_methods(request)
            headers["Allow"] = ", ".join(allowed)
            msg = f"method {request.method} is not allowed on {request.url.path} (allowed: {', '.join(allowed)})"
        if hasattr(exc, "limit"):
            details = {"limit_bytes": exc.limit, "reason": "payload_too_large"}
        count(request, code)
        return error_response(status, {"code": code, "message": msg, "details": details}, headers)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        count(request, "internal_error")
        return error_response(500, {"code": "shoal_error", "message": f"internal error ({type(exc).__name__}): "
                                    f"{exc}; the server log has the traceback", "details": {}})


def _operation_id(route: Any) -> str:
    # stable, readable operationIds (links refer to them); SandboxFusion's root routes get a prefix
    return route.name if route.path.startswith(("/v1/", "/healthz", "/metrics")) else f"fusion_{route.name}"


def _leaf_routes(routes: Any) -> Any:
    for r in routes:
        sub = getattr(r, "original_router", None)  # FastAPI keeps included routers nested
        if sub is not None:
            yield from _leaf_routes(sub.routes)
        else:
            yield r


def _allowed_methods(request: Request) -> list[str]:
    """The methods of the most specific route template matching this path (Starlette lists only the
    first route's, and a literal segment like /batch beats a {parameter})."""
    by_template: dict[str, set[str]] = {}
    for route in _leaf_routes(request.app.router.routes):
        rx, m = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if rx is not None and m and rx.match(request.url.path):
            by_template.setdefault(route.path, set()).update(m)
    if not by_template:
        return []
    best = min(by_template, key=lambda t: (t.count("{"), -len(t)))
    methods = by_template[best]
    if "GET" in methods:
        methods.add("HEAD")
    return sorted(methods)


class CrashGuard:
    """ASGI middleware: an unexpected exception becomes the JSON 500 here, and goes no further.

    Starlette answers a handler-less exception itself but then re-raises it, and uvicorn closes the
    connection of a request that raised after its response started, without `Connection: close`: the
    client's next request on that keep-alive connection failed with a read error (issue 19, item 5).
    Only an exception after the response started (mid-stream) still closes the connection: nothing
    else can tell the client the body is incomplete."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_wrapper(msg: dict[str, Any]) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception as exc:
            if started:
                raise
            log.error("unhandled error in %s %s", scope.get("method"), scope.get("path"), exc_info=exc)
            with contextlib.suppress(Exception):
                state = scope["app"].state.shoal
                state.metrics.errors.labels("internal_error").inc()
            resp = error_response(500, {"code": "shoal_error", "message": f"internal error ({type(exc).__name__}): "
                                        f"{exc}; the server log has the traceback", "details": {}})
            await resp(scope, receive, send)


class RequestMetrics:
    """ASGI middleware: count requests and time them by route template (not by raw path)."""

    def __init__(self, app: Any, state_getter: Any) -> None:
        self.app = app
        self.state_getter = state_getter

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]

        async def send_wrapper(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            st = self.state_getter()
            if st is not None:
                m = st.metrics
                m.requests.labels(scope["method"], path, str(status[0])).inc()
                m.request_seconds.labels(scope["method"], path).observe(time.perf_counter() - t0)


def create_app(node: Front | None = None, settings: ServerSettings | None = None, *,
               tokens: TokenStore | None = None, manage_node: bool = True,
               quotas: QuotaTracker | None = None) -> FastAPI:
    """Build the API app around `node` (started and stopped with the app when `manage_node`). `node` may
    also be a cluster gateway's front (shoal.cluster.gateway), with its cluster-wide `quotas`."""
    settings = settings or ServerSettings()
    if node is None:
        node = Node()
    tokens = tokens or TokenStore(node.paths.home)
    limiter = TokenLimiter(settings.max_inflight_per_token, settings.max_queued_per_token)
    quotas = quotas or QuotaTracker(node.paths.sandboxes)
    state = ServerState(node=node, settings=settings, tokens=tokens, quotas=quotas,
                        limiter=limiter, metrics=Metrics(node, limiter),
                        create_sem=asyncio.Semaphore(max(1, settings.create_concurrency)))
    from shoal.server.observe import view_for

    state.view = view_for(state)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_node:
            await node.start()
        state.quotas.refresh()
        await state.view.start()
        try:
            yield
        finally:
            await state.view.stop()
            from shoal.server import compat

            await compat.stop(state)
            if manage_node:
                # crash-only: sandboxes keep running; the next server re-adopts them
                await node.stop()
                n = len(list_records(node.paths.sandboxes))
                print(f"shoal API stopped; {n} sandbox(es) keep running for the next server", file=sys.stderr,
                      flush=True)

    app = FastAPI(title="shoal", version=__version__, description=DESCRIPTION, lifespan=lifespan,
                  openapi_url="/openapi.json", docs_url="/docs", redoc_url=None,
                  generate_unique_id_function=_operation_id, default_response_class=SafeJSONResponse,
                  responses={400: MALFORMED_HTTP})
    app.state.shoal = state
    bind_front(app, node)
    _install_handlers(app)
    app.include_router(api_observe.router)  # first: /v1/sandboxes/page is not a sandbox ID
    app.include_router(api_sandboxes.router)
    app.include_router(api_images.router)
    app.include_router(api_stream.router)
    _system_routes(app)
    ui.mount(app)
    _include_fusion(app)
    app.add_middleware(CrashGuard)
    app.add_middleware(BodyGuard, settings=settings)
    app.add_middleware(RequestMetrics, state_getter=lambda: state)
    # E2B and SWE-ReX compatible APIs; their router middleware goes outermost, so the limits and metrics
    # above see the paths it rewrites
    from shoal.server import compat

    compat.mount(app)
    # outermost: a server without tokens refuses DNS rebinding and cross-origin requests (issue 23)
    from shoal.server.browser_guard import BrowserGuard

    app.add_middleware(BrowserGuard, auth_required=state.auth_required, allowed_hosts=settings.allowed_hosts)
    return app


def _system_routes(app: FastAPI) -> None:
    @app.get("/healthz", response_model=Health, tags=["system"], summary="Liveness")
    async def healthz(request: Request) -> dict[str, Any]:
        """The server and its node agent answer (no token needed)."""
        st = state_of(request)
        return {"status": "ok", "version": __version__, "node": st.node.config.node_id,
                "auth": st.auth_required()}

    @app.get("/metrics", tags=["system"], summary="Prometheus metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
                              "description": "Prometheus text format"}, **errors(403)})
    async def metrics(request: Request, who: Principal = Depends(authorized)) -> Response:
        """Sandboxes by state, memory, create/exec latency histograms, events and errors by kind (admin tokens).
        A cluster gateway answers for every node (a `node` label) plus cluster totals."""
        require_admin(who, "reading node metrics")
        st = state_of(request)
        if st.view.kind == "cluster":
            from shoal.server.metrics import cluster_metrics

            data = await cluster_metrics(st.view, st.metrics.registry)
        else:
            data = await asyncio.to_thread(generate_latest, st.metrics.registry)
        return Response(content=data, media_type=CONTENT_TYPE_LATEST)


def _include_fusion(app: FastAPI) -> None:
    # the SandboxFusion-compatible /run_code of the fncall backend
    from shoal.server import fusion

    app.include_router(fusion.router, dependencies=[Depends(authorized)], responses=errors(500, 501, 503, 504))
