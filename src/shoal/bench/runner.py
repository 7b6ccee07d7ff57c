"""Run benchmark scenarios: set up a private node (and Docker), run, collect, clean up, report.

The node uses a private SHOAL_HOME (never the host's default one: other node agents may be serving
sandboxes there) and the shared layer store. Its admission cap on promised memory is lifted (the density
scenario measures the machine, not the policy); the free-memory floor stays on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from shoal.bench import homes, host, registry
from shoal.bench.context import BenchContext, make_progress
from shoal.bench.results import ScenarioResult
from shoal.bench.scenario import Scenario, params_dict
from shoal.config import settings
from shoal.host.spawn import run_sync

DOCKER_IMPORT_USER = "bench-docker-import"


def raise_nofile() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to the hard limit (5,000 sandboxes = 5,000+ sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def split_overrides(pairs: list[str], names: list[str]) -> dict[str, dict[str, str]]:
    """`-p key=value` / `-p scenario.key=value` strings as {scenario: {key: value}} for the scenarios `names`;
    a bare key goes to every named scenario that declares it (an error when none does)."""
    from shoal.bench.scenario import ParamError

    out: dict[str, dict[str, str]] = {n: {} for n in names}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ParamError(f"-p {pair!r}: write KEY=VALUE or SCENARIO.KEY=VALUE")
        scen, dot, k = key.rpartition(".")
        if dot:
            scen = registry.ALIASES.get(scen, scen)
            if scen not in out:
                raise ParamError(f"-p {pair!r}: scenario {scen!r} is not among those run ({', '.join(names)})")
            out[scen][k] = value
            continue
        takers = [n for n in names if any(p.name == k for p in registry.get(n).describe())]
        if not takers:
            raise ParamError(f"-p {pair!r}: none of {', '.join(names)} has a parameter {k!r} "
                             "(`shoal bench NAME --list` shows them)")
        for n in takers:
            out[n][k] = value
    return out


def leaks(home: Path) -> dict[str, list[str]]:
    """What a run left behind under `home`: sandbox mounts, runtime containers, sandbox cgroups."""
    from shoal.host import syscalls

    out: dict[str, list[str]] = {}
    mounts = [m for m in syscalls.mounts_under(str(home / "sandboxes"))]
    if mounts:
        out["mounts"] = mounts
    conts = []
    for rt in ("crun", "runc"):
        if shutil.which(rt):
            r = run_sync([rt, "list"], timeout=30)
            conts += [line.split()[0] for line in r.stdout.decode(errors="replace").splitlines()[1:]
                      if str(home) in line]
    if conts:
        out["containers"] = conts
    sbdir = home / "sandboxes"
    if sbdir.is_dir():
        left = [e.name for e in os.scandir(sbdir)]
        if left:
            out["sandbox_dirs"] = left
    return out


async def _run_one(ctx: BenchContext, scen: Scenario[Any], params: Any) -> ScenarioResult:
    name = scen.name
    t0 = time.monotonic()
    all0, idle0 = host.cpu_times()
    own0 = host.own_cpu_seconds()
    ctx.console.rule(f"[bold]{name}[/bold] — {scen.title}")
    try:
        res = await scen.run(ctx, params)
    except Exception as e:  # one scenario failing must not lose the others' results
        import traceback

        res = ScenarioResult(name=name, title=scen.title, error=f"{type(e).__name__}: {e}",
                             docker=ctx.docker_status if scen.uses_docker else "not applicable")
        res.data["traceback"] = traceback.format_exc()[-4000:]
        ctx.console.print(f"  [red]failed:[/red] {res.error}")
    res.title = res.title or scen.title
    res.params = params_dict(params)
    res.seconds = time.monotonic() - t0
    # how busy the machine was meanwhile, and how much of it was this benchmark's node (+ crun): the rest
    # is other work on the host (and Docker's daemons during the Docker parts)
    all1, idle1 = host.cpu_times()
    ticks = os.sysconf("SC_CLK_TCK")
    busy_s = ((all1 - all0) - (idle1 - idle0)) / ticks
    own_s = host.own_cpu_seconds() - own0
    ncpu = os.cpu_count() or 1
    res.data["machine"] = {"busy_fraction": round(busy_s / max(1e-9, res.seconds * ncpu), 3),
                           "bench_process_cpu_s": round(own_s, 1), "machine_busy_cpu_s": round(busy_s, 1),
                           "load_avg_after": [round(x, 1) for x in os.getloadavg()]}
    # every scenario starts from an empty node
    with contextlib.suppress(Exception):
        n = await ctx.node.close_all()
        if n:
            res.notes.append(f"{n} sandbox(es) were still open after the scenario and were closed")
    return res


def _start_docker(ctx_console: Console, node: Any, image: str) -> tuple[Any, Any, str]:
    """(engine, its private filesystem, '') or (None, None, why not)."""
    from shoal.bench.docker import DockerEngine, DockerError, find_dockerd

    path, why = find_dockerd()
    if not path:
        return None, None, why
    # Docker's data root gets its own device, so the disk scenario can count Docker's writes alone
    fs = host.LoopFs(Path(f"/tmp/sbd-{os.getpid()}"))
    try:
        fs.create()
    except Exception as e:
        return None, None, f"could not make a private filesystem for Docker's data root: {e}"
    eng = DockerEngine(fs.mountpoint)
    try:
        ctx_console.print(f"  starting a private dockerd ({path}) in {eng.dir} …")
        eng.start()
        img = node.store.resolve(image)
        mps = node.layer_mounts.acquire(img.layers, DOCKER_IMPORT_USER)
        try:
            if len(mps) != 1:
                raise DockerError(f"image {image} has {len(mps)} layers; the Docker import takes one tree")
            ctx_console.print(f"  importing the same '{image}' tree into Docker …")
            eng.import_tree(mps[0])
        finally:
            node.layer_mounts.release([lay.hex for lay in img.layers], DOCKER_IMPORT_USER)
        return eng, fs, ""
    except Exception as e:
        with contextlib.suppress(Exception):
            eng.stop()
        fs.destroy()
        return None, None, f"dockerd could not be started here: {e}"


async def run_bench(names: list[str] | None = None, *, json_path: Path | None = None, plot_dir: Path | None = None,
                    quick: bool = False, no_docker: bool = False, home: Path | None = None,
                    markdown: Path | None = None, command: str | None = None,
                    console: Console | None = None,
                    params: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run scenarios (the default run when `names` is empty) and return the results document; writes
    JSON/plots/markdown when asked. `params` overrides declared parameters: {scenario: {name: value}}."""
    from shoal import config

    # the run pins this process's settings (its layer store, below) and gives back the ones it found
    before = config.pinned()
    try:
        return await _run_bench(names, json_path=json_path, plot_dir=plot_dir, quick=quick, no_docker=no_docker,
                                home=home, markdown=markdown, command=command, console=console, params=params)
    finally:
        config.use(before)


