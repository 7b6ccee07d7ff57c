"""`shoal store …`: the layer store itself — check that it answers, and a MooseFS cluster for development
(`shoal store dev-moosefs up|down|status`) to put SHOAL_STORE on a real distributed filesystem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from shoal.cli.common import console, err_console

store_app = typer.Typer(help="The layer store: health probe, a MooseFS dev cluster.", no_args_is_help=True)
mfs_app = typer.Typer(help="A MooseFS cluster (master + chunkservers in network namespaces) FUSE-mounted "
                           "on this host, for development and tests.", no_args_is_help=True)
store_app.add_typer(mfs_app, name="dev-moosefs")

NameOpt = Annotated[str, typer.Option("--name", help="instance name (several may run at once)")]
BaseOpt = Annotated[Path | None, typer.Option("--base", help="base directory (default /var/lib/shoal-moosefs)")]


def _fail(msg: str, code: int = 1) -> None:
    err_console.print(f"[red]error:[/red] {escape(msg)}")
    raise typer.Exit(code)


@mfs_app.command("up")
def mfs_up(name: NameOpt = "dev", base: BaseOpt = None,
           chunkservers: Annotated[int, typer.Option(help="how many chunkservers")] = 2,
           as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Start the cluster (or check the running one) and print its mountpoint: export SHOAL_STORE under it."""
    from shoal.errors import ShoalError
    from shoal.images import moosefs

    try:
        c = moosefs.up(name, base, chunkservers=chunkservers)
    except ShoalError as e:
        _fail(e.message)
    if as_json:
        print(json.dumps(moosefs.status(name, base), indent=1))
        return
    console.print(f"MooseFS '{c.name}' mounted at {c.mountpoint} (master {c.master_ip} in netns "
                  f"{c.master_netns}, {len(c.chunkservers)} chunkservers)")
    console.print(f"use it:  export SHOAL_STORE={c.mountpoint}/store")


@mfs_app.command("status")
def mfs_status(name: NameOpt = "dev", base: BaseOpt = None,
               as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Daemons, mount and addresses of a running cluster (exit 1 when there is none)."""
    from shoal.errors import ShoalError
    from shoal.images import moosefs

    try:
        st = moosefs.status(name, base)
    except ShoalError as e:
        _fail(e.message)
    if as_json:
        print(json.dumps(st, indent=1))
        return
    m = st["master"]
    console.print(f"{st['name']}: mount {st['mountpoint']} {'mounted' if st['mounted'] else 'NOT mounted'}")
    console.print(f"  master       {m['ip']:<15} netns {m['netns']:<28} pid {m['pid'] or 'down'}")  # type: ignore[index]
    for cs in st["chunkservers"]:  # type: ignore[attr-defined]
        console.print(f"  chunkserver  {cs['ip']:<15} netns {cs['netns']:<28} pid {cs['pid'] or 'down'}")


@mfs_app.command("down")
def mfs_down(name: NameOpt = "dev", base: BaseOpt = None) -> None:
    """Stop everything of the cluster: unmount, daemons, namespaces and veths, data directories."""
    from shoal.images import moosefs

    moosefs.down(name, base)
    console.print(f"MooseFS '{name}' is down and removed")


@store_app.command("check")
def store_check(timeout: Annotated[float, typer.Option(help="seconds before the store counts as unreachable")] = 5.0
                ) -> None:
    """Probe SHOAL_STORE (a bounded stat and read): exit 0 when it answers, 1 with the reason otherwise."""
    from shoal.config import Paths
    from shoal.errors import ShoalError
    from shoal.images.probe import probe_store

    root = Paths.from_env().store
    try:
        ms = probe_store(root, timeout_s=timeout)
    except ShoalError as e:
        _fail(e.message)
    console.print(f"store {root} answers ({ms:.1f} ms)")
