"""Tables of benchmark results: rich on the terminal, Markdown for docs/benchmarks.md."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from shoal.bench.results import Metric, ScenarioResult, fmt_ratio, fmt_value


def _met(m: dict[str, Any] | Metric) -> str:
    met = m.met if isinstance(m, Metric) else m.get("met")
    target = m.target if isinstance(m, Metric) else m.get("target")
    if not target:
        return ""
    return {True: "met", False: "MISSED", None: "n/a"}[met]


def _row(m: dict[str, Any]) -> list[str]:
    adv = m.get("shoal_vs_docker")
    return [m["name"], fmt_value(m.get("shoal"), m.get("unit", "")), fmt_value(m.get("docker"), m.get("unit", "")),
            fmt_ratio(adv), m.get("target") or "", _met(m)]


def print_scenario(console: Console, res: ScenarioResult) -> None:
    """The rows of one scenario as a rich table, with Docker's status and notes."""
    t = Table(title=f"{res.name}: {res.title}", title_justify="left", show_lines=False)
    for col in ("metric", "shoal", "Docker", "shoal vs Docker", "target", ""):
        t.add_column(col)
    for m in res.metrics:
        row = _row(m.to_dict())
        if row[5] == "MISSED":
            row[5] = "[red]MISSED[/red]"
        elif row[5] == "met":
            row[5] = "[green]met[/green]"
        t.add_row(*row)
    console.print(t)
    if res.docker.startswith("absent") or res.docker.startswith("skipped"):
        console.print(f"  Docker: {res.docker}")
    for n in res.notes:
        console.print(f"  note: {n}")
    for f in res.figures:
        console.print(f"  figure: {f}")
    if res.error:
        console.print(f"  [red]error:[/red] {res.error}")


def markdown_table(doc: dict[str, Any]) -> str:
    """One Markdown table of every scenario's metrics."""
    lines = ["| scenario | metric | shoal | Docker | shoal vs Docker | target | | note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, sc in doc.get("scenarios", {}).items():
        if sc.get("error") and not sc.get("metrics"):
            lines.append(f"| {name} | error: {_esc(sc['error'])[:200]} | | | | | | |")
            continue
        if not sc.get("metrics"):
            lines.append(f"| {name} | (no figures: {_esc('; '.join(sc.get('notes', [])))[:200]}) | | | | | | |")
        for m in sc.get("metrics", []):
            r = _row(m)
            mark = {"met": "✅", "MISSED": "❌", "n/a": ""}.get(r[5], "")
            note = _esc(m.get("note") or "")[:160]
            lines.append(f"| {name} | {_esc(r[0])} | {r[1]} | {r[2]} | {r[3]} | {_esc(r[4])} | {mark} | {note} |")
    return "\n".join(lines)


def _esc(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def write_markdown(path: Path, doc: dict[str, Any]) -> None:
    """A self-contained Markdown report: command, machine, the table, notes and figures."""
    m = doc.get("machine", {})
    out = [f"# shoal bench — {doc.get('started', '')}", "",
           f"Command: `{doc.get('command', '')}`", "",
           f"Machine: {m.get('cpu', '?')}, {m.get('cores')} cores, {m.get('mem_gib')} GiB, {m.get('os')}, "
           f"Linux {m.get('kernel')}, cgroups {m.get('cgroups')}, {m.get('crun')}; "
           f"CPU busy before the run: {100 * float(m.get('cpu_busy_at_start') or 0):.0f}%", ""]
    if doc.get("docker"):
        d = doc["docker"]
        out += [f"Docker: {d.get('version')} ({d.get('storage_driver')}, {d.get('cgroup_driver')}, "
                f"{d.get('runtime')}), private daemon started by the benchmark.", ""]
    out += [markdown_table(doc), ""]
    for name, sc in doc.get("scenarios", {}).items():
        notes = sc.get("notes") or []
        if sc.get("docker", "").startswith(("absent", "skipped")):
            notes = [f"Docker {sc['docker']}", *notes]
        if notes or sc.get("figures"):
            out.append(f"**{name}**")
            out += [f"- {n}" for n in notes]
            out += [f"- figure: `{f}`" for f in sc.get("figures", [])]
            out.append("")
    if doc.get("leaks"):
        out += [f"Leaks after the run: `{doc['leaks']}`", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out) + "\n")


def fnum(x: Any) -> float | None:
    """A float from a JSON value, None for anything else."""
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x)):
        return float(x)
    return None
