"""Per-sandbox locks for state changes (pause, resume, snapshot, fork, close) that never block the event loop.

Two processes (a server and a CLI) may change the same sandbox, so the lock is an flock on a file under
$SHOAL_HOME/locks. Inside one process an asyncio.Lock goes first: flock locks belong to open files, so
two coroutines of one process would otherwise both wait for the flock in the event loop's thread, and
the holder could never run to release it. The node owns one `SandboxLocks` (`node.locks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
from collections.abc import AsyncIterator
from pathlib import Path

from shoal.records import check_sandbox_id


class SandboxLocks:
    """The state locks of one node's sandboxes."""

    def __init__(self, locks_dir: Path) -> None:
        self.dir = locks_dir
        self._held: dict[str, asyncio.Lock] = {}

    def path(self, sandbox_id: str) -> Path:
        """The lock file of a sandbox."""
        return self.dir / f"sb-{sandbox_id}.lock"

    @contextlib.asynccontextmanager
    async def state(self, sandbox_id: str) -> AsyncIterator[None]:
        """Hold the sandbox's lock (in-process asyncio lock, then a non-blocking polled flock)."""
        check_sandbox_id(sandbox_id)  # it becomes part of a path
        lock = self._held.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path(sandbox_id), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
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

    def held(self) -> int:
        """In-process locks kept now (one per sandbox that was locked and not yet closed)."""
        return len(self._held)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is gone: remove its lock file and in-process lock."""
        lock = self._held.get(sandbox_id)
        if lock is not None and not lock.locked():
            del self._held[sandbox_id]
        with contextlib.suppress(FileNotFoundError):
            self.path(sandbox_id).unlink()
