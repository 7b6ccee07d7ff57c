"""Knobs of `shoal serve`: where to listen, whether to authenticate, and the limits that keep one client
from pinning the server. Unset fields come from the settings (SHOAL_API_*, see docs/configuration.md) when a
ServerSettings is made; command-line options and constructor arguments win."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, fields
from typing import Any

from shoal.config import Settings, settings

#: ServerSettings field → the setting it defaults to
FROM_SETTINGS = {
    "host": "api_host", "port": "api_port", "max_request_bytes": "api_max_request_bytes",
    "max_upload_bytes": "api_max_upload_bytes", "max_import_bytes": "api_max_import_bytes",
    "header_timeout_s": "api_header_timeout", "body_idle_timeout_s": "api_body_idle_timeout",
    "body_total_timeout_s": "api_body_timeout", "send_timeout_s": "api_send_timeout",
    "max_inflight_per_token": "api_max_inflight", "max_queued_per_token": "api_max_queued",
    "create_concurrency": "api_create_concurrency", "max_batch": "api_max_batch", "log_level": "api_log_level",
    "allowed_hosts": "api_allowed_hosts",
}


def _setting(name: str) -> Any:
    return field(default_factory=lambda: getattr(settings(), name))


@dataclass
class ServerSettings:
    """Configuration of one API server process (see `docs/api.md`, "Limits")."""

    host: str = _setting("api_host")
    port: int = _setting("api_port")
    #: serve without tokens on any address (explicit opt-in); without tokens and without this flag the
    #: server binds loopback only
    no_auth: bool = False
    #: largest JSON request body (bytes); exec stdin travels inside it
    max_request_bytes: int = _setting("api_max_request_bytes")
    #: largest file upload (bytes, PUT .../files)
    max_upload_bytes: int = _setting("api_max_upload_bytes")
    #: largest image tarball upload (bytes, POST /v1/images/import)
    max_import_bytes: int = _setting("api_max_import_bytes")
    #: seconds a client may take to send its request headers (slowloris guard)
    header_timeout_s: float = _setting("api_header_timeout")
    #: seconds a client may stay silent while sending a request body
    body_idle_timeout_s: float = _setting("api_body_idle_timeout")
    #: seconds a whole request body may take, however it trickles in
    body_total_timeout_s: float = _setting("api_body_timeout")
    #: seconds one response write may wait for a client that does not read
    send_timeout_s: float = _setting("api_send_timeout")
    #: requests (and streams) one token may have in progress; more wait in a queue
    max_inflight_per_token: int = _setting("api_max_inflight")
    #: requests one token may have waiting for a slot; more are refused with 429
    max_queued_per_token: int = _setting("api_max_queued")
    #: sandboxes this server creates at once (bounds crun/mount work on the host; others queue)
    create_concurrency: int = _setting("api_create_concurrency")
    #: largest `n` of one batch create or fork (at most schemas.MAX_BATCH = 4096)
    max_batch: int = _setting("api_max_batch")
    #: largest WebSocket message (bytes)
    ws_max_message_bytes: int = 16 << 20
    #: seconds a new WebSocket stream may take to send its start message
    ws_start_timeout_s: float = 10.0
    #: TCP accept backlog (bursts of thousands of clients connect at once)
    backlog: int = 4096
    #: uvicorn log level
    log_level: str = _setting("api_log_level")
    #: Host names a server without tokens answers to besides IP addresses and localhost (`*.domain` too)
    allowed_hosts: tuple[str, ...] = _setting("api_allowed_hosts")
    #: log one line per request
    access_log: bool = False

    @classmethod
    def from_settings(cls, s: Settings, **overrides: Any) -> ServerSettings:
        """ServerSettings whose SHOAL_API_* fields come from `s` (keyword arguments win)."""
        kw: dict[str, Any] = {f: getattr(s, name) for f, name in FROM_SETTINGS.items()}
        kw.update(overrides)
        return cls(**kw)

    def is_loopback(self) -> bool:
        """True when `host` only accepts connections from this machine."""
        if self.host in ("localhost", ""):
            return self.host == "localhost"
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def to_dict(self) -> dict[str, object]:
        """The settings as plain data (for /healthz and logs)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
