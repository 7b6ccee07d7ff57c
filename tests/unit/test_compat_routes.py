"""The compatible APIs' one route helper: an endpoint's error comes back in that API's own shape, while
FastAPI's HTTPException and request validation keep their usual answers."""

from __future__ import annotations

from fastapi import FastAPI, HTTPException, Response
from fastapi.responses import PlainTextResponse
from fastapi.testclient import TestClient

from shoal.errors import InvalidRequest
from shoal.server.compat.routes import compat_router


def _shape(e: BaseException) -> Response:
    return PlainTextResponse(f"shaped {type(e).__name__}: {e}", status_code=418)


def test_errors_are_shaped_by_the_apis_own_function() -> None:
    router = compat_router(_shape, prefix="/x")

    @router.get("/boom")
    async def boom() -> Response:
        raise InvalidRequest("bad input")

    @router.get("/http")
    async def http() -> Response:
        raise HTTPException(409, "conflict")

    @router.get("/typed/{n}")
    async def typed(n: int) -> Response:
        return Response(str(n))

    app = FastAPI()
    app.include_router(router)
    c = TestClient(app)
    r = c.get("/x/boom")
    assert r.status_code == 418 and r.text == "shaped InvalidRequest: bad input"
    assert c.get("/x/http").status_code == 409
    assert c.get("/x/typed/7").text == "7"
    assert c.get("/x/typed/seven").status_code == 422  # FastAPI's validation answer, not the shape


def test_every_compat_router_uses_the_helper() -> None:
    from fastapi.routing import APIRoute

    from shoal.server.compat import e2b_api, e2b_envd, e2b_interpreter, swerex

    for mod in (e2b_api, e2b_envd, e2b_interpreter, swerex):
        routes = [r for r in mod.router.routes if isinstance(r, APIRoute)]
        assert routes and all(type(r).__name__ == "ErrorShapedRoute" for r in routes), mod.__name__
