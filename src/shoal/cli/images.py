"""`shoal image …`: build (base or recipes), pull (registries), import (tarballs), compose, tag, ls, layers,
inspect, rm, gc."""

from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from rich.markup import escape
from rich.table import Table
from typer.core import TyperCommand

from shoal.cli.common import console, err_console, run_async

image_app = typer.Typer(help="Build, import, compose, list and remove images.", no_args_is_help=True)


def _store() -> Any:
    from shoal.config import Paths
    from shoal.images.store import ImageStore

    return ImageStore(Paths.from_env().store)


def _local_tmp() -> Path:
    # unpacking wants a local filesystem (xattrs, device nodes) even when the store is shared
    from shoal.config import Paths

    p = Paths.from_env().home / "tmp"
    p.mkdir(parents=True, exist_ok=True)
    return p


def _fail(msg: str, code: int = 1) -> None:
    err_console.print(f"[red]error:[/red] {escape(msg)}")
    raise typer.Exit(code)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


def describe_source(src: dict[str, Any]) -> str:
    """A short human description of a layer's `source` metadata."""
    kind = str(src.get("type", "?"))
    for key in ("desc", "diff_id", "suite", "sandbox"):
        if src.get(key):
            val = str(src[key])
            return f"{kind}: {val[:19] if key == 'diff_id' else val[:60]}"
    return kind


def parse_duration(s: str) -> float:
    """'3600', '90s', '30m', '2h', '7d' -> seconds."""
    s = s.strip().lower()
    mult = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if s and s[-1] in mult:
            return float(s[:-1]) * mult[s[-1]]
        return float(s)
    except ValueError:
        raise typer.BadParameter(f"{s!r} is not a duration (like 3600, 90s, 30m, 2h, 7d)") from None


# ---- build --------------------------------------------------------------------------------------
_STEP_OPTS = {"--run": ("run", 1), "--copy": ("copy", 2), "--env": ("env", 1), "-e": ("env", 1),
              "--workdir": ("workdir", 1), "--user": ("user", 1)}


