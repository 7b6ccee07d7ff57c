"""CLI for stateful sandboxes: `shoal shell`, `pause`, `resume`, `snapshot`, `fork`, `node swap`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from typing import Annotated, Any

import typer
from rich.table import Table

from shoal.cli.common import console, err_console, make_client, run_async

UrlOpt = Annotated[str | None, typer.Option("--url", help="API server (default: embedded node; env SHOAL_URL)")]
node_app = typer.Typer(help="This host's node: swap for paused sandboxes, teardown.", no_args_is_help=True)


# ---- shell -------------------------------------------------------------------------------------
def shell(sandbox_id: str,
          cmd: Annotated[list[str] | None, typer.Argument(help="program to run (default: bash)")] = None,
          cwd: str | None = None, user: str | None = None,
          env: Annotated[list[str] | None, typer.Option("--env", "-e", help="KEY=VALUE")] = None,
          tty: Annotated[bool | None, typer.Option("--tty/--no-tty",
                                                   help="PTY (default: when stdin is a terminal)")] = None,
          url: UrlOpt = None) -> None:
    """An interactive shell in a sandbox (a PTY, raw terminal, resizes follow the window).

    With stdin not a terminal, stdin is fed to the program: `echo 'ls /' | shoal shell ID`.
    """
    argv = list(cmd) if cmd else ["/bin/bash"]
    envd = {}
    for item in env or []:
        if "=" not in item:
            err_console.print(f"[red]error:[/red] --env {item!r} must look like KEY=VALUE")
            raise typer.Exit(2)
        k, v = item.split("=", 1)
        envd[k] = v
    use_tty = sys.stdin.isatty() if tty is None else tty

    async def go() -> int:
        async with make_client(url) as client:
            sb = await client.get(sandbox_id)
            if use_tty:
                return await interactive(sb, argv, cwd=cwd, user=user, env=envd)
            return await piped(sb, argv, cwd=cwd, user=user, env=envd)

    raise typer.Exit(run_async(go))


def _term_size(fd: int) -> tuple[int, int]:
    try:
        sz = os.get_terminal_size(fd)
        if sz.lines > 0 and sz.columns > 0:
            return sz.lines, sz.columns
    except OSError:
        pass
    return 24, 80


async def interactive(sb: Any, argv: list[str], *, cwd: str | None = None, user: str | None = None,
                      env: dict[str, str] | None = None) -> int:
    """Run `argv` on a PTY in the sandbox wired to this terminal (raw mode); returns its exit code."""
    import termios
    import tty as ttymod

    fd_in = sys.stdin.fileno()
    is_term = os.isatty(fd_in)
    envd = {"TERM": os.environ.get("TERM") or "xterm-256color", **(env or {})}
    st = await sb.stream(argv, tty=True, cwd=cwd, user=user, env=envd, timeout=None)
    rows, cols = _term_size(fd_in)
    await st.resize(rows, cols)
    loop = asyncio.get_running_loop()
    inq: asyncio.Queue[bytes] = asyncio.Queue()

    def readable() -> None:
        try:
            data = os.read(fd_in, 65536)
        except OSError:
            data = b""
        inq.put_nowait(data)
        if not data:
            loop.remove_reader(fd_in)

    async def pump() -> None:
        while True:
            data = await inq.get()
            if not data:
                await st.close_stdin()  # on a PTY: the terminal's EOF character
                return
            await st.write(data)

    resizes: set[asyncio.Task] = set()

    def winch() -> None:
        r, c = _term_size(fd_in)
        t = loop.create_task(st.resize(r, c))
        resizes.add(t)
        t.add_done_callback(resizes.discard)

    old = termios.tcgetattr(fd_in) if is_term else None
    pump_task: asyncio.Task | None = None
    try:
        if is_term:
            ttymod.setraw(fd_in)
            loop.add_signal_handler(signal.SIGWINCH, winch)
        loop.add_reader(fd_in, readable)
        pump_task = loop.create_task(pump())
        async for ev in st:
            if ev.kind in ("stdout", "stderr"):
                os.write(sys.stdout.fileno(), ev.data)
    finally:
        with contextlib.suppress(Exception):
            loop.remove_reader(fd_in)
        if is_term:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(signal.SIGWINCH)
            termios.tcsetattr(fd_in, termios.TCSADRAIN, old)
        if pump_task is not None:
            pump_task.cancel()
            with contextlib.suppress(BaseException):
                await pump_task
    return st.result.exit_code if st.result else 1


async def piped(sb: Any, argv: list[str], *, cwd: str | None = None, user: str | None = None,
                env: dict[str, str] | None = None) -> int:
    """Run `argv` with this process's stdin fed to it (no PTY); stdout/stderr kept apart."""
    st = await sb.stream(argv, stdin=True, cwd=cwd, user=user, env=env or None, timeout=None)
    fd_in = sys.stdin.fileno()

    async def pump() -> None:
        while True:
            # a thread: stdin may be a regular file, which epoll cannot watch
            data = await asyncio.to_thread(os.read, fd_in, 65536)
            if not data:
                break
            await st.write(data)
        await st.close_stdin()

    pump_task = asyncio.get_running_loop().create_task(pump())
    try:
        async for ev in st:
            if ev.kind == "stdout":
                sys.stdout.buffer.write(ev.data)
                sys.stdout.buffer.flush()
            elif ev.kind == "stderr":
                sys.stderr.buffer.write(ev.data)
                sys.stderr.buffer.flush()
    finally:
        pump_task.cancel()
        with contextlib.suppress(BaseException):
            await pump_task
    return st.result.exit_code if st.result else 1


