"""`shoal cluster up|status|down --address ADDR`: the node agents of a Ray cluster; `shoal cluster local`: a Ray
cluster on 127.0.0.1 to try it on one machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from shoal.cli.common import console, err_console

cluster_app = typer.Typer(help="Cluster mode on Ray: one node agent per Ray node (see docs/cluster.md).",
                          no_args_is_help=True)

AddressOpt = Annotated[str, typer.Option("--address", help="the Ray cluster: its GCS address HOST:PORT as `ray "
                                         "start` printed it, `auto`, or ray://ADDR")]


def _addr(address: str) -> str:
    from shoal.cluster.raylink import parse_ray_url

    return parse_ray_url(address) if address.startswith("ray://") else address


def _fail(e: Exception) -> None:
    err_console.print(f"[red]error:[/red] {e}")
    raise typer.Exit(2)


@cluster_app.command("up")
def up(address: AddressOpt,
       resource: Annotated[str, typer.Option(help="custom resource marking the Ray nodes that host sandboxes")]
       = "shoal",
       home: Annotated[str | None, typer.Option(help="SHOAL_HOME of the node agents [each node's own]")] = None,
       store: Annotated[str | None, typer.Option(help="the shared layer store every node mounts "
                                                 "[each node's SHOAL_STORE; with --home-per-node this "
                                                 "host's]")] = None,
       home_per_node: Annotated[bool, typer.Option("--home-per-node", help="each agent gets "
                                                   "HOME/nodes/<node id>, all sharing this host's layer store "
                                                   "unless --store says otherwise (clusters whose Ray nodes "
                                                   "share one host)")] = False,
       env: Annotated[list[str] | None, typer.Option(help="KEY=VALUE set in every node agent (repeat)")] = None,
       as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Start a node agent on every Ray node offering the resource that has none (a second `up` only adds
    the missing ones). Each is pinned to its node and restarted by Ray if it dies."""
    from shoal.cluster import control
    from shoal.errors import ShoalError

    extra = {}
    for it in env or []:
        k, sep, v = it.partition("=")
        if not sep or not k:
            _fail(ValueError(f"--env {it!r} must look like KEY=VALUE"))
        extra[k] = v
    try:
        rep = control.up(_addr(address), resource=resource, home=home, store=store, home_per_node=home_per_node,
                         env=extra)
    except ShoalError as e:
        _fail(e)
    if as_json:
        print(json.dumps({"started": [{k: v for k, v in h.items() if k != "token"} for h in rep.started],
                          "existing": rep.existing, "skipped": rep.skipped}, indent=1))
        return
    for h in rep.started:
        console.print(f"started node agent [bold]{h['node_id']}[/bold] on Ray node {h['ray_node_id'][:12]} "
                      f"({h['url']}, {h['adopted'].get('sandboxes', 0)} sandbox(es) adopted)")
    if rep.existing:
        console.print(f"already running: {', '.join(rep.existing)}")
    if rep.skipped:
        console.print(f"[dim]{len(rep.skipped)} Ray node(s) without the {resource!r} resource: no agent[/dim]")
    if not rep.started and not rep.existing:
        console.print(f"[yellow]no Ray node offers the {resource!r} resource[/yellow]: start nodes with "
                      f"`ray start ... --resources '{{\"{resource}\": 1}}'`")


def _mb(x: Any) -> str:
    return f"{int(x) / 1024:.1f}G" if isinstance(x, (int, float)) else "-"


def _local_state(port: int) -> Path:
    return Path("/run/shoal/local-clusters") / f"{port}.json"