class _OrderedCommand(TyperCommand):
    """Takes the step options (--run/--copy/--env/--workdir/--user) out of the command line itself, so
    they apply in command-line order and `--copy` can take two values; click parses the rest."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        steps, rest = split_steps(list(args))
        ctx.meta["shoal.steps"] = steps
        return super().parse_args(ctx, rest)


def split_steps(raw: list[str]) -> tuple[list[tuple[str, Any]], list[str]]:
    """(the step options of a `shoal image build` command line in order, the other arguments)."""
    steps: list[tuple[str, Any]] = []
    rest: list[str] = []
    i = 0
    while i < len(raw):
        tok = raw[i]
        if tok == "--":
            rest += raw[i:]
            break
        opt, val = tok, None
        if tok.startswith("--") and "=" in tok:
            opt, val = tok.split("=", 1)
        elif tok.startswith("-e") and len(tok) > 2 and not tok.startswith("--"):
            opt, val = "-e", tok[2:]
        if opt not in _STEP_OPTS:
            rest.append(tok)
            i += 1
            continue
        kind, nargs = _STEP_OPTS[opt]
        if val is not None:
            vals = [val, *raw[i + 1 : i + nargs]]
            i += nargs
        else:
            vals = raw[i + 1 : i + 1 + nargs]
            i += 1 + nargs
        if len(vals) != nargs:
            raise click.UsageError(f"{opt} needs {nargs} value{'s' if nargs > 1 else ''}")
        steps.append((kind, tuple(vals) if nargs > 1 else vals[0]))
    return steps, rest


@image_app.command("build", cls=_OrderedCommand)
def image_build(
    ctx: typer.Context,
    name: Annotated[str | None, typer.Argument(
        help="image to build, name[:tag] (built in: `base`, `code-interpreter`); with -t: the build CONTEXT "
             "directory")] = None,
    file: Annotated[Path | None, typer.Option("-f", "--file",
                                              help="recipe file (TOML), or the Dockerfile with -t")] = None,
    from_: Annotated[str | None, typer.Option("--from", help="image to build on")] = None,
    run: Annotated[list[str] | None, typer.Option("--run", metavar="CMD",
                                                  help="a step: run CMD with /bin/sh -c")] = None,
    copy: Annotated[list[str] | None, typer.Option("--copy", metavar="SRC DST",
                                                   help="a step: copy host SRC to DST in the image")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", "-e", metavar="NAME=VALUE",
                                                  help="a step: set an environment variable")] = None,
    workdir: Annotated[list[str] | None, typer.Option("--workdir", metavar="PATH",
                                                      help="a step: set the working directory")] = None,
    user: Annotated[list[str] | None, typer.Option("--user", metavar="USER",
                                                   help="a step: run later steps as USER")] = None,
    network: Annotated[bool | None, typer.Option("--network/--no-network",
                                                 help="network for RUN steps (default: on)")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="rebuild every step")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="print only the result")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the image as JSON")] = False,
    tag: Annotated[str | None, typer.Option(
        "-t", "--tag", metavar="NAME[:TAG]",
        help="Dockerfile build: the image to make (then NAME is the CONTEXT)")] = None,
    build_arg: Annotated[list[str] | None, typer.Option("--build-arg", metavar="K=V",
                                                        help="Dockerfile build argument (repeatable)")] = None,
    target: Annotated[str | None, typer.Option("--target", help="Dockerfile stage to build")] = None,
    platform: Annotated[str | None, typer.Option("--platform", help="linux/amd64 (the only one built here)")] = None,
    secret: Annotated[list[str] | None, typer.Option("--secret", metavar="id=ID,src=FILE",
                                                     help="a secret for RUN --mount=type=secret")] = None,
    from_map: Annotated[list[str] | None, typer.Option("--from-map", metavar="NAME=IMAGE",
                                                       help="build FROM NAME with shoal image IMAGE instead")] = None,
) -> None:
    """Build an image: from a Dockerfile like `docker build` (`shoal image build -t app:1 [-f Dockerfile] [--build-arg K=V] [--target STAGE] CONTEXT`), `shoal image build base`, from a recipe file (`-f recipe.toml`), or from steps: `shoal image build proj:v1 --from base --copy ./src /work --run "pip install -e /work"`."""  # noqa: E501
    # the step options were taken out of the command line in order (see _OrderedCommand)
    steps = ctx.meta.get("shoal.steps", [])
    if tag is not None or (file is not None and not str(file).endswith(".toml") and from_ is None and not steps):
        if from_ is not None or steps:
            _fail("a Dockerfile build (-t) takes no --from/--run/--copy steps", 2)
        if tag is None:
            _fail("name the image: shoal image build -t NAME[:TAG] [-f Dockerfile] CONTEXT", 2)
        _build_dockerfile(str(tag), name or ".", file, build_arg or [], target, platform, secret or [],
                          from_map or [], no_cache, network, quiet, as_json)
        return
    if name is not None and Path(name).is_dir() and file is None and from_ is None and not steps:
        _fail(f"{name} is a directory: to build its Dockerfile, name the image with -t NAME[:TAG]", 2)
    if file is None and from_ is None:
        if steps:
            _fail("steps need a parent image: add --from IMAGE (or use -f recipe.toml)", 2)
        if name is None or name.split(":")[0] in ("base", "code-interpreter"):
            _build_base(name, quiet, as_json)
            return
        _fail(f"nothing to build {name!r} from: give --from IMAGE with steps, or -f recipe.toml", 2)
    from shoal.images.recipe import load_recipe, recipe_from_cli

    def make() -> Any:
        if file is not None:
            if from_ is not None or steps:
                _fail("give either -f recipe.toml or --from/--run/--copy options, not both", 2)
            r = load_recipe(file, ref=name)
            if network is not None:
                r.network = network
            return r
        if name is None:
            _fail("name the image to build: shoal image build NAME --from IMAGE …", 2)
        return recipe_from_cli(str(name), str(from_), steps, network=True if network is None else network)

    from shoal.errors import ShoalError

    try:
        recipe = make()
    except ShoalError as e:
        _fail(e.message, 2)

    async def go() -> Any:
        from shoal.images.recipe import build_recipe
        from shoal.node.node import Node

        node = Node()
        await node.start(reap=False, reconcile=False)
        try:
            return await build_recipe(node, recipe, no_cache=no_cache, log=None if quiet else _build_log)
        finally:
            await node.stop()

    img = run_async(go)
    _print_result(img, as_json, "built")


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for it in items:
        k, eq, v = it.partition("=")
        if not k or not eq:
            _fail(f"{what} {it!r} must look like NAME=VALUE", 2)
        out[k] = v
    return out


def _build_dockerfile(tag: str, context: str, file: Path | None, build_args: list[str], target: str | None,
                      platform: str | None, secrets: list[str], from_map: list[str], no_cache: bool,
                      network: bool | None, quiet: bool, as_json: bool) -> None:
    import os

    from shoal.errors import ShoalError
    from shoal.images.dockerbuild import BuildOptions, build_dockerfile

    args = {}
    for it in build_args:
        k, eq, v = it.partition("=")
        if not k:
            _fail(f"--build-arg {it!r} must look like NAME=VALUE", 2)
        # as in Docker: `--build-arg NAME` takes NAME's value from the environment (skipped when unset)
        if eq:
            args[k] = v
        elif k in os.environ:
            args[k] = os.environ[k]
    sec: dict[str, Path] = {}
    for it in secrets:
        f = dict(p.partition("=")[::2] for p in it.split(","))
        sid, src = f.get("id"), f.get("src") or f.get("source")
        if not sid or not src:
            _fail(f"--secret {it!r} must look like id=ID,src=FILE", 2)
        sec[str(sid)] = Path(str(src))
    ctx_dir = Path(context)
    df = file if file is None or file.is_absolute() or file.exists() else ctx_dir / file
    try:
        opts = BuildOptions(tag=tag, context=ctx_dir, dockerfile=df, build_args=args, target=target,
                            no_cache=no_cache, platform=platform, from_map=_pairs(from_map, "--from-map"),
                            network=True if network is None else network, secrets=sec)
        opts.check()
    except ShoalError as e:
        _fail(e.message, 2)

    async def go() -> Any:
        from shoal.node.node import Node

        node = Node()
        await node.start(reap=False, reconcile=False)
        try:
            return await build_dockerfile(node, opts, log=None if quiet else _build_log)
        finally:
            await node.stop()

    res = run_async(go)
    for w in res.warnings:
        err_console.print(f"[yellow]warning:[/yellow] {escape(w)}", highlight=False)
    _print_result(res.image, as_json, "built")


def _build_log(line: str) -> None:
    if line.startswith("["):
        head, _, rest = line.partition("]")
        cached = rest.endswith("(cached)") or "(cached," in rest
        style = "dim" if cached else "bold cyan"
        err_console.print(f"[{style}]{escape(head)}][/{style}]{escape(rest)}", highlight=False)
    elif line.startswith("      -> "):
        err_console.print(f"[green]{escape(line)}[/green]", highlight=False)
    elif line.startswith("built "):
        return
    else:
        err_console.print(f"[dim]{escape(line)}[/dim]", highlight=False)


def _print_result(img: Any, as_json: bool, verb: str) -> None:
    if as_json:
        print(json.dumps(img.to_dict(), indent=1))
    else:
        console.print(f"[green]{verb}[/green] {img.ref} {img.digest[:19]} "
                      f"({len(img.layers)} layers, {_mib(img.size)})", highlight=False)


def _build_base(name: str | None, quiet: bool, as_json: bool) -> None:
    """The built-in images: `base`, and `code-interpreter` (base + matplotlib/pandas/IPython, for E2B's run_code)."""
    from shoal.images.base import build_base
    from shoal.server.compat.interpreter_image import build_interpreter_image

    store = _store()
    kind = (name or "base").split(":")[0]
    ref = name if name and ":" in name else f"{kind}:latest"
    build = build_interpreter_image if kind == "code-interpreter" else build_base

    async def go() -> Any:
        import asyncio

        with console.status(f"building {kind} image (mmdebstrap)…") as status:
            def log(msg: str) -> None:
                status.update(msg)
                if not quiet:
                    err_console.print(f"  {escape(msg)}", highlight=False)

            return await asyncio.to_thread(build, store, ref, log=log, work_dir=_local_tmp())

    _print_result(run_async(go), as_json, "built")


# ---- pull / import / compose / tag --------------------------------------------------------------
@image_app.command("pull")
def image_pull(
    reference: Annotated[str, typer.Argument(help="python:3.12-slim, ghcr.io/org/img:tag, name@sha256:… (Docker's "
                                                  "form; mirrors and credentials as in docs/images.md)")],
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="no progress bars")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the pull's report as JSON")] = False,
) -> None:
    """Pull an image from its registry into the store, like `docker pull` (layers in parallel, each at most
    once: layers the store already has are not fetched)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from shoal.images.pull import PullEvent, pull_image

    store = _store()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                        console=err_console, disable=quiet or as_json, transient=False)
    tasks: dict[int, Any] = {}

    def on_event(ev: PullEvent) -> None:
        if ev.kind == "resolved":
            progress.log(f"{ev.reference}: {ev.layers} layers, manifest {str(ev.digest)[:19]}")
        elif ev.kind == "waiting":
            progress.log(f"{ev.reference}: {ev.message}")
        elif ev.kind in ("layer-cached", "layer-start") and ev.layer is not None:
            label = f"{str(ev.digest)[7:19]} {'already in the store' if ev.kind == 'layer-cached' else 'downloading'}"
            tasks[ev.layer] = progress.add_task(label, total=ev.size or None,
                                                completed=(ev.size or 0) if ev.kind == "layer-cached" else 0)
        elif ev.kind == "layer-bytes" and ev.layer in tasks:
            progress.advance(tasks[ev.layer], ev.bytes)
        elif ev.kind == "layer-done" and ev.layer in tasks:
            progress.update(tasks[ev.layer], description=f"{str(ev.digest)[7:19]} done",
                            completed=ev.size or progress.tasks[tasks[ev.layer]].completed)

    async def go() -> Any:
        import asyncio

        def run() -> Any:
            return pull_image(store, reference, progress=on_event, work_dir=_local_tmp())

        with progress:
            return await asyncio.to_thread(run)

    rep = run_async(go)
    for note in rep.notes:
        err_console.print(f"[yellow]note:[/yellow] {escape(note)}")
    if as_json:
        print(json.dumps(rep.to_dict(), indent=1))
        return
    if rep.up_to_date:
        console.print(f"{rep.image.ref} is up to date ({rep.manifest_digest[:19]})", highlight=False)
        return
    how = ("pulled by another node" if rep.waited else
           f"{rep.layers_fetched} layers fetched ({_mib(rep.bytes_fetched)}), {rep.layers_cached} already in the store")
    console.print(f"[green]pulled[/green] {rep.image.ref} {rep.image.digest[:19]} ({how}, {rep.seconds:.1f}s)",
                  highlight=False)


@image_app.command("export")
def image_export(
    name: Annotated[str, typer.Argument(help="the image (name[:tag] or name@sha256:…)")],
    output: Annotated[str, typer.Option("--output", "-o", help="the archive to write, or - for stdout")],
    tag: Annotated[list[str] | None, typer.Option("--tag", "-t", help="RepoTags in the archive (default: "
                                                                       "the image's name:tag)")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
) -> None:
    """Write an image as a docker-archive: `shoal image export task-17:step3 -o x.tar && docker load -i x.tar`."""
    import sys

    from shoal.images.export import export_image

    store = _store()

    def log(msg: str) -> None:
        if not quiet:
            err_console.print(f"  {escape(msg)}", highlight=False)

    async def go() -> Any:
        import asyncio

        target: Any = sys.stdout.buffer if output == "-" else Path(output)
        return await asyncio.to_thread(export_image, store, name, target, repo_tags=tag or None, log=log,
                                       work_dir=_local_tmp())

    rep = run_async(go)
    if output != "-":
        console.print(f"[green]exported[/green] {rep.image} to {output} ({rep.layers} layers, {_mib(rep.bytes)}, "
                      f"{rep.seconds:.1f}s)", highlight=False)


@image_app.command("push")
def image_push(
    name: Annotated[str, typer.Argument(help="the image in the store")],
    reference: Annotated[str, typer.Argument(help="where to push it: registry/repository:tag "
                                                  "(e.g. localhost:5000/team/env:1)")],
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Push an image to a registry (Docker v2, gzip layers; blobs it has are skipped; Docker's credentials)."""
    from shoal.images.export import push_image

    store = _store()

    def log(msg: str) -> None:
        if not quiet and not as_json:
            err_console.print(f"  {escape(msg)}", highlight=False)

    async def go() -> Any:
        import asyncio

        return await asyncio.to_thread(push_image, store, name, reference, progress=log, work_dir=_local_tmp())

    rep = run_async(go)
    if as_json:
        print(json.dumps(rep.to_dict(), indent=1))
        return
    console.print(f"[green]pushed[/green] {rep.image} to {rep.target} {rep.manifest_digest[:19]} "
                  f"({rep.layers_uploaded} layers uploaded, {rep.layers_present} already there, "
                  f"{_mib(rep.bytes)})", highlight=False)


