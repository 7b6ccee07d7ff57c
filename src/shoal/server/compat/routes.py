"""The one route helper of the compatible APIs: a router whose endpoints answer any error their body raises
in that API's own error shape (E2B's `{"code", "message"}`, the code interpreter's plain text, SWE-ReX's
`swerexception`), so no endpoint writes the same try/except around itself."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

#: turns an exception into the response a compatible API's clients expect
ErrorShape = Callable[[BaseException], Response]


def compat_router(errors: ErrorShape, **kw: Any) -> APIRouter:
    """An APIRouter (`kw` as for APIRouter) whose HTTP endpoints answer an exception with `errors(exc)`.
    FastAPI's own HTTPException and request validation keep their handlers."""

    class ErrorShapedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def shaped(request: Request) -> Response:
                try:
                    return await handler(request)
                except (HTTPException, RequestValidationError):
                    raise
                except Exception as e:
                    return errors(e)

            return shaped

    return APIRouter(route_class=ErrorShapedRoute, **kw)
