"""A sandbox swapping past its memory limit runs as `batch` while it does (issue 16, item 3).

A memory bomb — or any process whose memory outgrows its sandbox — spends its last seconds faulting
pages in and pushing older ones out to swap (zram: compressing them) until the OOM killer ends it.
That is CPU work done at the `interactive` class's weight, taken from the short agent steps of every
other sandbox: with 20 bombs beside 2,000 idle sandboxes a probe sandbox's exec p99 was 11.4× its idle
value. The sandbox doing it is not latency-sensitive any more; it is thrashing.

The line is the sandbox's memory limit plus `MARGIN`, on memory + swap: page cache never counts past
the limit (it is dropped, never swapped) and a paused sandbox reclaimed to swap does not change it, so
only anonymous memory beyond the limit crosses it. The kernel wakes the node when a sandbox reclaims at
its own limit; the node then reads its memory + swap, and past the line moves the sandbox's processes to
the `batch` class (shoal.backends.container.cpuclass: SCHED_IDLE, only CPU time nobody else wants). While it is there,
memory + swap is read every `RECHECK_S`; back under the line (the OOM killer ended the bomb, or the
process freed memory) the sandbox returns to its own class. Nothing is polled for the others.

**One watch for all sandboxes** (issue 24: descriptors must not grow with idle sandboxes):

* cgroup v1: each sandbox registers a `memory.pressure_level` "low,local" event (only a sandbox at its
  own limit reclaims), but sandboxes share eventfds, `BUCKET` to one: a signal marks that bucket's
  members to be read, off the event loop, at most every `RECHECK_S`. 10,000 sandboxes hold 157
  descriptors, not 10,000.
* cgroup v2 (no pressure_level events): one inotify descriptor watches every sandbox's `memory.events`,
  which the kernel rewrites (and notifies) each time the cgroup hits its `memory.max` or `memory.high`;
  the watch names the sandbox. A watch is not a descriptor; the host's `fs.inotify.max_user_watches`
  bounds them (admission refuses creates before it runs out: shoal.node.capacity).

A sandbox past its line keeps its usage file(s) open while it is there (a path lookup in cgroupfs can
wait on cgroup locks another sandbox's class change holds: 60 ms stalls of the node's loop were seen),
and closes them when it is back under it.
(Not a usage threshold on `memory.memsw.usage_in_bytes`: registering one waits for an RCU grace
period in the kernel, measured at ~28 ms per create — create p50 16 → 44 ms.)

Not watched: sandboxes whose class is `batch` already, and sandboxes without swap (at their limit they
are OOM-killed at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import os
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from shoal.host import cgroups

log = logging.getLogger(__name__)

#: how far past its memory limit memory + swap must go before a sandbox counts as thrashing (bytes)
MARGIN = 16 << 20
#: how often memory + swap of a sandbox past its line is read, to see it come back under (seconds); also
#: the shortest time between two reads of the sandboxes a signal named
RECHECK_S = 0.25
#: cgroup v1: sandboxes whose pressure events share one eventfd
BUCKET = 64

_IN_MODIFY = 0x2
_IN_IGNORED = 0x8000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then len bytes of name)


class _Inotify:
    """inotify through libc (the standard library has none)."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        fd = self._libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"inotify_init1: {os.strerror(e)}")
        self.fd = fd

    def add(self, path: Path, mask: int = _IN_MODIFY) -> int:
        """A watch descriptor for `path` (OSError: ENOSPC when the host's watches ran out)."""
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), ctypes.c_uint32(mask))
        if wd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"inotify_add_watch {path}: {os.strerror(e)}")
        return int(wd)

    def remove(self, wd: int) -> None:
        """Drop a watch (nothing when the kernel dropped it already: the file is gone)."""
        self._libc.inotify_rm_watch(self.fd, wd)

    def read(self) -> list[tuple[int, int]]:
        """(wd, mask) of the events queued now."""
        out: list[tuple[int, int]] = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            i = 0
            while i + _EVENT.size <= len(buf):
                wd, mask, _cookie, n = _EVENT.unpack_from(buf, i)
                out.append((wd, mask))
                i += _EVENT.size + n

    def close(self) -> None:
        """Close the descriptor (the kernel drops every watch)."""
        with contextlib.suppress(OSError):
            os.close(self.fd)


