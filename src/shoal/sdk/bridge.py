"""The one bridge from blocking code to shoal's async code: an event loop in a private daemon thread.

`SyncClient` runs its async `Client` on one, and so does every blocking caller that shares the
process-wide client (`shoal.sdk.sync.shared_client`: the RL adapters for trainers that call
environments synchronously, `SyncSandboxEnv`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Bridge:
    """An event loop running in a daemon thread; `run(coro)` blocks the caller until the coroutine ends.

    Everything async that a blocking caller uses (a Client, its transport, sandboxes) must be created and
    awaited on this one loop: objects such as locks and connections belong to the loop that first used them.
    """

    def __init__(self, name: str = "shoal-bridge") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        """Whether close() stopped the loop."""
        return not self._thread.is_alive()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the bridge's loop and return its result (its exception is raised here).

        `timeout` (seconds) cancels the coroutine and raises TimeoutError when it runs longer."""
        if threading.current_thread() is self._thread:
            coro.close()
            # waiting here for the loop we are running on would never return
            raise RuntimeError("Bridge.run called from the bridge's own thread: await the coroutine instead")
        if self.closed:
            coro.close()
            raise RuntimeError("the bridge is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise

    def close(self, timeout: float = 5.0) -> None:
        """Stop the loop and join its thread (the loop is closed once the thread has ended). Idempotent."""
        if self.closed:
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=timeout)
        if not self._thread.is_alive():
            self.loop.close()
