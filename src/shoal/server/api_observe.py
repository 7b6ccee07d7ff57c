"""REST routes for watching the factory: nodes, live stats, a page of sandboxes, a sandbox's events,
commands and usage, recent events, image users, and WebSocket tickets for the dashboard's terminal.

They are answered by the server's view (shoal.server.observe): one node, or a cluster gateway merging
its nodes' answers. Projects see their own sandboxes and events; nodes and live stats are node-wide
figures, for admin tokens (like /metrics).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi import Path as PathParam
from pydantic import StringConstraints

from shoal.errors import Forbidden, InvalidRequest
from shoal.node.events import KINDS, LIFECYCLE
from shoal.server.deps import Namespace, ServerState, authorized, require_admin, state_of
from shoal.server.observe import MAX_PAGE, SORT_KEYS, SandboxQuery
from shoal.server.responses import SANDBOX_ERRORS, errors
from shoal.server.tokens import Principal

router = APIRouter(prefix="/v1", tags=["observe"])
Who = Annotated[Principal, Depends(authorized)]
SidPath = Annotated[str, PathParam(max_length=200, description="sandbox id (`<node>-<26 chars>`)")]
_PROJECT = r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$"
#: KEY=VALUE, or empty (= no filter)
_LABEL = r"^(?:[^=]+=.*)?$"
#: an event kind, or empty (= any kind)
_KIND = "^(?:" + "|".join(KINDS) + ")?$"
LabelArg = Annotated[str, StringConstraints(pattern=_LABEL, max_length=2048)]
KindArg = Annotated[str, StringConstraints(pattern=_KIND)]
#: seconds a terminal ticket may wait for its WebSocket
TICKET_TTL_S = 30.0


def _view(request: Request) -> Any:
    return state_of(request).view


def _given(value: str | None) -> str | None:
    # an empty filter is what a form sends for "any": no filter, not "equal to the empty string"
    return value or None


def _labels(items: list[str] | None) -> dict[str, str]:
    out = {}
    for item in items or []:
        if not item:
            continue  # an empty label filter: any
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise InvalidRequest(f"label filter {item!r} must look like KEY=VALUE",
                                 errors=[{"field": "query.label", "message": "expected KEY=VALUE"}])
        out[k] = v
    return out


def _project_scope(who: Principal, project: str | None) -> None:
    if project is not None and not who.admin and project != who.project:
        raise Forbidden(f"this token sees project {who.project!r} only")


@router.get("/nodes", response_model=dict[str, Any], responses=errors(403), summary="Nodes with health and load")
async def list_nodes(request: Request, who: Who) -> dict[str, Any]:
    """Every node this server serves (one, or a cluster's): health, load, memory, sandboxes by state
    (admin tokens)."""
    require_admin(who, "reading node figures")
    view = _view(request)
    return {"kind": view.kind, "nodes": await view.nodes()}


@router.get("/stats", response_model=dict[str, Any], responses=errors(403), summary="Live figures")
async def live_stats(request: Request, who: Who,
                     since: Annotated[float | None, Query(description="only points after this UNIX time")] = None,
                     ) -> dict[str, Any]:
    """Recent points (every 2 s, ten minutes kept) of create rate, create/exec latency percentiles (ms),
    sandboxes by state and memory committed/used/reclaimed, per node and in total (admin tokens)."""
    require_admin(who, "reading live node figures")
    return dict(await _view(request).stats(since))


@router.get("/sandboxes/page", response_model=dict[str, Any], responses=errors(403),
            summary="A page of sandboxes, filtered")
async def page_sandboxes(
        request: Request, who: Who,
        project: Annotated[str | None, Query(pattern=_PROJECT, description="admin: one project")] = None,
        job: Annotated[str | None, Query(max_length=200, description="label shoal.job")] = None,
        label: Annotated[list[LabelArg] | None, Query(description="KEY=VALUE; repeat: all; empty: any")] = None,
        state: Annotated[list[str] | None, Query(max_length=32, description="repeat for any of several")] = None,
        backend: Annotated[str | None, Query(max_length=64)] = None,
        image: Annotated[str | None, Query(max_length=300, description="substring of the image")] = None,
        min_age_s: Annotated[float | None, Query(ge=0)] = None,
        max_age_s: Annotated[float | None, Query(ge=0)] = None,
        q: Annotated[str | None, Query(max_length=200, description="substring of the ID")] = None,
        node: Annotated[str | None, Query(max_length=64)] = None,
        sort: Annotated[str, Query(pattern="^(" + "|".join(SORT_KEYS) + ")$")] = "created_at",
        order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
        offset: Annotated[int, Query(ge=0, le=10_000_000)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 50) -> dict[str, Any]:
    """Sandboxes of the caller's project (admin: all) matching every filter given, sorted and paged on the
    server: {total, offset, limit, items, facets}. Fast at tens of thousands of sandboxes (an index in
    memory, refreshed at most once a second)."""
    _project_scope(who, project)
    qry = SandboxQuery(project=project, job=_given(job), labels=_labels(label),
                       states=tuple(s for s in state or () if s), backend=_given(backend), image=_given(image),
                       min_age_s=min_age_s, max_age_s=max_age_s, q=_given(q), node=_given(node), sort=sort,
                       desc=order == "desc", offset=offset, limit=limit)
    return dict(await _view(request).page(who, qry))


@router.get("/sandboxes/{sandbox_id}/events", response_model=dict[str, Any], responses=SANDBOX_ERRORS,
            summary="A sandbox's events")
async def sandbox_events(sandbox_id: SidPath, request: Request, who: Who,
                         commands: Annotated[bool, Query(description="its commands instead (exit codes, "
                                                         "durations)")] = False) -> dict[str, Any]:
    """created, paused, resumed, oom, timeout, lost, closed (or, with `commands`, its recent commands),
    oldest first; readable after the sandbox was closed."""
    evs = await _view(request).sandbox_events(who, sandbox_id, commands=commands)
    return {"events": evs}


@router.get("/sandboxes/{sandbox_id}/usage", response_model=dict[str, Any], responses=SANDBOX_ERRORS,
            summary="A sandbox's measured use")
async def sandbox_usage(sandbox_id: SidPath, request: Request, who: Who) -> dict[str, Any]:
    """Memory charged and working set (MiB), CPU seconds, processes, OOM kills, memory reclaimed by its
    last pause: what its cgroup measures now (VMs: what their host side has)."""
    return dict(await _view(request).sandbox_usage(who, sandbox_id))


@router.get("/events", response_model=dict[str, Any], responses=errors(403), summary="Recent events")
async def recent_events(
        request: Request, who: Who,
        kind: Annotated[list[KindArg] | None, Query(description=f"any of {', '.join(LIFECYCLE)}; "
                                                "repeat for several; empty: any")] = None,
        since: Annotated[float | None, Query(description="only events after this UNIX time")] = None,
        project: Annotated[str | None, Query(pattern=_PROJECT, description="admin: one project")] = None,
        limit: Annotated[int, Query(ge=1, le=5000)] = 200) -> dict[str, Any]:
    """The newest lifecycle events of the caller's sandboxes (admin: all), oldest first."""
    _project_scope(who, project)
    kind = [k for k in kind or [] if k] or None
    bad = [k for k in kind or [] if k not in KINDS]
    if bad:
        raise InvalidRequest(f"unknown event kind {bad[0]!r} (one of {', '.join(LIFECYCLE)})",
                             errors=[{"field": "query.kind", "message": "unknown event kind"}])
    evs = await _view(request).recent_events(who, kinds=kind, since=since, limit=limit, project=project)
    return {"events": evs}


@router.get("/ui/image-users", response_model=dict[str, Any], responses=errors(403),
            summary="Sandboxes per image and layer")
async def image_users(request: Request, who: Who,
                      project: Annotated[str | None, Query(pattern=_PROJECT)] = None) -> dict[str, Any]:
    """How many live sandboxes of the caller's project (admin: all, or `project`) use each image and
    each layer (by hex digest)."""
    _project_scope(who, project)
    if project is not None and who.admin and project != who.project:
        who = Principal(project=project, admin=False, token_id=who.token_id)
    out = dict(await _view(request).image_users(who))
    out["sizes"] = await asyncio.to_thread(_layer_sizes, state_of(request), Namespace(who))
    return out


def _layer_sizes(st: ServerState, ns: Namespace) -> dict[str, int]:
    # sizes of the layers of the images the caller sees (the resolved images carry them)
    return {lay.digest: lay.size for img in st.node.store.list_images() if ns.visible(img.name) for lay in img.layers}


@router.get("/ui/whoami", response_model=dict[str, Any], responses=errors(), summary="Who this token is")
async def whoami(request: Request, who: Who) -> dict[str, Any]:
    """The caller's project and whether it is an admin, and whether this server requires tokens."""
    st = state_of(request)
    return {"project": who.project, "admin": who.admin, "auth": st.auth_required(), "kind": st.view.kind}


@router.post("/ui/ticket", response_model=dict[str, Any], responses=errors(), summary="A WebSocket ticket")
async def ws_ticket(request: Request, who: Who) -> dict[str, Any]:
    """A one-time ticket that authenticates one WebSocket stream as this token within 30 s (browsers
    cannot set headers on a WebSocket): `GET /v1/sandboxes/{id}/stream?ticket=...`."""
    st = state_of(request)
    return {"ticket": issue_ticket(st, who), "expires_in_s": TICKET_TTL_S}


def issue_ticket(st: ServerState, who: Principal) -> str:
    """A fresh one-time ticket for `who` (old ones are dropped as they expire)."""
    now = time.monotonic()
    for t, (_, exp) in list(st.tickets.items()):
        if exp < now:
            st.tickets.pop(t, None)
    ticket = secrets.token_urlsafe(24)
    st.tickets[ticket] = (who, now + TICKET_TTL_S)
    return ticket
