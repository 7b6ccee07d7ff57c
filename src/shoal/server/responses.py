"""The error responses every route may answer, for `/openapi.json` (one schema: `ErrorOut`), and which errors
are the request's fault."""

from __future__ import annotations

import errno
from typing import Any

from shoal.errors import InvalidRequest, SandboxError, ShoalError
from shoal.server.schemas import ErrorOut

_WHY = {
    401: "missing, malformed or unknown API token",
    403: "a project quota would be exceeded (quota_exceeded), the token may not do this (forbidden), or an image "
         "registry refused the credentials (registry_auth_failed)",
    404: "no such sandbox, image, shell or file — or it belongs to another project",
    408: "the request body did not arrive in time",
    409: "a file operation failed inside the sandbox",
    413: "the request body is over the size limit",
    422: "invalid input; `details.errors` names the fields",
    429: "the node is at capacity or the token has too many requests in progress; retry after Retry-After",
    500: "the sandbox failed (its agent died, it did not start), or a layer of its image is corrupt (image_corrupt)",
    501: "this build does not provide the capability (the message says which)",
    502: "an image registry (and its mirrors) could not be reached or kept failing (registry_unavailable)",
    503: "the backend cannot run on this host, or the layer store does not answer (store_unavailable)",
    504: "an operation did not finish within its deadline",
}


# Answered by the HTTP server (uvicorn's parser), not by shoal, before any route runs: a request line,
# URL or header that is not valid HTTP (e.g. a query string whose percent-escapes decode to invalid
# UTF-8). Its body is uvicorn's plain text, so it is documented as such.
MALFORMED_HTTP = {"description": "the request is not valid HTTP (rejected by the HTTP server before routing)",
                   "content": {"text/plain": {"schema": {"type": "string"}}}}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for these error statuses (400, 401, 413, 422 and 429 are always possible)."""
    out: dict[int | str, dict[str, Any]] = {400: MALFORMED_HTTP}
    for c in sorted({401, 408, 413, 422, 429, *codes}):
        out[c] = {"model": ErrorOut, "description": _WHY[c]}
    return out


SANDBOX_ERRORS = errors(404, 409, 500, 503, 504)


#: errno values of a failed exec that mean "the command you named cannot run", not "the sandbox failed"
_USER_SPAWN_ERRNOS = {errno.ENOENT, errno.EACCES, errno.ENOTDIR, errno.ENOEXEC, errno.ELOOP, errno.ENAMETOOLONG,
                      errno.E2BIG, errno.EISDIR}


def blame_request(exc: ShoalError) -> ShoalError:
    """A command that does not exist or is not executable is bad input (422), not a server failure (500)."""
    if isinstance(exc, SandboxError) and exc.details.get("agent_code") == "spawn_failed" \
            and exc.details.get("errno") in _USER_SPAWN_ERRNOS:
        return InvalidRequest(f"{exc.message}: check the command (argv[0] must be an executable in the sandbox)",
                              **exc.details)
    return exc
