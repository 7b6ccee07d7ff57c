"""Run the API server with uvicorn (uvloop + httptools, one process: the node agent lives in it)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import uvicorn

from shoal.front import Front
from shoal.node.node import Node
from shoal.server.settings import ServerSettings
from shoal.server.tokens import TokenStore

log = logging.getLogger("shoal.server")


class AuthModeError(RuntimeError):
    """`shoal serve` was asked for something unsafe (open address without tokens)."""


def plan_auth(settings: ServerSettings, tokens: TokenStore, say: Callable[[str], None] = print) -> ServerSettings:
    """Decide how the server authenticates; without tokens (and without --no-auth) bind loopback only."""
    if settings.no_auth:
        say(f"WARNING: --no-auth: anyone who reaches {settings.host}:{settings.port} controls every sandbox")
        return settings
    if tokens.has_tokens():
        say(f"auth: API tokens required ({len(tokens.tokens())} configured in {tokens.path})")
        return settings
    if not settings.is_loopback():
        say(f"no API tokens are configured ({tokens.path}): binding 127.0.0.1 instead of {settings.host}. "
            "Make one with `shoal token create --project NAME`, or pass --no-auth to serve openly.")
        settings.host = "127.0.0.1"
    else:
        say("no API tokens are configured: serving on loopback only, without authentication "
            "(`shoal token create --project NAME` turns auth on, even while the server runs)")
    return settings


def uvicorn_config(app: object, settings: ServerSettings) -> uvicorn.Config:
    """uvicorn settings for shoal: uvloop, guarded httptools, bounded WebSocket messages, big backlog."""
    from shoal.server.limits import make_guarded_protocol

    return uvicorn.Config(
        app, host=settings.host, port=settings.port, loop="uvloop",
        http=make_guarded_protocol(settings.header_timeout_s), ws="websockets-sansio",
        ws_max_size=settings.ws_max_message_bytes, lifespan="on", backlog=settings.backlog,
        log_level=settings.log_level, access_log=settings.access_log, timeout_keep_alive=30,
        timeout_graceful_shutdown=10, server_header=False, proxy_headers=False)


def serve(settings: ServerSettings | None = None, node: Front | None = None,
          say: Callable[[str], None] = print, cluster: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM; sandboxes keep running after the server stops (crash-only). With
    `cluster` (ray://ADDR) the server is a gateway to every node agent of that Ray cluster."""
    from shoal.server.app import create_app

    settings = settings or ServerSettings()
    if cluster:
        from shoal.cluster.gateway import make_gateway_app
        from shoal.config import Paths

        paths = Paths.from_env()
        tokens = TokenStore(paths.home)
        plan_auth(settings, tokens, say)
        app = make_gateway_app(cluster, settings)
        say(f"shoal API on http://{settings.host}:{settings.port}: gateway to the cluster {cluster} "
            f"(tokens in {tokens.path}, images from {paths.store}); OpenAPI at /openapi.json")
    else:
        if node is None:
            node = Node()
        tokens = TokenStore(node.paths.home)
        plan_auth(settings, tokens, say)
        app = create_app(node, settings, tokens=tokens)
        say(f"shoal API on http://{settings.host}:{settings.port} (node {node.config.node_id}, "
            f"SHOAL_HOME={node.paths.home}); OpenAPI at /openapi.json")
    server = uvicorn.Server(uvicorn_config(app, settings))
    server.run()
