"""The web dashboard at `/ui`: static files served by the Python package (no CDN, no build at run time).

The page is a plain JavaScript client of the same HTTP API every SDK uses (`/v1/...`, with the user's
token in an Authorization header), so it can do exactly what its token may: a project token sees and
acts on its own sandboxes, an admin token on all and on node figures. The live terminal is the API's
PTY stream (`/v1/sandboxes/{id}/stream`), authenticated by a one-time ticket because browsers cannot set
headers on a WebSocket. xterm.js is vendored under static/vendor (scripts/vendor-ui.sh).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"


def mount(app: FastAPI) -> None:
    """Serve the dashboard: `/ui` (the page) and `/ui/static/...` (its scripts, styles, vendored xterm.js)."""

    @app.get("/ui", include_in_schema=False)
    async def ui_index() -> Any:
        # no caching of the page itself: a new shoal version's scripts are picked up at once
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/ui/", include_in_schema=False)
    async def ui_slash() -> Any:
        return RedirectResponse("/ui", status_code=308)

    app.mount("/ui/static", StaticFiles(directory=STATIC), name="ui-static")
