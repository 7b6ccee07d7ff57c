"""The scheduler's decisions on one node: job caps, preemption by pausing, gangs, compute tides.

The decisions are shoal.sched's (the same code the cluster runtime and `shoal sim` run); this module
builds the one-node view they read (from the node's records, its admission figures and the host's
memory) and carries them out with the node's own pause:

* **jobs** — a sandbox's labels name its job and priority class (`shoal.job`, `shoal.priority`,
  `shoal.max-sandboxes`); a create past its job's cap fails with QuotaExceeded;
* **preemption** — a create the node's admission refuses for memory pauses idle sandboxes of lower
  classes (`sched.plan_preemption`: lowest class, longest idle first), then is admitted; the paused
  sandboxes resume transparently on their next call (Node.client), never killed;
* **gangs** — `reserve_gang` holds admission for all `n` creates of an `all_or_nothing` burst, or
  raises GangUnsatisfiable saying how many fit, before anything starts;
* **compute tides** — every `tide_interval_s` the node reads its memory; when used memory is over
  `tide_high`, sandboxes idle over `tide_idle_s` are paused and reclaimed (`sched.plan_tides`) until it is
  under `tide_low`;
* **the pressure response** — before admission refuses a create for memory (its watermark,
  `SHOAL_MIN_FREE_MB`, or PSI), the same decision runs at once with that watermark as its threshold:
  the longest-idle sandboxes (idle at least `pressure_idle_s`) are paused and reclaimed — to swap, zram
  where set up — until the create fits; only then is it refused, saying what was tried.

"Idle" is the time since the sandbox last served a call through this node process (exec, files,
shells), or since it was created, adopted or resumed. Paused sandboxes carry `extra.paused_by`
("preempt", "tides", "pressure"; a user's own pause leaves none) until they resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from shoal.errors import CapacityExceeded, GangUnsatisfiable, ShoalError
from shoal.limits import DEFAULT_BACKEND
from shoal.sched import (
    Cluster,
    JobBook,
    NodeState,
    Policy,
    Request,
    SandboxView,
    job_labels,
    plan_preemption,
    plan_tides,
)
from shoal.sched.policy import JobLabels

if TYPE_CHECKING:
    from shoal.config import Settings
    from shoal.models import SandboxSpec
    from shoal.node.ports import SchedulingHost
    from shoal.records import SandboxRecord

log = logging.getLogger(__name__)
#: most sandboxes one tide or pressure pass pauses (idle ones hold ~1 MiB each: the rest waits for the next)
MAX_PAUSED_PER_PASS = 256
#: a pressure pass frees what the create needs plus this much (MiB), so the next creates fit too
PRESSURE_MARGIN_MB = 256.0
#: after a pass that found nothing to pause, the next waits this long (s)
PRESSURE_QUIET_S = 10.0


def _meminfo_mb() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of the host in MiB."""
    from shoal.node.admission import _recent_meminfo

    info = _recent_meminfo()
    return info.get("MemTotal", 0) // 1024, info.get("MemAvailable", 0) // 1024


