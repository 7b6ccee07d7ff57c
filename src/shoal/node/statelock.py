"""A per-sandbox lock for state changes (pause, resume, snapshot) that never blocks the event loop.

Two processes (a server and a CLI) may change the same sandbox, so the lock is an flock on a file under
$SHOAL_HOME/locks, the same file `Node._sandbox_lock` uses. Inside one process an asyncio.Lock goes
first: flock locks belong to open files, so two coroutines of one process would otherwise both wait
for the flock in the event loop's thread, and the holder could never run to release it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator
from typing import Any


@contextlib.asynccontextmanager
async def sandbox_state_lock(node: Any, sandbox_id: str) -> AsyncIterator[None]:
    """Hold the sandbox's lock (in-process asyncio lock, then a non-blocking polled flock)."""
    from shoal.node.records import check_sandbox_id

    check_sandbox_id(sandbox_id)  # it becomes part of a path
    locks: dict[str, asyncio.Lock] = node.__dict__.setdefault("_state_locks", {})
    lock = locks.setdefault(sandbox_id, asyncio.Lock())
    async with lock:
        node.paths.locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(node.paths.locks / f"sb-{sandbox_id}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            delay = 0.001
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    # held by another process: poll (a blocking flock here would stall every sandbox)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 0.05)
            yield
        finally:
            os.close(fd)
