"""Typed errors raised by shoal. Every message says what happened and what to do about it."""

from __future__ import annotations


class ShoalError(Exception):
    """Base class of every error shoal raises on purpose."""

    #: HTTP status the API server answers with for this error.
    http_status: int = 500
    #: Stable machine-readable code, used on the wire.
    code: str = "shoal_error"

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, object]:
        """Serialize for the wire (HTTP API)."""
        return {"code": self.code, "message": self.message, "details": self.details}


class InvalidRequest(ShoalError, ValueError):
    """A malformed spec or argument (bad name, negative limit, relative path ...)."""

    http_status = 422
    code = "invalid_request"


class ImageNotFound(ShoalError, LookupError):
    """The named image (or layer) does not exist in the store."""

    http_status = 404
    code = "image_not_found"


class RegistryUnavailable(ShoalError, ConnectionError):
    """An image registry (or every mirror of it) could not be reached or kept failing (connection refused,
    DNS, TLS, 5xx, a download that broke more often than the retries allow). Retryable later."""

    http_status = 502
    code = "registry_unavailable"
    retryable = True


class RegistryAuthFailed(ShoalError, PermissionError):
    """An image registry refused the credentials (or asked for some and none were configured): log in
    with `docker login` (shoal reads ~/.docker/config.json or $DOCKER_CONFIG/config.json)."""

    http_status = 403
    code = "registry_auth_failed"


class SandboxNotFound(ShoalError, LookupError):
    """No sandbox with this ID (or it belongs to another project)."""

    http_status = 404
    code = "sandbox_not_found"


class ShellNotFound(ShoalError, LookupError):
    """The shell session ended or never existed."""

    http_status = 404
    code = "shell_not_found"


class FileNotFound(ShoalError, FileNotFoundError):
    """A path inside the sandbox does not exist."""

    http_status = 404
    code = "file_not_found"


class SandboxFileError(ShoalError, OSError):
    """A file operation inside the sandbox failed (permission, is a directory, ...)."""

    http_status = 409
    code = "file_error"


class QuotaExceeded(ShoalError):
    """A project's quota (sandboxes, CPUs, memory) would be exceeded."""

    http_status = 403
    code = "quota_exceeded"


class CapacityExceeded(ShoalError):
    """The node refuses new sandboxes right now (memory overcommit, low free memory)."""

    http_status = 429
    code = "capacity_exceeded"

    def __init__(self, message: str, retry_after_s: float = 1.0, **details: object) -> None:
        super().__init__(message, retry_after_s=retry_after_s, **details)
        self.retry_after_s = retry_after_s


class GangUnsatisfiable(CapacityExceeded):
    """`create_many(n, all_or_nothing=True)` could not reserve all `n` sandboxes; none were created.

    `details["available"]` says how many fit at the time of the request."""

    code = "gang_unsatisfiable"

    def __init__(self, message: str, retry_after_s: float = 2.0, **details: object) -> None:
        super().__init__(message, retry_after_s=retry_after_s, **details)
        self.available = int(details.get("available", 0))  # type: ignore[call-overload]
        self.requested = int(details.get("requested", 0))  # type: ignore[call-overload]


class Timeout(ShoalError, TimeoutError):
    """An operation did not finish within its deadline."""

    http_status = 504
    code = "timeout"


class BackendUnavailable(ShoalError):
    """The requested backend or runtime cannot run on this host (see `shoal doctor`)."""

    http_status = 503
    code = "backend_unavailable"


class ImageCorrupt(ShoalError):
    """A layer's bytes no longer hash to its digest — a chunk failed its check when a node read it, or its
    filesystem does not mount: nothing of it is served. An operator problem, not bad input: rebuild or
    re-import the image (`shoal image verify`)."""

    http_status = 500
    code = "image_corrupt"


class StoreUnavailable(ShoalError):
    """The layer store (SHOAL_STORE, maybe a shared filesystem) did not answer a bounded probe."""

    http_status = 503
    code = "store_unavailable"


class SandboxError(ShoalError):
    """The sandbox failed: it did not start, its agent died, or it was killed."""

    http_status = 500
    code = "sandbox_error"


class SandboxLost(ShoalError, LookupError):
    """The node that held the sandbox is gone (its machine or Ray node left the cluster): the sandbox and
    its files cannot be reached any more. Close it to forget it, and create a new one."""

    http_status = 410
    code = "sandbox_lost"


class NodeUnavailable(ShoalError):
    """The node agent that owns the sandbox did not answer (it is restarting, or its node is overloaded).
    Retryable: the SDK retries idempotent calls by itself; retry others once the node is back."""

    http_status = 503
    code = "node_unavailable"
    retryable = True


class AgentProtocolError(SandboxError):
    """The in-sandbox agent answered something the protocol does not allow."""

    code = "agent_protocol_error"


class NoShell(InvalidRequest):
    """A command given as a string needs a shell, and the sandbox's image has neither /bin/bash nor /bin/sh
    (a distroless or scratch image): pass the command as an argv list instead."""

    code = "no_shell"


class PortNotOpen(SandboxError):
    """Nothing accepts TCP connections on that port inside the sandbox (on its loopback)."""

    http_status = 502
    code = "port_not_open"


class ImageBuildError(ShoalError):
    """An image build step failed; the message carries the failing step and its output tail."""

    http_status = 422
    code = "image_build_error"


class Unauthorized(ShoalError):
    """Missing or wrong API token."""

    http_status = 401
    code = "unauthorized"


class Forbidden(ShoalError, PermissionError):
    """The token is valid but may not do this (an operator-only action)."""

    http_status = 403
    code = "forbidden"


class EgressForbidden(Forbidden):
    """An egress rule reaches a protected destination (a private range, link-local/metadata, the cluster's
    own nodes) that the operator's egress policy does not grant; `details.rule` names the rule."""

    code = "egress_forbidden"


class NotImplementedYet(ShoalError, NotImplementedError):
    """A documented capability this build of shoal does not provide (the message says which)."""

    http_status = 501
    code = "not_implemented"


class Unsupported(NotImplementedYet):
    """The sandbox's backend cannot do this (e.g. pause a fncall pool, fork a container's memory); the
    message names the backend and what to use instead."""

    code = "unsupported"


ERRORS_BY_CODE: dict[str, type[ShoalError]] = {
    cls.code: cls
    for cls in (
        ShoalError,
        InvalidRequest,
        ImageNotFound,
        RegistryUnavailable,
        RegistryAuthFailed,
        SandboxNotFound,
        ShellNotFound,
        FileNotFound,
        PortNotOpen,
        SandboxFileError,
        QuotaExceeded,
        CapacityExceeded,
        GangUnsatisfiable,
        Timeout,
        BackendUnavailable,
        SandboxError,
        SandboxLost,
        NodeUnavailable,
        AgentProtocolError,
        ImageBuildError,
        NoShell,
        ImageCorrupt,
        StoreUnavailable,
        Unauthorized,
        Forbidden,
        EgressForbidden,
        NotImplementedYet,
        Unsupported,
    )
}


def error_from_dict(data: dict[str, object]) -> ShoalError:
    """Rebuild a typed error from its wire form (see ShoalError.to_dict)."""
    cls = ERRORS_BY_CODE.get(str(data.get("code")), ShoalError)
    details = data.get("details") or {}
    msg = str(data.get("message", "unknown error"))
    if not isinstance(details, dict):
        details = {}
    if issubclass(cls, CapacityExceeded):
        retry = float(details.pop("retry_after_s", 1.0))  # type: ignore[arg-type]
        return cls(msg, retry_after_s=retry, **details)
    return cls(msg, **details)
