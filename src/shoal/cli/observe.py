"""`shoal events` (the event log) and `shoal top` (the dashboard's live figures in a terminal, with rich)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated, Any

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from shoal.cli.common import console, err_console, make_client, run_async

UrlOpt = Annotated[str | None, typer.Option("--url", help="API server (default: embedded node; env SHOAL_URL)")]
_STYLE = {"created": "green", "paused": "magenta", "resumed": "cyan", "oom": "bold red", "timeout": "yellow",
          "lost": "red", "closed": "dim", "exec": ""}


def _when(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def _details(e: Any) -> str:
    return " ".join(f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in e.data.items()
                    if v is not None)


def events(sandbox_id: Annotated[str | None, typer.Argument(help="one sandbox (default: all you may see)")] = None,
           commands: Annotated[bool, typer.Option("--commands", "-c", help="its commands (exit code, "
                                                  "duration) instead")] = False,
           kind: Annotated[list[str] | None, typer.Option("--kind", "-k", help="created, paused, resumed, oom, "
                                                          "timeout, lost, closed (repeat)")] = None,
           limit: Annotated[int, typer.Option(help="newest N")] = 100,
           follow: Annotated[bool, typer.Option("--follow", "-f", help="keep printing new events")] = False,
           as_json: Annotated[bool, typer.Option("--json", help="one JSON object per line")] = False,
           url: UrlOpt = None) -> None:
    """The event log: what happened to sandboxes (created, paused, resumed, oom, timeout, lost, closed) and,
    with --commands, the commands one ran. Readable after a sandbox was closed."""
    if commands and sandbox_id is None:
        err_console.print("[red]error:[/red] --commands needs a sandbox ID")
        raise typer.Exit(2)

    def show(evs: list[Any]) -> None:
        for e in evs:
            if as_json:
                print(json.dumps({"t": e.t, "kind": e.kind, "id": e.sandbox_id, "project": e.project,
                                  "node": e.node, **e.data}), flush=True)
            else:
                style = _STYLE.get(e.kind, "")
                line = Text(f"{_when(e.t)}  ")
                line.append(f"{e.kind:<8}", style=style)
                line.append(f" {e.sandbox_id}  " if sandbox_id is None else " ")
                line.append(_details(e))
                console.print(line, soft_wrap=True)

    async def go() -> None:
        async with make_client(url) as client:
            evs = await client.events(sandbox_id, commands=commands, kinds=kind or None, limit=limit)
            show(evs)
            last = evs[-1].t if evs else time.time() - 1
            while follow:
                await asyncio.sleep(1.0)
                new = await client.events(sandbox_id, commands=commands, kinds=kind or None, since=last, limit=1000)
                show(new)
                if new:
                    last = new[-1].t

    run_async(go)


def top(url: UrlOpt = None, interval: Annotated[float, typer.Option(help="seconds between refreshes")] = 2.0,
        once: Annotated[bool, typer.Option("--once", help="print one frame and exit")] = False) -> None:
    """Live figures of a `shoal serve` (single node or --cluster): nodes, sandboxes by state, create rate,
    create/exec latency percentiles, memory, recent events (admin token)."""
    from shoal.config import settings
    from shoal.sdk.http import HttpTransport

    s = settings()
    base = url or s.url or "http://127.0.0.1:8700"
    if not base.startswith("http"):
        err_console.print(f"[red]error:[/red] shoal top reads a `shoal serve` over HTTP; {base!r} is not one")
        raise typer.Exit(2)

    async def frame(h: HttpTransport) -> Group:
        nodes, stats, evs = await asyncio.gather(h._request("GET", "/v1/nodes"), h._request("GET", "/v1/stats"),
                                                 h._request("GET", "/v1/events", params=[("limit", "8")]))
        return render(nodes.json(), stats.json(), evs.json()["events"], base)

    async def go() -> None:
        from rich.live import Live

        h = HttpTransport(base, token=s.token)
        await h.start()
        try:
            if once:
                console.print(await frame(h))
                return
            with Live(await frame(h), console=console, refresh_per_second=4, screen=False) as live:
                while True:
                    await asyncio.sleep(interval)
                    live.update(await frame(h))
        finally:
            await h.aclose()

    run_async(go)


def _f(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}{unit}"
    return f"{v:,}{unit}"


def _spark(values: list[float | None], width: int = 30) -> str:
    bars = "▁▂▃▄▅▆▇█"
    vals = [v for v in values[-width:]]
    real = [v for v in vals if v is not None]
    if not real:
        return ""
    hi = max(real) or 1.0
    return "".join(" " if v is None else bars[min(7, int(v / hi * 7.999))] for v in vals)


def render(nodes: dict[str, Any], stats: dict[str, Any], evs: list[dict[str, Any]], base: str) -> Group:
    """One frame of `shoal top` from the API's /v1/nodes, /v1/stats and /v1/events answers."""
    pts = stats.get("total") or []
    last = pts[-1] if pts else {}
    head = Table.grid(padding=(0, 3))
    # sandboxes by state now (the nodes' answers), not as of the last sampled point (up to 2 s old)
    states: dict[str, int] = {}
    for n in nodes.get("nodes") or []:
        for k, v in (n.get("sandboxes") or {}).items():
            states[k] = states.get(k, 0) + int(v or 0)
    states = states or last.get("states") or {}
    mem = last.get("memory") or {}
    head.add_row(Text(f"shoal top — {base} ({nodes.get('kind')})", style="bold"),
                 f"running {_f(states.get('running'))}", f"paused {_f(states.get('paused'))}",
                 f"creating {_f(states.get('creating'))}")
    head.add_row(f"creates/s {_f(last.get('create_rate'))}  {_spark([p.get('create_rate') for p in pts])}",
                 f"create p50/p99 {_f(last.get('create_p50'), ' ms')} / {_f(last.get('create_p99'), ' ms')}",
                 f"exec p50/p99 {_f(last.get('exec_p50'), ' ms')} / {_f(last.get('exec_p99'), ' ms')}", "")
    head.add_row(f"memory committed {_f(mem.get('committed_mb'), ' MiB')}", f"used {_f(mem.get('used_mb'), ' MiB')}",
                 f"reclaimed {_f(mem.get('reclaimed_mb'), ' MiB')}", f"of {_f(mem.get('total_mb'), ' MiB')}")
    nt = Table(title="nodes", expand=True)
    for c in ("node", "health", "load", "running", "paused", "creating", "committed MiB", "used MiB", "total MiB"):
        nt.add_column(c)
    for n in nodes.get("nodes") or []:
        sb, m = n.get("sandboxes") or {}, n.get("memory") or {}
        ok = n.get("health") == "ok"
        nt.add_row(str(n.get("node_id")), Text(str(n.get("health")), style="green" if ok else "red"),
                   _f(n.get("load1")), _f(sb.get("running", 0)), _f(sb.get("paused", 0)), _f(sb.get("creating", 0)),
                   _f(m.get("committed_mb")), _f(m.get("used_mb")), _f(m.get("total_mb")))
    et = Table(title="recent events", expand=True)
    for c in ("time", "event", "sandbox", "project"):
        et.add_column(c)
    for e in reversed(evs):
        et.add_row(_when(float(e.get("t", 0))), Text(str(e.get("kind")), style=_STYLE.get(str(e.get("kind")), "")),
                   str(e.get("id")), str(e.get("project")))
    return Group(head, nt, et)


def register(app: typer.Typer) -> None:
    """Add `shoal events` and `shoal top` to the CLI."""
    app.command("events")(events)
    app.command("top")(top)
