"""Per-project quota accounting for the API server.

Usage is what the project's sandboxes promise (count, CPUs, memory), kept in memory and rebuilt from
the node's records (the source of truth) every few seconds and whenever a request would be refused —
so sandboxes closed by the reaper or created by another process are never counted wrongly for long,
and a refusal is always based on fresh numbers. Creations in progress hold a reservation, so a burst
of concurrent creates can never overshoot the quota.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shoal.errors import QuotaExceeded
from shoal.records import list_records
from shoal.server.tokens import Principal


@dataclass
class Usage:
    """What a project holds (or is about to hold)."""

    sandboxes: int = 0
    cpus: float = 0.0
    memory_mb: int = 0

    def add(self, n: int, cpus: float, memory_mb: int) -> None:
        """Add `n` sandboxes of this size."""
        self.sandboxes += n
        self.cpus += n * cpus
        self.memory_mb += n * memory_mb


class Reservation:
    """Room for `n` sandboxes taken from a project's quota; give back what was not used."""

    def __init__(self, tracker: QuotaTracker, project: str, n: int, cpus: float, memory_mb: int,
                 granted: int | None = None, refused: QuotaExceeded | None = None) -> None:
        self.tracker, self.project = tracker, project
        self.n, self.cpus, self.memory_mb = n, cpus, memory_mb
        #: how many sandboxes the caller may create now
        self.granted = n if granted is None else granted
        #: the refusal for the rest of a partial reservation
        self.refused = refused

    def commit(self, sandbox_id: str) -> None:
        """One reserved sandbox now exists under `sandbox_id`."""
        if self.n <= 0:
            return
        self.n -= 1
        self.tracker._pending_add(self.project, -1, self.cpus, self.memory_mb)
        self.tracker._known[sandbox_id] = (self.project, self.cpus, self.memory_mb)
        if self.tracker.source is not None:
            self.tracker._committed_at[sandbox_id] = time.monotonic()

    def release(self) -> None:
        """Give back whatever was reserved and not committed."""
        if self.n > 0:
            self.tracker._pending_add(self.project, -self.n, self.cpus, self.memory_mb)
            self.n = 0


#: a snapshot of what every sandbox holds, for trackers not backed by one node's records: when it was
#: taken (time.monotonic()) and (id, project, cpus, memory_mb) per live sandbox
UsageSnapshot = tuple[float, Iterable[tuple[str, str, float, int]]]


