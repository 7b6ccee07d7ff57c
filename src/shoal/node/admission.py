"""Admission at the node: the node has the final say on whether a new sandbox fits (as in DSec's edge).

A sandbox's `memory_mb` is its *limit* (the cgroup enforces it), not what it uses: an idle agent sandbox
costs about a mebibyte, and 90% of them idle. So admission goes by what is **measured**, and keeps a
**commitment policy** users can tighten:

* **measured** — the host's available memory (MemAvailable: free + reclaimable page cache and slab), minus
  what the creates already in flight are expected to take, minus what this one is expected to take, must
  stay above the watermark `SHOAL_MIN_FREE_MB`. "Expected" is the working set new sandboxes of this node
  actually reach (`note_usage`, fed by the node's pressure monitor from their cgroups), capped at their
  limit. While tasks stall on memory (PSI `full avg10` over `SHOAL_ADMISSION_PSI_FULL` %) and less than
  half the host's memory is available, creates are refused too: the host is thrashing. (With more
  available, the stall is in sandboxes' own limits — a memory bomb reclaiming inside its cgroup, which
  host-wide PSI counts as well — and refusing everyone's creates for it would let one bomb stop a node.)
* **promised** — the sum of `memory_mb` of live sandboxes may not pass `SHOAL_MEMORY_OVERCOMMIT` × RAM.
  The default (1000) leaves the decision to measurement; `4` refuses past four times RAM, `1` never
  promises more than the host has. A paused sandbox's memory has been reclaimed (shoal.backends.container.reclaim):
  `paused(sandbox_id)` stops counting it against the limit (the scheduler's `Policy.paused_commit_weight`,
  0) and `resumed(sandbox_id)` counts it again — which is what lets preemption and compute tides
  (shoal.node.scheduling) make room by pausing.

Refusals (CapacityExceeded, HTTP 429 with Retry-After) name the reason
in `details["reason"]` ("promised", "memory", "pressure") and say what to do.

    res = node.admission.reserve(spec)      # CapacityExceeded when it does not fit
    ... start the sandbox ...
    res.commit(sandbox_id)                  # the memory now belongs to a live sandbox
    # (leaving without commit, or res.release(), gives the reservation back)
    node.admission.release(sandbox_id)      # when the sandbox is closed

`node.admission.snapshot()` is what placement (the cluster) and the dashboard read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from shoal.errors import CapacityExceeded
from shoal.host.memory import MemorySample, sample

if TYPE_CHECKING:
    from shoal.config import NodeConfig
    from shoal.records import SandboxRecord


def meminfo() -> dict[str, int]:
    """/proc/meminfo in KiB (kept here for callers of the old location; see shoal.host.memory)."""
    from shoal.host.memory import meminfo as _meminfo

    return _meminfo()


def _recent_meminfo() -> dict[str, int]:
    """MemTotal and MemAvailable (KiB) of a recent sample (for callers of the old helper)."""
    s = sample()
    return {"MemTotal": s.total_mb * 1024, "MemAvailable": s.available_mb * 1024}


#: what a new sandbox is expected to take before any has been measured (MiB): an idle container is ~1-2
DEFAULT_EXPECTED_MB = 8.0
#: the expected working set never counts less than this (MiB)
MIN_EXPECTED_MB = 2.0
#: weight of a new usage sample in the running estimate
_EWMA = 0.05
#: PSI refuses creates only while less than this share of the host's RAM is available (see the docstring)
PSI_AVAILABLE_FRACTION = 0.5


@dataclass(frozen=True)
class AdmissionSnapshot:
    """The node's capacity figures at one instant (MiB unless named otherwise)."""

    #: memory promised to live sandboxes of this node process, plus reservations in flight
    committed_mb: int
    #: the promise limit: memory_overcommit × RAM
    limit_mb: int
    #: limit − committed: the largest memory_mb the promise policy still allows (0 when full)
    free_mb: int
    #: the host's MemAvailable; new sandboxes are refused when it would fall below min_free_mb
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
    #: what one more sandbox is expected to take (measured working sets), MiB
    expected_mb: float = DEFAULT_EXPECTED_MB
    #: available − min_free − what reservations in flight are expected to take
    headroom_mb: int = 0
    #: how many more sandboxes of the expected size measured admission would take now
    room: int = 0
    #: PSI memory: % of the last 10 s some / all non-idle tasks stalled on memory (None without PSI)
    psi_some10: float | None = None
    psi_full10: float | None = None
    psi_full_limit: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