@image_app.command("import")
def image_import(
    source: Annotated[str, typer.Argument(help="FILE.tar (docker save / OCI layout, maybe .gz/.zst) or "
                                               "docker://registry/name:tag")],
    name: Annotated[str, typer.Argument(help="name[:tag] to store it as")],
    select: Annotated[str | None, typer.Option(help="which image of a multi-image archive (a RepoTag or "
                                                    "OCI ref name)")] = None,
    tls_verify: Annotated[bool, typer.Option("--tls-verify/--no-tls-verify",
                                             help="registry TLS verification (docker:// only)")] = True,
    quiet: Annotated[bool, typer.Option("--quiet", "-q")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Import an image: `shoal image import alpine.tar alpine:3.19` or `… docker://host:5000/app:1 app:1`."""
    from shoal.images.oci import import_archive, pull_image

    store = _store()

    async def go() -> Any:
        import asyncio

        with console.status(f"importing {source}…") as status:
            def log(msg: str) -> None:
                status.update(msg)
                if not quiet:
                    err_console.print(f"  {escape(msg)}", highlight=False)

            if source.startswith("docker://"):
                return await asyncio.to_thread(pull_image, store, source, name, tls_verify=tls_verify, log=log,
                                               work_dir=_local_tmp())
            return await asyncio.to_thread(import_archive, store, Path(source), name, select=select, log=log,
                                           work_dir=_local_tmp())

    rep = run_async(go)
    for note in rep.notes:
        err_console.print(f"[yellow]note:[/yellow] {escape(note)}")
    _print_result(rep.image, as_json, "imported")


@image_app.command("compose")
def image_compose(
    name: Annotated[str, typer.Argument(help="new image, name[:tag]")],
    sources: Annotated[list[str], typer.Argument(help="images to stack, bottom first")],
    env: Annotated[list[str] | None, typer.Option("--env", "-e", help="NAME=VALUE over the last's env")] = None,
    workdir: Annotated[str | None, typer.Option(help="working directory")] = None,
    user: Annotated[str | None, typer.Option(help="user")] = None,
    entrypoint: Annotated[str | None, typer.Option(help="entrypoint (a shell-quoted command line)")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Stack the layers of several images without rebuilding: `shoal image compose env:v1 base ws:v3 tk:v2`."""
    from shoal.errors import ShoalError
    from shoal.images.compose import compose_images

    envd = {}
    for item in env or []:
        if "=" not in item or item.startswith("="):
            _fail(f"--env {item!r} must look like NAME=VALUE", 2)
        k, v = item.split("=", 1)
        envd[k] = v
    try:
        img = compose_images(_store(), name, sources, env=envd or None, workdir=workdir, user=user,
                             entrypoint=shlex.split(entrypoint) if entrypoint is not None else None)
    except ShoalError as e:
        _fail(e.message)
    _print_result(img, as_json, "composed")


@image_app.command("tag")
def image_tag(source: str, name: str) -> None:
    """Point NAME (name:tag) at the same image version as SOURCE."""
    from shoal.errors import ShoalError
    from shoal.images.compose import tag_image

    try:
        img = tag_image(_store(), source, name)
    except ShoalError as e:
        _fail(e.message)
    console.print(f"tagged {img.ref} = {img.digest[:19]}", highlight=False)


# ---- inspect ------------------------------------------------------------------------------------
@image_app.command("ls")
def image_ls(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List images."""
    imgs = _store().list_images()
    if as_json:
        print(json.dumps([i.to_dict() for i in imgs], indent=1))
        return
    t = Table(title=f"{len(imgs)} images")
    for col in ("image", "digest", "layers", "size", "created"):
        t.add_column(col)
    for i in imgs:
        t.add_row(escape(i.ref), i.digest[:19], str(len(i.layers)), _mib(i.size),
                  time.strftime("%Y-%m-%d %H:%M", time.localtime(i.created)))
    console.print(t)


@image_app.command("layers")
def image_layers(name: str, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Show an image's layers, bottom first."""
    from shoal.errors import ShoalError

    try:
        img = _store().resolve(name)
    except ShoalError as e:
        _fail(e.message)
    if as_json:
        print(json.dumps([lay.to_dict() for lay in img.layers], indent=1))
        return
    t = Table(title=f"{escape(img.ref)} ({img.digest[:19]})")
    for col in ("#", "layer", "size", "created", "source"):
        t.add_column(col)
    for i, lay in enumerate(img.layers):
        t.add_row(str(i), lay.digest[:19], _mib(lay.size), time.strftime("%Y-%m-%d %H:%M", time.localtime(lay.created)),
                  escape(describe_source(lay.source)))
    console.print(t)


@image_app.command("inspect")
def image_inspect(name: str) -> None:
    """Print an image version as JSON: layers (with metadata), config and lineage."""
    from shoal.errors import ShoalError

    try:
        img = _store().resolve(name)
    except ShoalError as e:
        _fail(e.message)
    d = img.to_dict()
    d["layers"] = [lay.to_dict() for lay in img.layers]
    print(json.dumps(d, indent=1))


# ---- remove -------------------------------------------------------------------------------------
@image_app.command("rm")
def image_rm(names: list[str]) -> None:
    """Remove image tags (layers go at the next `shoal image gc`)."""
    from shoal.errors import ShoalError

    store = _store()
    bad = 0
    for n in names:
        try:
            store.remove_image(n)
            console.print(f"removed {escape(n)}")
        except ShoalError as e:
            bad += 1
            err_console.print(f"[red]error:[/red] {escape(e.message)}")
    raise typer.Exit(1 if bad else 0)


@image_app.command("gc")
def image_gc(
    grace: Annotated[str, typer.Option(help="keep layers created or used more recently than this "
                                            "(protects builds in progress on other hosts)")] = "1h",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="only report what would go")] = False,
    lease_max_age: Annotated[str | None, typer.Option(help="ignore other nodes' mount leases not renewed for this "
                                                           "long: their nodes died (default: SHOAL_LEASE_TTL_S, "
                                                           "15 min)")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Remove layers that no image and no live sandbox references (and stale temp files)."""
    from shoal.config import Paths
    from shoal.images.gc import collect_garbage

    rep = collect_garbage(_store(), Paths.from_env(), grace_s=parse_duration(grace), dry_run=dry_run,
                          lease_max_age_s=parse_duration(lease_max_age) if lease_max_age else -1.0)
    if as_json:
        print(json.dumps(rep.to_dict(), indent=1))
        return
    verb = "would remove" if dry_run else "removed"
    console.print(f"{verb} {len(rep.removed_layers)} layers ({_mib(rep.freed_bytes)}), "
                  f"{len(rep.removed_manifests)} untagged image versions, {rep.removed_cache_entries} cache entries, "
                  f"{rep.removed_tmp} temp files, {rep.removed_orphans} orphans; kept {rep.kept_referenced} "
                  f"referenced, {len(rep.kept_in_use)} in use, {len(rep.kept_young)} younger than {grace}")


@image_app.command("verify")
def image_verify(
    names: Annotated[list[str] | None,
                     typer.Argument(help="images to check (default: every layer in the store)")] = None,
    remove_corrupt: Annotated[bool, typer.Option("--remove-corrupt", help="delete damaged chunks and the layers "
                                                 "that use them, so that a rebuild or re-import stores them "
                                                 "afresh")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Check every chunk of the layers against its digest (each shared chunk once) and the marks nodes left
    when a chunk failed as they read it; list corrupt layers and the images that use them (exit 1 if any).
    A marked layer that checks clean again (a rebuild or re-import rewrote the chunk) is unmarked."""
    from shoal.errors import ShoalError
    from shoal.images import corruption

    store = _store()
    try:
        layers = list({lay.digest: lay for n in names for lay in store.resolve(n).layers}.values() if names
                      else store.list_layers())
    except ShoalError as e:
        _fail(e.message)
    users: dict[str, list[str]] = {}
    for img in store.list_images():
        for lay in img.layers:
            users.setdefault(lay.digest, []).append(img.ref)
    marks = corruption.read_marks(store.root)
    checked: dict[str, bool] = {}
    bad = []
    cleared = []
    for lay in layers:
        problems: list[tuple[str, str]] = []
        if lay.chunked:
            problems = store.chunks.verify(lay.hex, checked)
        elif not store.verify_layer(lay.digest):  # a whole-file layer not converted yet: hash the file
            problems = [("file", "corrupt")]
        if not problems and lay.hex in marks:
            corruption.clear(store.root, lay.hex)
            cleared.append(lay.digest)
        if problems:
            bad.append({"layer": lay.digest, "images": sorted(users.get(lay.digest, [])),
                        "chunks": [{"chunk": c if c in ("table", "file") else f"sha256:{c}", "problem": why}
                                   for c, why in problems]})
            if remove_corrupt:
                for c, why in problems:
                    if len(c) == 64 and why == "corrupt":
                        store.chunks.chunk_path(c).unlink(missing_ok=True)
                store.remove_layer(lay.digest)
    if as_json:
        print(json.dumps({"checked": len(layers), "chunks_checked": len(checked), "corrupt": bad,
                          "unmarked": cleared, "removed": remove_corrupt}, indent=1))
    else:
        console.print(f"checked {len(layers)} layers ({len(checked)} chunks): {len(bad)} corrupt")
        for b in bad:
            what = "removed" if remove_corrupt else "corrupt"
            first = b["chunks"][0]
            console.print(f"  {what} {b['layer']}  ({len(b['chunks'])} bad: {first['chunk']} {first['problem']})  "
                          f"used by: {', '.join(b['images']) or '-'}")
        for d in cleared:
            console.print(f"  repaired {d}: its chunks check clean again, the mark is gone")
    raise typer.Exit(1 if bad else 0)
