"""A sandbox swapping past its memory limit runs as `batch` while it does (issue 16, item 3).

A memory bomb — or any process whose memory outgrows its sandbox — spends its last seconds faulting
pages in and pushing older ones out to swap (zram: compressing them) until the OOM killer ends it.
That is CPU work done at the `interactive` class's weight, taken from the short agent steps of every
other sandbox: with 20 bombs beside 2,000 idle sandboxes a probe sandbox's exec p99 was 11.4× its idle
value. The sandbox doing it is not latency-sensitive any more; it is thrashing.

The line is the sandbox's memory limit plus `MARGIN`, on memory + swap: page cache never counts past
the limit (it is dropped, never swapped) and a paused sandbox reclaimed to swap does not change it, so
only anonymous memory beyond the limit crosses it. The kernel wakes the node when the sandbox reclaims
(a cgroup v1 `memory.pressure_level` "low,local" event on an eventfd: only a sandbox at its own limit
reclaims); the node then reads memory + swap, and past the line moves the sandbox's processes to the
`batch` class (shoal.node.cpuclass: SCHED_IDLE, only CPU time nobody else wants). While it is there,
memory + swap is read every `RECHECK_S`; back under the line (the OOM killer ended the bomb, or the
process freed memory) the sandbox returns to its own class. Nothing is polled for the others.
(Not a usage threshold on `memory.memsw.usage_in_bytes`: registering one waits for an RCU grace
period in the kernel, measured at ~28 ms per create — create p50 16 → 44 ms.)

Not watched: sandboxes whose class is `batch` already, sandboxes without swap (at their limit they are
OOM-killed at once), and hosts whose memory controller is cgroup v2 (it has no pressure_level events; there
the sandbox keeps its class — docs/sandboxes.md says so).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from shoal.host import cgroups

log = logging.getLogger(__name__)

#: how far past its memory limit memory + swap must go before a sandbox counts as thrashing (bytes)
MARGIN = 16 << 20
#: how often memory + swap of a sandbox past its line is read, to see it come back under (seconds)
RECHECK_S = 0.25


@dataclass
class _Watch:
    usage: Path
    line: int
    efd: int
    on_cross: Callable[[bool], None]
    over: bool = field(default=False)
    recheck: asyncio.TimerHandle | None = field(default=None)
    #: the usage file, opened at the first reclaim event and kept: a path lookup in cgroupfs can wait on
    #: cgroup locks another sandbox's class change holds (60 ms stalls of the node's loop were seen)
    ufd: int | None = field(default=None)

    def read_usage(self) -> int:
        """Memory + swap now (bytes); OSError once the cgroup is gone."""
        if self.ufd is None:
            self.ufd = os.open(self.usage, os.O_RDONLY | os.O_CLOEXEC)
        return int(os.pread(self.ufd, 64, 0))


def supported(root: Path | None = None) -> bool:
    """True when this host's memory controller can signal reclaim and count memory + swap (cgroup v1 with
    swap accounting)."""
    base = root or cgroups.CGROUP_ROOT
    return all((base / "memory" / f).exists() for f in ("memory.memsw.usage_in_bytes", "memory.pressure_level",
                                                         "cgroup.event_control"))


class SwapWatch:
    """The watches of one node process (see the module docstring)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or cgroups.CGROUP_ROOT
        self._watches: dict[str, _Watch] = {}

    def watching(self, sandbox_id: str) -> bool:
        """True while the sandbox is watched."""
        return sandbox_id in self._watches

    def over(self, sandbox_id: str) -> bool:
        """True while the sandbox's memory + swap is past its line (as last read)."""
        w = self._watches.get(sandbox_id)
        return bool(w and w.over)

    def watch(self, sandbox_id: str, cgroup: str, memory_limit: int, on_cross: Callable[[bool], None]) -> bool:
        """Watch the sandbox against the line `memory_limit + MARGIN`; `on_cross(over)` is called from the
        event loop each time it crosses. False when the host cannot (nothing set). Idempotent. Must run in
        the event loop."""
        if sandbox_id in self._watches:
            return True
        d = self.root / "memory" / cgroup.strip("/")
        try:
            efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except OSError as e:
            log.warning("swap watch for %s: no eventfd: %s", sandbox_id, e)
            return False
        try:
            pfd = os.open(d / "memory.pressure_level", os.O_RDONLY | os.O_CLOEXEC)
            try:
                # the kernel keeps only the eventfd: the control file's descriptor may close at once
                (d / "cgroup.event_control").write_text(f"{efd} {pfd} low,local")
            finally:
                os.close(pfd)
        except OSError as e:
            os.close(efd)
            log.debug("swap watch for %s not set: %s", sandbox_id, e)
            return False
        w = _Watch(d / "memory.memsw.usage_in_bytes", int(memory_limit) + MARGIN, efd, on_cross)
        self._watches[sandbox_id] = w
        asyncio.get_running_loop().add_reader(efd, self._signalled, sandbox_id)
        self._check(sandbox_id)  # it may be past the line already (adopted sandboxes)
        return True

    def _signalled(self, sandbox_id: str) -> None:
        w = self._watches.get(sandbox_id)
        if w is None:
            return
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_read(w.efd)
        if not w.over:
            self._check(sandbox_id)

    def _check(self, sandbox_id: str) -> None:
        w = self._watches.get(sandbox_id)
        if w is None:
            return
        w.recheck = None
        try:
            now = w.read_usage()
        except (OSError, ValueError):
            # the kernel signals the eventfd when the cgroup is removed: the sandbox is gone
            self.unwatch(sandbox_id)
            return
        over = now >= w.line
        if over:
            w.recheck = asyncio.get_running_loop().call_later(RECHECK_S, self._check, sandbox_id)
        if over == w.over:
            return
        w.over = over
        try:
            w.on_cross(over)
        except Exception as e:  # a failed class change must not stop the watch
            log.warning("swap watch for %s: %s", sandbox_id, e)

    def unwatch(self, sandbox_id: str) -> bool:
        """Stop watching (the sandbox is closing). True when it was past its line. Closing the eventfd
        removes the kernel's side."""
        w = self._watches.pop(sandbox_id, None)
        if w is None:
            return False
        if w.recheck is not None:
            w.recheck.cancel()
        with contextlib.suppress(RuntimeError, ValueError):
            asyncio.get_running_loop().remove_reader(w.efd)
        for fd in (w.efd, w.ufd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        return w.over

    def close(self) -> None:
        """Stop every watch (the node stops; the next node process sets them again)."""
        for sid in list(self._watches):
            self.unwatch(sid)
