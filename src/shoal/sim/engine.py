"""The simulator: a trace replayed through the real scheduler (`shoal.sched`) over virtual nodes in virtual time.

Each simulated node is a `shoal.sched.NodeState` in a `Cluster`, kept current exactly as the cluster
runtime keeps its view (`reserve`, `release`, `paused`, `resumed`, `mount_done`, `unmounted`), so
every decision — placement, fair share, preemption, tides, resume — is the production code's.

What the simulator models around the decisions (the knobs are `SimConfig` fields):

* a request waits in a `FairQueue` until `place` finds a node (placement delay = placed - arrival); a
  request still waiting after `max_wait_s` is rejected (its client gave up);
* the node mounts the request's cold layers (each takes ~`mount_s`, log-normal) and starts the
  sandbox at most `node_start_rate` per second, `start_s` after its layers are there (ready delay);
* a sandbox gets calls for its trace's `active_s`, then idles until its final call at close time: it
  counts as in use until its active phase ends (so only idle sandboxes are ever paused);
* a paused sandbox gives back `reclaim_fraction` (60%) of its used memory; its final call resumes it when
  its node has room (`can_resume`), paying `resume_s` plus the prefetch of that memory, or waits for room
  (both figures from `shoal bench tides` on a real node);
* an unused layer stays mounted `layer_keep_s` (locality for the next sandbox of the image).
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import time
from array import array
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from shoal.errors import CapacityExceeded
from shoal.limits import DEFAULT_BACKEND
from shoal.sched import (
    Cluster,
    FairQueue,
    JobBook,
    NodeState,
    Placement,
    Policy,
    Request,
    SandboxView,
    can_resume,
    place,
    plan_preemption,
    plan_tides,
)
from shoal.sim.trace import TraceRecord, iter_sorted

_ARRIVE, _CLOSE, _MOUNTED, _UNMOUNT, _TIDE, _SAMPLE, _CALLED, _RETRY = range(8)


@dataclass
class SimConfig:
    """The simulated cluster and what happens around the scheduler's decisions."""

    nodes: int = 160
    node_cpus: float = 190.0
    node_memory_mb: int = 1_572_864
    policy: Policy = field(default_factory=Policy)
    #: pause idle lower-priority sandboxes for a request that finds no room
    preempt: bool = True
    #: pause idle sandboxes on nodes whose used memory is over the policy's tide_high
    tides: bool = True
    tide_interval_s: float = 30.0
    #: a blocked queue asks for a preemption plan at most this often (seconds)
    preempt_retry_s: float = 5.0
    max_wait_s: float = 3600.0
    mount_s: float = 0.5
    start_s: float = 0.15
    node_start_rate: float = 400.0
    #: share of a paused sandbox's used memory given back (measured on a real node with zram swap by
    #: `shoal bench tides`: 53-77%)
    reclaim_fraction: float = 0.6
    #: a resume costs this plus reading back what was given (measured: a tided sandbox's first request
    #: took ~150 ms more than a running one's, p50, for ~21 MiB given back)
    resume_s: float = 0.1
    resume_mb_per_s: float = 400.0
    layer_keep_s: float = 600.0
    sample_s: float = 60.0
    seed: int = 0


@dataclass(slots=True)
class SimSandbox(SandboxView):
    """A simulated sandbox: what the scheduler sees (SandboxView) plus its trace and timeline."""

    rec: TraceRecord | None = None
    req: Request | None = None
    arrival: float = 0.0
    ready_at: float = -1.0
    close_at: float = 0.0
    returned_mb: int = 0
    paused_by: str = ""
    paused_at: float = -1.0
    waiting_resume: bool = False


@dataclass
class _Burst:
    size: int = 0
    priority: str = ""
    first_arrival: float = math.inf
    last_placed: float = 0.0
    last_ready: float = 0.0
    placed: int = 0
    rejected: int = 0
    sched_s: float = 0.0


