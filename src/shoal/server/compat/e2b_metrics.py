"""E2B's sandbox metrics (`Sandbox.get_metrics`, `GET /sandboxes/{id}/metrics`, `GET /sandboxes/metrics`):
a CPU / memory / disk series per sandbox, sampled from its cgroup by the server.

E2B samples every sandbox every 5 s from inside its VM; shoal samples the sandboxes made through the E2B API
(and any whose metrics were asked for) every `SAMPLE_S` seconds from the host, in one thread pass per round, and
once at once when it starts tracking one (so a fresh sandbox has a point). Fields as E2B's `SandboxMetric`:

- `cpuCount`: the sandbox's CPUs (its `cpus`, rounded up); `cpuUsedPct`: CPU time used over the last interval
  as a percentage of those CPUs (100 = all of them busy), two decimals.
- `memTotal`: its memory limit; `memUsed`: its cgroup's charge without page cache (anonymous and kernel
  memory, what E2B's `used` counts in its VM); `memCache`: its page cache.
- `diskTotal`: its disk limit (`disk_mb`); `diskUsed`: the blocks its writable layer holds on the host (a walk
  of the layer at most every `DISK_S` seconds; 0 where it has none on the host, e.g. a VM's disk).

A series holds at most `MAX_POINTS` points over the sandbox's whole life: when full, every other old point is
dropped (5 s steps for the first hour, coarser after). Series live in the server process and end with their
sandbox (or a restart of the server).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from shoal.errors import InvalidRequest, SandboxNotFound
from shoal.server.compat import common

if TYPE_CHECKING:
    from shoal.records import SandboxRecord
    from shoal.server.deps import ServerState

log = logging.getLogger("shoal.server")
SAMPLE_S = 5.0
DISK_S = 30.0
MAX_POINTS = 720
#: entries one disk-use walk of a writable layer reads at most
MAX_WALK = 200_000


@dataclass
class Series:
    """The samples of one sandbox: (unix s, cpu %, mem used, mem cache, disk used)."""

    sandbox_id: str
    cgroup: str
    cpus: int
    mem_total: int
    disk_total: int
    #: the host path of its writable layer ("" when it has none there, e.g. a VM)
    upper: str
    created_at: float
    points: list[tuple[float, float, int, int, int]] = field(default_factory=list)
    #: (time, CPU seconds) of the last reading
    last_cpu: tuple[float, float] | None = None
    disk_used: int = 0

    def add(self, point: tuple[float, float, int, int, int]) -> None:
        """Append a point, thinning old ones once the series is full."""
        if len(self.points) >= MAX_POINTS:
            self.points = self.points[::2]
        self.points.append(point)


def upper_bytes(path: str, max_entries: int = MAX_WALK) -> int:
    """Bytes a writable layer takes on disk (allocated blocks; a walk of at most `max_entries` entries)."""
    total, seen, stack = 0, 0, [path]
    while stack and seen < max_entries:
        with os.scandir(stack.pop()) as it:
            for e in it:
                seen += 1
                with contextlib.suppress(OSError):
                    st = e.stat(follow_symlinks=False)
                    total += st.st_blocks * 512
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
    return total


def _cpu_seconds(cg: Any) -> float | None:
    if cg.mode == "v2":
        for line in (cg.read("cpu", "cpu.stat") or "").splitlines():
            k, _, v = line.partition(" ")
            if k == "usage_usec" and v.strip().isdigit():
                return int(v) / 1e6
        return None
    raw = cg.read("cpuacct", "cpuacct.usage")
    return int(raw) / 1e9 if raw and raw.strip().isdigit() else None


def sample(s: Series, now: float) -> tuple[float, float, int, int, int] | None:
    """One reading of a sandbox's cgroup (None when the cgroup is gone)."""
    from shoal.host.cgroups import SandboxCgroup

    cg = SandboxCgroup(s.cgroup)
    charge = cg.memory_bytes()
    cpu_s = _cpu_seconds(cg)
    if charge is None or cpu_s is None:
        return None
    stat = cg.memory_stat()
    cache = stat.get("file", stat.get("cache", 0))
    if s.last_cpu is None:
        t0, c0 = s.created_at, 0.0
    else:
        t0, c0 = s.last_cpu
    s.last_cpu = (now, cpu_s)
    pct = 100.0 * max(0.0, cpu_s - c0) / max(1e-3, now - t0) / max(1, s.cpus)
    return (now, round(min(pct, 100.0), 2), max(0, charge - cache), cache, s.disk_used)