@cluster_app.command("local")
def local(workers: Annotated[int, typer.Option(help="worker nodes offering the shoal resource")] = 2,
          port: Annotated[int, typer.Option(help="the head's GCS port (the --address is 127.0.0.1:PORT)")] = 6390,
          worker_cpus: Annotated[int, typer.Option(help="CPUs each worker node offers Ray")] = 1,
          stop: Annotated[bool, typer.Option("--stop", help="stop the local cluster on PORT")] = False) -> None:
    """A Ray head and WORKERS worker nodes offering `shoal`, all on 127.0.0.1, started for trying cluster mode on
    one machine (Ray's own `ray start` registers the host's outward address instead: it allows loopback only for
    single-node clusters). Returns once they are up; they run until `shoal cluster local --stop --port PORT`."""
    from shoal.cluster.local import LocalCluster, stop_session

    state = _local_state(port)
    if stop:
        if not state.exists():
            _fail(ValueError(f"no local cluster on port {port} was started here (no {state})"))
        info = json.loads(state.read_text())
        n = stop_session(info["temp_dir"])
        state.unlink(missing_ok=True)
        console.print(f"stopped the local cluster on 127.0.0.1:{port} ({n} Ray process(es))")
        return
    if state.exists():
        info = json.loads(state.read_text())
        if Path(info.get("temp_dir", "")).is_dir():
            _fail(ValueError(f"a local cluster already runs on port {port} (stop it: shoal cluster local --stop "
                             f"--port {port})"))
    for attempt in range(3):
        lc = LocalCluster(workers, worker_cpus=worker_cpus, port=port, detached=True)
        try:
            with console.status(f"starting a Ray head and {workers} worker node(s) on 127.0.0.1:{port}…"):
                lc.start()
            break
        except Exception as e:
            if lc.temp_dir:
                stop_session(lc.temp_dir)
            # Ray gives a node a fixed 30 s to register: on a busy machine that can pass, and a new try works
            if "timed out during startup" in str(e) and attempt < 2:
                err_console.print(f"[yellow]{e}[/yellow]: trying again")
                continue
            _fail(RuntimeError(f"the local Ray cluster did not start: {e}"))
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"address": lc.address, "temp_dir": lc.temp_dir, "workers": workers}))
    console.print(f"Ray cluster on [bold]{lc.address}[/bold]: a head and {workers} worker node(s) offering "
                  f"`shoal`; next: shoal cluster up --address {lc.address} --home-per-node")


@cluster_app.command("status")
def status(address: AddressOpt, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """One row per node: health, sandboxes by state, CPU and memory committed and used, images mounted."""
    from shoal.cluster import control
    from shoal.errors import ShoalError

    try:
        rows = control.status(_addr(address))
    except ShoalError as e:
        _fail(e)
    if as_json:
        print(json.dumps(rows, indent=1))
        return
    t = Table(title=f"shoal cluster {address}")
    for col in ("node", "health", "sandboxes", "CPU committed / cores (load)", "memory committed / limit",
                "memory used / total", "layers mounted", "images in use", "runtimes", "endpoint"):
        t.add_column(col)
    for r in rows:
        mem, cpu = r.get("memory") or {}, r.get("cpus") or {}
        sbs = ", ".join(f"{k} {v}" for k, v in sorted((r.get("sandboxes") or {}).items())) or "-"
        health = r.get("health", "?")
        t.add_row(r.get("node_id", "?"), f"[green]{health}[/green]" if health == "ok" else f"[red]{health}[/red]",
                  sbs, f"{cpu.get('committed', '-')} / {cpu.get('count', '-')} ({cpu.get('load1', '-')})" if cpu
                  else "-", f"{_mb(mem.get('committed_mb'))} / {_mb(mem.get('limit_mb'))}" if mem else "-",
                  f"{_mb(mem.get('used_mb'))} / {_mb(mem.get('total_mb'))}" if mem else "-",
                  str(len(r.get("layers") or [])) if "layers" in r else "-",
                  ", ".join(sorted(r.get("images") or {})) or "-", ", ".join(r.get("runtimes") or []) or "-",
                  r.get("url", "-"))
    console.print(t)


@cluster_app.command("down")
def down(address: AddressOpt,
         force: Annotated[bool, typer.Option("--force", help="close live sandboxes too")] = False,
         purge: Annotated[bool, typer.Option("--purge", help="also delete each agent's SHOAL_HOME")] = False,
         as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Stop every node agent: refuses while sandboxes live (unless --force); leaves no mounts, processes or
    actors behind."""
    from shoal.cluster import control
    from shoal.errors import ShoalError

    try:
        out = control.down(_addr(address), force=force, purge=purge)
    except ShoalError as e:
        _fail(e)
    if as_json:
        print(json.dumps(out, indent=1))
        return
    for nid, res in sorted(out.items()):
        console.print(f"node agent {nid} stopped ({res.get('closed', 0)} sandbox(es) closed)")
    if not out:
        console.print("no node agents were running")


def register(app: typer.Typer) -> None:
    """Add `shoal cluster ...` to the main app."""
    app.add_typer(cluster_app, name="cluster")
