"""Refuse what only a web page would send to a server without tokens (issue 23, item 2).

A `shoal serve` without tokens (loopback, or `--no-auth`) runs whatever its callers ask, as root in
sandboxes. Any web page the machine's user opens can send requests to it: a *cross-origin* request (a
`no-cors` `text/plain` POST creating a sandbox: the browser sends it, it just hides the answer), or,
after *DNS rebinding* (a name of the attacker's that first resolves to the page's server, then to
127.0.0.1), a same-origin one whose answers the page reads. A server with tokens needs neither check:
a page cannot attach a token it does not have (the dashboard keeps its token in the tab's storage and
sends it in a header; no cookie is ever set).

So a tokenless server answers only requests

- whose `Host` names it by an IP address, `localhost`, or a name in the `api_allowed_hosts` setting
  (`*.example.lan` matches every name under it): a rebinding page's Host is its own domain name;
- that come from no web page of another origin: an `Origin` header (sent by browsers on cross-origin
  requests, on POSTs and on every WebSocket handshake) must name the same host and port as `Host`
  (another port of localhost is another origin: any local web app) or a name in `api_allowed_hosts`,
  and a `Sec-Fetch-Site` of `cross-site` or `same-site` is refused.

Clients that are not browsers (the SDK, curl, the E2B and SWE-ReX clients) send neither header and
name the server as they reach it, so nothing changes for them. Refusals are 403 `forbidden`, saying why.
"""

from __future__ import annotations

import ipaddress
import json
import logging
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("shoal.server")


def _hostname(host: str) -> str:
    """The name part of a Host header value (`[::1]:8700` → `::1`), lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host: str, allowed: Sequence[str]) -> bool:
    """True when a Host value names this server: an IP address, localhost, or an allowed name."""
    name = _hostname(host)
    if name in ("localhost", "localhost.") or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    return _named(name, allowed)


def _named(name: str, allowed: Sequence[str]) -> bool:
    name = name.lower()
    for pat in allowed:
        pat = pat.strip().lower()
        if pat == name or (pat.startswith("*.") and name.endswith(pat[1:])):
            return True
    return False


def refusal(headers: dict[bytes, bytes], allowed: Sequence[str]) -> str | None:
    """Why a request with these headers must be refused (None: it may pass)."""
    host = headers.get(b"host", b"").decode("latin-1")
    if host and not host_allowed(host, allowed):
        return (f"Host {host!r} does not name this server (a server without tokens answers to IP addresses, "
                "localhost and the names in SHOAL_API_ALLOWED_HOSTS): refused as DNS rebinding")
    site = headers.get(b"sec-fetch-site", b"").decode("latin-1").strip().lower()
    if site in ("cross-site", "same-site"):
        return f"a request from a web page of another site (Sec-Fetch-Site: {site}) to a server without tokens"
    origin = headers.get(b"origin")
    if origin is not None:
        o = origin.decode("latin-1").strip()
        parts = urlsplit(o) if o and o != "null" else None
        same = parts is not None and parts.netloc.lower() == host.strip().lower()
        # an origin the operator named (a proxy in front may rewrite Host); never "any local port"
        named = parts is not None and bool(parts.hostname) and _named(str(parts.hostname), allowed)
        if not same and not named:
            return f"a request from a web page of another origin ({o}) to a server without tokens"
    return None


class BrowserGuard:
    """ASGI middleware (outermost): for a server without tokens, refuse rebinding and cross-origin requests."""

    def __init__(self, app: Any, auth_required: Callable[[], bool], allowed_hosts: Sequence[str] = ()) -> None:
        self.app = app
        self.auth_required = auth_required
        self.allowed = tuple(allowed_hosts)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self.auth_required():
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        why = refusal(headers, self.allowed)
        if why is None:
            await self.app(scope, receive, send)
            return
        log.warning("refused %s %s: %s", scope.get("method", "WS"), scope.get("path"), why)
        body = json.dumps({"error": {"code": "forbidden", "message": why + "; use a token (`shoal token create`) "
                                     "to serve browsers of other origins", "details": {"reason": "browser_guard"}}})
        if scope["type"] == "websocket":
            # refuse the handshake itself (uvicorn answers it with 403)
            await send({"type": "websocket.close", "code": 1008})
            return
        await send({"type": "http.response.start", "status": 403,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body.encode()})