@dataclass(eq=False)
class _Bucket:
    """cgroup v1: one eventfd shared by up to BUCKET sandboxes' pressure events."""

    efd: int
    members: set[str] = field(default_factory=set)


@dataclass(eq=False)
class _Watch:
    sandbox_id: str
    #: memory + swap is the sum of these files (v1: memory.memsw.usage_in_bytes; v2: memory.current and
    #: memory.swap.current)
    files: tuple[Path, ...]
    line: int
    on_cross: Callable[[bool], None]
    over: bool = field(default=False)
    recheck: asyncio.TimerHandle | None = field(default=None)
    #: the usage files, open while the sandbox is past its line (read every RECHECK_S without a lookup)
    fds: list[int] | None = field(default=None)
    bucket: _Bucket | None = field(default=None)
    wd: int | None = field(default=None)

    def read_usage(self) -> int:
        """Memory + swap now through the kept descriptors (opened on first use); OSError once the cgroup
        is gone."""
        if self.fds is None:
            self.fds = _open_all(self.files)
        return sum(int(os.pread(fd, 64, 0)) for fd in self.fds)

    def drop_fds(self) -> None:
        """Close the kept usage files."""
        fds, self.fds = self.fds, None
        for fd in fds or ():
            with contextlib.suppress(OSError):
                os.close(fd)


def _open_all(files: Iterable[Path]) -> list[int]:
    fds: list[int] = []
    try:
        for f in files:
            fds.append(os.open(f, os.O_RDONLY | os.O_CLOEXEC))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _read_once(files: tuple[Path, ...]) -> int:
    """Memory + swap of one sandbox, opening and closing its files (no descriptor kept)."""
    total = 0
    for f in files:
        fd = os.open(f, os.O_RDONLY | os.O_CLOEXEC)
        try:
            total += int(os.pread(fd, 64, 0))
        finally:
            os.close(fd)
    return total


def host_mode(root: Path | None = None) -> str | None:
    """How this host's memory controller can signal reclaim and count memory + swap: 'v1' (pressure_level
    events, memsw), 'v2' (memory.events + memory.swap.current), or None."""
    base = root or cgroups.CGROUP_ROOT
    if all((base / "memory" / f).exists() for f in ("memory.memsw.usage_in_bytes", "memory.pressure_level",
                                                   "cgroup.event_control")):
        return "v1"
    with contextlib.suppress(OSError):
        if "memory" in (base / "cgroup.controllers").read_text().split():
            return "v2"
    return None


def supported(root: Path | None = None) -> bool:
    """True when this host's memory controller can signal reclaim and count memory + swap (cgroup v1 with
    swap accounting, or cgroup v2 with the memory controller)."""
    return host_mode(root) is not None


