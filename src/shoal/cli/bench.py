"""`shoal bench [SCENARIO…]`: run the benchmark suite, side by side with Docker when it is installed.

`shoal bench --list` lists the scenarios; `shoal bench NAME --list` lists NAME's parameters, which
`-p key=value` (or `-p NAME.key=value`) sets.
"""

from __future__ import annotations

import asyncio
import shlex
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from shoal.cli.common import console, err_console


def _fmt(v: Any) -> str:
    if isinstance(v, tuple):
        return ",".join(str(x) for x in v)
    return "—" if v is None else str(v)


def _list(names: list[str]) -> None:
    from shoal.bench import registry

    if not names:
        t = Table(title="shoal bench scenarios (in the order a plain `shoal bench` runs them)", title_justify="left")
        for col in ("scenario", "what it measures", "beside Docker", "in the default run"):
            t.add_column(col)
        for n in registry.SCENARIOS:
            s = registry.get(n)
            t.add_row(n, s.title, "yes" if s.uses_docker else "no", "yes" if s.default_run else "no")
        console.print(t)
        console.print("aliases: " + ", ".join(f"{a} = {c}" for a, c in registry.ALIASES.items()))
        console.print("parameters of one: shoal bench NAME --list; set one: shoal bench NAME -p key=value")
        return
    for n in names:
        s = registry.get(n)
        t = Table(title=f"{n}: {s.title}", title_justify="left")
        for col in ("parameter", "type", "default", "--quick", "meaning"):
            t.add_column(col)
        for p in s.describe():
            t.add_row(p.name, p.type, _fmt(p.default), _fmt(p.quick) if p.quick != p.default else "", p.help)
        if not s.describe():
            t.add_row("(none)", "", "", "", "")
        console.print(t)


def bench(
    scenarios: Annotated[list[str] | None, typer.Argument(
        help="scenarios to run (default: all in the default run; `shoal bench --list` lists them)")] = None,
    param: Annotated[list[str] | None, typer.Option(
        "--param", "-p", help="set a scenario parameter: KEY=VALUE or SCENARIO.KEY=VALUE (repeatable)")] = None,
    list_: Annotated[bool, typer.Option(
        "--list", help="list the scenarios (or, with names, their parameters) and exit")] = False,
    json_file: Annotated[Path | None, typer.Option("--json", help="write all results to this JSON file")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="write PNG figures into this directory")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="each scenario's small sizes: about a minute each")] = False,
    no_docker: Annotated[bool, typer.Option("--no-docker", help="shoal only, no Docker")] = False,
    markdown: Annotated[Path | None, typer.Option("--markdown", help="also write a Markdown report here")] = None,
    home: Annotated[Path | None, typer.Option("--home", help="SHOAL_HOME for the run (default: a fresh one in /tmp)")
                    ] = None,
) -> None:
    """Benchmark shoal (and Docker in the same run, when dockerd is installed): latency, rates, density, disk."""
    import os

    from shoal.bench import registry
    from shoal.bench.runner import run_bench, split_overrides
    from shoal.bench.scenario import ParamError

    try:
        names = registry.resolve(scenarios)
        if list_:
            _list(list(scenarios or []) and names)
            return
        overrides = split_overrides(param or [], names)
        for n in names:  # check every value now: a typo must not surface after an hour of other scenarios
            registry.get(n).make_params(quick, overrides[n])
    except (registry.UnknownScenario, ParamError) as e:
        err_console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    if os.geteuid() != 0:
        err_console.print("[red]error:[/red] shoal bench creates real sandboxes: run it as root")
        raise typer.Exit(1)
    command = "shoal " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    try:
        doc = asyncio.run(run_bench(names, json_path=json_file, plot_dir=plot, quick=quick, no_docker=no_docker,
                                    home=home, markdown=markdown, command=command, console=console,
                                    params=overrides))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except asyncio.CancelledError:  # SIGTERM/SIGHUP: the run stopped after its teardown
        err_console.print("stopped by a signal (everything it set up was removed)")
        raise typer.Exit(143) from None
    from shoal.bench.report import markdown_table

    console.rule("[bold]summary[/bold]")
    console.print(markdown_table(doc), markup=False, highlight=False, soft_wrap=True)
    if doc.get("leaks"):
        err_console.print(f"[red]left behind:[/red] {doc['leaks']}")
        raise typer.Exit(1)
    if json_file:
        console.print(f"results: {json_file}")
    if plot:
        console.print(f"figures: {plot}/")
