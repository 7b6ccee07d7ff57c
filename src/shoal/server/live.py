"""Live figures of one API server for the dashboard and `shoal top`: a short history of samples.

The routes that create and run commands already time them (shoal.server.metrics); they also hand each
duration to `LiveStats.observe_*`, which appends it to a bounded ring (no lock: one event loop). Every
`interval_s` a sampler turns what came in since the last sample into one point: creates per second,
create and exec latency percentiles over the last `window_s`, sandboxes by state and memory committed /
used / reclaimed (from the node's admission figures and the host's meminfo). `SAMPLES` points are kept
(ten minutes at 2 s), so a dashboard opened now shows the recent past. The sampler costs one admission
snapshot and a few sorts of at most a window's durations per interval, whatever the load; nothing is
added to a create but an append.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import time
from collections.abc import Callable
from typing import Any

#: points kept (at 2 s: ten minutes)
SAMPLES = 300
#: durations kept per kind between samples (a burst beyond this is sampled uniformly enough: newest kept)
_RING = 20_000


def percentiles(values: list[float], qs: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[float | None]:
    """Nearest-rank percentiles of `values` (None for an empty list)."""
    if not values:
        return [None] * len(qs)
    s = sorted(values)
    return [s[min(len(s) - 1, max(0, int(q * len(s) + 0.5) - 1))] for q in qs]


class LiveStats:
    """Recent creates and commands, and a history of sampled points (see the module doc)."""

    def __init__(self, figures: Callable[[], dict[str, Any]], *, interval_s: float = 2.0,
                 window_s: float = 30.0, samples: int = SAMPLES) -> None:
        #: returns {"states": {...}, "memory": {...}} of the node at this instant
        self.figures = figures
        self.interval_s = interval_s
        self.window_s = window_s
        self.creates: collections.deque[tuple[float, float, bool]] = collections.deque(maxlen=_RING)
        self.execs: collections.deque[tuple[float, float]] = collections.deque(maxlen=_RING)
        self.points: collections.deque[dict[str, Any]] = collections.deque(maxlen=samples)
        self.totals = {"creates": 0, "create_errors": 0, "execs": 0}
        self._task: asyncio.Task[None] | None = None
        self._last: float | None = None

    # ---- fed by the routes ------------------------------------------------------------------------
    def observe_create(self, seconds: float, ok: bool = True) -> None:
        """One create finished (ok or not)."""
        self.creates.append((time.time(), seconds, ok))
        self.totals["creates" if ok else "create_errors"] += 1

    def observe_exec(self, seconds: float) -> None:
        """One command finished."""
        self.execs.append((time.time(), seconds))
        self.totals["execs"] += 1

    # ---- sampling ---------------------------------------------------------------------------------
    def sample(self, now: float | None = None) -> dict[str, Any]:
        """Take one point now (the sampler calls this every interval) and return it."""
        now = time.time() if now is None else now
        last = self._last if self._last is not None else now - self.interval_s
        self._last = now  # unrounded: an event in the same millisecond as a sample is counted once
        span = max(1e-3, now - last)
        lo = now - self.window_s
        created = [d for t, d, ok in self.creates if t >= lo and ok]
        n_new = sum(1 for t, _, ok in self.creates if t > last and ok)
        n_err = sum(1 for t, _, ok in self.creates if t > last and not ok)
        execs = [d for t, d in self.execs if t >= lo]
        n_exec = sum(1 for t, _ in self.execs if t > last)
        # drop what no window will need again
        while self.creates and self.creates[0][0] < lo:
            self.creates.popleft()
        while self.execs and self.execs[0][0] < lo:
            self.execs.popleft()
        cp = percentiles(created)
        ep = percentiles(execs)
        point: dict[str, Any] = {
            "t": round(now, 3),
            "create_rate": round(n_new / span, 3), "create_errors": n_err,
            "exec_rate": round(n_exec / span, 3),
            "create_p50": _ms(cp[0]), "create_p90": _ms(cp[1]), "create_p99": _ms(cp[2]),
            "exec_p50": _ms(ep[0]), "exec_p90": _ms(ep[1]), "exec_p99": _ms(ep[2]),
        }
        with contextlib.suppress(Exception):
            point.update(self.figures())
        self.points.append(point)
        return point

    def series(self, since: float | None = None) -> list[dict[str, Any]]:
        """The kept points newer than `since` (all without it), oldest first."""
        pts = list(self.points)
        if since is None:
            return pts
        i = bisect.bisect_right([p["t"] for p in pts], since)
        return pts[i:]

    def start(self) -> None:
        """Sample every `interval_s` in the background (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="shoal-live-stats")

    async def stop(self) -> None:
        """Stop sampling."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            with contextlib.suppress(Exception):
                self.sample()  # on the loop: the rings are appended to by its routes


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 2)
