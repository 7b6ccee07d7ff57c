"""What the compatible APIs share: who is calling (an E2B API key, a SWE-ReX auth token or a per-sandbox
envd access token → a shoal principal), which sandbox they may touch, and how E2B template IDs map onto
shoal images.

Settings (declared in shoal.config, read here):
- `SHOAL_E2B_TEMPLATES`: extra template aliases, `TEMPLATE=IMAGE[,TEMPLATE=IMAGE...]`
  (e.g. `code-interpreter-v1=py:3.12,my-team/app=app:7`).
- `SHOAL_E2B_DEFAULT_IMAGE`: the image E2B's stock templates (`base`, `code-interpreter-v1`, ...) map to
  (default `base`).
- `SHOAL_E2B_NETWORK`: whether an E2B sandbox that did not say `allow_internet_access` gets a network
  (default `0`: shoal's secure default, unlike E2B's cloud).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import logging
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from shoal.config import settings
from shoal.errors import ImageNotFound, SandboxNotFound, Unauthorized
from shoal.records import SandboxRecord, check_sandbox_id
from shoal.server.deps import ANONYMOUS, Namespace, owned_record
from shoal.server.tokens import TOKEN_RE, Principal

if TYPE_CHECKING:
    from shoal.server.deps import ServerState

log = logging.getLogger("shoal.server")
T = TypeVar("T")
#: E2B's own template names that mean "a general Linux box" (mapped to SHOAL_E2B_DEFAULT_IMAGE)
STOCK_TEMPLATES = ("base", "code-interpreter-v1", "code-interpreter", "desktop", "mcp-gateway")
#: ... of which these are E2B's code interpreter (the `code-interpreter` image when the store has it)
INTERPRETER_TEMPLATES = ("code-interpreter-v1", "code-interpreter")
#: the label that remembers which E2B template a sandbox was created from (hidden from E2B metadata)
TEMPLATE_LABEL = "shoal.e2b/template"
#: whether the sandbox's ports answer without its traffic access token (E2B's allow_public_traffic)
PUBLIC_PORTS_LABEL = "shoal.e2b/public-ports"
#: labels the compat layer keeps for itself (not part of E2B's metadata)
LABEL_PREFIX = "shoal.e2b/"
#: envd version shoal reports: new enough for stdin, close-stdin and octet-stream uploads; below 0.6.2,
#: so the SDK itself refuses file metadata (which shoal does not store)
ENVD_VERSION = "0.5.7"
ENVD_PORT = 49983
INTERPRETER_PORT = 49999
#: envd access tokens: e2bsb_<shoal token id or "-">_<hmac>
_ACCESS_RE = re.compile(r"^e2bsb_([a-z2-7]{10}|-)_([A-Za-z0-9_-]{43})$")


def interpreter_image(st: ServerState) -> str | None:
    """The image E2B's interpreter templates run in: `code-interpreter` (matplotlib, pandas, IPython) when the
    store has it; None otherwise (they then get SHOAL_E2B_DEFAULT_IMAGE, and the server says once how to build
    it)."""
    from shoal.server.compat.interpreter_image import INTERPRETER_IMAGE

    if st.node.store.exists(INTERPRETER_IMAGE):
        return INTERPRETER_IMAGE
    if not st.compat.get("interpreter_image_warned"):
        st.compat["interpreter_image_warned"] = True
        log.warning("E2B template code-interpreter-v1 runs in %s without matplotlib/pandas/IPython: build "
                    "them once with `shoal image build code-interpreter`", settings().e2b_default_image or "base")
    return None


def server_local(st: ServerState, name: str, make: Callable[[], T]) -> T:
    """What the compat layer keeps per server process (process tables, contexts, watchers, ...): made on first
    use and kept in the server state's `compat` table under `name`."""
    got: T | None = st.compat.get(name)
    if got is None:
        got = st.compat[name] = make()
    return got


def template_aliases() -> dict[str, str]:
    """Template ID → shoal image, from SHOAL_E2B_TEMPLATES."""
    return dict(settings().e2b_templates)


def default_network() -> bool:
    """Whether E2B sandboxes get a network when the request does not say (SHOAL_E2B_NETWORK)."""
    return bool(settings().e2b_network)


def resolve_template(st: ServerState, who: Principal, template: str) -> str:
    """The shoal image (store reference) an E2B template ID names.

    Order: an alias from SHOAL_E2B_TEMPLATES; an image of that name (the caller's project first); E2B's
    interpreter templates → the `code-interpreter` image when it is built; E2B's stock templates →
    SHOAL_E2B_DEFAULT_IMAGE; a registry reference (`python:3.12-slim`, `ghcr.io/org/env:1`), pulled by
    the create when pull_policy allows. Anything else is ImageNotFound naming the ways to fix it.
    """
    template = (template or "base").strip()
    ns = Namespace(who)
    alias = template_aliases().get(template)
    if alias is not None:
        return ns.for_read(st, alias)
    with contextlib.suppress(ImageNotFound, ValueError, OSError):
        ref = ns.for_read(st, template)
        if st.node.store.exists(ref):
            return ref
    # a digest names one image exactly: never the stock fallback (`base:latest@sha256:<someone else's>`
    # is not found, like any digest the caller may not see)
    if "@" not in template and (template in STOCK_TEMPLATES or template.split(":", 1)[0] in STOCK_TEMPLATES):
        if template.split(":", 1)[0] in INTERPRETER_TEMPLATES:
            interpreter = interpreter_image(st)
            if interpreter is not None:
                return interpreter
        return ns.for_read(st, settings().e2b_default_image or "base")
    from shoal.images.pull import check_available

    with contextlib.suppress(ImageNotFound, ValueError):
        # a registry reference (Docker's form) the create will pull — seen through the project's eyes like
        # any other name: a digest the project may not see stays not found (tests/security/test_image_visibility.py)
        ref = ns.for_read(st, template)
        check_available(st.node.store, ref)
        return ref
    raise ImageNotFound(f"template {template!r} is neither a shoal image nor an alias: build or import an image "
                        f"of that name (`shoal image ls`), or map it with SHOAL_E2B_TEMPLATES={template}=IMAGE")