@dataclass
class SimResult:
    """Everything a run measured (`to_dict` for JSON; see shoal.sim.report for figures and text)."""

    config: dict[str, Any]
    counts: dict[str, int]
    delays: dict[str, dict[str, float]]
    ready_delays: dict[str, dict[str, float]]
    bursts: list[dict[str, Any]]
    series: dict[str, list[float]]
    per_node_at_peak: list[int]
    scheduler: dict[str, float]
    invariants: dict[str, Any]
    tides: dict[str, float]
    wall_s: float = 0.0
    raw_delays: dict[str, list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (without the raw delay samples)."""
        return {k: v for k, v in self.__dict__.items() if k != "raw_delays"}


def _quantiles(xs: array) -> dict[str, float]:
    if not len(xs):
        return {"n": 0}
    s = sorted(xs)
    n = len(s)

    def q(p: float) -> float:
        return round(s[min(n - 1, int(p * n))], 3)

    return {"n": n, "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": round(s[-1], 3),
            "mean": round(sum(s) / n, 3)}


class Simulation:
    """One run of a trace over a simulated cluster (see the module docstring)."""

    def __init__(self, records: Iterable[TraceRecord], cfg: SimConfig | None = None) -> None:
        self.cfg = c = cfg or SimConfig()
        self.policy = p = c.policy
        nodes = [NodeState.new(f"n{i}", c.node_cpus, c.node_memory_mb, p) for i in range(c.nodes)]
        self.cluster = Cluster(nodes, p, seed=c.seed)
        self.book = JobBook(p)
        self.queue = FairQueue(p, self.book)
        self.rng = random.Random(c.seed + 1)
        self._records: Iterator[TraceRecord] = iter_sorted(records)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.now = 0.0
        self._epoch = 0
        self._blocked = -1
        self._next_preempt = 0.0
        self._retry_at = -1.0
        self._preempt_batch = 0
        self._ids = 0
        self._arrivals_left = True
        self.live = 0
        self.refs: dict[str, dict[str, int]] = {n.node_id: {} for n in nodes}
        self.layer_ready: dict[str, dict[str, float]] = {n.node_id: {} for n in nodes}
        self.start_clock = dict.fromkeys(self.refs, 0.0)
        self.resume_wait: dict[str, deque[SimSandbox]] = {nid: deque() for nid in self.refs}
        self._tide_skip: dict[str, float] = {}
        # measurements
        self.n = dict.fromkeys(("arrived", "placed", "rejected", "closed", "preempted", "tide_paused", "resumed",
                                "closed_paused", "limit_violations", "preempt_plans", "tide_plans",
                                "placements_failed", "waits_for_mounts"), 0)
        self.sched_s = 0.0
        self.decisions = 0
        ranks = range(len(p.priorities))
        self.delay = {r: array("d") for r in ranks}
        self.ready = {r: array("d") for r in ranks}
        self.rejected = dict.fromkeys(ranks, 0)
        self.resume_waits = array("d")
        self.resume_costs = array("d")
        self.tide_returned_mb = 0
        self.preempt_returned_mb = 0
        self.bursts: dict[str, _Burst] = {}
        self.series: dict[str, list[float]] = {k: [] for k in (
            "t", "live", "running", "paused", "waiting", "committed_mb", "paused_mb", "used_mb", "cpus_used",
            "node_live_max", "node_live_min")}
        self._peak_live = -1
        self.per_node_at_peak: list[int] = []
        self.cpus_used = 0.0

    # ---- events ------------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, obj))

    def _next_arrival(self) -> None:
        rec = next(self._records, None)
        if rec is None:
            self._arrivals_left = False
        else:
            self._push(rec.t, _ARRIVE, rec)

    def run(self) -> SimResult:
        """Replay the whole trace, then let every sandbox finish; returns the measurements.

        Python's cyclic garbage collector is off meanwhile: the simulation makes no reference cycles worth
        collecting, and a full collection over 400,000 live sandboxes would otherwise land inside whichever
        scheduler decision is being timed (and cost minutes over a day)."""
        was = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if was:
                gc.enable()

    def _run(self) -> SimResult:
        wall0 = time.perf_counter()
        self._next_arrival()
        self._push(0.0, _SAMPLE, None)
        if self.cfg.tides:
            self._push(self.cfg.tide_interval_s, _TIDE, None)
        heap = self._heap
        pop = heapq.heappop
        while heap:
            t, _, kind, obj = pop(heap)
            self.now = t
            if kind == _ARRIVE:
                self._arrive(obj)
            elif kind == _CLOSE:
                self._close_due(obj)
            elif kind == _MOUNTED:
                self.cluster.mount_done(obj[0], obj[1])
                self._epoch += 1
                self._drain()
            elif kind == _UNMOUNT:
                self._unmount(obj)
            elif kind == _CALLED:
                self._close(obj)
            elif kind == _TIDE:
                self._tide()
                if self._busy():
                    self._push(t + self.cfg.tide_interval_s, _TIDE, None)
            elif kind == _SAMPLE:
                self._sample()
                if self._busy():
                    self._push(t + self.cfg.sample_s, _SAMPLE, None)
            elif kind == _RETRY:
                self._retry_at = -1.0
                self._epoch += 1
                self._drain()
        # whatever still waits can never be placed (nothing is left to free room)
        while (it := self.queue.pop()) is not None:
            self._reject(it[0])
        return self._result(time.perf_counter() - wall0)

    def _busy(self) -> bool:
        return self._arrivals_left or self.live > 0 or len(self.queue) > 0

    # ---- arrivals and placement ----------------------------------------------------------------
    def _arrive(self, rec: TraceRecord) -> None:
        self.n["arrived"] += 1
        p = self.policy
        prio = p.rank(rec.priority or None)
        job = rec.job or f"project:{rec.project}"
        req = Request(rec.cpus, rec.memory_mb, 0, DEFAULT_BACKEND, rec.image, rec.layers, prio, job, rec.project)
        self._ids += 1
        sb = SimSandbox(str(self._ids), "", rec.memory_mb, rec.cpus, prio, job, rec.project, "running", 0.0,
                        rec.used_mb, rec, req, rec.t)
        if rec.burst is not None:
            b = self.bursts.get(rec.burst)
            if b is None:
                b = self.bursts[rec.burst] = _Burst(priority=rec.priority)
            b.size += 1
            b.first_arrival = min(b.first_arrival, rec.t)
        self.queue.push(sb, req)
        self._next_arrival()
        self._drain()

    def _drain(self) -> None:
        if self._blocked == self._epoch:
            return
        q = self.queue
        cluster = self.cluster
        clock = time.process_time
        max_wait = self.cfg.max_wait_s
        while True:
            it = q.pop()  # put back (keeping its turn) when it cannot be placed
            if it is None:
                self._preempt_batch = 0
                return
            sb, req = it
            if self.now - sb.arrival > max_wait:
                self._reject(sb)
                continue
            t0 = clock()
            why = ""
            try:
                pl: Placement | None = place(req, cluster)
            except CapacityExceeded as e:
                pl = None
                why = str(e.details.get("reason", ""))
            dt = clock() - t0
            self.sched_s += dt
            self.decisions += 1
            if sb.rec is not None and sb.rec.burst is not None:
                self.bursts[sb.rec.burst].sched_s += dt
            if pl is None:
                q.push_front(sb, req)
                self.n["placements_failed"] += 1
                if why == "mounting":
                    self.n["waits_for_mounts"] += 1
                elif self.cfg.preempt and self._preempt(req):
                    continue
                self._blocked = self._epoch
                return
            self._start(sb, req, pl)

    def _reject(self, sb: SimSandbox) -> None:
        self.n["rejected"] += 1
        self.rejected[sb.priority] += 1
        if sb.rec is not None and sb.rec.burst is not None:
            self.bursts[sb.rec.burst].rejected += 1

    def _start(self, sb: SimSandbox, req: Request, pl: Placement) -> None:
        c = self.cfg
        node = self.cluster.reserve(pl, req)
        if node.committed_mb > node.mem_limit_mb or node.committed_cpus > node.cpu_limit + 1e-6 or (
                node.max_sandboxes and node.running > node.max_sandboxes):
            self.n["limit_violations"] += 1
        nid = pl.node_id
        self.book.charge(req.job, req.project, 1)
        self.n["placed"] += 1
        self.live += 1
        now = self.now
        sb.node_id = nid
        self.delay[sb.priority].append(now - sb.arrival)
        refs = self.refs[nid]
        lr = self.layer_ready[nid]
        layers_at = now
        cold = pl.cold_layers
        mounted_at = now
        for d in req.layers:
            refs[d] = refs.get(d, 0) + 1
            if d in cold:
                at = now + self.rng.lognormvariate(math.log(c.mount_s), 0.5)
                lr[d] = at
                mounted_at = max(mounted_at, at)
            else:
                at = lr.get(d, now)
            layers_at = max(layers_at, at)
        if cold:
            self._push(mounted_at, _MOUNTED, (nid, len(cold)))
        sc = max(self.start_clock[nid], now) + 1.0 / c.node_start_rate
        self.start_clock[nid] = sc
        ready = max(layers_at, sc) + c.start_s
        rec = sb.rec
        assert rec is not None
        sb.ready_at = ready
        sb.last_used = ready + rec.active_s  # in use (calls) until its active phase ends
        sb.close_at = ready + rec.lifetime
        node.used_mb += sb.used_mb
        self.cpus_used += sb.cpus * rec.cpu_frac
        self.cluster.track(sb)
        self.ready[sb.priority].append(ready - sb.arrival)
        if rec.burst is not None:
            b = self.bursts[rec.burst]
            b.placed += 1
            b.last_placed = max(b.last_placed, now)
            b.last_ready = max(b.last_ready, ready)
        self._push(sb.close_at, _CLOSE, sb)

    # ---- preemption, tides, resume -------------------------------------------------------------
    def _preempt(self, req: Request) -> bool:
        if self.now < self._next_preempt:
            self._wake_at(self._next_preempt)
            return False
        # a burst arrives one create at a time: plan for what waits, and for twice as much as the
        # last plan of this blocked stretch (so a 32k burst takes ~10 plans, not 32k)
        self._preempt_batch = min(max(self._preempt_batch * 2, 64), 32_000)
        want = max(self.queue.waiting(req.priority), self._preempt_batch)
        clock = time.process_time
        t0 = clock()
        plan = plan_preemption(req, want, self.cluster, self.now)
        self.sched_s += clock() - t0
        self.decisions += 1
        self.n["preempt_plans"] += 1
        if not plan:
            self._next_preempt = self.now + self.cfg.preempt_retry_s
            self._wake_at(self._next_preempt)
            return False
        for _copies, victims in plan.values():
            for v in victims:
                self.preempt_returned_mb += self._pause(v, "preempt")  # type: ignore[arg-type]
                self.n["preempted"] += 1
        return True

    def _wake_at(self, t: float) -> None:
        if self._retry_at < 0 or t < self._retry_at:
            self._retry_at = t
            self._push(t, _RETRY, None)

    def _pause(self, sb: SimSandbox, why: str) -> int:
        returned = int(sb.used_mb * self.cfg.reclaim_fraction)
        self.cluster.paused(sb, returned)
        sb.returned_mb = returned
        sb.paused_by = why
        sb.paused_at = self.now
        if sb.rec is not None:
            self.cpus_used -= sb.cpus * sb.rec.cpu_frac
        self._epoch += 1
        return returned

    def _tide(self) -> None:
        p = self.policy
        clock = time.process_time
        paused = 0
        for node in self.cluster:
            if node.used_mb < p.tide_high * node.memory_mb:
                continue
            if self._tide_skip.get(node.node_id, -1.0) > self.now:
                continue
            t0 = clock()
            victims = plan_tides(node.node_id, self.cluster, self.now)
            self.sched_s += clock() - t0
            self.decisions += 1
            self.n["tide_plans"] += 1
            if not victims:
                # nothing idle long enough: look again once more sandboxes may have gone idle
                self._tide_skip[node.node_id] = self.now + p.tide_idle_s / 4
                continue
            for v in victims:
                self.tide_returned_mb += self._pause(v, "tide")  # type: ignore[arg-type]
                self.n["tide_paused"] += 1
                paused += 1
        if paused:
            self._drain()

    def _close_due(self, sb: SimSandbox) -> None:
        """The sandbox's final call (grading) and close are due."""
        if sb.state == "paused" and sb.rec is not None and sb.rec.final_call:
            if can_resume(sb, self.cluster):
                self._resume(sb)
            else:
                sb.waiting_resume = True
                self.resume_wait[sb.node_id].append(sb)
            return
        self._close(sb)

    def _resume(self, sb: SimSandbox) -> None:
        self.cluster.resumed(sb, self.now, sb.returned_mb)
        if sb.rec is not None:
            self.cpus_used += sb.cpus * sb.rec.cpu_frac
        self.n["resumed"] += 1
        self.resume_waits.append(self.now - sb.close_at)
        cost = self.cfg.resume_s + sb.returned_mb / self.cfg.resume_mb_per_s
        self.resume_costs.append(cost)
        sb.waiting_resume = False
        self._push(self.now + cost, _CALLED, sb)

    def _try_resumes(self, nid: str) -> None:
        waiting = self.resume_wait[nid]
        while waiting and can_resume(waiting[0], self.cluster):
            self._resume(waiting.popleft())

    def _close(self, sb: SimSandbox) -> None:
        nid = sb.node_id
        node = self.cluster.node(nid)
        req = sb.req
        assert req is not None and sb.rec is not None
        if sb.state == "paused":
            self.cluster.release(nid, req, paused=True)
            node.used_mb -= sb.used_mb - sb.returned_mb
            self.n["closed_paused"] += 1
        else:
            self.cluster.release(nid, req)
            node.used_mb -= sb.used_mb
            self.cpus_used -= sb.cpus * sb.rec.cpu_frac
        self.cluster.untrack(nid, sb.id)
        self.book.charge(req.job, req.project, -1)
        self.live -= 1
        self.n["closed"] += 1
        refs = self.refs[nid]
        for d in req.layers:
            left = refs[d] - 1
            if left:
                refs[d] = left
            else:
                del refs[d]
                self._push(self.now + self.cfg.layer_keep_s, _UNMOUNT, (nid, d))
        self._epoch += 1
        self._try_resumes(nid)
        self._drain()

    def _unmount(self, obj: tuple[str, str]) -> None:
        nid, d = obj
        if d in self.refs[nid]:
            return  # in use again
        self.layer_ready[nid].pop(d, None)
        self.cluster.unmounted(nid, (d,))

    # ---- measurements --------------------------------------------------------------------------
    def _sample(self) -> None:
        s = self.series
        committed = paused_mb = used = running = paused = 0
        lo, hi = 1 << 62, 0
        per_node = []
        for n in self.cluster:
            committed += n.committed_mb
            paused_mb += n.paused_mb
            used += n.used_mb
            running += n.running
            paused += n.paused
            live = n.running + n.paused
            per_node.append(live)
            lo = min(lo, live)
            hi = max(hi, live)
        s["t"].append(self.now)
        s["live"].append(running + paused)
        s["running"].append(running)
        s["paused"].append(paused)
        s["waiting"].append(len(self.queue))
        s["committed_mb"].append(committed)
        s["paused_mb"].append(paused_mb)
        s["used_mb"].append(used)
        s["cpus_used"].append(round(self.cpus_used, 1))
        s["node_live_max"].append(hi)
        s["node_live_min"].append(lo if per_node else 0)
        if running + paused > self._peak_live:
            self._peak_live = running + paused
            self.per_node_at_peak = per_node

    def _result(self, wall: float) -> SimResult:
        p = self.policy
        c = self.cfg
        names = p.priorities
        delays = {names[r]: _quantiles(xs) for r, xs in self.delay.items()}
        readies = {names[r]: _quantiles(xs) for r, xs in self.ready.items()}
        for r in self.delay:
            delays[names[r]]["rejected"] = self.rejected[r]
        bursts = []
        for bid, b in self.bursts.items():
            bursts.append({"id": bid, "priority": b.priority, "size": b.size, "placed": b.placed,
                           "rejected": b.rejected, "placed_s": round(b.last_placed - b.first_arrival, 3),
                           "completion_s": round(b.last_ready - b.first_arrival, 3) if b.placed == b.size else None,
                           "sched_s": round(b.sched_s, 4)})
        bursts.sort(key=lambda b: -b["size"])
        left_paused = sum(1 for n in self.cluster for v in n.sandboxes.values() if v.state == "paused")
        waiting_resume = sum(len(w) for w in self.resume_wait.values())
        pauses = self.n["preempted"] + self.n["tide_paused"]
        invariants = {
            "limit_violations": self.n["limit_violations"],
            "arrived": self.n["arrived"],
            "placed_plus_rejected": self.n["placed"] + self.n["rejected"],
            "still_live": self.live,
            "still_waiting": len(self.queue),
            "paused": pauses,
            "resumed": self.n["resumed"],
            "closed_while_paused": self.n["closed_paused"],
            "left_paused": left_paused,
            "left_waiting_resume": waiting_resume,
            "ok": (self.n["limit_violations"] == 0 and self.live == 0 and len(self.queue) == 0
                   and self.n["placed"] + self.n["rejected"] == self.n["arrived"]
                   and pauses == self.n["resumed"] + self.n["closed_paused"] and left_paused == 0
                   and waiting_resume == 0),
        }
        sched = {"decisions": self.decisions, "cpu_s": round(self.sched_s, 3),
                 "decisions_per_s": round(self.decisions / self.sched_s) if self.sched_s else 0}
        big = [b for b in bursts if b["size"] == bursts[0]["size"]] if bursts else []
        if big:
            sched["largest_burst"] = big[0]["size"]
            sched["largest_burst_sched_s_max"] = max(b["sched_s"] for b in big)
        tides = {"returned_mb_tides": self.tide_returned_mb, "returned_mb_preempt": self.preempt_returned_mb,
                 "resume_wait_s": _quantiles(self.resume_waits), "resume_cost_s": _quantiles(self.resume_costs)}
        cfg = {k: v for k, v in c.__dict__.items() if k != "policy"}
        cfg["policy"] = {k: (list(v) if isinstance(v, tuple) else v) for k, v in p.__dict__.items()
                         if not k.startswith("_")}
        return SimResult(config=cfg, counts=dict(self.n), delays=delays, ready_delays=readies, bursts=bursts,
                         series=self.series, per_node_at_peak=self.per_node_at_peak, scheduler=sched,
                         invariants=invariants, tides=tides, wall_s=round(wall, 2),
                         raw_delays={names[r]: list(xs) for r, xs in self.delay.items()})
