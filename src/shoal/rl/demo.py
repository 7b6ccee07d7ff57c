"""`shoal demo`: build what is missing, generate the task set, run a rollout, grade it, report.

1. images: `base` (mmdebstrap), the shared Python image and one workspace per project (recipes, cached);
2. tasks: bugs injected into real functions of real PyPI projects, each checked against the project's
   own test suite (cached in the store: a second run creates no sandbox for this);
3. a rollout of N concurrent episodes with scripted policies — some submit the gold patch, some explore
   with shell commands and fix the bug in the sandbox, some submit a wrong fix, give up, or submit a
   patch that does not apply — each graded in a fresh sandbox;
4. rewards, throughput and where the time went, with a live view while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from shoal.rl.rollout import POLICIES, MixedPolicy, RolloutStats, RolloutSummary, rollout
from shoal.rl.taskgen.config import TaskRecipe, load_task_recipe
from shoal.rl.taskgen.generate import GenerationReport, generate_tasks

#: the reward each scripted policy must get: a mismatch means something is broken, and the demo says so
EXPECTED_REWARD = {"gold": 1.0, "explore+fix": 1.0, "wrong": 0.0, "give-up": 0.0, "malformed": 0.0}


@dataclass
class DemoConfig:
    """Knobs of `shoal demo`."""

    episodes: int = 64
    concurrency: int = 64
    grade_concurrency: int | None = None
    max_steps: int = 20
    recipe: str | None = None
    projects: list[str] = field(default_factory=list)
    tasks_per_project: int | None = None
    memory_mb: int = 512
    json_path: str | None = None
    live: bool = True


@dataclass
class DemoReport:
    """Everything the demo measured."""

    wall_s: float = 0.0
    base_s: float = 0.0
    base_built: bool = False
    gen: GenerationReport = field(default_factory=GenerationReport)
    tasks_s: float = 0.0
    tasks: int = 0
    summary: RolloutSummary | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        g = self.gen
        return {"wall_s": self.wall_s, "base_s": self.base_s, "base_built": self.base_built,
                "images_s": g.images_s, "tasks_s": self.tasks_s, "tasks": self.tasks, "tasks_cached": g.from_cache,
                "mutants_s": g.mutants_s, "task_images_s": g.task_images_s, "images": g.images,
                "projects": [p.__dict__ for p in g.projects],
                "rollout": self.summary.to_dict() if self.summary else None}


class _LiveView:
    """What the live display shows while the rollout runs (re-rendered on every refresh)."""

    def __init__(self, stats: RolloutStats, progress: Progress, task_id: Any) -> None:
        self.stats, self.progress, self.task_id = stats, progress, task_id
        self.t0 = time.monotonic()

    def __rich__(self) -> Group:
        s = self.stats
        self.progress.update(self.task_id, completed=s.done)
        el = max(1e-6, time.monotonic() - self.t0)
        mean = s.reward_sum / s.done if s.done else 0.0
        line = Text.assemble(
            ("  creating ", "dim"), (f"{s.count('create'):>3}", "bold"), ("   agent steps ", "dim"),
            (f"{s.count('agent'):>3}", "bold"), ("   grading ", "dim"), (f"{s.count('grade'):>3}", "bold"),
            ("   done ", "dim"), (f"{s.done:>3}", "bold green"), ("   steps ", "dim"), (f"{s.steps}", "bold"),
            ("   mean reward ", "dim"), (f"{mean:.2f}", "bold cyan"), ("   ", ""),
            (f"{s.done / el:.2f} episodes/s", "dim"))
        outs = Text("  " + "  ".join(f"{k} {v}" for k, v in sorted(s.outcomes.items())), style="dim")
        return Group(self.progress, line, outs)


async def run_demo(cfg: DemoConfig, console: Console | None = None) -> DemoReport:
    """Run the whole demo; a failing episode is reported in the summary, never raised."""
    import shoal
    from shoal.images.base import ensure_base

    console = console or Console()
    rep = DemoReport()
    t_start = time.monotonic()
    tr = _recipe(cfg)
    console.rule("[bold]shoal demo[/bold]: agentic RL in real sandboxes")
    console.print(f"[dim]projects:[/dim] {', '.join(f'{p.name} {p.version}' for p in tr.projects)}")
    console.print(f"[dim]rollout:[/dim] {cfg.episodes} episodes, {cfg.concurrency} at once")
    async with shoal.Client() as client:
        node = client.transport.node
        # 1. base image
        t0 = time.monotonic()
        rep.base_built = not node.store.exists("base:latest")
        with console.status("base image: checking…") as status:
            log = _logger(console, status)
            if rep.base_built:
                log("building the base image (Debian bookworm via mmdebstrap)…")
            await asyncio.to_thread(ensure_base, node.store, log)
        rep.base_s = time.monotonic() - t0
        console.print(f"[green]✓[/green] base image {'built' if rep.base_built else 'present'} "
                      f"[dim]({rep.base_s:.1f}s)[/dim]")
        # 2. workspace images + tasks
        t0 = time.monotonic()
        with console.status("task set: checking…") as status:
            tasks = await generate_tasks(node, tr, log=_logger(console, status), report=rep.gen)
        rep.tasks_s = time.monotonic() - t0
        rep.tasks = len(tasks)
        g = rep.gen
        console.print(f"[green]✓[/green] workspace images [dim]({g.images_s:.1f}s)[/dim]: "
                      + ", ".join(v for k, v in g.images.items()))
        tried = sum(p.tried for p in g.projects)
        console.print(f"[green]✓[/green] {len(tasks)} tasks "
                      + ("[dim](cached)[/dim]" if g.from_cache else
                         f"[dim]from {tried} mutants in {g.mutants_s:.1f}s, task images {g.task_images_s:.1f}s[/dim]"))
        # 3. rollout
        stats = RolloutStats(total=cfg.episodes)
        progress = Progress(TextColumn("[bold]rollout[/bold]"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, transient=False)
        tid = progress.add_task("episodes", total=cfg.episodes)
        view = _LiveView(stats, progress, tid)
        coro = rollout(tasks, client=client, episodes=cfg.episodes, concurrency=cfg.concurrency,
                       policy=MixedPolicy(), grade_concurrency=cfg.grade_concurrency, max_steps=cfg.max_steps,
                       stats=stats, memory_mb=cfg.memory_mb)
        if cfg.live and console.is_terminal:
            with Live(view, console=console, refresh_per_second=8, transient=False):
                rep.summary = await coro
        else:
            rep.summary = await _with_ticker(coro, stats, console)
    rep.wall_s = time.monotonic() - t_start
    print_summary(rep, console)
    if cfg.json_path:
        Path(cfg.json_path).write_text(json.dumps(rep.to_dict(), indent=1, default=str))
        console.print(f"[dim]wrote {cfg.json_path}[/dim]")
    return rep


def _recipe(cfg: DemoConfig) -> TaskRecipe:
    tr = load_task_recipe(cfg.recipe).select(cfg.projects or None)
    if cfg.tasks_per_project:
        tr.mutations.tasks_per_project = cfg.tasks_per_project
        tr.mutations.max_candidates = max(tr.mutations.max_candidates, cfg.tasks_per_project + 4)
    return tr


def _logger(console: Console, status: Any) -> Callable[[str], None]:
    def log(msg: str) -> None:
        line = msg.strip()
        if not line:
            return
        status.update(f"[dim]{line[:110]}[/dim]")
        if line.startswith("warning:"):
            console.print(f"  [yellow]{line}[/yellow]")
        # keep what a reader wants in the scrollback; step output stays in the status line only
        elif line.startswith(("built ", "task set ", "downloading ", "building the base")) or ": kept " in line:
            console.print(f"  [dim]{line[:150]}[/dim]")
    return log


async def _with_ticker(coro: Any, stats: RolloutStats, console: Console) -> RolloutSummary:
    """Without a terminal: one progress line every few seconds instead of a live display."""
    task = asyncio.ensure_future(coro)
    t0 = time.monotonic()
    try:
        while not task.done():
            await asyncio.wait([task], timeout=5)
            if not task.done():
                mean = stats.reward_sum / stats.done if stats.done else 0.0
                console.print(f"  rollout {stats.done}/{stats.total} done  (creating {stats.count('create')}, "
                              f"agent {stats.count('agent')}, grading {stats.count('grade')}; mean reward "
                              f"{mean:.2f}; {time.monotonic() - t0:.0f}s)")
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def print_summary(rep: DemoReport, console: Console) -> None:
    """The closing tables: rewards, outcomes, throughput and the per-phase time breakdown."""
    s = rep.summary
    if s is None:
        return
    g = rep.gen
    console.rule("[bold]summary[/bold]")
    n = len(s.results)
    errors = [r for r in s.results if r.error]
    graded = [r for r in s.results if r.grade]
    sandboxes = sum(1 for r in s.results if r.timings.get("create")) + \
        sum(1 for r in graded if r.grade.get("phases", {}).get("create"))
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column()
    t.add_row("tasks", f"{rep.tasks} from {len(g.images) - 1} projects "
                       f"({'cached' if g.from_cache else f'generated in {rep.tasks_s:.1f}s'})")
    t.add_row("episodes", f"{n} ({s.concurrency} at once), {s.steps_total()} agent steps, "
                          f"{sandboxes} sandboxes created")
    t.add_row("mean reward", f"[bold cyan]{s.mean_reward:.3f}[/bold cyan]   "
                             + "  ".join(f"{k}: {v}" for k, v in sorted(s.outcomes().items())))
    t.add_row("throughput", f"{n / s.wall_s:.2f} episodes/s · {sandboxes / s.wall_s:.1f} sandboxes/s · "
                            f"{s.steps_total() / s.wall_s:.1f} steps/s  (rollout wall {s.wall_s:.1f}s)")
    t.add_row("failed episodes", f"[red]{len(errors)}[/red]" if errors else "0")
    console.print(t)

    pt = Table(title="reward by policy", title_justify="left")
    for c in ("policy", "episodes", "mean reward", "expected"):
        pt.add_column(c, justify="right" if c != "policy" else "left")
    mismatch = []
    for tag, (cnt, mean) in s.by_tag().items():
        exp = EXPECTED_REWARD.get(tag)
        ok = exp is None or abs(mean - exp) < 1e-9
        if not ok:
            mismatch.append(tag)
        pt.add_row(tag, str(cnt), f"{mean:.2f}", "" if exp is None else
                   (f"{exp:.2f}" if ok else f"[red]{exp:.2f}[/red]"))
    console.print(pt)

    ph = Table(title="where the time went (per episode, seconds)", title_justify="left")
    for c in ("phase", "sum", "mean", "p50", "p90", "max"):
        ph.add_column(c, justify="right" if c != "phase" else "left")
    tot = s.phase_totals()
    sub: dict[str, list[float]] = {"grade: sandbox create": [], "grade: apply patches": [], "grade: run tests": []}
    for r in graded:
        p = r.grade.get("phases", {})
        sub["grade: sandbox create"].append(p.get("create", 0.0))
        sub["grade: apply patches"].append(p.get("apply", 0.0))
        sub["grade: run tests"].append(p.get("test", 0.0))
    rows = [("sandbox create", "create"), ("agent steps", "agent"), ("wait for a grading slot", "grade_wait"),
            ("grading", "grade")]
    for label, key in rows:
        p50, p90, mx = s.phase_percentiles(key)
        ph.add_row(label, f"{tot.get(key, 0.0):.1f}", f"{tot.get(key, 0.0) / max(1, n):.2f}", f"{p50:.2f}",
                   f"{p90:.2f}", f"{mx:.2f}")
        if key == "grade":
            for lab, xs in sub.items():
                xs = sorted(xs)
                if xs:
                    ph.add_row(f"  {lab}", f"{sum(xs):.1f}", f"{sum(xs) / len(xs):.2f}", f"{xs[len(xs) // 2]:.2f}",
                               f"{xs[min(len(xs) - 1, int(len(xs) * 0.9))]:.2f}", f"{xs[-1]:.2f}")
    console.print(ph)

    wt = Table(title="wall time of this run (seconds)", title_justify="left")
    for c in ("image build (base)", "workspace images", "task generation", "rollout + grading", "total"):
        wt.add_column(c, justify="right")
    wt.add_row(f"{rep.base_s:.1f}" + (" built" if rep.base_built else " cached"), f"{g.images_s:.1f}",
               f"{max(0.0, rep.tasks_s - g.images_s):.1f}" + (" cached" if g.from_cache else ""),
               f"{s.wall_s:.1f}", f"[bold]{rep.wall_s:.1f}[/bold]")
    console.print(wt)
    for r in errors[:5]:
        console.print(f"[red]episode {r.episode} ({r.task_id}, {r.tag}) failed:[/red] {r.error}")
    if mismatch:
        console.print(f"[red]policies {mismatch} did not get their expected reward: see the grades in the JSON "
                      "report (--json)[/red]")


__all__ = ["EXPECTED_REWARD", "POLICIES", "DemoConfig", "DemoReport", "print_summary", "run_demo"]