# ---- pause / resume ----------------------------------------------------------------------------
def _mib(n: Any) -> str:
    return f"{int(n or 0) / 2**20:.1f} MiB"


def pause(sandbox_ids: Annotated[list[str], typer.Argument(help="sandbox IDs")], url: UrlOpt = None) -> None:
    """Freeze sandboxes and reclaim their memory; any later request resumes them."""
    async def go() -> int:
        bad = 0
        async with make_client(url) as client:
            for sid in sandbox_ids:
                try:
                    sb = await client.get(sid)
                    t0 = time.monotonic()
                    await sb.pause()
                    dt = time.monotonic() - t0
                    info = await sb.refresh()
                    rc = info.extra.get("reclaim") or {}
                    detail = (f"memory {_mib(rc.get('before'))} -> {_mib(rc.get('after'))}, "
                              f"swap {_mib(rc.get('swap_after'))}" if rc else "no reclaim")
                    console.print(f"paused {sid} in {dt * 1000:.0f} ms ({detail})")
                except Exception as e:
                    bad += 1
                    err_console.print(f"[red]error:[/red] {sid}: {getattr(e, 'message', e)}")
        return 1 if bad else 0

    raise typer.Exit(run_async(go))


def resume(sandbox_ids: Annotated[list[str], typer.Argument(help="sandbox IDs")], url: UrlOpt = None) -> None:
    """Prefetch the working set and thaw paused sandboxes."""
    async def go() -> int:
        bad = 0
        async with make_client(url) as client:
            for sid in sandbox_ids:
                try:
                    sb = await client.get(sid)
                    t0 = time.monotonic()
                    await sb.resume()
                    console.print(f"resumed {sid} in {(time.monotonic() - t0) * 1000:.0f} ms")
                except Exception as e:
                    bad += 1
                    err_console.print(f"[red]error:[/red] {sid}: {getattr(e, 'message', e)}")
        return 1 if bad else 0

    raise typer.Exit(run_async(go))


# ---- snapshot / fork ---------------------------------------------------------------------------
def snapshot(sandbox_id: str, name: Annotated[str, typer.Argument(help="new image, name[:tag]")],
             as_json: Annotated[bool, typer.Option("--json")] = False, url: UrlOpt = None) -> None:
    """Save a sandbox's files as a new image (parent layers + its changes): `shoal snapshot ID task:step3`."""
    async def go() -> int:
        async with make_client(url) as client:
            sb = await client.get(sandbox_id)
            img = await sb.snapshot(name)
        if as_json:
            print(json.dumps(img, indent=1))
        else:
            layer = (img.get("layer") or "none (no changes)")[:19]
            console.print(f"[green]snapshot[/green] {img['ref']} {img['digest'][:19]}: {len(img['layers'])} layers, "
                          f"new layer {layer} ({_mib(img.get('diff_bytes'))}), {img['seconds'] * 1000:.0f} ms "
                          f"(frozen {img['frozen_s'] * 1000:.0f} ms)")
        return 0

    raise typer.Exit(run_async(go))


def fork(sandbox_id: str, n: Annotated[int, typer.Option("-n", help="how many children")] = 1,
         name: Annotated[str | None, typer.Option(help="tag for the intermediate snapshot")] = None,
         memory: Annotated[bool, typer.Option(help="fork processes and memory too (needs a backend that "
                                                   "can checkpoint them)")] = False,
         url: UrlOpt = None) -> None:
    """Make N children from a sandbox's current files; prints their IDs (the parent keeps running)."""
    async def go() -> int:
        async with make_client(url, keep=True) as client:
            sb = await client.get(sandbox_id)
            t0 = time.monotonic()
            kw: dict[str, Any] = {"memory": memory}
            if name:
                kw["name"] = name
            items = await client.transport.fork(sb.id, n, **kw)
        bad = 0
        for it in items:
            if isinstance(it, Exception):
                bad += 1
                err_console.print(f"[red]error:[/red] {getattr(it, 'message', it)}")
            else:
                print(it.id)
        err_console.print(f"{n - bad}/{n} children in {time.monotonic() - t0:.2f}s")
        return 1 if bad else 0

    raise typer.Exit(run_async(go))


