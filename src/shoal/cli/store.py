"""`shoal store …`: the layer store itself — check that it answers, convert whole-file layers to chunks
(`shoal store migrate`), the node's chunk cache (`shoal store cache`), and a MooseFS cluster for
development (`shoal store dev-moosefs up|down|status`) to put SHOAL_STORE on a real distributed filesystem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from shoal.cli.common import console, err_console

store_app = typer.Typer(help="The layer store: health probe, migration to chunks, the node's chunk cache, a "
                             "MooseFS dev cluster.", no_args_is_help=True)
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


@store_app.command("migrate")
def store_migrate(
    drop_files: Annotated[bool, typer.Option("--drop-files", help="then delete the whole-file copies of converted "
                                             "layers (older shoal versions can no longer read those images)")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="only say what would be done")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Convert every layer still stored as one whole file into chunks (same digests; images unchanged).
    Layers are also converted on their first mount; this does the whole store at once."""
    from shoal.config import Paths
    from shoal.images.migrate import migrate_store
    from shoal.images.store import ImageStore

    store = ImageStore(Paths.from_env().store)
    say = (lambda _m: None) if as_json else (lambda m: console.print(escape(m)))
    rep = migrate_store(store, drop_files=drop_files, dry_run=dry_run, progress=say)
    if as_json:
        print(json.dumps(rep.to_dict(), indent=1))
    else:
        verb = "would convert" if dry_run else "converted"
        console.print(f"{verb} {len(rep.converted)} layers ({rep.whole_bytes / 1048576:.0f} MiB as whole files"
                      + ("" if dry_run else f", {rep.stored_bytes / 1048576:.0f} MiB of new chunks") + f"); "
                      f"{rep.already} were chunked already")
        if drop_files:
            console.print(f"{'would drop' if dry_run else 'dropped'} {rep.dropped_files} whole files "
                          f"({rep.dropped_bytes / 1048576:.0f} MiB)")
        for c in rep.corrupt:
            console.print(f"  [red]corrupt[/red] {c['layer']}: {escape(c['error'])}")
    raise typer.Exit(1 if rep.corrupt else 0)


@store_app.command("cache")
def store_cache(
    limit_mb: Annotated[int | None, typer.Option("--limit-mb", help="resize the running reader's cache "
                                                 "(until it restarts; SHOAL_CHUNK_CACHE_MB sets the default)")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The node's layer reader: chunks fetched and checked, the chunk cache's use, evictions, corrupt chunks."""
    from shoal.config import Paths
    from shoal.errors import ShoalError
    from shoal.images.chunkd import ChunkDaemon

    paths = Paths.from_env()
    d = ChunkDaemon(paths.home, paths.store)
    if not d.running():
        _fail(f"the layer reader of {paths.home} is not running (it starts with the first sandbox)")
    try:
        if limit_mb is not None:
            d.set_limit(limit_mb)
        st = d.stats()
    except ShoalError as e:
        _fail(e.message)
    if as_json:
        print(json.dumps(st, indent=1))
        return
    mib = 1048576
    console.print(f"cache {st['cache_bytes'] / mib:.1f} of {st['cache_limit'] / mib:.0f} MiB "
                  f"({st['cache_chunks']} chunks; {st['cache_bytes_of_open_layers'] / mib:.1f} MiB of layers in use)")
    console.print(f"fetched {st['fetched_chunks']} chunks: {st['fetched_bytes'] / mib:.1f} MiB "
                  f"({st['fetched_wire_bytes'] / mib:.1f} MiB as stored), {st['prefetched_chunks']} by prefetch; "
                  f"hits {st['hits']}, misses {st['misses']}; evicted {st['evicted_chunks']} "
                  f"({st['evicted_bytes'] / mib:.1f} MiB)")
    console.print(f"checked {st['verified_chunks']} chunks; corrupt {st['corrupt_chunks']}, missing "
                  f"{st['missing_chunks']}, store errors {st['store_errors']}, reads failed {st['eio']}")