class NodeScheduling:
    """See the module docstring. One per node, made by its core (`node.scheduling`)."""

    def __init__(self, node: SchedulingHost, s: Settings | None = None) -> None:
        s = s or node.config.settings
        self.node = node
        cfg = node.config
        self.policy = Policy.from_settings(s, memory_overcommit=cfg.memory_overcommit,
                                           min_free_mb=cfg.min_free_memory_mb)
        self.preempt_enabled = bool(s.preempt)
        #: the operator's policy (issue 23): without it, preemption pauses only the creator's own project's
        self.preempt_across_projects = bool(s.preempt_across_projects)
        self.tides_enabled = bool(s.tides)
        self.tide_interval_s = float(s.tide_interval_s)
        #: jobs and what they hold on this node (for caps)
        self.book = JobBook(self.policy)
        #: sandbox id -> time.time() of its last call through this process
        self.last_used: dict[str, float] = {}
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.trace = None
        if s.trace_file is not None:
            from shoal.node.tracelog import TraceLog

            self.trace = TraceLog(s.trace_file, cfg.node_id)
        #: what the last tide pass did (for `shoal bench` and tests), and counts over the node's life
        self.last_tide: dict[str, Any] = {}
        self.tide_totals = {"passes": 0, "paused": 0}
        #: the pressure response pauses sandboxes idle at least this long before refusing a create
        self.pressure_idle_s = float(getattr(s, "pressure_idle_s", 30.0))
        self._quiet_until = 0.0

    # ---- bookkeeping -----------------------------------------------------------------------------
    def job_of(self, spec: SandboxSpec) -> JobLabels:
        """The job, priority, cap and weight a spec's labels give (InvalidRequest naming a bad label)."""
        return job_labels(spec.labels, self.policy, project=spec.project)

    def recount(self, recs: list[SandboxRecord]) -> None:
        """Start over from the live records (node start, reconcile)."""
        self.book = JobBook(self.policy)
        now = time.time()
        for rec in recs:
            if rec.extra.get("pool") or rec.state not in ("running", "paused", "creating"):
                continue
            with contextlib.suppress(ShoalError):
                jl = job_labels(rec.labels, self.policy, project=rec.project)
                self.book.charge(jl.job, rec.project, 1)
            self.last_used.setdefault(rec.id, now)

    def created(self, rec: SandboxRecord) -> None:
        """A sandbox was handed out (its labels are final)."""
        self.last_used[rec.id] = time.time()
        jl = job_labels(rec.labels, self.policy, project=rec.project)
        self.book.charge(jl.job, rec.project, 1)
        if self.trace is not None:
            self.trace.created(rec.id, rec.spec, rec.image, list(rec.layers), rec.labels)

    def closed(self, rec: SandboxRecord) -> None:
        """A sandbox was closed."""
        self.last_used.pop(rec.id, None)
        if rec.extra.get("pool"):
            return
        with contextlib.suppress(ShoalError):
            jl = job_labels(rec.labels, self.policy, project=rec.project)
            self.book.charge(jl.job, rec.project, -1)
        if self.trace is not None:
            self.trace.event("close", rec.id)

    def touched(self, sandbox_id: str) -> None:
        """The sandbox served a call now (it is not idle)."""
        self.last_used[sandbox_id] = time.time()

    def paused(self, sandbox_id: str, by: str) -> None:
        """Record a pause (trace)."""
        if self.trace is not None:
            self.trace.event("pause", sandbox_id, by=by)

    def resumed(self, sandbox_id: str) -> None:
        """A paused sandbox runs again (its idle time starts over)."""
        self.last_used[sandbox_id] = time.time()
        if self.trace is not None:
            self.trace.event("resume", sandbox_id)

    def idle_mb(self, recs: list[SandboxRecord]) -> dict[str, int]:
        """Memory (MiB) of running sandboxes idle at least the policy's min_idle_s, per priority class:
        what this node reports so a cluster scheduler can send it work that pausing them makes room for."""
        cutoff = time.time() - self.policy.min_idle_s
        out: dict[str, int] = {}
        for rec in recs:
            if rec.state != "running" or rec.extra.get("pool"):
                continue
            if self.last_used.get(rec.id, rec.created_at) > cutoff:
                continue
            try:
                jl = job_labels(rec.labels, self.policy, project=rec.project)
            except ShoalError:
                continue
            name = self.policy.name(jl.priority)
            out[name] = out.get(name, 0) + int(rec.spec.memory_mb)
        return out

    # ---- the one-node view -------------------------------------------------------------------------
    def view(self, *, used: bool = False, backend: str = DEFAULT_BACKEND, policy: Policy | None = None,
             project: str | None = None, last_used: dict[str, float] | None = None, snap: Any = None) -> Cluster:
        """This node as the scheduler sees it: promised and used memory, and every running sandbox
        (with its class, job, last call and — `used=True` — the memory pausing it would give back: its
        cgroup's charge less page cache). The node counts as offering `backend` (the one the request is
        for; a node's own view needs no filter). `policy`: decide with these knobs instead of the node's.
        `project`: only that project's sandboxes are candidates to pause (the others still count in the
        node's figures). Blocking (reads every record): from the event loop, `view_async` runs it in a
        thread with a snapshot of `last_used` (which creates and closes change meanwhile)."""
        from shoal.records import list_records

        last_used = self.last_used if last_used is None else last_used
        snap = snap or self.node.admission.snapshot()
        total, avail = _meminfo_mb()
        state = NodeState.new(self.node.config.node_id, cpus=_cpu_count(), memory_mb=max(1, total),
                              policy=self.policy, cpu_overcommit=1e9,
                              memory_overcommit=snap.limit_mb / max(1, total), backends=frozenset({backend}))
        state.committed_mb = snap.committed_mb
        state.paused_mb = getattr(snap, "paused_mb", 0)
        state.used_mb = max(0, total - avail)
        cluster = Cluster([state], policy or self.policy)
        now = time.time()
        for rec in list_records(self.node.paths.sandboxes):
            if rec.extra.get("pool") or rec.state not in ("running", "paused"):
                continue
            try:
                jl = job_labels(rec.labels, self.policy, project=rec.project)
            except ShoalError:
                continue
            if rec.state == "paused":
                state.paused += 1
            else:
                state.running += 1
            if project is not None and rec.project != project:
                continue  # counted, never a candidate
            state.by_priority[jl.priority] = state.by_priority.get(jl.priority, 0) + 1
            state.by_job[jl.job] = state.by_job.get(jl.job, 0) + 1
            used_mb = 0
            if used and rec.state == "running" and rec.cgroup:
                from shoal.host.cgroups import SandboxCgroup

                used_mb = (SandboxCgroup(rec.cgroup).working_set_bytes() or 0) >> 20
            cluster.track(SandboxView(rec.id, state.node_id, int(rec.spec.memory_mb),
                                      float(rec.spec.cpus), jl.priority, jl.job, rec.project,
                                      rec.state, last_used.get(rec.id, rec.created_at or now), used_mb))
        return cluster

    async def view_async(self, *, used: bool = False, backend: str = DEFAULT_BACKEND,
                         policy: Policy | None = None, project: str | None = None) -> Cluster:
        """`view` off the event loop (with 10,000 sandboxes it reads 10,000 records), over a snapshot of
        `last_used` taken here, on the loop."""
        # the tables the event loop changes are read here, on the loop; the records in the thread
        return await asyncio.to_thread(functools.partial(self.view, used=used, backend=backend, policy=policy,
                                                         project=project, last_used=dict(self.last_used),
                                                         snap=self.node.admission.snapshot()))

    def request(self, spec: SandboxSpec, jl: JobLabels | None = None) -> Request:
        """A spec as the scheduler's Request."""
        jl = jl or self.job_of(spec)
        return Request(cpus=float(spec.cpus), memory_mb=int(spec.memory_mb), backend=spec.backend,
                       image=spec.image, priority=jl.priority, job=jl.job, project=spec.project)

    # ---- admission with jobs and preemption ----------------------------------------------------------
    def check_job(self, spec: SandboxSpec, n: int = 1) -> JobLabels:
        """QuotaExceeded when `n` more sandboxes would pass the job's `shoal.max-sandboxes`."""
        jl = self.job_of(spec)
        if jl.max_sandboxes is not None:
            self.book.configure(jl.job, spec.project, max_sandboxes=jl.max_sandboxes)
            self.book.check(jl.job, spec.project, n)
        return jl

    async def admit(self, spec: SandboxSpec) -> Any:
        """An admission reservation for one create, pausing idle lower-priority sandboxes when the node
        is full and that makes room. Raises what admission raises when nothing helps."""
        jl = self.check_job(spec)
        try:
            return self.node.admission.reserve(spec)
        except CapacityExceeded as e:
            if e.details.get("reason") in ("memory", "pressure"):
                return await self.relieve(spec, e)
            if not self._may_preempt(e, jl):
                raise
        async with self._lock:
            with contextlib.suppress(CapacityExceeded):
                return self.node.admission.reserve(spec)  # someone freed room meanwhile
            await self._preempt(self.request(spec, jl), 1)
            return self.node.admission.reserve(spec)

    async def reserve_gang(self, spec: SandboxSpec, n: int) -> list[Any]:
        """Admission reservations for all `n` creates of a gang, or GangUnsatisfiable (with how many fit)
        before anything starts; idle lower-priority sandboxes are paused when that makes room for all."""
        jl = self.check_job(spec, n)
        async with self._lock:
            held = self._reserve_up_to(spec, n)
            if len(held) < n and self.preempt_enabled and jl.priority + self.policy.preempt_gap < len(
                    self.policy.priorities):
                req = self.request(spec, jl)
                cluster = await self.view_async(backend=req.backend, project=self._victims_of(req))
                extra = plan_preemption(req, n - len(held), cluster, time.time())
                if sum(k for k, _ in extra.values()) >= n - len(held):
                    await self._pause_all([v.id for _, vs in extra.values() for v in vs], "preempt")
                    held += self._reserve_up_to(spec, n - len(held))
            if len(held) < n:
                for r in held:
                    r.release()
                raise GangUnsatisfiable(
                    f"only {len(held)} of {n} sandboxes fit on this node now (all_or_nothing: none were created); "
                    f"ask for at most {len(held)}, retry later, or drop all_or_nothing to get as many as fit",
                    requested=n, available=len(held))
            return held

    def _reserve_up_to(self, spec: SandboxSpec, n: int) -> list[Any]:
        held = []
        for _ in range(n):
            try:
                held.append(self.node.admission.reserve(spec))
            except CapacityExceeded:
                break
        return held

    def _may_preempt(self, e: CapacityExceeded, jl: JobLabels) -> bool:
        # only a refusal for promised memory can be cured by pausing (a host short of free memory is the
        # tides' business); only classes with someone below them may preempt
        return (self.preempt_enabled and "committed_mb" in e.details
                and jl.priority + self.policy.preempt_gap < len(self.policy.priorities))

    def _victims_of(self, req: Request) -> str | None:
        # whose sandboxes a create may pause: its own project's, or anyone's when the operator allows it
        return None if self.preempt_across_projects else req.project

    async def _preempt(self, req: Request, n: int) -> list[str]:
        plan = plan_preemption(req, n, await self.view_async(backend=req.backend, project=self._victims_of(req)),
                               time.time())
        victims = [v.id for _, vs in plan.values() for v in vs]
        await self._pause_all(victims, "preempt")
        return victims

    async def _pause_all(self, ids: list[str], by: str) -> int:
        async def one(sid: str) -> int:
            try:
                await self.node.pause(sid, by=by)
                return 1
            except ShoalError as e:  # closed or died meanwhile: another victim's room will do
                log.info("could not pause %s for %s: %s", sid, by, e)
                return 0

        return sum(await asyncio.gather(*(one(s) for s in ids)))

    # ---- compute tides and the pressure response -------------------------------------------------------
    async def tide_once(self, *, need_mb: float = 0.0, idle_s: float | None = None, by: str = "tides",
                        ) -> list[str]:
        """One tide pass: when the host's memory is tight (over `tide_high`), pause idle sandboxes (longest
        idle first, `sched.plan_tides`) until it is under `tide_low`; returns their ids.

        With `need_mb` (the pressure response to a create about to be refused) the pass runs whatever
        the fraction in use, to free `need_mb` from sandboxes idle at least `idle_s` — the same decision
        with the node's watermark folded into its thresholds."""
        total, avail = _meminfo_mb()
        t0 = time.monotonic()
        self.last_tide = {"at": time.time(), "used_mb": total - avail, "total_mb": total, "paused": [], "by": by,
                          "need_mb": round(need_mb, 1)}
        if total <= 0:
            return []
        policy = self.policy
        used = total - avail
        if need_mb > 0:
            high = max(1e-6, min(policy.tide_high, (used - 1) / total))
            low = max(1e-6, min(high, (used - need_mb) / total))
            policy = replace(policy, tide_high=high, tide_low=low,
                             tide_idle_s=policy.tide_idle_s if idle_s is None else idle_s)
        elif used < policy.tide_high * total:
            return []
        cluster = await self.view_async(used=True, policy=policy)
        victims = [v.id for v in plan_tides(self.node.config.node_id, cluster, time.time())][:MAX_PAUSED_PER_PASS]
        paused = await self._pause_all_ids(victims, by)
        _, avail_after = _meminfo_mb()
        self.last_tide.update(paused=paused, used_after_mb=total - avail_after, freed_mb=avail_after - avail,
                              seconds=round(time.monotonic() - t0, 3))
        self.tide_totals["passes"] += 1
        self.tide_totals["paused"] += len(paused)
        if paused:
            log.info("%s: paused %d idle sandboxes (host memory %d of %d MiB in use)", by, len(paused), used, total)
        return paused

    async def _pause_all_ids(self, ids: list[str], by: str) -> list[str]:
        done: list[str] = []

        async def one(sid: str) -> None:
            if await self._pause_all([sid], by):
                done.append(sid)

        # a few at a time: each pause reclaims its memory (a freezer write, then reclaim of its cgroup)
        for i in range(0, len(ids), 16):
            await asyncio.gather(*(one(sid) for sid in ids[i:i + 16]))
        return done

    async def relieve(self, spec: SandboxSpec, err: CapacityExceeded) -> Any:
        """The pressure response to a create admission refused for memory: pause and reclaim the longest-idle
        sandboxes (idle at least `pressure_idle_s`) to make room, then reserve again; raises the refusal,
        saying what was tried, when that is not enough."""
        adm = self.node.admission
        async with self._lock:
            with contextlib.suppress(CapacityExceeded):
                return adm.reserve(spec)  # another create's pass freed room meanwhile
            paused: list[str] = []
            now = time.monotonic()
            if self.tides_enabled and now >= self._quiet_until:
                exp = adm.expected_mb(int(spec.memory_mb))
                need = max(PRESSURE_MARGIN_MB, exp - adm.headroom_mb() + PRESSURE_MARGIN_MB)
                paused = await self.tide_once(need_mb=need, idle_s=self.pressure_idle_s, by="pressure")
                if not paused:
                    # nothing idle enough to pause: do not scan again for every create of a burst
                    self._quiet_until = time.monotonic() + PRESSURE_QUIET_S
            try:
                return adm.reserve(spec)
            except CapacityExceeded as e:
                e.details.update(paused_for_room=len(paused), pressure_idle_s=self.pressure_idle_s)
                what = (f"{len(paused)} idle sandboxes were paused and reclaimed first, not enough"
                        if paused else f"no sandbox was idle for {self.pressure_idle_s:g} s to pause")
                e.message = f"{e.message} ({what})"
                e.args = (e.message,)
                raise e from err

    def rearm(self) -> None:
        """Let the next tide or pressure pass run now, even right after one that found nothing to pause."""
        self._quiet_until = 0.0

    def start(self) -> None:
        """Start the tide loop (when tides are on)."""
        if self.tides_enabled and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="shoal-tides")

    async def stop(self) -> None:
        """Stop the tide loop; close the trace file."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self.trace is not None:
            self.trace.close()

    def sample_working_sets(self, k: int = 8, ids: list[str] | None = None) -> int:
        """Measure the working sets of `k` running sandboxes picked at random (from `ids`, a snapshot of
        `last_used` taken on the event loop, when this runs in a thread) and hand them to admission (its
        estimate of what a new sandbox takes). Returns how many were measured."""
        from shoal.host.cgroups import SandboxCgroup

        # never iterate last_used itself from a thread: creates and closes change it meanwhile ("dictionary
        # changed size during iteration" ended tide passes under churn, issue 24)
        ids = list(self.last_used) if ids is None else ids
        done = 0
        for sid in random.sample(ids, min(k, len(ids))):
            try:
                rec = self.node.record(sid)
            except ShoalError:
                continue
            if rec.state != "running" or not rec.cgroup or rec.extra.get("pool"):
                continue
            ws = SandboxCgroup(rec.cgroup).working_set_bytes()
            if ws is not None:
                self.node.admission.note_usage(ws / 2**20)
                done += 1
        return done

    async def _loop(self) -> None:
        # memory is checked every tide_interval_s (a /proc/meminfo read); a pass only runs when it is tight,
        # and after a pass that found nothing to pause, not again for PRESSURE_QUIET_S
        tick = 0
        while True:
            await asyncio.sleep(self.tide_interval_s)
            tick += 1
            try:
                if tick % 5 == 1:
                    await asyncio.to_thread(self.sample_working_sets, 8, list(self.last_used))
                total, avail = _meminfo_mb()
                if total and total - avail >= self.policy.tide_high * total and time.monotonic() >= self._quiet_until:
                    async with self._lock:
                        if not await self.tide_once():
                            self._quiet_until = time.monotonic() + PRESSURE_QUIET_S
            except Exception as e:  # a tide pass must never take the node down
                log.warning("tide pass failed: %s", e)


def _cpu_count() -> int:
    import os

    return os.cpu_count() or 1

