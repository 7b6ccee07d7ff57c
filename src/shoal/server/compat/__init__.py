"""Drop-in compatible APIs in `shoal serve`: E2B's control plane, envd and code interpreter (for the unmodified
`e2b` / `e2b-code-interpreter` SDKs) and SWE-ReX's runtime API (for `swerex`'s RemoteRuntime).
See docs/compat.md."""

from __future__ import annotations

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from shoal.server.compat import e2b_api, e2b_envd, e2b_interpreter, routing, swerex

__all__ = ["mount"]


def mount(app: FastAPI) -> None:
    """Add the compatible APIs to a shoal API app (call before the app starts)."""
    app.include_router(e2b_envd.router)
    app.include_router(e2b_interpreter.router)
    app.include_router(e2b_api.router)
    app.include_router(swerex.router)

    @app.api_route(routing._UNKNOWN_PORT + "/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"],
                   include_in_schema=False)
    async def other_port(rest: str, request: Request) -> Response:
        """A sandbox port other than envd's and the interpreter's: E2B's proxy answer for a closed port."""
        port = request.scope.get("shoal.e2b.port")
        sid = request.scope.get(e2b_envd.SCOPE_SANDBOX)
        return JSONResponse({"code": 502, "message": f"The sandbox {sid} is running but port {port} is not open: "
                                                     "shoal serves envd (49983) and the code interpreter (49999) "
                                                     "only"}, status_code=502)

    app.add_middleware(routing.CompatRouter)
