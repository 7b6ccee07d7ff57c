"""What every route needs: who is calling (token → project), whether they may touch a sandbox, and how
project-scoped image names map onto the shared store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from shoal.errors import BackendUnavailable, Forbidden, InvalidRequest, SandboxNotFound, Unauthorized
from shoal.images.refs import parse_ref
from shoal.images.visibility import PROJECT_IMAGES, foreign, project_prefix, scoped_ref
from shoal.models import SandboxInfo
from shoal.records import SandboxRecord
from shoal.server.tokens import DEFAULT_PROJECT, Principal

if TYPE_CHECKING:
    from shoal.front import Front
    from shoal.server.limits import TokenLimiter
    from shoal.server.metrics import Metrics
    from shoal.server.quotas import QuotaTracker
    from shoal.server.settings import ServerSettings
    from shoal.server.tokens import TokenStore

#: the principal of requests when the server runs without tokens (loopback or --no-auth)
ANONYMOUS = Principal(project=DEFAULT_PROJECT, admin=True, token_id="-")

bearer = HTTPBearer(auto_error=False, description="an API token from `shoal token create` "
                                                   "(not needed when the server runs without tokens)")


@dataclass
class ServerState:
    """Everything the routes share (kept on `app.state.shoal`)."""

    #: the node side: the embedded Node, or a cluster gateway's ClusterFront (shoal.front.Front)
    node: Front
    settings: ServerSettings
    tokens: TokenStore
    quotas: QuotaTracker
    limiter: TokenLimiter
    metrics: Metrics
    create_sem: asyncio.Semaphore  # bounds sandboxes created at once by this server
    #: what the dashboard and `shoal top` read (shoal.server.observe), set by create_app
    view: Any = None
    #: one-time WebSocket tickets (api_observe.ws_ticket): ticket -> (principal, monotonic expiry)
    tickets: dict[str, tuple[Principal, float]] = field(default_factory=dict)
    #: what the compat APIs keep per server process, by name (shoal.server.compat.common.server_local)
    compat: dict[str, Any] = field(default_factory=dict)

    def auth_required(self) -> bool:
        """Tokens are required once any exists, unless the server runs with --no-auth."""
        return not self.settings.no_auth and self.tokens.has_tokens()

    def authenticate(self, authorization: str | None) -> Principal:
        """The caller of a request with this Authorization header value; Unauthorized when not allowed."""
        if not self.auth_required():
            return ANONYMOUS
        if not authorization:
            raise Unauthorized("missing API token: send 'Authorization: Bearer <token>' "
                               "(an operator makes one with `shoal token create --project NAME`)")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("malformed Authorization header: expected 'Bearer <token>'")
        who = self.tokens.authenticate(token.strip())
        if who is None:
            raise Unauthorized("unknown or revoked API token: check SHOAL_TOKEN, or ask for a new one")
        return who


    def authenticate_ws(self, authorization: str | None, ticket: str | None) -> Principal:
        """The caller of a WebSocket: its Authorization header, or a one-time ticket (browsers)."""
        if authorization or not ticket or not self.auth_required():
            return self.authenticate(authorization)
        got = self.tickets.pop(ticket, None)
        if got is None or got[1] < time.monotonic():
            raise Unauthorized("unknown or expired WebSocket ticket: ask POST /v1/ui/ticket for a new one")
        return got[0]


def state_of(request: Any) -> ServerState:
    """The shared server state of a request or WebSocket."""
    return request.app.state.shoal


def bind_front(app: Any, front: Front) -> None:
    """Make `front` the node side of `app` (what `front_of` returns): create_app does it for the API
    server, shoal.server.fusion.bind_node for an app serving only the fncall routes."""
    app.state.front = front


def front_of(request: Any) -> Front:
    """The node front bound to a request's app (`bind_front`); BackendUnavailable when none is."""
    try:
        front: Front = request.app.state.front
    except AttributeError:  # starlette's State raises it for a name never set
        raise BackendUnavailable("no shoal node is bound to this app: call shoal.server.fusion.bind_node(app, node)"
                                 ) from None
    return front


