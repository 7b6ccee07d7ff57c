"""Send requests meant for a sandbox to what serves them, with every sandbox behind the one origin of
`shoal serve`: its E2B daemons (envd on port 49983, the code interpreter on 49999) and any other port a
process in it listens on (shoal.server.compat.ports).

A request is for a sandbox when it carries `E2b-Sandbox-Id` (with `E2b-Sandbox-Port`; clients configured
with `E2B_SANDBOX_URL`), or when its Host reads `<port>-<sandbox id>.<domain>` (clients configured with
`E2B_DOMAIN`, behind a TLS proxy with a wildcard certificate). For the daemons, its path is moved under the
prefix of the daemon's router and the sandbox id is put in the ASGI scope; other ports are proxied. Anything
else passes through untouched.
"""

from __future__ import annotations

import re
from typing import Any

from shoal.server.compat import common, e2b_envd, e2b_interpreter, ports

#: `<port>-<node>-<26 base32 chars>.<anything>` (ids never contain dots)
_HOST_RE = re.compile(r"^(\d{1,5})-([A-Za-z0-9_-]{1,32}-[a-z2-7]{26})\.")
_PREFIX = {common.ENVD_PORT: e2b_envd.PREFIX, common.INTERPRETER_PORT: e2b_interpreter.PREFIX}


def target(scope: dict[str, Any]) -> tuple[str, int] | None:
    """(sandbox id, port) a request is for, None when it is for shoal's own API."""
    sid = port = host = None
    for k, v in scope.get("headers", ()):
        if k == b"e2b-sandbox-id":
            sid = v.decode("latin-1").strip()
        elif k == b"e2b-sandbox-port":
            port = v.decode("latin-1").strip()
        elif k == b"host":
            host = v.decode("latin-1").strip().lower()
    if sid:
        try:
            return sid, int(port) if port else common.ENVD_PORT
        except ValueError:
            return sid, -1
    if host:
        m = _HOST_RE.match(host)
        if m:
            return m.group(2), int(m.group(1))
    return None


class CompatRouter:
    """ASGI middleware: route sandbox-addressed requests to the envd / interpreter routers, or to the port."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket"):
            hit = target(scope)
            if hit is not None:
                sid, port = hit
                prefix = _PREFIX.get(port)
                if prefix is None:
                    await ports.serve(scope["app"].state.shoal, scope, receive, send, sid, port)
                    return
                path = scope.get("path") or "/"
                scope = dict(scope, path=prefix + path, raw_path=(prefix + path).encode())
                scope[e2b_envd.SCOPE_SANDBOX] = sid
                scope["shoal.e2b.port"] = port
        await self.app(scope, receive, send)
