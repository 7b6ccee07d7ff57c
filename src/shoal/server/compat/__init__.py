"""Drop-in compatible APIs in `shoal serve`: E2B's control plane, envd, code interpreter and sandbox ports (for
the unmodified `e2b` / `e2b-code-interpreter` SDKs) and SWE-ReX's runtime API (for `swerex`'s RemoteRuntime).
See docs/compat.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.server.deps import ServerState

from fastapi import FastAPI

from shoal.server.compat import e2b_api, e2b_envd, e2b_interpreter, routing, swerex

__all__ = ["mount", "stop"]


def mount(app: FastAPI) -> None:
    """Add the compatible APIs to a shoal API app (call before the app starts)."""
    app.include_router(e2b_envd.router)
    app.include_router(e2b_interpreter.router)
    app.include_router(e2b_api.router)
    app.include_router(swerex.router)

    app.add_middleware(routing.CompatRouter)


async def stop(state: ServerState) -> None:
    """Let go of what the compat layer holds at server shutdown (the metrics sampler, pooled port relays)."""
    from shoal.server.compat import e2b_metrics, ports

    await e2b_metrics.recorder(state).stop()
    await ports.close_pool(state)