async def authorized(request: Request,
                     creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> AsyncIterator[Principal]:
    """Dependency: authenticate, then hold one of the token's in-progress slots for the request."""
    st = state_of(request)
    header = request.headers.get("authorization")
    who = st.authenticate(header)
    if not who.admin and not who.quota.is_unlimited():
        # fncall pools are node-wide: a call may not ask for more than the project's quota allows
        from shoal.backends.fncall import caller_limits

        caller_limits.set((who.project, who.quota.max_memory_mb, who.quota.max_cpus))
    async with st.limiter.slot(who.token_id):
        yield who


def require_admin(who: Principal, what: str) -> None:
    """Operator-only actions."""
    if not who.admin:
        raise Forbidden(f"{what} needs an admin token (`shoal token create --admin`)")


def owned_record(st: ServerState, who: Principal, sandbox_id: str) -> SandboxRecord:
    """The record of a sandbox the caller may touch; another project's sandbox is reported as not found."""
    rec = st.node.record(sandbox_id)
    if not who.admin and rec.project != who.project:
        raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
    return rec


async def owned(st: ServerState, who: Principal, sandbox_id: str) -> Any:
    """`owned_record` for any node front: a cluster gateway's (`shoal.cluster.gateway`) may have to ask
    the sandbox's node (`record_async`); its result has at least `.project` and `.spec`."""
    rec = await st.node.record_async(sandbox_id)
    if not who.admin and rec.project != who.project:
        raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
    return rec


class Namespace:
    """A project's view of the image store.

    Images a project's token makes (snapshots, builds, imports) are stored as `projects/<project>/<name>`;
    the project names them without the prefix. Names it looks up resolve to its own image first, then to
    a shared one; it can remove only its own. Admin tokens (and a server without tokens) see the store as
    it is, like the embedded client.
    """

    def __init__(self, who: Principal) -> None:
        self.prefix = None if who.admin else project_prefix(who.project)
        self.project = who.project
        #: whose view of the store this is (None: the operator's, the store as it is)
        self.scope = None if who.admin else who.project

    def _foreign(self, name: str) -> bool:
        return foreign(name, self.scope)

    def for_read(self, st: ServerState, ref: str) -> str:
        """The store reference `ref` means for this project: own image first, then shared; a digest only as
        an image of one of those names (shoal.images.visibility, the one place that rule lives)."""
        return scoped_ref(st.node.store, ref, self.scope)

    def for_write(self, ref: str) -> str:
        """The store name a new image of this project gets."""
        r = parse_ref(ref)
        if r.digest:
            raise InvalidRequest(f"name new images by name:tag, not by digest ({ref})")
        if self.prefix is None or r.name.startswith(self.prefix):
            return ref
        if r.name.startswith(PROJECT_IMAGES):
            raise InvalidRequest(f"image names starting with {PROJECT_IMAGES!r} are reserved for projects")
        return self.prefix + ref

    def owns(self, name: str) -> bool:
        """True when the caller may remove an image of this store name."""
        return self.prefix is None or name.startswith(self.prefix)

    def visible(self, name: str) -> bool:
        """True when the caller sees an image of this store name."""
        return not self._foreign(name)

    def show(self, name: str) -> str:
        """The name the caller sees for a store name."""
        if self.prefix is not None and isinstance(name, str) and name.startswith(self.prefix):
            return name[len(self.prefix):]
        return name

    def show_image(self, d: dict[str, Any]) -> dict[str, Any]:
        """An image dict with names as the caller sees them."""
        d = dict(d)
        for k in ("name", "ref", "image"):
            if isinstance(d.get(k), str):
                d[k] = self.show(d[k])
        return d

    def show_info(self, info: SandboxInfo) -> dict[str, Any]:
        """A sandbox as the caller sees it."""
        d = info.to_dict()
        d["image"] = self.show(d["image"])
        if isinstance(d.get("spec"), dict) and isinstance(d["spec"].get("image"), str):
            d["spec"] = {**d["spec"], "image": self.show(d["spec"]["image"])}
        return d
