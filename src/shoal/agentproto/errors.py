"""Agent ERR answers as shoal's typed errors (docs/protocol.md, Error codes)."""

from __future__ import annotations

import errno
from collections.abc import Mapping
from typing import Any

from shoal.errors import (
    AgentProtocolError,
    CapacityExceeded,
    FileNotFound,
    InvalidRequest,
    PortNotOpen,
    SandboxError,
    SandboxFileError,
    ShellNotFound,
    ShoalError,
    Unauthorized,
)

# Ops whose `not_found` & co. are about the cwd of a process, not about a file the caller named.
_PROCESS_OPS = frozenset({"exec", "shell_open", "shell_run", "shell_close"})
_FILE_CODES = frozenset(
    {"not_found", "exists", "not_a_directory", "is_a_directory", "permission_denied", "too_large", "io_error"}
)


def agent_error(op: str, payload: Mapping[str, Any]) -> ShoalError:
    """Map an agent ERR payload to the typed error the rest of shoal expects."""
    code = str(payload.get("code", ""))
    message = str(payload.get("message", "agent error"))
    details: dict[str, Any] = {"agent_code": code}
    if payload.get("errno") is not None:
        details["errno"] = payload["errno"]
    if code == "unauthorized":
        return Unauthorized(f"agent refused the request: {message}", **details)
    if code == "no_such_shell":
        return ShellNotFound(message, **details)
    if code == "connection_refused":
        return PortNotOpen(message, **details)
    if code == "too_many_watchers":
        return CapacityExceeded(message, retry_after_s=5.0, **details)
    if code in ("bad_request", "no_such_user", "shell_busy"):
        return InvalidRequest(message, **details)
    if code == "unknown_op":
        return AgentProtocolError(f"agent does not know op {op!r} (version mismatch?): {message}", **details)
    if code == "spawn_failed":
        # a program that does not exist or cannot be executed is the caller's mistake (HTTP 422);
        # anything else (EAGAIN at the pids limit, ENOMEM) is the sandbox's state
        if payload.get("errno") in (errno.ENOENT, errno.EACCES, errno.ENOEXEC, errno.ENOTDIR, errno.ELOOP):
            return InvalidRequest(f"cannot run the command: {message}", **details)
        return SandboxError(f"could not start the process: {message}", **details)
    if code in _FILE_CODES:
        if op in _PROCESS_OPS:
            if code == "io_error":
                return SandboxError(message, **details)
            return InvalidRequest(message, **details)
        if code == "not_found":
            return FileNotFound(message, **details)
        return SandboxFileError(message, **details)
    return SandboxError(f"agent error {code or '?'}: {message}", **details)
