"""Build claims: "node K is building this recipe step", so that node agents sharing a store build each
step once instead of racing to make different layers of the same step.

    <store>/cache/steps/<key>.claim     {"host", "pid", "since"}; mtime = last heartbeat

A recipe step's output is not reproducible (a `run` step writes timestamps, logs, .pyc files), so two
nodes building the same step at once would publish two different layers — both valid, but only one
ends in the step cache and the other is wasted work and an orphan. The first builder creates the claim
with O_CREAT|O_EXCL (atomic on POSIX shared filesystems) and renews its mtime while it builds; the others
wait for the step's cache entry, then use it as a cache hit. A claim not renewed for CLAIM_TTL_S belongs
to a builder that died: it is broken and another builder takes over. A failed build removes its claim
(no cache entry is written), so a waiter then builds the step itself and meets the same error.

Pulls from registries use the same claims (`<store>/cache/pulls/<key>.claim`, shoal.images.pull): one
node pulls an image, the others wait for its tag.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

from shoal.fsutil import tmp_name

#: a claim whose heartbeat is older than this belongs to a builder that died
CLAIM_TTL_S = 60.0
HEARTBEAT_S = 10.0


class Claim:
    """A claim this process holds; renew it with `heartbeat()` (a task) and end it with `release()`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._task: asyncio.Task[None] | None = None
        self._stop: threading.Event | None = None

    @classmethod
    def try_take(cls, path: Path) -> Claim | None:
        """Create the claim file exclusively; None when someone else holds it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return None
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}))
        return cls(path)

    def start_heartbeat(self) -> None:
        """Renew the claim's mtime every HEARTBEAT_S until released."""
        async def beat() -> None:
            while True:
                await asyncio.sleep(HEARTBEAT_S)
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(os.utime, self.path)

        self._task = asyncio.create_task(beat(), name="shoal-build-claim")

    def start_heartbeat_thread(self) -> None:
        """The same heartbeat from a thread, for claims taken by blocking code (a pull runs in a thread)."""
        stop = self._stop = threading.Event()

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                with contextlib.suppress(OSError):
                    os.utime(self.path)

        threading.Thread(target=beat, name="shoal-claim-heartbeat", daemon=True).start()

    def release_sync(self) -> None:
        """Stop a thread heartbeat and remove the claim."""
        if self._stop is not None:
            self._stop.set()
            self._stop = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def release(self) -> None:
        """Stop the heartbeat and remove the claim."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def age_s(path: Path) -> float | None:
    """Seconds since a claim's last heartbeat, in the store's clock (None: no claim)."""
    from shoal.images.leases import store_now

    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return None
    # the store's clock: <store>/cache/steps/<key>.claim -> <store>
    return max(0.0, store_now(path.parent.parent.parent) - mtime)


def break_stale(path: Path, ttl_s: float = CLAIM_TTL_S) -> bool:
    """Remove a claim whose builder died (older than `ttl_s`); True when this call removed it."""
    aside = path.parent / tmp_name("claim-")
    try:
        os.rename(path, aside)  # only one breaker wins
    except FileNotFoundError:
        return False
    try:
        from shoal.images.leases import store_now

        if store_now(path.parent.parent.parent) - aside.stat().st_mtime < ttl_s:
            # it was renewed (or replaced by a fresh claim) since we looked: put it back if nobody took over
            with contextlib.suppress(OSError):
                os.link(aside, path)
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            aside.unlink()