class QuotaTracker:
    """Reserve, commit and release quota for the projects of one node (its records), or of a whole
    cluster (`source`: the latest UsageSnapshot of every node, see shoal.cluster.gateway)."""

    def __init__(self, sandboxes_dir: os.PathLike[str] | str, refresh_s: float = 5.0,
                 min_forced_refresh_s: float = 0.5, source: Callable[[], UsageSnapshot] | None = None) -> None:
        self.sandboxes_dir = sandboxes_dir
        self.refresh_s = refresh_s
        self.min_forced_refresh_s = min_forced_refresh_s
        self.source = source
        self._known: dict[str, tuple[str, float, int]] = {}
        #: when each sandbox committed here was committed: a snapshot taken before that does not know it yet
        self._committed_at: dict[str, float] = {}
        self._pending: dict[str, Usage] = {}
        self._refreshed = 0.0

    def refresh(self) -> None:
        """Rebuild the sandbox map from the node's records (or the source's latest snapshot)."""
        if self.source is not None:
            taken_at, entries = self.source()
            known = {sid: (project, float(cpus), int(mem)) for sid, project, cpus, mem in entries}
            for sid, at in list(self._committed_at.items()):
                if at < taken_at:
                    del self._committed_at[sid]
                elif sid in self._known:
                    known.setdefault(sid, self._known[sid])  # newer than the snapshot
            self._known = known
            self._refreshed = time.monotonic()
            return
        me = os.getpid()
        known = {}
        for rec in list_records(self.sandboxes_dir):
            if rec.state == "creating" and rec.owner_pid == me:
                continue  # ours, still being made: covered by its reservation
            if rec.state in ("stopped", "stopping"):
                continue
            known[rec.id] = (rec.project, float(rec.spec.cpus), int(rec.spec.memory_mb))
        self._known = known
        self._refreshed = time.monotonic()

    def usage(self, project: str) -> Usage:
        """What `project` holds plus what it has reserved."""
        u = Usage()
        for p, cpus, mem in self._known.values():
            if p == project:
                u.add(1, cpus, mem)
        pend = self._pending.get(project)
        if pend:
            u.sandboxes += pend.sandboxes
            u.cpus += pend.cpus
            u.memory_mb += pend.memory_mb
        return u

    def _pending_add(self, project: str, n: int, cpus: float, memory_mb: int) -> None:
        self._pending.setdefault(project, Usage()).add(n, cpus, memory_mb)

    def forget(self, sandbox_id: str) -> None:
        """A sandbox was closed."""
        self._known.pop(sandbox_id, None)
        self._committed_at.pop(sandbox_id, None)

    def reserve(self, who: Principal, n: int, cpus: float, memory_mb: int, *, partial: bool = False) -> Reservation:
        """Reserve room for `n` sandboxes, or raise QuotaExceeded with the numbers.

        With `partial`, reserve as many as fit (at least one) — a batch then reports the rest per item.
        """
        q = who.quota
        if q.is_unlimited():
            return Reservation(self, who.project, 0, cpus, memory_mb, granted=n)
        now = time.monotonic()
        if now - self._refreshed > self.refresh_s:
            self.refresh()
        fit = self._fit(who, n, cpus, memory_mb)
        if fit < n and now - self._refreshed > self.min_forced_refresh_s:
            self.refresh()  # refuse only on fresh numbers
            fit = self._fit(who, n, cpus, memory_mb)
        refused = self._refusal(who, n, cpus, memory_mb) if fit < n else None
        if refused is not None and not (partial and fit > 0):
            raise refused
        take = min(n, fit)
        self._pending_add(who.project, take, cpus, memory_mb)
        return Reservation(self, who.project, take, cpus, memory_mb, refused=refused)

    def _fit(self, who: Principal, n: int, cpus: float, memory_mb: int) -> int:
        q, u = who.quota, self.usage(who.project)
        fit = n
        if q.max_sandboxes is not None:
            fit = min(fit, max(0, q.max_sandboxes - u.sandboxes))
        if q.max_cpus is not None and cpus > 0:
            fit = min(fit, max(0, int((q.max_cpus - u.cpus + 1e-9) // cpus)))
        if q.max_memory_mb is not None and memory_mb > 0:
            fit = min(fit, max(0, (q.max_memory_mb - u.memory_mb) // memory_mb))
        return fit

    def _refusal(self, who: Principal, n: int, cpus: float, memory_mb: int) -> QuotaExceeded:
        q, u = who.quota, self.usage(who.project)
        checks = [("max_sandboxes", q.max_sandboxes, u.sandboxes, n, "sandboxes"),
                  ("max_cpus", q.max_cpus, u.cpus, n * cpus, "CPUs"),
                  ("max_memory_mb", q.max_memory_mb, u.memory_mb, n * memory_mb, "MiB of memory")]
        for name, limit, used, want, unit in checks:
            if limit is not None and used + want > limit + 1e-9:
                return QuotaExceeded(
                    f"project {who.project!r} would hold {_num(used + want)} {unit}, over its quota of "
                    f"{_num(limit)} ({name}; {_num(used)} in use, {_num(want)} requested): close sandboxes "
                    "or ask the operator to raise the quota",
                    project=who.project, quota=name, limit=limit, used=_num(used), requested=_num(want))
        return QuotaExceeded(f"project {who.project!r} is over its quota", project=who.project)


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else round(float(x), 3)
