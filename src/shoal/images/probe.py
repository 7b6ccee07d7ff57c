"""Bounded probes of the layer store, so that creates fail fast when a shared store is unreachable.

A shared filesystem whose servers are gone may block a system call for a long time (MooseFS retries
`mfsioretries` times, NFS hard mounts forever). shoal never waits for that on a create: a probe runs
in a worker thread and the caller waits at most `timeout_s`; a probe still blocked is left behind (the
thread ends when the filesystem answers) and, while it is, later callers fail at once instead of
stacking more blocked threads. A healthy answer is reused for `ttl_s` so a burst of creates costs one
probe, not one per sandbox.

What a probe touches: a stat of the store's `layers/sha256` directory (metadata: the master / MDS),
and a read of `<store>/.shoal-store`, a small file written once, dropped from this host's page cache
first so that the read goes to the storage servers (chunkservers / OSDs).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from shoal.errors import StoreUnavailable

MARKER = ".shoal-store"
DEFAULT_TTL_S = 1.0


def ensure_marker(root: Path) -> None:
    """Write the probe file once (best effort: a read-only store is probed by the stat alone)."""
    p = Path(root) / MARKER
    if p.exists():
        return
    with contextlib.suppress(OSError):
        from shoal.fsutil import atomic_write

        atomic_write(p, b"shoal layer store: probed by `shoal store check`; do not remove\n" + b"." * 4000)


def _probe_once(root: Path) -> None:
    os.stat(Path(root) / "layers" / "sha256")
    p = Path(root) / MARKER
    try:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.pread(fd, 4096, 0)
    finally:
        os.close(fd)


def probe_store(root: Path, timeout_s: float | None = None) -> float:
    """Probe the store once, waiting at most `timeout_s`; returns milliseconds, or StoreUnavailable."""
    return StoreHealth(Path(root), timeout_s=timeout_s, ttl_s=1e-9).check()


class StoreHealth:
    """Remembers whether the store answered recently; `check()` raises StoreUnavailable fast when not."""

    def __init__(self, root: Path, timeout_s: float | None = None, ttl_s: float | None = None) -> None:
        self.root = Path(root)
        if timeout_s is None:
            from shoal.config import settings

            timeout_s = float(settings().store_probe_timeout_s)
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s if ttl_s is not None else DEFAULT_TTL_S
        self._lock = threading.Lock()
        self._ok_until = 0.0
        self._inflight: threading.Thread | None = None
        self._result: BaseException | None = None
        self._done = threading.Event()
        self._box: dict[str, BaseException | None] = {"err": None}
        self._last_ms = 0.0
        self._started = 0.0
        #: monotonic time of the first failed probe of the current outage (None: healthy)
        self.failing_since: float | None = None
        #: called (in the probing thread) when the store answers again after failed probes
        self.on_recover: list[Callable[[], object]] = []
        #: outages seen by this process (failed probes followed by a good one)
        self.recoveries = 0

    def _why(self, what: str) -> StoreUnavailable:
        return StoreUnavailable(f"the layer store (SHOAL_STORE) {what}: creates fail until it answers again; "
                                "check its mount and servers (`shoal store check`)", store_error=what)

    def check(self) -> float:
        """Milliseconds of the last probe; StoreUnavailable when the store does not answer within the bound.
        Concurrent callers share one probe in flight (a burst of creates waits for the same answer)."""
        now = time.monotonic()
        with self._lock:
            if now < self._ok_until:
                return self._last_ms
            th = self._inflight
            if th is not None and th.is_alive():
                if now - self._started >= self.timeout_s:
                    # an earlier probe is still blocked inside the filesystem: do not stack another
                    if self.failing_since is None:
                        self.failing_since = now
                    raise self._why(f"has not answered a probe for {now - self._started:.0f} s")
                done, box, started = self._done, self._box, self._started  # join the probe in flight
            else:
                self._done = done = threading.Event()
                self._box = box = {"err": None}
                self._started = started = now

                def run() -> None:
                    try:
                        _probe_once(self.root)
                    except BaseException as e:  # reported to the waiting callers
                        box["err"] = e
                    done.set()

                th = threading.Thread(target=run, name="shoal-store-probe", daemon=True)
                self._inflight = th
                th.start()
        if not done.wait(max(0.0, started + self.timeout_s - now)):
            self._failed()
            raise self._why(f"did not answer within {self.timeout_s:g} s")
        err = box["err"]
        if err is not None:
            self._failed()
            if isinstance(err, FileNotFoundError):
                raise self._why("is missing its layers directory (is the shared filesystem mounted?)")
            if isinstance(err, OSError):
                raise self._why(f"failed a probe ({err.strerror or err})")
            raise self._why(f"failed a probe ({type(err).__name__})")
        ms = (time.monotonic() - started) * 1000
        with self._lock:
            self._last_ms = ms
            self._ok_until = time.monotonic() + self.ttl_s
            recovered = self.failing_since is not None
            self.failing_since = None
        if recovered:
            self.recoveries += 1
            for fn in list(self.on_recover):
                with contextlib.suppress(Exception):
                    fn()
        return ms

    def _failed(self) -> None:
        with self._lock:
            if self.failing_since is None:
                self.failing_since = time.monotonic()