class Reservation:
    """Memory held for one sandbox being made; `commit` hands it to the sandbox, `release` gives it back."""

    def __init__(self, admission: Admission, memory_mb: int, cpus: float, expected_mb: float = 0.0) -> None:
        self.admission = admission
        self.memory_mb = memory_mb
        self.cpus = cpus
        #: what measured admission set aside for it until it shows up in the host's figures
        self.expected_mb = expected_mb
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
    """Counts what this node promised (memory, CPUs), watches what is used, and refuses what would not fit.

    `sampler` returns the host's memory (shoal.host.memory.sample); unit tests pass their own."""

    def __init__(self, config: NodeConfig, sampler: Callable[[], MemorySample] | None = None) -> None:
        self.config = config
        self.sampler = sampler or sample
        self._live: dict[str, tuple[int, float]] = {}
        self._pending_mb = 0
        self._pending_cpus = 0.0
        self._pending = 0
        self._pending_expected = 0.0
        self._committed_mb = 0
        self._committed_cpus = 0.0
        #: paused sandboxes: id -> memory_mb (in _live, but not in _committed_mb)
        self._paused: dict[str, int] = {}
        self._expected = DEFAULT_EXPECTED_MB
        self._samples = 0

    # ---- policy knobs (from the node's config) ----------------------------------------------------
    @property
    def psi_full_limit(self) -> float:
        """Refuse while PSI memory full avg10 is above this (percent); 0 = ignore PSI."""
        return float(getattr(self.config, "admission_psi_full", 0.0) or 0.0)

    @property
    def committed_mb(self) -> int:
        """Memory promised to live sandboxes and reservations in flight (MiB)."""
        return self._committed_mb + self._pending_mb

    # ---- measured working sets ----------------------------------------------------------------------
    def note_usage(self, used_mb: float) -> None:
        """One measured working set of a running sandbox (its cgroup's memory, MiB): the estimate of what
        a new sandbox takes follows these (a running average, never under MIN_EXPECTED_MB)."""
        used_mb = max(0.0, float(used_mb))
        if self._samples == 0:
            self._expected = used_mb
        else:
            self._expected += _EWMA * (used_mb - self._expected)
        self._samples += 1

    def expected_mb(self, memory_mb: int | None = None) -> float:
        """What one more sandbox is expected to take (MiB), at most its limit `memory_mb`."""
        e = max(MIN_EXPECTED_MB, self._expected)
        return min(e, float(memory_mb)) if memory_mb else e

    def headroom_mb(self, s: MemorySample | None = None) -> float:
        """Available memory above the watermark once reservations in flight are paid for (MiB)."""
        s = s or self.sampler()
        return s.available_mb - self.config.min_free_memory_mb - self._pending_expected

    # ---- reserve / release --------------------------------------------------------------------------
    def check(self, spec: Any, s: MemorySample | None = None) -> CapacityExceeded | None:
        """The refusal a create of `spec` would get now, or None when it fits (nothing is reserved)."""
        mem = int(spec.memory_mb)
        s = s or self.sampler()
        cfg = self.config
        limit_mb = int(s.total_mb * cfg.memory_overcommit)
        committed = self.committed_mb
        if committed + mem > limit_mb:
            return CapacityExceeded(
                f"node memory commitment would reach {committed + mem} MiB, over its limit of {limit_mb} MiB "
                f"(SHOAL_MEMORY_OVERCOMMIT={cfg.memory_overcommit:g} × RAM); close sandboxes, ask for less "
                "memory_mb, or raise SHOAL_MEMORY_OVERCOMMIT (memory use is measured either way)",
                retry_after_s=2.0, reason="promised", committed_mb=committed, limit_mb=limit_mb)
        limit = self.psi_full_limit
        if limit > 0 and s.psi_full10 is not None and s.psi_full10 > limit \
                and s.available_mb < s.total_mb * PSI_AVAILABLE_FRACTION:
            return CapacityExceeded(
                f"memory pressure on this node: all its tasks were stalled waiting for memory {s.psi_full10:.0f}% "
                f"of the last 10 s (limit {limit:g}%, SHOAL_ADMISSION_PSI_FULL); retry in a few seconds, "
                "close or pause sandboxes, or create on another node",
                retry_after_s=5.0, reason="pressure", psi_full10=s.psi_full10, available_mb=s.available_mb)
        exp = self.expected_mb(mem)
        head = self.headroom_mb(s)
        if head - exp < 0:
            inflight = f" and {self._pending} creates in flight expected to take {self._pending_expected:.0f} MiB" \
                if self._pending else ""
            return CapacityExceeded(
                f"only {s.available_mb} MiB of memory is available on this node{inflight}; a new sandbox is expected "
                f"to take {exp:.0f} MiB and {cfg.min_free_memory_mb} MiB must stay free (SHOAL_MIN_FREE_MB). "
                "Close or pause sandboxes, retry later, or create on another node",
                retry_after_s=5.0, reason="memory", available_mb=s.available_mb,
                min_free_mb=cfg.min_free_memory_mb, expected_mb=round(exp, 1), pending=self._pending)
        return None

    def reserve(self, spec: Any) -> Reservation:
        """Hold `spec.memory_mb` (promised) and its expected working set (measured) for a sandbox about to
        be made; CapacityExceeded (HTTP 429 with Retry-After) when it does not fit on this node now."""
        err = self.check(spec)
        if err is not None:
            raise err
        mem, cpus = int(spec.memory_mb), float(spec.cpus)
        exp = self.expected_mb(mem)
        self._pending_mb += mem
        self._pending_cpus += cpus
        self._pending += 1
        self._pending_expected += exp
        return Reservation(self, mem, cpus, exp)

    def _settle(self, res: Reservation, sandbox_id: str | None) -> None:
        self._pending_mb -= res.memory_mb
        self._pending_cpus -= res.cpus
        self._pending -= 1
        self._pending_expected = max(0.0, self._pending_expected - res.expected_mb) if self._pending else 0.0
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
        self._add(rec.id, int(rec.spec.memory_mb), float(rec.spec.cpus))
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

    def live_ids(self) -> list[str]:
        """The sandboxes counted as live here (created by this process or adopted from the node's home)."""
        return list(self._live)

    def committed_to(self, sandbox_ids: Iterable[str]) -> int:
        """Memory promised to these sandboxes (MiB): the part of committed_mb they account for (a paused or
        unknown one adds nothing)."""
        return sum(self._live[i][0] for i in set(sandbox_ids) if i in self._live and i not in self._paused)

    def snapshot(self) -> AdmissionSnapshot:
        """Committed, limit, free and measured figures now (read by placement and the dashboard)."""
        s = self.sampler()
        limit_mb = int(s.total_mb * self.config.memory_overcommit)
        committed = self.committed_mb
        exp = self.expected_mb()
        head = self.headroom_mb(s)
        return AdmissionSnapshot(
            committed_mb=committed, limit_mb=limit_mb, free_mb=max(0, limit_mb - committed),
            available_mb=s.available_mb, min_free_mb=self.config.min_free_memory_mb,
            total_mb=s.total_mb, overcommit=self.config.memory_overcommit,
            committed_cpus=round(self._committed_cpus + self._pending_cpus, 3), sandboxes=len(self._live),
            pending=self._pending, expected_mb=round(exp, 2), headroom_mb=int(head),
            room=max(0, int(head // exp)), psi_some10=s.psi_some10, psi_full10=s.psi_full10,
            psi_full_limit=self.psi_full_limit,
            paused_mb=sum(self._paused.values()), paused=len(self._paused))