async def _run_bench(names: list[str] | None, *, json_path: Path | None, plot_dir: Path | None, quick: bool,
                     no_docker: bool, home: Path | None, markdown: Path | None, command: str | None,
                     console: Console | None, params: dict[str, dict[str, Any]] | None) -> dict[str, Any]:
    import shoal
    from shoal import config
    from shoal.config import NodeConfig, Paths
    from shoal.images.base import ensure_base
    from shoal.node.node import Node
    from shoal.sdk.local import LocalTransport

    console = console or Console()
    names = registry.resolve(names)
    scens = {n: registry.get(n) for n in names}
    # every parameter is checked before anything starts: a typo must not cost a half-hour run
    chosen = {n: s.make_params(quick, (params or {}).get(n)) for n, s in scens.items()}
    nofile = raise_nofile()
    busy = await asyncio.to_thread(host.cpu_busy_fraction, 1.0)
    machine = host.machine_info()
    machine["cpu_busy_at_start"] = round(busy, 3)
    if busy > 0.25:
        console.print(f"[yellow]warning:[/yellow] the machine is {busy:.0%} busy before the run; "
                      "absolute numbers will be noisy (ratios less so)")
    own_home = home is None
    home = Path(home or homes.home_for())
    if own_home:
        homes.claim(home)
    home.mkdir(parents=True, exist_ok=True)
    st = settings()
    paths = Paths.from_env(home, st.store if st.is_set("store") else "/var/lib/shoal/store")
    # runs killed before their teardown (SIGKILL, a CI timeout) left sandboxes and mounts: undo them first
    for stale, left in (await homes.reap_stale(paths.store)).items():
        console.print(f"  removed what a dead benchmark run left: {stale}"
                      + (f" [red](still there: {left})[/red]" if left else ""))
    # other scenarios start nodes of their own (and servers: shoal_child_env): they use the same store
    st = st.replace(store=str(paths.store))
    config.use(st)
    cfg = NodeConfig(settings=st, paths=paths)  # the default settings: what a new user gets
    node = Node(cfg)
    ensure_base(node.store, log=lambda s: console.print(f"  {s}"))
    client = shoal.Client(transport=LocalTransport(node=node, reap=True))
    doc: dict[str, Any] = {"command": command or " ".join(["shoal", "bench", *sys.argv[2:]]),
                           "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "quick": quick, "machine": machine,
                           "limits": host.kernel_limits(), "home": str(home), "store": str(paths.store),
                           "rlimit_nofile": list(nofile), "scenarios": {}}
    docker = None
    docker_fs = None
    docker_reason = "disabled with --no-docker" if no_docker else ""
    wants_docker = not no_docker and any(s.uses_docker for s in scens.values())
    stop = _cancel_on_signals()
    try:
        await client.__aenter__()
        if wants_docker:
            docker, docker_fs, docker_reason = await asyncio.to_thread(_start_docker, console, node, "base")
            if docker is None:
                console.print(f"[yellow]Docker is absent:[/yellow] {docker_reason} — shoal-only figures")
            else:
                doc["docker"] = docker.info()
        ctx = BenchContext(client=client, node=node, home=home, quick=quick, console=console,
                           docker=docker, docker_reason=docker_reason, plot_dir=plot_dir)
        ctx.extra["docker_fs"] = docker_fs
        with make_progress(console) as progress:
            ctx.progress = progress
            for name in names:
                res = await _run_one(ctx, scens[name], chosen[name])
                doc["scenarios"][name] = res.to_dict()
                from shoal.bench.report import print_scenario

                print_scenario(console, res)
                if json_path:  # partial results survive an interrupted run
                    _write_json(json_path, doc)
    finally:
        stop.tearing_down()
        if stop.fired:
            console.print("  stopped by a signal: closing its sandboxes and removing what the run set up …")

        async def teardown() -> None:
            if docker is not None:
                with contextlib.suppress(Exception):
                    await docker.aclose_client()
                console.print("  stopping the private dockerd and removing its data …")
                await asyncio.to_thread(docker.stop)
            if docker_fs is not None:
                await asyncio.to_thread(docker_fs.destroy)
            with contextlib.suppress(Exception):
                await _close_everything(node, console)
            with contextlib.suppress(Exception):
                await client.aclose()
            doc["leaks"] = leaks(home)
            # everything mounted in the home goes (layers, upper pool, tmpfs dirs), even after a failed scenario
            remaining = await homes.teardown(home, paths.store, remove=own_home and not doc["leaks"])
            if remaining:
                doc["leaks"].update(remaining.to_dict())
                console.print(f"[red]still mounted after the teardown:[/red] {remaining.to_dict()}")

        # in a task of its own: a cancel delivered late (a signal just before the teardown) must not cut it short
        await _finish(asyncio.ensure_future(teardown()))
        stop.restore()
    if stop.fired:
        raise asyncio.CancelledError  # the teardown ran to its end; the caller reports the stop
    doc["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    if json_path:
        _write_json(json_path, doc)
    if markdown:
        from shoal.bench.report import write_markdown

        write_markdown(markdown, doc)
    return doc


async def _finish(task: asyncio.Future[None]) -> None:
    """Wait for `task` to end even if this task is cancelled meanwhile (the cancel is passed on afterwards)."""
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    task.result()
    if cancelled:
        raise asyncio.CancelledError


async def _close_everything(node: Any, console: Console) -> None:
    """Close every sandbox of the run's node in parallel, saying how far it got every few seconds (10,000
    sandboxes take a while even in parallel)."""
    t0 = time.monotonic()
    last = [t0]
    done = [0]

    def tick(_sid: str, _err: BaseException | None) -> None:
        done[0] += 1
        now = time.monotonic()
        if now - last[0] >= 5.0:
            last[0] = now
            console.print(f"  closed {done[0]} sandboxes ({now - t0:.0f} s) …")

    n = await node.close_all(on_done=tick)
    if n >= 100:
        console.print(f"  closed {n} sandboxes in {time.monotonic() - t0:.1f} s")


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)