# ---- callers ------------------------------------------------------------------------------------
def principal_from_key(st: ServerState, api_key: str | None, authorization: str | None = None) -> Principal:
    """The caller of a request carrying an API key (E2B `X-API-KEY`, SWE-ReX `X-API-Key`) or a Bearer token."""
    if api_key:
        return st.authenticate(f"Bearer {api_key.strip()}")
    return st.authenticate(authorization)


def _secret(st: ServerState) -> bytes:
    """The server's key for envd access tokens: random, made once per SHOAL_HOME, readable by root only."""
    cached: bytes | None = st.compat.get("secret")
    if cached is not None:
        return cached
    path = Path(st.node.paths.home) / "api" / "compat.key"
    path.parent.mkdir(parents=True, exist_ok=True)
    key = b""
    for _ in range(50):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            key = path.read_bytes()
            if len(key) >= 32:
                break
            time.sleep(0.01)  # another server is writing it right now
            continue
        key = secrets.token_bytes(32)
        try:
            os.write(fd, key)
        finally:
            os.close(fd)
        break
    if len(key) < 32:
        raise RuntimeError(f"{path} is damaged: remove it (envd access tokens handed out so far stop working)")
    st.compat["secret"] = key
    return key


def access_token(st: ServerState, who: Principal, sandbox_id: str) -> str:
    """The envd access token of one sandbox for one shoal token (what E2B calls `envdAccessToken`).

    It opens that sandbox only, and stops working when the shoal token it was made for is revoked."""
    tid = who.token_id if who.token_id != "-" else "-"
    mac = hmac.new(_secret(st), f"{sandbox_id}\0{tid}".encode(), hashlib.sha256).digest()
    return f"e2bsb_{tid}_{base64.urlsafe_b64encode(mac).decode().rstrip('=')}"


def principal_for_sandbox(st: ServerState, sandbox_id: str, headers: Any) -> Principal:
    """The caller of an envd / interpreter request to `sandbox_id`.

    Accepted: the sandbox's envd access token (`X-Access-Token` or `E2B-Traffic-Access-Token`), or a shoal
    token (`X-API-KEY`, `Authorization: Bearer`)."""
    if not st.auth_required():
        return ANONYMOUS
    for name in ("x-access-token", "e2b-traffic-access-token"):
        value = headers.get(name)
        if not value:
            continue
        m = _ACCESS_RE.match(value.strip())
        if m:
            return _from_access_token(st, sandbox_id, m.group(1), value.strip())
        if TOKEN_RE.match(value.strip()):
            return principal_from_key(st, value)
        raise Unauthorized(f"malformed {name} header: use the envdAccessToken the create answer gave")
    if headers.get("x-api-key") or (headers.get("authorization") or "").lower().startswith("bearer "):
        return principal_from_key(st, headers.get("x-api-key"), headers.get("authorization"))
    raise Unauthorized("missing sandbox access token: send X-Access-Token (the envdAccessToken of the sandbox) "
                       "or X-API-KEY with a shoal token")


def _from_access_token(st: ServerState, sandbox_id: str, tid: str, token: str) -> Principal:
    check_sandbox_id(sandbox_id)
    expect = access_token(st, Principal(project="-", token_id=tid), sandbox_id)
    if not hmac.compare_digest(expect, token):
        raise Unauthorized(f"this access token does not open sandbox {sandbox_id}")
    entry = st.tokens.entry(tid) if tid != "-" else None
    if entry is None:
        raise Unauthorized("the API token this access token was made for is revoked: create the sandbox again "
                           "or connect to it with a valid key")
    return Principal(project=entry.project, admin=entry.admin, token_id=tid, quota=st.tokens.quota(entry.project))


def sandbox_of(st: ServerState, who: Principal, sandbox_id: str) -> SandboxRecord:
    """The record of a sandbox the caller may touch (another project's is reported as not found)."""
    if not isinstance(sandbox_id, str) or not sandbox_id:
        raise SandboxNotFound("no sandbox id given")
    check_sandbox_id(sandbox_id)
    return owned_record(st, who, sandbox_id)


@contextlib.asynccontextmanager
async def slot(st: ServerState, who: Principal) -> AsyncIterator[None]:
    """Hold one of the caller's in-progress slots (the same per-token limit as shoal's own API)."""
    async with st.limiter.slot(who.token_id):
        yield


def user_of(name: str | None) -> str | None:
    """The sandbox user for an E2B username: E2B's default `user` account does not exist in shoal images, so
    it (and no name) means the sandbox's default user; any other name is passed through."""
    if not name or name == "user":
        return None
    return name
