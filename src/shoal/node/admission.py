"""Admission at the node: the node has the final say on whether a new sandbox fits (as in DSec's edge).

Memory is oversubscribed on purpose (90% of agent sandboxes idle), but bounded: the node refuses
when promised memory passes `memory_overcommit` × RAM, or when little memory is actually free.

    res = node.admission.reserve(spec)      # CapacityExceeded when it does not fit
    ... start the sandbox ...
    res.commit(sandbox_id)                  # the memory now belongs to a live sandbox
    # (leaving without commit, or res.release(), gives the reservation back)
    node.admission.release(sandbox_id)      # when the sandbox is closed

`node.admission.snapshot()` is what placement (the cluster) and the dashboard read.

A paused sandbox's memory has been reclaimed (shoal.node.reclaim): `paused(sandbox_id)` stops counting it
against the limit (the scheduler's `Policy.paused_commit_weight`, 0) and `resumed(sandbox_id)` counts it
again — which is what lets preemption and compute tides (shoal.node.scheduling) make room by pausing.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from shoal.errors import CapacityExceeded

if TYPE_CHECKING:
    from shoal.config import NodeConfig
    from shoal.node.records import SandboxRecord


def meminfo() -> dict[str, int]:
    """/proc/meminfo in KiB."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            parts = v.split()
            if parts and parts[0].isdigit():
                out[k] = int(parts[0])
    return out


_MEMINFO_TTL_S = 0.05
_cached: tuple[float, dict[str, int]] = (-1.0, {})


def _recent_meminfo() -> dict[str, int]:
    # a burst asks for admission hundreds of times a second; /proc/meminfo 20 times a second is enough
    global _cached
    now = time.monotonic()
    if now - _cached[0] > _MEMINFO_TTL_S:
        _cached = (now, meminfo())
    return _cached[1]


@dataclass(frozen=True)
class AdmissionSnapshot:
    """The node's capacity figures at one instant (MiB unless named otherwise)."""

    #: memory promised to live sandboxes of this node process, plus reservations in flight
    committed_mb: int
    #: the refusal threshold: memory_overcommit × RAM
    limit_mb: int
    #: limit − committed: the largest memory_mb a new sandbox may ask for now (0 when full)
    free_mb: int
    #: the host's MemAvailable; new sandboxes are refused below min_free_mb
    available_mb: int
    min_free_mb: int
    total_mb: int
    overcommit: float
    #: CPUs promised to live sandboxes (not enforced here: CPU is shared, see the scheduler)
    committed_cpus: float
    #: live sandboxes counted, and reservations not yet committed
    sandboxes: int
    pending: int
    #: memory promised to paused sandboxes (not counted in committed_mb: reclaimed while paused)
    paused_mb: int = 0
    paused: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