class _SignalStop:
    """SIGTERM and SIGHUP cancel the run (like Ctrl-C), so its teardown still unmounts everything.

    A cancel can be swallowed on its way (code that waits for a task it cancelled, a cleanup that must not be
    interrupted): the run is cancelled again every `RETRY_S` until it reaches its teardown (`tearing_down()`),
    so a run that already hit an error, or sits in such a wait, still stops. Signals during the teardown are
    ignored: it must finish to leave the host clean."""

    RETRY_S = 1.0

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.fired = False
        self._teardown = False
        self._retry: asyncio.TimerHandle | None = None
        self.sigs = (signal.SIGTERM, signal.SIGHUP)
        for sig in self.sigs:
            self.loop.add_signal_handler(sig, self._cancel)

    def _cancel(self) -> None:
        self.fired = True
        if self._teardown or self.task is None or self.task.done():
            return
        self.task.cancel()
        if self._retry is None:
            self._retry = self.loop.call_later(self.RETRY_S, self._again)

    def _again(self) -> None:
        self._retry = None
        self._cancel()

    def tearing_down(self) -> None:
        """The run reached its teardown: no more cancels (a cancel already delivered stays delivered)."""
        self._teardown = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None

    def restore(self) -> None:
        """Put the default handlers back."""
        self.tearing_down()
        for sig in self.sigs:
            self.loop.remove_signal_handler(sig)


def _cancel_on_signals() -> _SignalStop:
    """Install the run's signal handling (see _SignalStop)."""
    return _SignalStop()
