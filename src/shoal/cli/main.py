"""`shoal` — create sandboxes, run commands in them, manage images, serve the API, benchmark."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Annotated, Any

import typer
from rich.table import Table

from shoal.cli.common import console, err_console, make_client, run_async
from shoal.errors import InvalidRequest
from shoal.limits import (
    DEFAULT_BACKEND,
    DEFAULT_CPUS,
    DEFAULT_EXEC_TIMEOUT_S,
    DEFAULT_IMAGE,
    DEFAULT_MEMORY_MB,
    DEFAULT_TTL_S,
)

app = typer.Typer(help="shoal: isolated, stateful sandboxes for agentic RL.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)
from shoal.cli.images import image_app  # noqa: E402 - the `image` sub-commands live there

app.add_typer(image_app, name="image")
from shoal.cli.store import store_app  # noqa: E402 - `store` (probe, MooseFS dev cluster)

app.add_typer(store_app, name="store")

UrlOpt = Annotated[str | None, typer.Option("--url", help="API server (default: embedded node; env SHOAL_URL)")]


def _fmt_age(ts: float) -> str:
    s = max(0, time.time() - ts)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


# ---- host --------------------------------------------------------------------------------------
@app.command()
def doctor(fix: Annotated[bool, typer.Option(help="apply safe host fixes (mount hugetlb for crun)")] = False,
           as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False) -> None:
    """What this host can run, and why not (with the fix)."""
    from shoal.doctor import run_checks

    checks = run_checks(fix=fix)
    if as_json:
        print(json.dumps([c.__dict__ for c in checks], indent=1))
        return
    t = Table(title="shoal doctor", show_lines=False)
    t.add_column("check")
    t.add_column("")
    t.add_column("detail")
    t.add_column("fix")
    for c in checks:
        t.add_row(c.name, "[green]ok[/green]" if c.ok else "[yellow]no[/yellow]", c.detail, c.fix)
    console.print(t)


# ---- sandboxes ---------------------------------------------------------------------------------
def _spec_kwargs(backend: str, runtime: str | None, cpus: float, memory_mb: int, network: bool,
                 ttl: float | None, env: list[str] | None, labels: list[str] | None) -> dict[str, Any]:
    def pairs(items: list[str] | None, what: str) -> dict[str, str]:
        out = {}
        for it in items or []:
            if "=" not in it:
                err_console.print(f"[red]error:[/red] {what} {it!r} must look like KEY=VALUE")
                raise typer.Exit(2)
            k, v = it.split("=", 1)
            out[k] = v
        return out

    kw: dict[str, Any] = {"backend": backend, "cpus": cpus, "memory_mb": memory_mb, "network": network,
                          "ttl_s": ttl, "env": pairs(env, "--env"), "labels": pairs(labels, "--label")}
    if runtime:
        kw["runtime"] = runtime
    return kw


@app.command()
def run(image: str, cmd: Annotated[list[str] | None, typer.Argument(
            help="command (after --); none: the image's ENTRYPOINT + CMD, as `docker run IMAGE` does")] = None,
        backend: str = DEFAULT_BACKEND, runtime: str | None = None, cpus: float = DEFAULT_CPUS,
        memory_mb: int = DEFAULT_MEMORY_MB, network: bool = False, timeout: float = DEFAULT_EXEC_TIMEOUT_S,
        url: UrlOpt = None) -> None:
    """Run one command in a fresh sandbox, print its output, remove the sandbox: `shoal run base -- ls /`."""
    async def go() -> int:
        async with make_client(url, keep=False) as client:
            sb = await client.create(image, **_spec_kwargs(backend, runtime, cpus, memory_mb, network, 600,
                                                           None, None))
            try:
                if cmd:
                    argv: str | list[str] = cmd if len(cmd) > 1 else cmd[0]
                else:
                    conf = (await client.image(image)).get("config") or {}
                    argv = [*(conf.get("entrypoint") or []), *(conf.get("cmd") or [])]
                    if not argv:
                        raise InvalidRequest(f"image {image} has no ENTRYPOINT or CMD: give a command after --")
                r = await sb.exec(argv, timeout=timeout)
            finally:
                await sb.close()
        sys.stdout.buffer.write(r.stdout if isinstance(r.stdout, bytes) else r.stdout.encode())
        sys.stderr.buffer.write(r.stderr if isinstance(r.stderr, bytes) else r.stderr.encode())
        if r.timed_out:
            err_console.print(f"[yellow]timed out after {timeout}s[/yellow]")
        if r.truncated:
            err_console.print("[yellow]output truncated[/yellow]")
        return r.exit_code

    raise typer.Exit(run_async(go))


@app.command()
def create(image: Annotated[str, typer.Argument()] = DEFAULT_IMAGE,
           n: Annotated[int, typer.Option("-n", help="how many")] = 1,
           backend: str = DEFAULT_BACKEND, runtime: str | None = None, cpus: float = DEFAULT_CPUS,
           memory_mb: int = DEFAULT_MEMORY_MB, network: bool = False,
           ttl: Annotated[float | None, typer.Option(help="seconds until auto-stop")] = DEFAULT_TTL_S,
           env: Annotated[list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE")] = None,
           label: Annotated[list[str] | None, typer.Option("--label", "-l", help="KEY=VALUE")] = None,
           url: UrlOpt = None) -> None:
    """Create sandboxes and print their IDs (they live until `shoal rm` or their TTL)."""
    kw = _spec_kwargs(backend, runtime, cpus, memory_mb, network, ttl, env, label)

    async def go() -> int:
        async with make_client(url, keep=True) as client:
            if n == 1:
                sb = await client.create(image, **kw)
                print(sb.id)
                return 0
            from rich.progress import Progress

            t0 = time.monotonic()
            with Progress(console=err_console, transient=True) as prog:
                task = prog.add_task(f"creating {n} sandboxes", total=None)
                items = await client.create_many(image, n, **kw)
                prog.update(task, completed=n, total=n)
            bad = 0
            for it in items:
                if isinstance(it, Exception):
                    bad += 1
                    err_console.print(f"[red]error:[/red] {it}")
                else:
                    print(it.id)
            err_console.print(f"{n - bad}/{n} created in {time.monotonic() - t0:.2f}s")
            return 1 if bad else 0

    raise typer.Exit(run_async(go))


@app.command("exec")
def exec_(sandbox_id: str, cmd: Annotated[list[str], typer.Argument(help="command (after --)")],
          timeout: float = DEFAULT_EXEC_TIMEOUT_S, cwd: str | None = None, user: str | None = None,
          url: UrlOpt = None) -> None:
    """Run a command in an existing sandbox: `shoal exec ID -- make test`."""
    async def go() -> int:
        async with make_client(url) as client:
            sb = await client.get(sandbox_id)
            r = await sb.exec(cmd if len(cmd) > 1 else cmd[0], timeout=timeout, cwd=cwd, user=user)
        sys.stdout.buffer.write(r.stdout if isinstance(r.stdout, bytes) else r.stdout.encode())
        sys.stderr.buffer.write(r.stderr if isinstance(r.stderr, bytes) else r.stderr.encode())
        if r.timed_out:
            err_console.print(f"[yellow]timed out after {timeout}s[/yellow]")
        return r.exit_code

    raise typer.Exit(run_async(go))


def _resources(info: Any) -> tuple[str, str]:
    """cpus and memory_mb of a listed sandbox, for the table: read from the SandboxInfo's JSON view of its
    spec, not through SandboxSpec.from_wire, which would load pydantic (~0.2 s) for a listing."""
    return str(info.spec.get("cpus")), str(info.spec.get("memory_mb"))  # untyped-spec-read: allowed


@app.command("ls")
def ls(as_json: Annotated[bool, typer.Option("--json")] = False,
       label: Annotated[list[str] | None, typer.Option("--label", "-l")] = None, url: UrlOpt = None) -> None:
    """List sandboxes."""
    labels = dict(x.split("=", 1) for x in (label or []) if "=" in x) or None

    async def go() -> None:
        async with make_client(url) as client:
            items = await client.list(labels=labels)
        if as_json:
            print(json.dumps([i.to_dict() for i in items], indent=1))
            return
        t = Table(title=f"{len(items)} sandboxes")
        for col in ("id", "image", "backend", "state", "age", "expires", "cpus", "mem MiB", "labels"):
            t.add_column(col)
        for i in items:
            exp = "-" if not i.expires_at else f"in {max(0, i.expires_at - time.time()):.0f}s"
            t.add_row(i.id, i.image, f"{i.backend}/{i.runtime}" if i.runtime else i.backend, i.state,
                      _fmt_age(i.created_at), exp, *_resources(i),
                      ",".join(f"{k}={v}" for k, v in i.labels.items()))
        console.print(t)

    run_async(go)


@app.command("rm")
def rm(sandbox_ids: Annotated[list[str] | None, typer.Argument()] = None,
       all_: Annotated[bool, typer.Option("--all", help="remove every sandbox")] = False,
       parallel: Annotated[int, typer.Option("--parallel", min=1, help="closes at once")] = 64,
       url: UrlOpt = None) -> None:
    """Remove sandboxes (everything they had on the host goes with them), many at once."""
    if not sandbox_ids and not all_:
        err_console.print("[red]error:[/red] give sandbox IDs or --all")
        raise typer.Exit(2)

    async def go() -> int:
        from rich.progress import Progress

        async with make_client(url) as client:
            ids = [i.id for i in await client.list()] if all_ else list(sandbox_ids or [])
            bad = 0
            sem = asyncio.Semaphore(parallel)
            t0 = time.monotonic()
            with Progress(console=err_console, transient=True, disable=len(ids) < 50) as progress:
                task = progress.add_task(f"removing {len(ids)} sandboxes", total=len(ids))

                async def one(sid: str) -> None:
                    nonlocal bad
                    async with sem:
                        try:
                            await client.transport.close(sid)
                        except Exception as e:
                            bad += 1
                            err_console.print(f"[red]error:[/red] {sid}: {e}")
                    progress.advance(task)

                await asyncio.gather(*(one(sid) for sid in ids))
            err_console.print(f"removed {len(ids) - bad} sandbox(es) in {time.monotonic() - t0:.1f} s")
            return 1 if bad else 0

    raise typer.Exit(run_async(go))


@app.command()
def gc() -> None:
    """Clean up: close expired and dead sandboxes, re-adopt live ones, unmount unused layers."""
    from shoal.node.node import Node

    async def go() -> None:
        node = Node()
        await node.start(reap=False, reconcile=False)
        try:
            stats = await node.reconcile()
            stats["expired"] = await node.recovery.reap_once()
        finally:
            await node.stop()
        console.print(stats)

    run_async(go)


from shoal.cli.stateful import register as _register_stateful  # noqa: E402

_register_stateful(app)

from shoal.cli.server import register as _register_server  # noqa: E402

_register_server(app)

from shoal.cli.observe import register as _register_observe  # noqa: E402 - `shoal events` and `shoal top`

_register_observe(app)

from shoal.cli.demo import register as _register_demo  # noqa: E402 - `shoal demo` and `shoal tasks` live there

_register_demo(app)

from shoal.cli.fncall import fncall_app  # noqa: E402 - the `fncall` sub-commands live there

app.add_typer(fncall_app, name="fncall")


from shoal.cli.bench import bench as _bench  # noqa: E402 - `shoal bench` lives in its own module

app.command("bench")(_bench)


from shoal.cli.sim import sim as _sim  # noqa: E402 - `shoal sim` lives in its own module

app.command("sim")(_sim)


from shoal.cli.vm import vm_app  # noqa: E402 - the `vm` sub-commands live there

app.add_typer(vm_app, name="vm")

from shoal.cli.config import config as _config  # noqa: E402 - `shoal config` lives in its own module

app.command("config")(_config)

from shoal.cli.cluster import register as _register_cluster  # noqa: E402 - `shoal cluster ...` lives there

_register_cluster(app)


@app.callback()
def _load_settings() -> None:
    """Check the settings when any command starts: a bad SHOAL_* value stops it here, with the variable named,
    instead of deep inside a create; unknown SHOAL_* variables (typos) are reported."""
    import warnings

    from shoal.config import InvalidSetting, UnknownSettingWarning, settings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UnknownSettingWarning)
        try:
            settings()
        except InvalidSetting as e:
            err_console.print(f"[red]error:[/red] {e.message}")
            raise typer.Exit(2) from None
    for w in caught:
        err_console.print(f"[yellow]warning:[/yellow] {w.message}")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
