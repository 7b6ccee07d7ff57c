"""Container sandboxes: overlayfs over shared EROFS layers + an OCI bundle + crun/runc/runsc.

Creating one costs a few mkdirs, one overlay mount (the layers are already mounted host-wide), one
listening socket, one config.json and one `crun run -d`. Nothing is copied or unpacked.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import shutil
import signal
import socket
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.backends.base import Backend, Capability, RuntimeStatus
from shoal.backends.container import cpuclass, disk_guard, swapwatch
from shoal.backends.container.disk import UpperPool
from shoal.backends.container.guestfs import GuestFiles
from shoal.backends.container.oci import build_config, render_config
from shoal.backends.container.reclaim import drop_working_set, prefetch_before_thaw, reclaim_paused, sandbox_swap_mb
from shoal.backends.container.runtime import OciRuntime, pick_runtime, probe_runtimes, use_sealed
from shoal.backends.container.volatile import VolatileDirs
from shoal.backends.registry import make_runtime
from shoal.egress import check_network, grants_for
from shoal.errors import InvalidRequest, SandboxError
from shoal.faults import crash_point
from shoal.fsutil import remove_tree
from shoal.host import cgroups, syscalls
from shoal.host.mntns import helper_binary as mntns_helper_binary
from shoal.host.oom import protect_agent
from shoal.images.store import Image
from shoal.limits import AGENT_READY_TIMEOUT_S
from shoal.records import SandboxRecord, proc_starttime
from shoal.spec import SandboxSpec

log = logging.getLogger(__name__)
#: how long a pause waits for the freezer to report every process frozen
FREEZE_TIMEOUT_S = 10.0

if TYPE_CHECKING:
    from shoal.agentproto.client import AgentClient
    from shoal.backends.container.swap import SwapDecision
    from shoal.backends.context import NodeContext

# Overlay options: no redirect/metacopy/index so an upper dir is a plain tree we can pack as a layer;
# volatile skips syncs of the upper (a sandbox never outlives its host, so durability buys nothing).
_OVERLAY_OPTS = "redirect_dir=off,index=off,metacopy=off,volatile"
_SUN_PATH_MAX = 107


_OVL_LINKS = "o"


def _overlay_links(d: Path, lowers: list[Path], upper: Path, work: Path) -> Path:
    """`d/o/{0,1,..,u,w}`: symlinks to the lower layers (bottom first), the upper and the work dir."""
    links = d / _OVL_LINKS
    links.mkdir(exist_ok=True)
    for i, p in enumerate(lowers):
        os.symlink(p, links / str(i))
    os.symlink(upper, links / "u")
    os.symlink(work, links / "w")
    return links


def _overlay_opts(base: str, n_lowers: int) -> str:
    """Overlay mount options naming the directories through the links under `base` (see _overlay_links)."""
    # overlay wants the topmost lower first
    lowerdir = ":".join(f"{base}/{i}" for i in reversed(range(n_lowers)))
    return f"lowerdir={lowerdir},upperdir={base}/u,workdir={base}/w,{_OVERLAY_OPTS}"


def _drop_overlay_links(links: Path) -> None:
    # the mounted overlay holds its directories; the names were only needed to mount it
    with contextlib.suppress(OSError), os.scandir(links) as it:
        for e in it:
            os.unlink(e.path)
    with contextlib.suppress(OSError):
        links.rmdir()


async def kill_and_forget(rec: SandboxRecord, rt: OciRuntime, timeout: float = 5.0) -> bool:
    """Tear a container down without spawning its runtime: SIGKILL its init through a pidfd (the kernel then
    kills everything else in its pid namespace and the mount namespace holding its overlay goes with it),
    wait for it to exit, and remove the runtime's state directory; the caller removes the cgroups.

    `crun delete --force` does the same work plus a fork+exec of the runtime, which was a third of the
    CPU a close cost (`shoal bench create`, closes interleaved). False when this cannot be done safely
    (a runtime whose state shoal does not know, an init that is not ours): then the runtime deletes it."""
    if rt.state_root is None or not rec.init_pid:
        return False
    state = rt.state_root / rec.cid
    if not state.is_dir():
        return False
    if rec.init_alive():
        if rec.cgroup:
            # a frozen (paused) task cannot die of SIGKILL under the v1 freezer: thaw it first (in a thread:
            # a cgroupfs write waits on the kernel's cgroup locks, which thousands of closes contend for)
            await asyncio.to_thread(cgroups.SandboxCgroup(rec.cgroup).set_frozen, False)
        try:
            pidfd = os.pidfd_open(rec.init_pid)
        except ProcessLookupError:
            pidfd = -1
        if pidfd >= 0:
            try:
                if rec.init_alive():  # the pidfd is for our init, not for a reused pid
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    loop = asyncio.get_running_loop()
                    gone = loop.create_future()
                    def exited() -> None:
                        if not gone.done():
                            gone.set_result(None)

                    loop.add_reader(pidfd, exited)
                    try:
                        await asyncio.wait_for(gone, timeout)
                    except TimeoutError:
                        return False
                    finally:
                        loop.remove_reader(pidfd)
            finally:
                os.close(pidfd)
    await asyncio.to_thread(shutil.rmtree, state, True)  # 12% of the node's loop when 10,000 closed at once
    return True


class ContainerBackend(Backend):
    """OCI containers with the shoal agent as PID 1."""

    name = "container"
    idle_close = True
    mounts_layers = True
    capabilities = frozenset({Capability.SANDBOXES, Capability.PAUSE, Capability.RECLAIM,
                              Capability.SNAPSHOT_FILES, Capability.NETWORK, Capability.EGRESS_RULES,
                              Capability.CPU_CLASS})
    instead = {
        Capability.SNAPSHOT_MEMORY: "snapshot(name) saves the files as an image; memory snapshots need "
                                    "backend='microvm' or 'vm'",
        Capability.FORK_MEMORY: "containers fork their files only: fork(n) without memory=True (processes start "
                                "again in the children); forking processes and memory needs backend='microvm' or 'vm' "
                                "(CRIU fails on this kernel; Debian 12's runsc checkpoint cannot save the agent's "
                                "host-backed socket and the sandbox dies: docs/security.md)",
        Capability.RESTORE: "create from the image a snapshot made (client.create(name)); memory snapshots "
                            "are restored by the VM backends",
    }

    def __init__(self, ctx: NodeContext, name: str | None = None) -> None:
        super().__init__(ctx, name)
        use_sealed(ctx.settings.sealed_runtime)
        self.paths = ctx.paths
        self.layer_mounts = ctx.layer_mounts
        self.guest_dir = ctx.guest_dir
        self.default_runtime = ctx.config.runtime
        self.upper_pool = UpperPool(ctx.paths, ctx.settings)
        self._runtimes: dict[str, OciRuntime] = {}
        # sandbox directories (record, bundle, socket) in memory: see shoal.backends.container.volatile
        self.volatile = VolatileDirs(ctx.paths, enabled=ctx.settings.sandbox_tmpfs)
        # agent connections opened while the runtime starts the sandbox (see create/connect)
        self._connecting: dict[str, asyncio.Task] = {}
        self._swap_cache: dict[int, tuple[float, int | None]] = {}
        #: close by killing the init and removing the runtime's state ourselves (kill_and_forget)
        self.fast_teardown = True
        self._helper: str | bool | None = False  # the mount-namespace helper (False: not looked up yet)
        #: the agent and the masking files, on a tmpfs of their own (see shoal.backends.container.guestfs)
        self.guestfs = GuestFiles(ctx.paths, ctx.agent_binary)
        #: keeps the upper pool's reserve for bystanders while this process has sandboxes (disk_guard.py)
        self._disk_guard: asyncio.Task | None = None
        #: sandboxes swapping past their memory limit run as batch while they do (shoal.backends.container.swapwatch)
        self.swap_watch = swapwatch.SwapWatch() if ctx.settings.swap_demote and swapwatch.supported() else None
        self._cpu_own: dict[str, str] = {}  # the class each watched sandbox returns to
        self._cpu_moves: dict[str, asyncio.Task] = {}  # its last class change, while it runs
        self._statuses: dict[str, RuntimeStatus] | None = None
        #: what host_start did about swap (shoal.backends.container.swap): made a zram device, kept the
        #: host's, or nothing
        self.swap: SwapDecision | None = None

    @property
    def statuses(self) -> dict[str, RuntimeStatus]:
        """Which OCI runtimes work on this host (probed once per boot; the probe's result is cached)."""
        if self._statuses is None:
            self._statuses = probe_runtimes(self.paths, self.ctx.agent_binary)
        return self._statuses

    async def prepare(self) -> dict[str, Any]:
        """Probe the OCI runtimes (cached per boot) and report which work."""
        statuses = await asyncio.to_thread(lambda: self.statuses)
        return {name: st.works for name, st in statuses.items()}

    # ---- the host hooks (shoal.backends.base: the node calls them, never these modules) ---------------
    async def host_start(self) -> None:
        """Compressed swap in RAM is what lets pause() return a sandbox's anonymous memory: a host with no
        swap gets it from the node (SHOAL_ZRAM_SWAP=auto), not from what earlier runs left behind."""
        if self.ctx.config.zram_swap and self.swap is None:
            from shoal.backends.container.swap import start_for_node

            self.swap = await asyncio.to_thread(start_for_node, self.ctx.config.zram_swap)

    async def host_reconcile(self) -> dict[str, int]:
        """Writable layers whose sandbox directory is gone, batch CPU cgroups of sandboxes closed while no
        node ran, and crun/runc state of stopped containers whose home was deleted (a killed bench run)."""
        with contextlib.suppress(Exception):
            pool = UpperPool(self.paths, self.ctx.settings)
            try:
                pool.sweep_orphans(self.paths.sandboxes)
                if pool.enforced:
                    pool.guard.prune()  # promises and clamps of layers that are gone (container.disk_guard)
            finally:
                pool.close()  # its handle would keep the pool's filesystem (and loop device) alive
        await asyncio.to_thread(cpuclass.sweep)
        from shoal.backends.container.runtime_state import sweep_stale

        return {"runtime_states_removed": len(await asyncio.to_thread(sweep_stale))}

    def host_runtimes(self) -> dict[str, RuntimeStatus]:
        """Which OCI runtimes (crun, runc, gVisor) work here."""
        return self.statuses

    def host_teardown(self) -> bool:
        """Unmount the upper pool (the writable layers' btrfs); True when it was mounted."""
        return UpperPool(self.paths, self.ctx.settings).teardown()

    def runtime(self, name: str | None) -> OciRuntime:
        """The OciRuntime for a name ('auto'/None picks the best working one)."""
        key = name or self.default_runtime or "auto"
        if key not in self._runtimes:
            self._runtimes[key] = pick_runtime(self.statuses, key)
        return self._runtimes[key]

    def upper_dir(self, rec: SandboxRecord) -> Path:
        """Private writable layer of the sandbox (on the size-limited upper pool when available)."""
        return Path(rec.extra.get("upper") or rec.path / "upper")

    def rootfs(self, rec: SandboxRecord) -> Path:
        """The merged overlay (the sandbox's / as the host sees it)."""
        return rec.path / "rootfs"

    async def _mntns_helper(self) -> str | None:
        if self._helper is False:
            self._helper = await asyncio.to_thread(mntns_helper_binary, self.paths.run)
        return self._helper

    def _swap_mb(self, memory_mb: int) -> int | None:
        # the swap policy reads /proc/swaps; it changes when zram is set up, not between two creates
        now = time.monotonic()
        hit = self._swap_cache.get(memory_mb)
        if hit is not None and now - hit[0] < 1.0:
            return hit[1]
        val = sandbox_swap_mb(memory_mb, self.ctx.settings.sandbox_swap)
        self._swap_cache[memory_mb] = (now, val)
        return val

    def _has_swap(self, rec: SandboxRecord) -> bool:
        # without swap a sandbox at its limit is OOM-killed at once: nothing to watch
        if "swap_mb" in rec.extra:
            return bool(rec.extra["swap_mb"])
        return bool(self._swap_mb(int(rec.spec.memory_mb or 0)))  # a record from an older shoal

    def _ensure_guard(self) -> None:
        # started by the first sandbox this process makes or reaches (one per node process)
        if self._disk_guard is None:
            self._disk_guard = asyncio.create_task(disk_guard.watch(self.upper_pool), name="shoal-disk-guard")

    def _watch_swap(self, rec: SandboxRecord) -> None:
        if self.swap_watch is None or not rec.cgroup or self.swap_watch.watching(rec.id):
            return
        own = str(rec.spec.cpu_class or cpuclass.DEFAULT_CPU_CLASS)
        if own == cpuclass.BATCH:
            return
        cgroup, cpus, sid = rec.cgroup, float(rec.spec.cpus), rec.id

        async def move(over: bool, before: asyncio.Task | None) -> None:
            if before is not None:
                await asyncio.gather(before, return_exceptions=True)  # crossings apply in order
            cls = self._cpu_own.get(sid, own)
            if cls == cpuclass.BATCH:
                return  # put in batch by its owner meanwhile: nothing to change either way
            # in a thread: a write to cgroup.procs waits for the kernel's threadgroup lock (an RCU grace period)
            await asyncio.to_thread(cpuclass.apply, cgroup, cpuclass.BATCH if over else cls, cpus, rec.init_pid)
            log.info("sandbox %s %s", sid, "swaps past its memory limit: batch until it stops" if over
                     else f"is back under its memory limit: {cls} again")
            if not over:
                # the killed processes stay in the batch cgroup until reaped: remove it once they are (one
                # rmdir each time; a sandbox closed meanwhile had it removed by its close)
                loop = asyncio.get_running_loop()
                for delay in (0.2, 1.0, 5.0):
                    loop.call_later(delay, lambda: self.swap_watch is not None and self.swap_watch.watching(sid)
                                    and not self.swap_watch.over(sid) and cpuclass.forget(sid, wait_s=0))

        def crossed(over: bool) -> None:
            task = asyncio.get_running_loop().create_task(move(over, self._cpu_moves.get(sid)),
                                                          name=f"shoal-cpu-class-{sid}")
            self._cpu_moves[sid] = task
            task.add_done_callback(lambda t: self._cpu_moves.get(sid) is t and self._cpu_moves.pop(sid, None))

        self._cpu_own[sid] = own
        if not self.swap_watch.watch(sid, cgroup, int(rec.spec.memory_mb or 0) << 20, crossed):
            self._cpu_own.pop(sid, None)

    async def close(self) -> None:
        """Stop this process's disk guard (sandboxes keep running; the next node process watches them)."""
        if self.swap_watch is not None:
            self.swap_watch.close()
            self._cpu_own.clear()
            moves = list(self._cpu_moves.values())
            self._cpu_moves.clear()
            await asyncio.gather(*moves, return_exceptions=True)
        if self._disk_guard is not None:
            self._disk_guard.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._disk_guard
            self._disk_guard = None
        self.upper_pool.close()  # a stopped node must not keep the pool's filesystem alive

    def make_dir(self, d: Path) -> None:
        """Create the sandbox directory: on the node's tmpfs when the writable layer is on the upper pool
        (the layer itself must not live in memory), else on disk."""
        if self.volatile.enabled and self.upper_pool.ensure() and self.volatile.make_dir(d):
            return
        d.mkdir()

    async def create(self, rec: SandboxRecord, spec: SandboxSpec, image: Image) -> None:
        """Mount, configure and start one container; undo everything on failure."""
        rt = self.runtime(spec.runtime)
        rec.runtime = rt.name
        rec.cid = f"shoal-{rec.id}"
        rec.cgroup = f"/shoal/{rec.id}"
        d = rec.path
        sock_path = d / "agent.sock"
        if len(str(sock_path)) > _SUN_PATH_MAX:
            raise InvalidRequest(f"SHOAL_HOME path too long for a Unix socket ({sock_path}); use a shorter one")
        listener: socket.socket | None = None
        overlay: tuple[str, str, str] | None = None
        try:
            rootfs = d / "rootfs"
            rootfs.mkdir()
            upper, work, projid = self.upper_pool.allocate(rec.id, spec.disk_mb)
            rec.extra["upper"] = str(upper)
            rec.extra["projid"] = projid
            if projid:
                self._ensure_guard()
            crash_point("create.upper")
            lowers = self.layer_mounts.acquire(image.layers, rec.id)
            helper = await self._mntns_helper() if rt.overlay_helper else None
            # the sandbox can read the overlay's options in /proc/self/mountinfo: name its directories
            # through short symlinks in the sandbox directory, resolved relative to it (the helper) or
            # through a /proc/self/fd path (mounted here), never by their host paths
            links = _overlay_links(d, lowers, upper, work)
            if helper:
                # mounted by the runtime's wrapper in a mount namespace of its own (see shoal.host.mntns)
                overlay = (helper, str(rootfs), _overlay_opts(_OVL_LINKS, len(lowers)))
            else:
                dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    syscalls.mount("overlay", str(rootfs), "overlay", 0,
                                   _overlay_opts(f"/proc/self/fd/{dfd}/{_OVL_LINKS}", len(lowers)))
                finally:
                    os.close(dfd)
            crash_point("create.mount")
            netns = None
            resolv = None
            if spec.network:
                net = self.ctx.network()
                policy = check_network(spec.network, self.ctx.settings.egress_sets)
                # network=True: the protected destinations the operator's policy grants (shoal.egress);
                # an allowlist reaches what its rules name (checked against the policy by Node.create)
                grants = None if policy is not None else grants_for(
                    spec.egress_grants, self.ctx.settings.egress_allow).boxes(net.blocked_nets())
                netns = await net.setup(rec, policy, spec.egress_mbps, grants)
                # every networked sandbox asks the node's DNS proxy (shoal.node.dnsproxy), named in a
                # resolv.conf of the node's own: no host file (nor its path and device) is bound in
                resolv = str(self.guestfs.proxy_resolv(net.gateway))
                crash_point("create.network")
            run_dir = None
            if rt.passes_fds:
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
                listener.bind(str(sock_path))
                listener.listen(64)
            else:
                # the agent makes its socket in a directory of ours bound into the sandbox (gVisor)
                run_dir = d / "run"
                run_dir.mkdir(mode=0o700)
                rec.extra["agent_sock"] = str(run_dir / "agent.sock")
            # connect and say hello now, while the runtime starts the container (the agent answers as soon
            # as it is up; a socket the agent makes itself is waited for)
            self._connecting[rec.id] = asyncio.ensure_future(self._connect(rec, 30.0))
            env = dict(image.config.env)
            env.update(spec.env)
            env.setdefault("HOSTNAME", spec.hostname or "sandbox")
            swap_mb = self._swap_mb(spec.memory_mb)
            rec.extra["swap_mb"] = swap_mb  # None: the runtime's default (no swap on the host)
            gf = self.guestfs
            gf.ensure()
            cfg = build_config(
                rootfs=str(rootfs), hostname=spec.hostname or "sandbox",
                env=env, cwd="/", cgroups_path=rec.cgroup, cpus=spec.cpus,
                # the runtime's own processes (gVisor's sentry and gofer) live in the sandbox's cgroups too
                memory_mb=spec.memory_mb + rt.memory_overhead_mb, pids=rt.host_pids(spec.pids),
                nproc=spec.pids if rt.own_pids_limit else None,
                netns_path=netns, resolv_conf=resolv, swap_mb=swap_mb,
                proc_binds=rt.proc_binds, **gf.config_args(spec.memory_mb, swap_mb),
                agent_run_dir=str(run_dir) if run_dir else None, bind_tmp=rt.own_tmp and _tmp_dir(rootfs),
                extra_mounts=rec.extra.get("build_mounts"),
            )
            (d / "config.json").write_text(render_config(cfg))
            rec.save()
            r = await rt.run_detached(d, rec.cid, listener.fileno() if listener else None, pid_file=d / "init.pid",
                                      overlay=overlay, network=netns is not None)
            if r.returncode != 0:
                msg = (r.stderr or r.stdout).decode(errors="replace").strip()
                raise SandboxError(f"{rt.name} could not start the sandbox: {msg[-1500:]}")
            _drop_overlay_links(links)
            pid = int((d / "init.pid").read_text().strip())
            rec.init_pid = pid
            rec.init_start = proc_starttime(pid) or 0
            crash_point("create.runtime")
            # the agent must outlive an OOM in its own sandbox: what it runs dies instead (shoal.host.oom)
            protect_agent(pid)
            if rt.own_pids_limit:
                # gVisor: `pid` is its sentry; its gofer (the sandbox's file server, made at 500 by runsc from
                # the config) shares the cgroup and must not be the OOM killer's first choice either
                for other in _runtime_helpers(rec.cgroup, pid):
                    protect_agent(other)
            # the runtime set cpus as quota and shares; the class adds burst, or makes the sandbox idle
            rec.extra["cpu"] = cpuclass.apply(rec.cgroup, spec.cpu_class, spec.cpus, pid)
            if swap_mb:
                self._watch_swap(rec)
            # the runtime keeps its own copy of the config; these would only take memory on a tmpfs
            for name in ("init.pid", "config.json"):
                with contextlib.suppress(OSError):
                    os.unlink(d / name)
        except BaseException:
            if listener is not None:
                listener.close()
            await self._drop_pending(rec.id)
            await self.destroy(rec)
            raise
        if listener is not None:
            listener.close()

    async def _connect(self, rec: SandboxRecord, timeout: float) -> AgentClient:
        from shoal.agentproto.client import AgentClient

        own = rec.extra.get("agent_sock")
        if not own:
            return await AgentClient.connect_unix(str(rec.path / "agent.sock"), timeout=timeout)
        # a socket the agent makes itself: it appears (and listens) a moment after the runtime starts it
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await AgentClient.connect_unix(own, timeout=max(0.1, deadline - time.monotonic()))
            except SandboxError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.02)

    async def _drop_pending(self, sandbox_id: str) -> None:
        task = self._connecting.pop(sandbox_id, None)
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(BaseException):
            client = await task
            await client.close()

    async def connect(self, rec: SandboxRecord, timeout: float = AGENT_READY_TIMEOUT_S) -> AgentClient:
        """Connect to the agent's socket in the sandbox directory (the connection create() opened, if any)."""
        if rec.extra.get("projid"):
            self._ensure_guard()
        if self._has_swap(rec):
            self._watch_swap(rec)  # a sandbox made by an earlier node process (idempotent)
        task = self._connecting.pop(rec.id, None)
        if task is not None:
            try:
                return await asyncio.wait_for(task, timeout)
            except (SandboxError, OSError):
                pass  # opened too early or lost: one fresh attempt below
        return await self._connect(rec, timeout)

    async def destroy(self, rec: SandboxRecord) -> None:
        """Kill, unmount, release layers, remove cgroups, network and the directory. Idempotent."""
        errors: list[str] = []
        # stop watching first: a class change racing the teardown could make a cgroup again
        demoted = False
        if self.swap_watch is not None and self._cpu_own.pop(rec.id, None) is not None:
            self.swap_watch.unwatch(rec.id)
            moving = self._cpu_moves.pop(rec.id, None)
            if moving is not None:  # a class change in flight finishes first (it could make a cgroup again)
                await asyncio.gather(moving, return_exceptions=True)
            demoted = cpuclass.batch_cgroup(rec.id).exists()  # its batch cgroup, if one is left
        if rec.cid:
            try:
                rt = make_runtime(rec.runtime, self.statuses[rec.runtime].binary or rec.runtime) \
                    if rec.runtime in self.statuses else self.runtime(None)
                if not (self.fast_teardown and await kill_and_forget(rec, rt)):
                    r = await rt.delete(rec.cid, force=True)
                    if r.returncode != 0 and await rt.state(rec.cid) is not None:
                        errors.append(f"{rt.name} delete: {r.stderr.decode(errors='replace').strip()}")
            except Exception as e:  # keep cleaning the rest
                errors.append(f"runtime delete: {e}")
        if rec.init_pid and rec.init_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(rec.init_pid, 9)
        # the runtime's delete removed them already unless it failed (or was not asked: kill_and_forget);
        # in a thread, checks included: with 10,000 closes at once, stat in cgroupfs was a fifth of the loop
        if rec.cgroup and not await asyncio.to_thread(cgroups.remove_if_there, rec.cgroup):
            errors.append(f"cgroup {rec.cgroup} could not be removed")
        # a batch sandbox's cpu cgroup beside /shoal (empty once its killed processes are gone)
        if ((rec.extra.get("cpu") or {}).get("cgroup") or demoted) and \
                not await asyncio.to_thread(cpuclass.forget, rec.id):
            errors.append(f"cpu cgroup /{cpuclass.BATCH_PARENT}/{rec.id} still has processes")
        crash_point("close.runtime")
        rootfs = str(rec.path / "rootfs")
        # unmount what create() mounted, by path: scanning /proc/self/mountinfo costs time proportional
        # to every mount on the host; the scan is only the fallback when something unexpected is left
        self._umount(rootfs, errors)
        if syscalls.mount_root(rootfs) is not False:
            for mp in syscalls.mounts_under(str(rec.path)):
                if mp != str(rec.path):
                    self._umount(mp, errors)
        if rec.layers:
            try:
                self.layer_mounts.release(rec.layers, rec.id)
            except OSError as e:
                errors.append(f"release layers: {e}")
        crash_point("close.unmounted")
        if rec.extra.get("upper"):
            try:
                await asyncio.to_thread(self.upper_pool.release, rec.id, int(rec.extra.get("projid") or 0))
            except OSError as e:
                errors.append(f"release upper: {e}")
        if rec.netns:
            try:
                await self.ctx.network().teardown(rec)
            except Exception as e:
                errors.append(f"network teardown: {e}")
        crash_point("close.network")
        if syscalls.mount_root(rootfs) is not False and syscalls.mounts_under(rootfs):
            errors.append(f"{rootfs} is still mounted; leaving {rec.path} in place")
        elif os.path.islink(rec.path):
            # the directory on the tmpfs (a record, a socket, an empty rootfs dir) goes last, with its link
            remove_tree(rec.path)
        else:
            # (a directory that was its own tmpfs, as made by an earlier shoal, is unmounted first)
            self._umount(str(rec.path), errors)
            try:
                os.rmdir(rec.path)
            except FileNotFoundError:
                pass
            except OSError:  # a directory on disk still holding files
                await asyncio.to_thread(shutil.rmtree, rec.path, True)
        if errors:
            raise SandboxError(f"cleanup of sandbox {rec.id} was incomplete: " + "; ".join(errors))

    @staticmethod
    def _umount(mp: str, errors: list[str]) -> None:
        try:
            syscalls.umount_or_detach(mp)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOENT):  # not mounted / not there
                errors.append(str(e))

    async def pause(self, rec: SandboxRecord) -> None:
        """Freeze every process of the sandbox; returns once the freezer says all are frozen."""
        rt = self.runtime(rec.runtime)
        await rt.pause(rec.cid)
        if rec.cgroup and rt.freezes_cgroup:
            await self._until_frozen(rec, rt)

    async def _until_frozen(self, rec: SandboxRecord, rt: OciRuntime, timeout: float = FREEZE_TIMEOUT_S) -> None:
        # the runtime's pause can return while a v1 freezer is still FREEZING (a task in an uninterruptible
        # sleep, e.g. mid-rename on a busy host: seen in CI, where `crun state` then said "running"); asking
        # again retries the tasks that were busy
        cg = cgroups.SandboxCgroup(rec.cgroup)
        deadline = time.monotonic() + timeout
        delay = 0.002
        while not cg.frozen():
            if time.monotonic() > deadline:
                await rt.resume(rec.cid)  # not left half frozen
                raise SandboxError(f"sandbox {rec.id} did not freeze within {timeout:g} s (a process stuck in "
                                   "an uninterruptible sleep?); it keeps running: retry the pause")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
            cg.set_frozen(True)

    async def resume(self, rec: SandboxRecord) -> None:
        """Thaw the sandbox."""
        await self.runtime(rec.runtime).resume(rec.cid)

    async def reclaim(self, rec: SandboxRecord, *, record_working_set: bool) -> dict[str, Any]:
        """Reclaim the frozen cgroup's memory (page cache; anonymous memory to swap), recording the
        working set first when asked (see shoal.backends.container.reclaim)."""
        if not rec.cgroup:
            return {}
        return await reclaim_paused(rec.cgroup, rec.path, prefetch=record_working_set)

    async def prefetch(self, rec: SandboxRecord) -> dict[str, Any]:
        """Read the working set recorded at pause back in while the sandbox is still frozen."""
        return await prefetch_before_thaw(rec.path)

    def forget_working_set(self, rec: SandboxRecord) -> None:
        """Remove the recorded working set after the thaw."""
        drop_working_set(rec.path)

    async def set_cpu_class(self, rec: SandboxRecord, cpu_class: str) -> dict[str, Any]:
        """Move the running sandbox's processes to another CPU class (shoal.backends.container.cpuclass)."""
        if not rec.cgroup:
            raise SandboxError(f"sandbox {rec.id} has no cgroup to put in a CPU class")
        if rec.id in self._cpu_own:
            self._cpu_own[rec.id] = cpu_class  # where it returns once it stops swapping past its limit
        return await asyncio.to_thread(cpuclass.apply, rec.cgroup, cpu_class, float(rec.spec.cpus),
                                       rec.init_pid)

    def info(self, rec: SandboxRecord) -> dict[str, Any]:
        """Runtime name, cgroup path, whether the disk limit is enforced, egress drops."""
        out = {"runtime": rec.runtime, "cgroup": rec.cgroup,
               "disk_limit_enforced": bool(rec.extra.get("projid"))}
        clamped = self.upper_pool.guard.clamped().get(rec.id) if rec.extra.get("projid") else None
        if clamped is not None:
            # the pool ran low: this sandbox may not grow past what it held then (shoal.backends.container.disk_guard)
            out["disk_clamped_mb"] = clamped
        if rec.extra.get("egress"):
            # the allowlist's drops and DNS refusals so far (network=[rules], docs/security.md)
            out["egress"] = self.ctx.network().egress_stats(rec)
        if "cpu" in rec.extra:
            out["cpu"] = rec.extra["cpu"]  # its CPU class and what was set for it (shoal.backends.container.cpuclass)
        if self.swap_watch is not None and self.swap_watch.over(rec.id):
            out["cpu_demoted"] = "batch while it swaps past its memory limit (shoal.backends.container.swapwatch)"
        # what the last pause reclaimed and the last resume prefetched (shoal.backends.container.reclaim)
        out.update({k: rec.extra[k] for k in ("paused_at", "reclaim", "resume") if k in rec.extra})
        return out


def _tmp_dir(rootfs: Path) -> bool:
    """Make sure the rootfs's /tmp is a real directory (created 1777 when the image has none) before it is
    bound at /tmp from the host side; False when it is anything else (a symlink would resolve on the host:
    such an image keeps the runtime's own /tmp)."""
    tmp = rootfs / "tmp"
    try:
        st = os.lstat(tmp)
    except FileNotFoundError:
        tmp.mkdir()
        os.chmod(tmp, 0o1777)
        return True
    return stat.S_ISDIR(st.st_mode)


def _runtime_helpers(cgroup: str, sentry: int) -> list[int]:
    """The runtime's own processes beside the sandbox's in its memory cgroup (gVisor's gofer)."""
    out = []
    with contextlib.suppress(OSError):
        for p in Path(f"/sys/fs/cgroup/memory{cgroup}/cgroup.procs").read_text().split():
            with contextlib.suppress(OSError, ValueError):
                if int(p) != sentry and Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"runsc-gofer"):
                    out.append(int(p))
    return out
