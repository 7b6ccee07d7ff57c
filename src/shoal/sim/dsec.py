"""A DSec-shaped day of sandboxes (`shoal sim --trace dsec`), from the figures DSec published.

The published shape (arXiv 2609.22978; see docs/scheduling.md for the sources): ≈3M sandboxes a day
on ≈160 nodes of ≈190 cores and ≈1.5 TiB; ≈380,000 alive at the peak; one training step asks for up
to 32,000 within seconds (p50 ≈2,500 per task); lifetimes median ≈17 min with p99 beyond 3 h; 90% of
sandboxes use under 5% of the CPU they ask for; an image is shared by 1-3 sandboxes (median).

The mix that gives it (all numbers are fields of `DsecShape`):

* train-rollout: one large RL run stepping every 40 min with 32,000-sandbox bursts, and six runs
  stepping every ~30 min with bursts of median 2,528 (log-normal); each burst arrives within 2-8 s;
  GRPO-style groups of 2 rollouts share one task image; lifetimes log-normal (median 8 min, σ 1.9:
  a heavy tail of multi-hour trajectories);
* eval: a burst of median 1,000 every 15 min, lifetimes median 30 min;
* batch: environment builds and data generation, ≈650k a day, Poisson with a daily wave (±60%),
  lifetimes median 5 h;
* interactive: users' sandboxes, ≈220k a day, Poisson with the same wave, lifetimes median 4 h.

Together: ≈3.05M sandboxes, a trace-implied peak of ≈390k alive, overall median lifetime ≈24 min.

Every sandbox is active (gets calls) for the first 30-90% of its life and idle afterwards until its
final call (grading) and close — the idle tide that pausing reclaims.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

from shoal.sim.trace import TraceRecord

PRIORITIES = ("train-rollout", "eval", "interactive", "batch")


@dataclass
class DsecShape:
    """Knobs of the generated day (defaults: DSec's published shape at scale 1)."""

    duration_s: float = 86_400.0
    nodes: int = 160
    node_cpus: float = 190.0
    node_memory_mb: int = 1_572_864  # 1.5 TiB
    # train-rollout
    big_runs: int = 1
    big_burst: int = 32_000
    big_period_s: float = 2_400.0
    runs: int = 6
    run_burst_median: float = 2_528.0
    run_burst_sigma: float = 0.7
    run_period_s: float = 1_800.0
    burst_window_s: tuple[float, float] = (2.0, 8.0)
    group: int = 2
    rollout_life_median_s: float = 8 * 60.0
    rollout_life_sigma: float = 1.9
    rollout_tasks: int = 60_000
    # eval
    eval_period_s: float = 900.0
    eval_burst_median: float = 1_000.0
    eval_burst_sigma: float = 0.8
    eval_life_median_s: float = 30 * 60.0
    eval_life_sigma: float = 1.0
    # batch and interactive (Poisson with a daily wave)
    batch_per_day: float = 650_000.0
    batch_life_median_s: float = 5 * 3600.0
    batch_life_sigma: float = 0.8
    interactive_per_day: float = 220_000.0
    interactive_life_median_s: float = 4 * 3600.0
    interactive_life_sigma: float = 1.0
    interactive_workspaces: int = 4_000
    wave: float = 0.6
    max_life_s: float = 24 * 3600.0
    # sizes
    memory_mb: tuple[int, ...] = (1024, 2048, 4096, 8192)
    memory_weights: tuple[float, ...] = (0.40, 0.38, 0.17, 0.05)
    cpus: tuple[float, ...] = (1.0, 2.0)
    cpus_weights: tuple[float, ...] = (0.85, 0.15)
    bases: int = 8
    toolkits: int = 4
    #: multiplies every count (bursts, Poisson volumes) and the number of nodes
    scale: float = 1.0
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def scaled_nodes(self) -> int:
        """Nodes of the simulated cluster at this scale."""
        return max(2, round(self.nodes * self.scale))


def shape_from(options: dict[str, Any]) -> DsecShape:
    """A DsecShape with some fields replaced (unknown names raise TypeError naming them)."""
    names = {f.name for f in fields(DsecShape)}
    bad = set(options) - names
    if bad:
        raise TypeError(f"unknown dsec option(s): {sorted(bad)}")
    return DsecShape(**options)


def generate(shape: DsecShape | None = None) -> Iterator[TraceRecord]:
    """The day's sandboxes in arrival order."""
    import numpy as np

    s = shape or DsecShape()
    rng = np.random.default_rng(s.seed)
    cols: dict[str, list[Any]] = {k: [] for k in ("t", "life", "prio", "job", "burst", "task")}
    jobs: list[str] = []
    bursts: list[str] = []

    def add(t: Any, life: Any, prio: int, job: str, burst: str | None, task: Any) -> None:
        n = len(t)
        jobs.append(job)
        cols["t"].append(t)
        cols["life"].append(life)
        cols["prio"].append(np.full(n, prio, dtype=np.int8))
        cols["job"].append(np.full(n, len(jobs) - 1, dtype=np.int32))
        if burst is not None:
            bursts.append(burst)
        cols["burst"].append(np.full(n, len(bursts) - 1 if burst is not None else -1, dtype=np.int32))
        cols["task"].append(task)

    def lives(n: int, median: float, sigma: float) -> Any:
        return np.minimum(rng.lognormal(math.log(median), sigma, n), s.max_life_s)

    def burst_at(t0: float, size: float, prio: int, job: str, median: float, sigma: float, group: int,
                 tasks: int, task_base: int) -> None:
        n = max(1, round(size))
        t = t0 + rng.uniform(0.0, rng.uniform(*s.burst_window_s), n)
        ngroups = -(-n // group)
        task = task_base + np.repeat(rng.integers(0, tasks, ngroups), group)[:n]
        add(np.sort(t), lives(n, median, sigma), prio, job, job, task)

    # train-rollout: one step = one burst
    task_base = 0
    for r in range(s.big_runs):
        t = rng.uniform(0, s.big_period_s)
        k = 0
        while t < s.duration_s:
            burst_at(t, s.big_burst * s.scale, 0, f"big{r}/step{k}", s.rollout_life_median_s,
                     s.rollout_life_sigma, s.group, s.rollout_tasks, task_base)
            t += s.big_period_s * rng.uniform(0.9, 1.1)
            k += 1
        task_base += s.rollout_tasks
    for r in range(s.runs):
        t = rng.uniform(0, s.run_period_s)
        k = 0
        while t < s.duration_s:
            n = min(rng.lognormal(math.log(s.run_burst_median), s.run_burst_sigma), s.big_burst) * s.scale
            burst_at(t, n, 0, f"run{r}/step{k}", s.rollout_life_median_s, s.rollout_life_sigma, s.group,
                     s.rollout_tasks, task_base)
            t += s.run_period_s * rng.uniform(0.8, 1.2)
            k += 1
        task_base += s.rollout_tasks
    # eval: bursts of one task each
    t = rng.uniform(0, s.eval_period_s)
    k = 0
    while t < s.duration_s:
        n = rng.lognormal(math.log(s.eval_burst_median), s.eval_burst_sigma) * s.scale
        burst_at(t, n, 1, f"eval/{k}", s.eval_life_median_s, s.eval_life_sigma, 1, 5_000, task_base)
        t += s.eval_period_s * rng.uniform(0.8, 1.2)
        k += 1
    task_base += 5_000

    # Poisson with a daily wave (thinning), peak mid-day
    def poisson(per_day: float) -> Any:
        peak = per_day / 86_400.0 * (1 + s.wave) * s.scale
        n = rng.poisson(peak * s.duration_s)
        t = np.sort(rng.uniform(0, s.duration_s, n))
        keep = rng.uniform(0, 1, n) < (1 + s.wave * np.sin(2 * math.pi * (t / 86_400.0 - 0.25))) / (1 + s.wave)
        return t[keep]

    t = poisson(s.interactive_per_day)
    add(t, lives(len(t), s.interactive_life_median_s, s.interactive_life_sigma), 2, "interactive", None,
        task_base + rng.integers(0, s.interactive_workspaces, len(t)))
    task_base += s.interactive_workspaces
    t = poisson(s.batch_per_day)
    add(t, lives(len(t), s.batch_life_median_s, s.batch_life_sigma), 3, "batch", None,
        task_base + np.arange(len(t)))

    t = np.concatenate(cols["t"])
    order = np.argsort(t, kind="stable")
    t = t[order]
    life = np.concatenate(cols["life"])[order]
    prio = np.concatenate(cols["prio"])[order]
    job = np.concatenate(cols["job"])[order]
    burst = np.concatenate(cols["burst"])[order]
    task = np.concatenate(cols["task"])[order]
    n = len(t)
    mem = rng.choice(np.array(s.memory_mb), n, p=_norm(s.memory_weights))
    cpus = rng.choice(np.array(s.cpus), n, p=_norm(s.cpus_weights))
    used = (mem * rng.beta(2.0, 6.0, n)).astype(np.int64) + 16
    busy = rng.uniform(0, 1, n) < 0.1
    cpu_frac = np.where(busy, rng.uniform(0.1, 1.0, n), rng.uniform(0.005, 0.05, n))
    active = life * rng.uniform(0.3, 0.9, n)
    final = rng.uniform(0, 1, n) < 0.8
    base = task % s.bases
    kit = (task // s.bases) % s.toolkits
    base_names = [f"base{i}" for i in range(s.bases)]
    kit_names = [f"toolkit{i}" for i in range(s.toolkits)]
    step = 65_536
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        for ti, li, pi, ji, bi, ki, mi, ci, ui, fi, ai, fc, b0, k0 in zip(
                t[lo:hi].tolist(), life[lo:hi].tolist(), prio[lo:hi].tolist(), job[lo:hi].tolist(),
                burst[lo:hi].tolist(), task[lo:hi].tolist(), mem[lo:hi].tolist(), cpus[lo:hi].tolist(),
                used[lo:hi].tolist(), cpu_frac[lo:hi].tolist(), active[lo:hi].tolist(), final[lo:hi].tolist(),
                base[lo:hi].tolist(), kit[lo:hi].tolist(), strict=True):
            ws = f"task{ki}"
            yield TraceRecord(ti, li, ws, (base_names[b0], kit_names[k0], ws), ci, mi, PRIORITIES[pi], jobs[ji],
                              "default", ui, fi, ai, fc, bursts[bi] if bi >= 0 else None)


def _norm(w: tuple[float, ...]) -> list[float]:
    tot = sum(w)
    return [x / tot for x in w]


def concurrency_profile(records: list[TraceRecord], step_s: float = 60.0) -> tuple[list[float], list[int]]:
    """Sandboxes alive over time if every one started at arrival (the trace's own shape, no scheduler)."""
    import numpy as np

    t = np.array([r.t for r in records])
    e = t + np.array([r.lifetime for r in records])
    end = float(e.max()) if len(e) else 0.0
    grid = np.arange(0.0, end + step_s, step_s)
    alive = np.searchsorted(np.sort(t), grid, side="right") - np.searchsorted(np.sort(e), grid, side="right")
    return grid.tolist(), alive.tolist()