class SwapWatch:
    """The watches of one node process (see the module docstring)."""

    def __init__(self, root: Path | None = None, mode: str | None = None) -> None:
        self.root = root or cgroups.CGROUP_ROOT
        self.mode = mode or host_mode(self.root) or "v1"
        self._watches: dict[str, _Watch] = {}
        self._buckets: list[_Bucket] = []  # v1
        self._inotify: _Inotify | None = None  # v2
        self._wds: dict[int, str] = {}  # v2: watch descriptor -> sandbox
        self._pending: set[str] = set()  # sandboxes a signal named, to read at the next scan
        self._scan: asyncio.TimerHandle | asyncio.Task[None] | None = None
        self._last_scan = 0.0
        #: reads done by scans (for tests and the soak benchmark)
        self.scans = 0

    # ---- what is watched -----------------------------------------------------------------------------
    def watching(self, sandbox_id: str) -> bool:
        """True while the sandbox is watched."""
        return sandbox_id in self._watches

    def over(self, sandbox_id: str) -> bool:
        """True while the sandbox's memory + swap is past its line (as last read)."""
        w = self._watches.get(sandbox_id)
        return bool(w and w.over)

    def descriptors(self) -> int:
        """Descriptors this watch holds now: shared eventfds (v1) or the inotify descriptor (v2), plus the
        usage files of sandboxes past their line."""
        own = len(self._buckets) + (1 if self._inotify is not None else 0)
        return own + sum(len(w.fds) for w in self._watches.values() if w.fds)

    def __len__(self) -> int:
        return len(self._watches)

    # ---- watch / unwatch -------------------------------------------------------------------------------
    def watch(self, sandbox_id: str, cgroup: str, memory_limit: int, on_cross: Callable[[bool], None]) -> bool:
        """Watch the sandbox against the line `memory_limit + MARGIN`; `on_cross(over)` is called from the
        event loop each time it crosses. False when the host cannot (nothing set). Idempotent. Must run in
        the event loop."""
        if sandbox_id in self._watches:
            return True
        rel = cgroup.strip("/")
        line = int(memory_limit) + MARGIN
        if self.mode == "v2":
            d = self.root / rel
            w = _Watch(sandbox_id, (d / "memory.current", d / "memory.swap.current"), line, on_cross)
            ok = self._watch_v2(w, d)
        else:
            d = self.root / "memory" / rel
            w = _Watch(sandbox_id, (d / "memory.memsw.usage_in_bytes",), line, on_cross)
            ok = self._watch_v1(w, d)
        if not ok:
            return False
        self._watches[sandbox_id] = w
        self._want(sandbox_id)  # it may be past the line already (adopted sandboxes)
        return True

    def _watch_v1(self, w: _Watch, d: Path) -> bool:
        bucket = next((b for b in reversed(self._buckets) if len(b.members) < BUCKET), None)
        fresh = bucket is None
        if bucket is None:
            try:
                bucket = _Bucket(os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK))
            except OSError as e:
                log.warning("swap watch for %s: no eventfd: %s", w.sandbox_id, e)
                return False
        try:
            pfd = os.open(d / "memory.pressure_level", os.O_RDONLY | os.O_CLOEXEC)
            try:
                # the kernel keeps only the eventfd: the control file's descriptor may close at once
                (d / "cgroup.event_control").write_text(f"{bucket.efd} {pfd} low,local")
            finally:
                os.close(pfd)
        except OSError as e:
            if fresh:
                os.close(bucket.efd)
            log.debug("swap watch for %s not set: %s", w.sandbox_id, e)
            return False
        if fresh:
            self._buckets.append(bucket)
            asyncio.get_running_loop().add_reader(bucket.efd, self._bucket_signalled, bucket)
        bucket.members.add(w.sandbox_id)
        w.bucket = bucket
        return True

    def _watch_v2(self, w: _Watch, d: Path) -> bool:
        if not w.files[1].exists():
            log.debug("swap watch for %s not set: no memory.swap.current in %s", w.sandbox_id, d)
            return False
        try:
            if self._inotify is None:
                self._inotify = _Inotify()
                asyncio.get_running_loop().add_reader(self._inotify.fd, self._inotify_ready)
            w.wd = self._inotify.add(d / "memory.events")
        except OSError as e:
            lvl = logging.WARNING if e.errno in (errno.ENOSPC, errno.EMFILE, errno.ENFILE) else logging.DEBUG
            log.log(lvl, "swap watch for %s not set: %s", w.sandbox_id, e)
            return False
        self._wds[w.wd] = w.sandbox_id
        return True

    def unwatch(self, sandbox_id: str) -> bool:
        """Stop watching (the sandbox is closing). True when it was past its line."""
        w = self._watches.pop(sandbox_id, None)
        if w is None:
            return False
        self._pending.discard(sandbox_id)
        if w.recheck is not None:
            w.recheck.cancel()
        w.drop_fds()
        b = w.bucket
        if b is not None:
            b.members.discard(sandbox_id)
            if not b.members:
                # closing the eventfd removes what the kernel still holds for it (cgroups not yet gone)
                self._buckets.remove(b)
                with contextlib.suppress(RuntimeError, ValueError):
                    asyncio.get_running_loop().remove_reader(b.efd)
                with contextlib.suppress(OSError):
                    os.close(b.efd)
        if w.wd is not None and self._wds.get(w.wd) == sandbox_id:
            del self._wds[w.wd]
            if self._inotify is not None:
                self._inotify.remove(w.wd)
        return w.over

    def close(self) -> None:
        """Stop every watch (the node stops; the next node process sets them again)."""
        for sid in list(self._watches):
            self.unwatch(sid)
        if self._scan is not None:
            self._scan.cancel()
        self._scan = None
        if self._inotify is not None:
            with contextlib.suppress(RuntimeError, ValueError):
                asyncio.get_running_loop().remove_reader(self._inotify.fd)
            self._inotify.close()
            self._inotify = None
            self._wds.clear()

    # ---- signals ---------------------------------------------------------------------------------------
    def _bucket_signalled(self, bucket: _Bucket) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_read(bucket.efd)
        # one of them reclaims at its limit (or a cgroup went away: the kernel signals that too)
        for sid in list(bucket.members):
            self._want(sid)

    def _inotify_ready(self) -> None:
        if self._inotify is None:
            return
        for wd, mask in self._inotify.read():
            sid = self._wds.get(wd)
            if sid is None:
                continue
            if mask & _IN_IGNORED:  # the cgroup is gone (the sandbox closed, or its init died)
                del self._wds[wd]
                w = self._watches.get(sid)
                if w is not None and w.wd == wd:
                    w.wd = None
                    self.unwatch(sid)
                continue
            self._want(sid)

    def _want(self, sandbox_id: str) -> None:
        """Read the sandbox's memory + swap at the next scan (none is due sooner than RECHECK_S after the
        last; sandboxes past their line are read by their own recheck)."""
        w = self._watches.get(sandbox_id)
        if w is None or w.over:
            return
        self._pending.add(sandbox_id)
        if self._scan is not None:
            return
        loop = asyncio.get_running_loop()
        wait = self._last_scan + RECHECK_S - time.monotonic()
        if wait > 0:
            self._scan = loop.call_later(wait, self._start_scan)
        else:
            self._start_scan()

    def _start_scan(self) -> None:
        self._scan = asyncio.get_running_loop().create_task(self._run_scan(), name="shoal-swapwatch-scan")

    async def _run_scan(self) -> None:
        try:
            self._last_scan = time.monotonic()
            todo = [(sid, w) for sid in self._pending if (w := self._watches.get(sid)) is not None and not w.over]
            self._pending.clear()
            # off the loop: a path lookup in cgroupfs can wait on cgroup locks (see the module docstring)
            got = await asyncio.to_thread(_read_all, [w.files for _, w in todo])
            self.scans += len(todo)
            for (sid, w), now in zip(todo, got, strict=True):
                if self._watches.get(sid) is not w:
                    continue  # closed meanwhile
                if now is None:
                    self.unwatch(sid)  # the cgroup is gone: the sandbox is
                elif now >= w.line:
                    self._check(sid)  # past its line: read again through kept descriptors, then cross
        except Exception as e:  # a failed read must never stop the watch
            log.warning("swap watch scan failed: %s", e)
        finally:
            self._scan = None
        if self._pending:
            self._want(next(iter(self._pending)))

    def _check(self, sandbox_id: str) -> None:
        w = self._watches.get(sandbox_id)
        if w is None:
            return
        w.recheck = None
        try:
            now = w.read_usage()
        except (OSError, ValueError):
            self.unwatch(sandbox_id)  # the cgroup is gone: the sandbox is
            return
        over = now >= w.line
        if over:
            w.recheck = asyncio.get_running_loop().call_later(RECHECK_S, self._check, sandbox_id)
        else:
            w.drop_fds()  # back under: no descriptor is kept for it
        if over == w.over:
            return
        w.over = over
        try:
            w.on_cross(over)
        except Exception as e:  # a failed class change must not stop the watch
            log.warning("swap watch for %s: %s", sandbox_id, e)


def _read_all(files: list[tuple[Path, ...]]) -> list[int | None]:
    out: list[int | None] = []
    for fs in files:
        try:
            out.append(_read_once(fs))
        except (OSError, ValueError):
            out.append(None)
    return out
