"""`shoal bench [SCENARIO…]`: run the benchmark suite, side by side with Docker when it is installed."""

from __future__ import annotations

import asyncio
import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from shoal.cli.common import console, err_console


def bench(
    scenarios: Annotated[list[str] | None, typer.Argument(
        help="create exec density disk lazy (alias image) fork pause fncall vm api (default: all)")] = None,
    json_file: Annotated[Path | None, typer.Option("--json", help="write all results to this JSON file")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="write PNG figures into this directory")] = None,
    quick: Annotated[bool, typer.Option("--quick", help="small sizes: about a minute")] = False,
    no_docker: Annotated[bool, typer.Option("--no-docker", help="shoal only, no Docker")] = False,
    markdown: Annotated[Path | None, typer.Option("--markdown", help="also write a Markdown report here")] = None,
    home: Annotated[Path | None, typer.Option("--home", help="SHOAL_HOME for the run (default: a fresh one in /tmp)")
                    ] = None,
) -> None:
    """Benchmark shoal (and Docker in the same run, when dockerd is installed): latency, rates, density, disk."""
    import os

    from shoal.bench.registry import DEFAULT_ORDER, load_all
    from shoal.bench.runner import run_bench

    known = load_all()
    # other names users reach for: the image issue speaks of `shoal bench image`
    aliases = {"image": "lazy", "images": "lazy", "snapshot": "fork", "stateful": "pause", "api-server": "api"}
    names = [aliases.get(n, n) for n in scenarios] if scenarios else list(DEFAULT_ORDER)
    bad = [n for n in names if n not in known]
    if bad:
        err_console.print(f"[red]error:[/red] unknown scenario(s) {', '.join(bad)}; "
                          f"choose from {', '.join(DEFAULT_ORDER)}")
        raise typer.Exit(2)
    if os.geteuid() != 0:
        err_console.print("[red]error:[/red] shoal bench creates real sandboxes: run it as root")
        raise typer.Exit(1)
    command = "shoal " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    try:
        doc = asyncio.run(run_bench(names, json_path=json_file, plot_dir=plot, quick=quick, no_docker=no_docker,
                                    home=home, markdown=markdown, command=command, console=console))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
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