class Reservation:
    """Memory held for one sandbox being made; `commit` hands it to the sandbox, `release` gives it back."""

    def __init__(self, admission: Admission, memory_mb: int, cpus: float) -> None:
        self.admission = admission
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.sandbox_id: str | None = None
        self.done = False

    def commit(self, sandbox_id: str) -> None:
        """The sandbox is live: its memory stays counted until `Admission.release(sandbox_id)`."""
        if not self.done:
            self.done = True
            self.sandbox_id = sandbox_id
            self.admission._settle(self, sandbox_id)

    def release(self) -> None:
        """Give the reservation back (creation failed). Does nothing after `commit`."""
        if not self.done:
            self.done = True
            self.admission._settle(self, None)

    def __enter__(self) -> Reservation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Admission:
    """Counts what this node promised (memory, CPUs) and refuses what would not fit."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self._live: dict[str, tuple[int, float]] = {}
        self._pending_mb = 0
        self._pending_cpus = 0.0
        self._pending = 0
        self._committed_mb = 0
        self._committed_cpus = 0.0
        #: paused sandboxes: id -> memory_mb (in _live, but not in _committed_mb)
        self._paused: dict[str, int] = {}

    @property
    def committed_mb(self) -> int:
        """Memory promised to live sandboxes and reservations in flight (MiB)."""
        return self._committed_mb + self._pending_mb

    def reserve(self, spec: Any) -> Reservation:
        """Hold `spec.memory_mb` for a sandbox about to be made; CapacityExceeded (HTTP 429 with
        Retry-After) when it does not fit on this node now."""
        mem, cpus = int(spec.memory_mb), float(spec.cpus)
        info = _recent_meminfo()
        total_mb = info.get("MemTotal", 0) // 1024
        avail_mb = info.get("MemAvailable", 0) // 1024
        cfg = self.config
        limit_mb = int(total_mb * cfg.memory_overcommit)
        committed = self.committed_mb
        if committed + mem > limit_mb:
            raise CapacityExceeded(
                f"node memory commitment would reach {committed + mem} MiB, over its limit "
                f"of {limit_mb} MiB ({cfg.memory_overcommit}x RAM); close sandboxes or ask for less memory_mb",
                retry_after_s=2.0, committed_mb=committed, limit_mb=limit_mb)
        if avail_mb < cfg.min_free_memory_mb:
            raise CapacityExceeded(
                f"only {avail_mb} MiB of memory is free on this node (minimum {cfg.min_free_memory_mb} MiB); "
                "retry later", retry_after_s=5.0, available_mb=avail_mb)
        self._pending_mb += mem
        self._pending_cpus += cpus
        self._pending += 1
        return Reservation(self, mem, cpus)

    def _settle(self, res: Reservation, sandbox_id: str | None) -> None:
        self._pending_mb -= res.memory_mb
        self._pending_cpus -= res.cpus
        self._pending -= 1
        if sandbox_id is not None:
            self._add(sandbox_id, res.memory_mb, res.cpus)

    def _add(self, sandbox_id: str, memory_mb: int, cpus: float) -> None:
        old = self._live.get(sandbox_id)
        if old is not None:
            self._committed_mb -= old[0]
            self._committed_cpus -= old[1]
        self._live[sandbox_id] = (memory_mb, cpus)
        self._committed_mb += memory_mb
        self._committed_cpus += cpus

    def adopt(self, rec: SandboxRecord) -> None:
        """Count a live sandbox this process did not create (re-adopted after a restart)."""
        self.resumed(rec.id)
        self._add(rec.id, int(rec.spec.get("memory_mb", 0)), float(rec.spec.get("cpus", 0.0)))
        if rec.state == "paused":
            self.paused(rec.id)

    def release(self, sandbox_id: str) -> None:
        """The sandbox is gone: stop counting it. Idempotent."""
        self.resumed(sandbox_id)
        old = self._live.pop(sandbox_id, None)
        if old is not None:
            self._committed_mb -= old[0]
            self._committed_cpus -= old[1]

    def paused(self, sandbox_id: str) -> None:
        """The sandbox is paused (its memory reclaimed): its memory stops counting against the limit."""
        live = self._live.get(sandbox_id)
        if live is not None and sandbox_id not in self._paused:
            self._paused[sandbox_id] = live[0]
            self._committed_mb -= live[0]

    def resumed(self, sandbox_id: str) -> None:
        """The sandbox runs again: its memory counts again (even past the limit: a resume is never refused)."""
        mem = self._paused.pop(sandbox_id, None)
        if mem is not None:
            self._committed_mb += mem

    def recount(self, live: list[SandboxRecord]) -> None:
        """Start over from these live records (reconcile: after a restart, or sandboxes closed elsewhere)."""
        self._live.clear()
        self._paused.clear()
        self._committed_mb = 0
        self._committed_cpus = 0.0
        for rec in live:
            self.adopt(rec)

    def counts(self, sandbox_id: str) -> bool:
        """True when the sandbox is counted as live here."""
        return sandbox_id in self._live

    def snapshot(self) -> AdmissionSnapshot:
        """Committed, limit and free figures now (read by placement and the dashboard)."""
        info = _recent_meminfo()
        total_mb = info.get("MemTotal", 0) // 1024
        limit_mb = int(total_mb * self.config.memory_overcommit)
        committed = self.committed_mb
        return AdmissionSnapshot(
            committed_mb=committed, limit_mb=limit_mb, free_mb=max(0, limit_mb - committed),
            available_mb=info.get("MemAvailable", 0) // 1024, min_free_mb=self.config.min_free_memory_mb,
            total_mb=total_mb, overcommit=self.config.memory_overcommit,
            committed_cpus=round(self._committed_cpus + self._pending_cpus, 3), sandboxes=len(self._live),
            pending=self._pending, paused_mb=sum(self._paused.values()), paused=len(self._paused))