# ---- node swap ---------------------------------------------------------------------------------
@node_app.command("swap")
def node_swap(zram: Annotated[str | None, typer.Option(help="make the zram swap this size, e.g. 16G (a zram "
                                                       "swap of another size is read back and replaced)")] = None,
              auto: Annotated[bool, typer.Option("--auto", help="the size a node picks by itself: half the RAM, "
                                                 "at most 8G")] = False,
              off: Annotated[bool, typer.Option("--off", help="turn zram swap off (reads pages back first)")] = False,
              algorithm: Annotated[str | None, typer.Option(help="zram compression (default: best offered)")] = None,
              as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Show or change the swap paused sandboxes go to. A node makes zram swap by itself on a host without any
    (SHOAL_ZRAM_SWAP=auto: half the RAM, at most 8G); `--zram 16G` / `--auto` resize it, `--off` removes it."""
    from shoal.backends.container import reclaim, swap
    from shoal.errors import ShoalError

    try:
        if sum(bool(x) for x in (zram, auto, off)) > 1:
            err_console.print("[red]error:[/red] give one of --zram SIZE, --auto or --off")
            raise typer.Exit(2)
        if zram or auto:
            d = swap.resize("auto" if auto else str(zram), algorithm=algorithm)
            err_console.print(f"zram swap on /dev/{d.device}: {d.size / 2**30:.1f} GiB")
        elif off:
            done = swap.turn_off()
            err_console.print(f"zram swap off ({', '.join(done) or 'none was on'})")
    except ShoalError as e:
        err_console.print(f"[red]error:[/red] {e.message}")
        raise typer.Exit(1) from None
    st = reclaim.swap_status()
    if as_json:
        print(json.dumps({**st, "made_by_node": swap.made_by_node(), "auto_size": swap.auto_size()}, indent=1))
        return
    t = Table(title="swap")
    for col in ("device", "type", "size", "used", "prio", "zram data -> memory"):
        t.add_column(col)
    zr = {f"/dev/{z['name']}": z for z in st["zram"]}
    for s in st["swap"]:
        z = zr.get(s["path"])
        ratio = (f"{_mib(z['orig_data_size'])} -> {_mib(z['mem_used_total'])} ({z['algorithm']})" if z else "")
        t.add_row(s["path"], s["type"], _mib(s["size_kb"] * 1024), _mib(s["used_kb"] * 1024), str(s["priority"]), ratio)
    console.print(t if st["swap"] else "no swap: paused sandboxes give back page cache only until a node "
                  "starts (SHOAL_ZRAM_SWAP=auto makes zram then) — or now: `shoal node swap --auto`")
    made = swap.made_by_node()
    if made:
        console.print(f"/dev/{made['device']} was made by a node (SHOAL_ZRAM_SWAP={made.get('setting')}); node "
                      f"processes relying on it: {len(swap.live_users())}")
    if st["zswap"].get("enabled") in ("Y", "1"):
        console.print(f"zswap on ({st['zswap'].get('compressor')})")


@node_app.command("teardown")
def node_teardown(
    close: Annotated[bool, typer.Option("--close-sandboxes",
                                        help="close every sandbox of this SHOAL_HOME first (they are lost)")] = False,
    purge: Annotated[bool, typer.Option("--purge", help="then delete SHOAL_HOME itself (with the image store "
                                                        "when it lives inside it)")] = False,
) -> None:
    """Undo what a node set up in SHOAL_HOME: layer mounts, the upper pool, the sandbox tmpfs (`--purge`: the
    directory too). Refuses while sandboxes exist, unless `--close-sandboxes`."""
    from shoal.config import Paths
    from shoal.errors import ShoalError
    from shoal.node.teardown import purge_home, teardown_home

    paths = Paths.from_env()
    report = run_async(lambda: teardown_home(paths, close_sandboxes=close))
    err_console.print(f"closed {report.closed} sandbox(es); upper pool "
                      f"{'unmounted' if report.pool_unmounted else 'was not mounted'}")
    if purge:
        try:
            purge_home(paths)
        except ShoalError as e:
            err_console.print(f"[red]error:[/red] {e.message}")
            raise typer.Exit(1) from None
        err_console.print(f"deleted {paths.home}")


def register(app: typer.Typer) -> None:
    """Add these commands to the main `shoal` app."""
    app.command("shell")(shell)
    app.command("pause")(pause)
    app.command("resume")(resume)
    app.command("snapshot")(snapshot)
    app.command("fork")(fork)
    app.add_typer(node_app, name="node")
