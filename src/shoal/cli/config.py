"""`shoal config`: the effective settings and where each came from; `--markdown` emits the docs table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from shoal.cli.common import console, err_console


def config(
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    group: Annotated[str | None, typer.Option("--group", "-g", help="only this group (paths, node, vm, api, …)")]
    = None,
    changed: Annotated[bool, typer.Option("--changed", help="only settings not at their default")] = False,
    markdown: Annotated[bool, typer.Option("--markdown", help="the docs table of every setting (defaults)")]
    = False,
    update: Annotated[Path | None, typer.Option("--update", help="with --markdown: rewrite the table inside this "
                                                "file (docs/configuration.md)")] = None,
) -> None:
    """Print every SHOAL_* setting: its value and where it came from (default, config file, env, argument)."""
    from shoal.config import GROUPS, Settings, settings, show, update_docs
    from shoal.config import markdown as settings_markdown

    if markdown or update is not None:
        if update is None:
            print(settings_markdown(), end="")
        else:
            err_console.print(f"{update}: {'updated' if update_docs(update) else 'already up to date'}")
        return
    if group is not None and group not in GROUPS:
        err_console.print(f"[red]error:[/red] no settings group {group!r}; groups: {', '.join(GROUPS)}")
        raise typer.Exit(2)
    s: Settings = settings()
    rows = s.rows(group=group, changed=changed)
    file = str(s.file) if s.file is not None else None
    if as_json:
        print(json.dumps({"config_file": file, "settings": rows}, indent=1))
        return
    console.print(f"config file: {file}" if file else "config file: none (SHOAL_CONFIG is unset and "
                  "/etc/shoal/config.toml does not exist)")
    if not rows:
        console.print("every setting is at its default" if changed else "no settings")
        return
    t = Table(show_lines=False, show_edge=False)
    for col in ("variable", "value", "from", "meaning"):
        t.add_column(col, overflow="fold")
    last = None
    for r in rows:
        if r["group"] != last and last is not None:
            t.add_section()
        last = r["group"]
        value = show(r["value"])
        style = "bold" if r["source"] != "default" else ""
        t.add_row(r["name"], value, r["source"], r["doc"], style=style)
    console.print(t)
