"""`shoal demo` (the README's main job) and `shoal tasks …` (generate, validate, list, grade)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from shoal.cli.common import console, err_console, run_async

tasks_app = typer.Typer(help="RL tasks: generate a task set, validate task files, grade patches.",
                        no_args_is_help=True)


def demo(episodes: Annotated[int, typer.Option(help="episodes in the rollout")] = 64,
         concurrency: Annotated[int, typer.Option(help="episodes running at once")] = 64,
         grade_concurrency: Annotated[int | None, typer.Option(help="gradings at once (default 2 per core)")] = None,
         projects: Annotated[str, typer.Option(help="comma-separated subset of the recipe's projects")] = "",
         tasks_per_project: Annotated[int | None, typer.Option(help="tasks to generate per project")] = None,
         recipe: Annotated[str | None, typer.Option(help="task recipe TOML (default: the shipped one)")] = None,
         json_out: Annotated[str | None, typer.Option("--json", help="write the full report here")] = None,
         no_live: Annotated[bool, typer.Option("--no-live", help="plain progress lines")] = False) -> None:
    """Build what is missing, generate tasks from real projects, run a graded rollout, report where time went."""
    from shoal.rl.demo import DemoConfig, run_demo

    if episodes < 1 or concurrency < 1:
        err_console.print("[red]error:[/red] --episodes and --concurrency must be at least 1")
        raise typer.Exit(2)
    cfg = DemoConfig(episodes=episodes, concurrency=concurrency, grade_concurrency=grade_concurrency,
                     projects=[p.strip() for p in projects.split(",") if p.strip()],
                     tasks_per_project=tasks_per_project, recipe=recipe, json_path=json_out, live=not no_live)
    rep = run_async(lambda: run_demo(cfg, console))
    s = rep.summary
    raise typer.Exit(0 if s is not None and not any(r.error for r in s.results) else 1)


@tasks_app.command("generate")
def tasks_generate(out: Annotated[Path, typer.Option("--out", "-o", help="JSONL file to write")] = Path("tasks.jsonl"),
                   recipe: Annotated[str | None, typer.Option(help="task recipe TOML")] = None,
                   projects: Annotated[str, typer.Option(help="comma-separated subset of projects")] = "",
                   tasks_per_project: Annotated[int | None, typer.Option(help="tasks per project")] = None,
                   verify: Annotated[bool, typer.Option(help="grade each task's gold patch and bug")] = False,
                   no_cache: Annotated[bool, typer.Option(help="re-run every mutant")] = False) -> None:
    """Build the workspace images and synthesize tasks by mutation; write them as SWE-bench-style JSONL."""
    from shoal.rl.taskgen.config import load_task_recipe
    from shoal.rl.taskgen.generate import GenerationReport, generate_tasks, verify_task
    from shoal.rl.tasks import dump_jsonl

    tr = load_task_recipe(recipe).select([p.strip() for p in projects.split(",") if p.strip()] or None)
    if tasks_per_project:
        tr.mutations.tasks_per_project = tasks_per_project
        tr.mutations.max_candidates = max(tr.mutations.max_candidates, tasks_per_project + 4)

    async def go() -> int:
        import shoal

        async with shoal.Client() as client:
            rep = GenerationReport()
            with console.status("generating…") as st:
                def log(msg: str) -> None:
                    st.update(f"[dim]{msg.strip()[:110]}[/dim]")
                    if msg.startswith(("built ", "task set ", "warning:")) or ": kept " in msg:
                        console.print(f"  [dim]{msg.strip()[:150]}[/dim]")
                tasks = await generate_tasks(client.transport.node, tr, log=log, report=rep, no_cache=no_cache)
            dump_jsonl(tasks, out)
            console.print(f"[green]wrote[/green] {len(tasks)} tasks to {out}")
            for p in rep.projects:
                console.print(f"  {p.name}: {p.kept} kept of {p.tried} tried, rejected {p.rejected or '-'}")
            bad = 0
            if verify:
                for t in tasks:
                    problems = await verify_task(client, t)
                    bad += bool(problems)
                    console.print(("[red]✗[/red] " if problems else "[green]✓[/green] ") + t.instance_id +
                                  (": " + "; ".join(problems) if problems else ""))
            return 1 if bad else 0

    raise typer.Exit(run_async(go))


@tasks_app.command("validate")
def tasks_validate(path: Path) -> None:
    """Check a JSONL/JSON task file or a Harbor/Terminal-Bench task directory; errors name task and field."""
    from shoal.rl.tasks import load_tasks

    tasks = run_async(lambda: _async(load_tasks, path))
    kinds: dict[str, int] = {}
    for t in tasks:
        kinds[t.kind] = kinds.get(t.kind, 0) + 1
    console.print(f"[green]ok[/green] {len(tasks)} task(s): " + ", ".join(f"{v} {k}" for k, v in kinds.items()))


@tasks_app.command("ls")
def tasks_ls(path: Path, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List the tasks of a file or directory."""
    from shoal.rl.tasks import SWETask, load_tasks

    tasks = run_async(lambda: _async(load_tasks, path))
    if as_json:
        print(json.dumps([{"id": t.id, "kind": t.kind, "image": t.image} for t in tasks], indent=1))
        return
    tab = Table(title=f"{len(tasks)} tasks")
    for c in ("id", "kind", "image", "FAIL_TO_PASS", "PASS_TO_PASS"):
        tab.add_column(c)
    for t in tasks:
        f2p = str(len(t.FAIL_TO_PASS)) if isinstance(t, SWETask) else ""
        p2p = str(len(t.PASS_TO_PASS)) if isinstance(t, SWETask) else ""
        tab.add_row(t.id, t.kind, t.image, f2p, p2p)
    console.print(tab)


@tasks_app.command("grade")
def tasks_grade(path: Path,
                task: Annotated[list[str] | None, typer.Option("--task", "-t", help="task id(s); default all")] = None,
                patch: Annotated[Path | None, typer.Option(help="a diff file to grade (default: gold)")] = None,
                partial: Annotated[bool, typer.Option(help="partial credit: fraction of named tests passing")] = False,
                as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Grade a patch (default: each task's gold patch) in fresh sandboxes and print outcomes and rewards."""
    from shoal.errors import InvalidRequest
    from shoal.rl.grader import grade_patch
    from shoal.rl.tasks import SWETask, load_tasks

    async def go() -> int:
        import asyncio

        import shoal

        tasks = [t for t in load_tasks(path) if isinstance(t, SWETask) and (not task or t.id in task)]
        if task:
            missing = set(task) - {t.id for t in tasks}
            if missing:
                raise InvalidRequest(f"no SWE-style task {sorted(missing)} in {path}")
        text = patch.read_text() if patch else None
        async with shoal.Client() as client:
            grades = await asyncio.gather(*(grade_patch(client, t, text if text is not None else t.patch,
                                                        partial=partial) for t in tasks))
        if as_json:
            print(json.dumps([g.to_dict() for g in grades], indent=1))
        else:
            for g in grades:
                style = "green" if g.resolved else "yellow"
                console.print(f"[{style}]{g.outcome:>18}[/{style}] {g.summary()}")
        return 0

    raise typer.Exit(run_async(go))


async def _async(fn, *a):  # type: ignore[no-untyped-def]
    return fn(*a)


def register(app: typer.Typer) -> None:
    """Add `demo` and `tasks` to the main CLI."""
    app.command("demo")(demo)
    app.add_typer(tasks_app, name="tasks")
