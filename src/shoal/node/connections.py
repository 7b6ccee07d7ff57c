"""The node's cache of agent connections: one open AgentClient per sandbox this process talks to.

A connection is opened by the backend (`backend.connect(rec)`) the first time a sandbox is reached and
reused afterwards; a closed or broken one is dropped and reopened on the next request. Concurrent first
requests to one sandbox share one connect (a per-sandbox lock).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.agentproto.client import AgentClient
    from shoal.backends.base import Backend
    from shoal.node.records import SandboxRecord


class AgentConnections:
    """Open agent connections by sandbox ID."""

    def __init__(self) -> None:
        self._clients: dict[str, AgentClient] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def get(self, sandbox_id: str) -> AgentClient | None:
        """The open connection to the sandbox, if there is one."""
        c = self._clients.get(sandbox_id)
        return c if c is not None and not c.closed else None

    def put(self, sandbox_id: str, client: AgentClient) -> None:
        """Keep `client` as the sandbox's connection (e.g. the one a create or restore just opened)."""
        self._clients[sandbox_id] = client

    async def connect(self, rec: SandboxRecord, backend: Backend, timeout: float = 10.0) -> AgentClient:
        """The cached connection, or a new one from the backend (one connect at a time per sandbox)."""
        c = self.get(rec.id)
        if c is not None:
            return c
        lock = self._locks.setdefault(rec.id, asyncio.Lock())
        async with lock:
            c = self.get(rec.id)
            if c is None:
                c = await backend.connect(rec, timeout=timeout)
                self._clients[rec.id] = c
            return c

    def forget(self, sandbox_id: str, client: AgentClient | None = None) -> None:
        """Drop the cached connection (only if it is still `client`, when given) without closing it."""
        if client is None or self._clients.get(sandbox_id) is client:
            self._clients.pop(sandbox_id, None)

    async def drop(self, sandbox_id: str) -> None:
        """Close and forget the sandbox's connection (the sandbox is being closed)."""
        c = self._clients.pop(sandbox_id, None)
        self._locks.pop(sandbox_id, None)
        if c is not None:
            with contextlib.suppress(Exception):
                await c.close()

    async def close_all(self) -> None:
        """Close every connection (the node process stops; the sandboxes keep running)."""
        clients = list(self._clients.values())
        self._clients.clear()
        self._locks.clear()
        for c in clients:
            with contextlib.suppress(Exception):
                await c.close()

    def __len__(self) -> int:
        return len(self._clients)
