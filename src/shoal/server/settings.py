"""Knobs of `shoal serve`: where to listen, whether to authenticate, and the limits that keep one client
from pinning the server. Every field can come from the command line or a SHOAL_API_* variable."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field, fields


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


@dataclass
class ServerSettings:
    """Configuration of one API server process (see `docs/api.md`, "Limits")."""

    host: str = field(default_factory=lambda: _env("SHOAL_API_HOST", "127.0.0.1"))
    port: int = field(default_factory=lambda: int(_env("SHOAL_API_PORT", "8700")))
    #: serve without tokens on any address (explicit opt-in); without tokens and without this flag the
    #: server binds loopback only
    no_auth: bool = False
    #: largest JSON request body (bytes); exec stdin travels inside it
    max_request_bytes: int = field(default_factory=lambda: int(_env("SHOAL_API_MAX_REQUEST_BYTES", str(8 << 20))))
    #: largest file upload (bytes, PUT .../files)
    max_upload_bytes: int = field(default_factory=lambda: int(_env("SHOAL_API_MAX_UPLOAD_BYTES", str(64 << 20))))
    #: largest image tarball upload (bytes, POST /v1/images/import)
    max_import_bytes: int = field(default_factory=lambda: int(_env("SHOAL_API_MAX_IMPORT_BYTES", str(16 << 30))))
    #: seconds a client may take to send its request headers (slowloris guard)
    header_timeout_s: float = field(default_factory=lambda: float(_env("SHOAL_API_HEADER_TIMEOUT", "10")))
    #: seconds a client may stay silent while sending a request body
    body_idle_timeout_s: float = field(default_factory=lambda: float(_env("SHOAL_API_BODY_IDLE_TIMEOUT", "15")))
    #: seconds a whole request body may take, however it trickles in
    body_total_timeout_s: float = field(default_factory=lambda: float(_env("SHOAL_API_BODY_TIMEOUT", "120")))
    #: seconds one response write may wait for a client that does not read
    send_timeout_s: float = field(default_factory=lambda: float(_env("SHOAL_API_SEND_TIMEOUT", "60")))
    #: requests (and streams) one token may have in progress; more wait in a queue
    max_inflight_per_token: int = field(default_factory=lambda: int(_env("SHOAL_API_MAX_INFLIGHT", "1024")))
    #: requests one token may have waiting for a slot; more are refused with 429
    max_queued_per_token: int = field(default_factory=lambda: int(_env("SHOAL_API_MAX_QUEUED", "4096")))
    #: sandboxes this server creates at once (bounds crun/mount work on the host; others queue)
    create_concurrency: int = field(default_factory=lambda: int(_env("SHOAL_API_CREATE_CONCURRENCY", "32")))
    #: largest `n` of one batch create or fork (at most schemas.MAX_BATCH = 4096)
    max_batch: int = field(default_factory=lambda: int(_env("SHOAL_API_MAX_BATCH", "4096")))
    #: largest WebSocket message (bytes)
    ws_max_message_bytes: int = 16 << 20
    #: seconds a new WebSocket stream may take to send its start message
    ws_start_timeout_s: float = 10.0
    #: TCP accept backlog (bursts of thousands of clients connect at once)
    backlog: int = 4096
    #: uvicorn log level
    log_level: str = field(default_factory=lambda: _env("SHOAL_API_LOG_LEVEL", "warning"))
    #: log one line per request
    access_log: bool = False

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