def as_metric(s: Series, p: tuple[float, float, int, int, int]) -> dict[str, Any]:
    """E2B's SandboxMetric of one point."""
    ts, pct, used, cache, disk = p
    return {"timestamp": datetime.fromtimestamp(int(ts), UTC).isoformat().replace("+00:00", "Z"),
            "timestampUnix": int(ts), "cpuCount": s.cpus, "cpuUsedPct": pct, "memUsed": used,
            "memTotal": s.mem_total, "memCache": cache, "diskUsed": disk, "diskTotal": s.disk_total}


class Recorder:
    """The series of every tracked sandbox of this server, and the task that samples them."""

    def __init__(self, st: ServerState) -> None:
        self.st = st
        self.series: dict[str, Series] = {}
        self.task: asyncio.Task[None] | None = None
        self._disk_at = 0.0

    def track(self, rec: SandboxRecord) -> Series | None:
        """Start sampling a sandbox (a first point is taken now); its series when it has a cgroup."""
        s = self.series.get(rec.id)
        if s is not None or not rec.cgroup:
            return s
        spec = rec.spec
        s = Series(sandbox_id=rec.id, cgroup=rec.cgroup, cpus=max(1, math.ceil(float(spec.cpus))),
                   mem_total=int(spec.memory_mb) << 20, disk_total=int(spec.disk_mb) << 20,
                   upper=str(rec.extra.get("upper") or ""), created_at=rec.created_at or time.time())
        self.series[rec.id] = s
        p = sample(s, time.time())
        if p is not None:
            s.add(p)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run(), name="e2b-metrics")
        return s

    def _disk(self) -> None:
        """Refresh every series' disk use: what its writable layer holds."""
        for s in list(self.series.values()):
            if s.upper:
                with contextlib.suppress(OSError):
                    s.disk_used = upper_bytes(s.upper)

    def _round(self) -> None:
        now = time.time()
        if now - self._disk_at >= DISK_S:
            self._disk_at = now
            self._disk()
        for sid, s in list(self.series.items()):
            try:
                rec = self.st.node.record(sid)
            except SandboxNotFound:
                self.series.pop(sid, None)
                continue
            if rec.state != "running":
                continue  # paused: no samples, like E2B
            if s.points and now - s.points[-1][0] < SAMPLE_S / 2:
                # tracked just now (its first point): the round is on one clock for all series, so without
                # this a new series could get two points in one second (E2B's timestamps are whole seconds)
                continue
            p = sample(s, now)
            if p is not None:
                s.add(p)

    async def _run(self) -> None:
        while self.series:
            await asyncio.sleep(SAMPLE_S)
            try:
                await asyncio.to_thread(self._round)
            except Exception:
                log.exception("sampling E2B sandbox metrics failed")

    def query(self, rec: SandboxRecord, start: int | None, end: int | None) -> list[dict[str, Any]]:
        """The points of a sandbox between `start` and `end` (unix seconds, both inclusive)."""
        if start is not None and end is not None and start > end:
            raise InvalidRequest("start time cannot be after end time")
        s = self.track(rec)
        if s is None:
            return []
        lo = float("-inf") if start is None else start
        hi = float("inf") if end is None else end + 1
        return [as_metric(s, p) for p in s.points if lo <= p[0] < hi]

    def latest(self, rec: SandboxRecord) -> dict[str, Any] | None:
        """The last point of a sandbox."""
        s = self.track(rec)
        return as_metric(s, s.points[-1]) if s is not None and s.points else None

    async def stop(self) -> None:
        """Stop sampling (server shutdown)."""
        self.series.clear()
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task


def recorder(st: ServerState) -> Recorder:
    """This server's metrics recorder."""
    return common.server_local(st, "metrics", lambda: Recorder(st))


def parse_time(value: str | None, name: str) -> int | None:
    """A `start`/`end` query parameter: unix seconds, ≥ 0."""
    if value in (None, ""):
        return None
    try:
        v = int(value)  # type: ignore[arg-type]
    except ValueError:
        raise InvalidRequest(f"{name} must be unix seconds (an integer)") from None
    if v < 0:
        raise InvalidRequest(f"{name} must be at least 0")
    return v
