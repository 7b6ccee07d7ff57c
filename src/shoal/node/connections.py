"""The node's cache of agent connections: an open AgentClient per sandbox this process talks to *now*.

A connection is opened by the backend (`backend.connect(rec)`) the first time a sandbox is reached and
reused afterwards; a closed or broken one is dropped and reopened on the next request. Concurrent first
requests to one sandbox share one connect (a per-sandbox lock).

Idle connections are closed (issue 24): a connection with no request or stream open and no use for
`idle_s` seconds (`SHOAL_AGENT_IDLE_S`, default 20) is closed by a sweep every `idle_s / 2`, and the next
request opens a new one (a Unix-socket connect and a hello: ~0.3 ms). So an idle sandbox costs the node
no descriptor, and 10,000 of them fit under any descriptor limit; the processes a sandbox runs, its
shells and detached commands belong to its agent and never notice. Only backends whose agent takes new
connections cheaply (`Backend.idle_close`: containers) are swept; a VM's virtio-serial line stays open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from shoal.limits import AGENT_CONNECT_TIMEOUT_S

if TYPE_CHECKING:
    from shoal.agentproto.client import AgentClient
    from shoal.backends.base import Backend
    from shoal.records import SandboxRecord

log = logging.getLogger(__name__)

#: default seconds an agent connection may sit unused before the sweep closes it
IDLE_S = 20.0


class AgentConnections:
    """Open agent connections by sandbox ID."""

    def __init__(self, idle_s: float = IDLE_S) -> None:
        #: close a connection unused this long (0: never)
        self.idle_s = float(idle_s)
        self._clients: dict[str, AgentClient] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._used: dict[str, float] = {}  # time.monotonic() of the last get/put/connect
        self._sweepable: set[str] = set()  # connections the sweep may close (their backend reconnects cheaply)
        self._sweeper: asyncio.Task[None] | None = None
        #: connections closed for idleness over this object's life (for `shoal bench` and tests)
        self.idle_closed = 0

    def get(self, sandbox_id: str) -> AgentClient | None:
        """The open connection to the sandbox, if there is one (marked as used now)."""
        c = self._clients.get(sandbox_id)
        if c is None or c.closed:
            return None
        self._used[sandbox_id] = time.monotonic()
        return c

    def put(self, sandbox_id: str, client: AgentClient, *, idle_close: bool = False) -> None:
        """Keep `client` as the sandbox's connection (e.g. the one a create or restore just opened);
        `idle_close`: the sweep may close it once idle."""
        self._clients[sandbox_id] = client
        self._used[sandbox_id] = time.monotonic()
        if idle_close:
            self._sweepable.add(sandbox_id)
        else:
            self._sweepable.discard(sandbox_id)

    async def connect(self, rec: SandboxRecord, backend: Backend, timeout: float = AGENT_CONNECT_TIMEOUT_S
                      ) -> AgentClient:
        """The cached connection, or a new one from the backend (one connect at a time per sandbox)."""
        c = self.get(rec.id)
        if c is not None:
            return c
        lock = self._locks.setdefault(rec.id, asyncio.Lock())
        async with lock:
            c = self.get(rec.id)
            if c is None:
                c = await backend.connect(rec, timeout=timeout)
                self.put(rec.id, c, idle_close=backend.idle_close)
            return c

    def forget(self, sandbox_id: str, client: AgentClient | None = None) -> None:
        """Drop the cached connection (only if it is still `client`, when given) without closing it."""
        if client is None or self._clients.get(sandbox_id) is client:
            self._clients.pop(sandbox_id, None)
            self._used.pop(sandbox_id, None)
            self._sweepable.discard(sandbox_id)

    async def drop(self, sandbox_id: str) -> None:
        """Close and forget the sandbox's connection (the sandbox is being closed)."""
        c = self._clients.pop(sandbox_id, None)
        self._locks.pop(sandbox_id, None)
        self._used.pop(sandbox_id, None)
        self._sweepable.discard(sandbox_id)
        if c is not None:
            with contextlib.suppress(Exception):
                await c.close()

    # ---- closing idle connections ------------------------------------------------------------------
    def idle(self, now: float | None = None, idle_s: float | None = None) -> list[str]:
        """Sandboxes whose connection may be closed now: sweepable, nothing open on it, unused `idle_s`
        (default: the configured one)."""
        idle_s = self.idle_s if idle_s is None else idle_s
        if idle_s <= 0:
            return []
        now = time.monotonic() if now is None else now
        out = []
        # a snapshot: requests add and drop connections while this runs (issue 24, item 4)
        for sid in list(self._sweepable):
            c = self._clients.get(sid)
            if c is None:
                continue
            last = max(self._used.get(sid, 0.0), c.last_active)
            if not c.busy and now - last >= idle_s:
                out.append(sid)
        return out

    async def sweep(self, now: float | None = None, idle_s: float | None = None) -> int:
        """Close the idle connections (`idle`); returns how many. Closed ones reopen on the next request."""
        gone = []
        for sid in self.idle(now, idle_s):
            c = self._clients.pop(sid, None)
            self._used.pop(sid, None)
            self._sweepable.discard(sid)
            if c is not None:
                c.closed_idle = True
                gone.append(c)
        await asyncio.gather(*(c.close() for c in gone), return_exceptions=True)
        self.idle_closed += len(gone)
        return len(gone)

    def start(self) -> None:
        """Run `sweep` every `idle_s / 2` seconds (at least every 0.5 s) in the background."""
        if self._sweeper is None and self.idle_s > 0:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop(), name="shoal-agent-idle")

    async def stop(self) -> None:
        """Stop the background sweep."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._sweeper
            self._sweeper = None

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(max(0.5, self.idle_s / 2))
            try:
                await self.sweep()
            except Exception as e:  # the sweep must never take the node down
                log.warning("closing idle agent connections failed: %s", e)

    async def close_all(self) -> None:
        """Close every connection (the node process stops; the sandboxes keep running)."""
        await self.stop()
        clients = list(self._clients.values())
        self._clients.clear()
        self._locks.clear()
        self._used.clear()
        self._sweepable.clear()
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)  # not 10,000 in a row

    def __len__(self) -> int:
        return len(self._clients)
