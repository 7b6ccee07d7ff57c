"""The node agent's front: owns the sandboxes of one host — validates, admits and routes each request.

It is a library object, embedded in the SDK's local client by default or served over HTTP by
`shoal serve`. Its only durable state is one record per sandbox on local disk, so any number of
node-agent processes can come and go (the CLI, a server, a test) and all see the same sandboxes.

The work lives in the node's parts, each a public object of its own module:
`admission` (what fits), `connections` (agent connections), `locks` (per-sandbox state locks),
`recovery` (reconcile, adopt, reap), `pool` (warm sandboxes), the backends (built from
shoal.backends.registry with a `NodeContext`), and `shoal.node.snapshot` (file snapshots and forks).
Exec, files and shells go through the in-sandbox agent, identical on every backend (shoal.node.dataplane).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Literal

from shoal.agentbin import find_agent_binary
from shoal.backends.base import Backend, Capability, RuntimeStatus
from shoal.backends.registry import create_backend, host_backend_names
from shoal.config import NodeConfig
from shoal.errors import InvalidRequest, SandboxError, SandboxNotFound, ShoalError
from shoal.faults import configure as configure_faults
from shoal.faults import crash_point
from shoal.fsutil import install_copy
from shoal.images import corruption
from shoal.images.mounts import LayerMounts
from shoal.images.store import Image, ImageStore
from shoal.limits import AGENT_CONNECT_TIMEOUT_S, AGENT_READY_TIMEOUT_S, MAX_BATCH, check_cpu_class
from shoal.models import SandboxInfo, StreamEvent
from shoal.node.admission import Admission, Reservation
from shoal.node.connections import AgentConnections
from shoal.node.context import NodeContextImpl
from shoal.node.dataplane import DataPlane
from shoal.node.pool import WarmPool
from shoal.node.recovery import Recovery
from shoal.node.statelock import SandboxLocks
from shoal.records import SandboxRecord, check_sandbox_id, forget_record, list_records

if TYPE_CHECKING:
    from shoal.agentproto.client import AgentClient
    from shoal.backends.fncall import FncallManager
    from shoal.node.network import NetworkManager
    from shoal.node.protect import Protection
    from shoal.spec import SandboxSpec

log = logging.getLogger(__name__)

#: closes run at once by close_all / close_many (a close mostly waits: for a killed init, a cgroup, an unmount)
CLOSE_CONCURRENCY = 64


class Node(DataPlane):
    """One host's sandboxes. Use `async with Node() as node:` or call start()/stop(). Implements the front
    protocol (shoal.front.Front) the server, compat APIs and transports use."""

    #: shoal.front.Front.kind: records and admission are here
    kind: Literal["node", "cluster"] = "node"

    def __init__(self, config: NodeConfig | None = None) -> None:
        self.config = config or NodeConfig()
        configure_faults(self.config.settings.fault)
        self.paths = self.config.paths
        self.store = ImageStore(self.paths.store)
        self._image_shells: dict[str, str] = {}
        for d in (self.paths.home, self.paths.sandboxes, self.paths.run, self.paths.locks):
            d.mkdir(parents=True, exist_ok=True)
        self.layer_mounts = LayerMounts(self.paths)
        self.guest_dir = self.paths.home / "guest"
        #: what fits on this node (memory committed, limit, free): see shoal.node.admission
        self.admission = Admission(self.config)
        #: open agent connections by sandbox ID (closed when idle: shoal.node.connections)
        self.connections = AgentConnections(idle_s=self.config.agent_idle_s)
        from shoal.node.capacity import HostCapacity
        from shoal.node.network import BRIDGE

        #: descriptors, PIDs, inotify watches, bridge ports: what a create needs besides memory
        self.capacity = HostCapacity(bridge=BRIDGE, inotify_in_use=self._inotify_watches)
        #: per-sandbox state locks (pause, resume, snapshot, close)
        self.locks = SandboxLocks(self.paths.locks)
        #: reconcile, adopt and reap
        self.recovery = Recovery(self)
        #: sandboxes created ahead of time and handed out by create() (off until configured)
        self.pool = WarmPool(self)
        from shoal.node.scheduling import NodeScheduling

        #: jobs, preemption by pausing, gangs, compute tides (shoal.sched's decisions on this node)
        self.scheduling = NodeScheduling(self)
        from shoal.node.events import EventLog

        #: what happened to each sandbox, and the commands it ran ($SHOAL_HOME/events; shoal.node.events)
        self.events = EventLog.from_settings(self.paths.home, self.config.node_id, self.config.settings)
        #: bytes the last pause reclaimed, per sandbox paused by this process (the dashboard's "reclaimed")
        self.reclaimed: dict[str, int] = {}
        #: what backends see of this node
        self.context = NodeContextImpl(
            config=self.config, store=self.store, layer_mounts=self.layer_mounts, guest_dir=self.guest_dir,
            admission=self.admission, connections=self.connections, locks=self.locks, network=self.network,
            backend=self.backend, describe=self.describe,
            sandboxes=self)
        from shoal.images.probe import StoreHealth

        #: bounded probes of SHOAL_STORE: creates fail fast (StoreUnavailable) when a shared store is down
        self.store_health = StoreHealth(self.paths.store)
        # after an outage, loop-mounted layers get a fresh handle on their store file (see reopen_loops)
        self.store_health.on_recover.append(self.layer_mounts.reopen_loops)
        # a chunk that failed its check when the node's layer reader read it: an image_corrupt event
        self.layer_mounts.on_corrupt.append(self._image_corrupt)
        self._leases_renewed = 0.0
        self._backends: dict[str, Backend] = {}
        self._network: NetworkManager | None = None
        self._started = False
        #: this process's RLIMIT_NOFILE (soft, hard) after start() raised it
        self.nofile: tuple[int, int] | None = None
        #: what the node did to keep itself and the host out of the OOM killer's reach (shoal.node.protect)
        self.protection: Protection | None = None

    # ---- lifecycle of the node agent itself ---------------------------------------------------
    async def start(self, reap: bool = True, reconcile: bool = True) -> Node:
        """Install the guest agent, re-adopt or clean up sandboxes left by earlier processes, start the reaper."""
        if self._started:
            return self
        from shoal.node.capacity import raise_nofile

        # descriptors must not be what limits the sandboxes a node holds (issue 24)
        self.nofile = raise_nofile()
        self.capacity.refresh()
        self._install_guest_agent()
        self.layer_mounts.keep_reader = True
        if self.config.protect_host and not self.protection:
            from shoal.node.protect import protect_host

            # before any sandbox starts: their parent cgroup's limit, and the node's own OOM score
            cfg = self.config
            self.protection = await asyncio.to_thread(
                protect_host, reserve_mb=cfg.host_reserve_mb, node_oom_score_adj=cfg.node_oom_score_adj,
                node_memory_min_mb=cfg.node_memory_min_mb)
        if not self.config.fake_backend:
            # host-wide setup the backends keep (the container's zram swap), before any sandbox is adopted
            for b in self._host_backends():
                await b.host_start()
        if reconcile:
            await self.reconcile()
            with contextlib.suppress(Exception):
                await self.heartbeat_leases(force=True)
        if reap:
            self.recovery.start_reaper()
            self.scheduling.start()
        self.connections.start()  # idle connections go in every node process (a CLI's create -n 10000 too)
        self._started = True
        if self.config.warm_pool:
            from shoal.spec import SandboxSpec

            for image, size in self.config.warm_pool.items():
                self.set_warm_pool(SandboxSpec(image=image), size)
        return self

    async def stop(self) -> None:
        """Stop the reaper and drop agent connections. Sandboxes keep running (crash-only); pooled ones,
        never handed out, are closed, and so are the backends' services (fncall's pools)."""
        if self.pool.active:
            await self.pool.close()
        for b in list(self._backends.values()):
            with contextlib.suppress(Exception):
                await b.close()
        await self.recovery.stop_reaper()
        await self.scheduling.stop()
        await self.connections.close_all()
        # the layer reader outlives the node agent while layers are in use (their sandboxes keep running)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.layer_mounts.finish_records)
        self.layer_mounts.keep_reader = False
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.layer_mounts.stop_reader_if_unused)
        self.layer_mounts.daemon.close_subscription()
        # no handle of a stopped node may stay open in SHOAL_HOME: it would keep the filesystem holding the
        # home busy (a bench's private disk stayed attached to its loop device until the process exited)
        self.events.close()
        self._started = False

    async def __aenter__(self) -> Node:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _install_guest_agent(self) -> None:
        # a stable copy under SHOAL_HOME: rebuilding the repo never swaps the binary under live sandboxes
        src = find_agent_binary()
        self.guest_dir.mkdir(parents=True, exist_ok=True)
        install_copy(src, self.guest_dir / "shoal-agent")

    # ---- the node's parts ---------------------------------------------------------------------
    @property
    def runtime_statuses(self) -> dict[str, RuntimeStatus]:
        """Which runtimes the node's backends run sandboxes on work here (the container's OCI runtimes;
        probed once per boot)."""
        return {name: st for b in self._host_backends() for name, st in b.host_runtimes().items()}

    def _host_backends(self) -> builtins.list[Backend]:
        """The backends that keep host-wide machinery (registered with `host=True`): the node calls their
        host hooks (shoal.backends.base: host_start, host_reconcile, host_runtimes, host_teardown)."""
        return [self.backend(name) for name in host_backend_names()]

    def network(self) -> NetworkManager:
        """The node's network manager (veth + NAT), created on first use."""
        if self._network is None:
            from shoal.node.network import NetworkManager

            self._network = NetworkManager(self.paths, self.config.node_id, self.config.settings)
        return self._network

    def check_egress(self, spec: SandboxSpec) -> None:
        """EgressForbidden (403, naming the rule) when an allowlist's CIDR rule reaches a protected destination
        (private, link-local, reserved, the cluster's nodes) that the operator's policy does not grant it
        (the egress_allow setting plus the spec's egress_grants; see shoal.egress)."""
        if not isinstance(spec.network, list):
            return
        from shoal.egress import check_network, check_policy, grants_for

        s = self.config.settings
        policy = check_network(spec.network, s.egress_sets)
        if policy is not None and policy.cidrs:
            check_policy(policy, grants_for(spec.egress_grants, s.egress_allow), self.network().blocked_nets(),
                         who=f"project {spec.project!r}")

    def backend(self, name: str) -> Backend:
        """The backend object for `name` (see shoal.backends.registry), created on first use."""
        b = self._backends.get(name)
        if b is None:
            b = self._backends[name] = create_backend(name, self.context)
        return b

    def table_sizes(self) -> dict[str, int]:
        """How many entries the node keeps in each per-sandbox table now (admission, last use, connections,
        parsed records, state locks, swap watches): what `shoal bench soak` checks stays flat under churn."""
        from shoal import records

        b = self._backends.get("container")
        sw = getattr(b, "swap_watch", None)
        return {"admission_live": len(self.admission.live_ids()), "last_used": len(self.scheduling.last_used),
                "connections": len(self.connections), "parsed_records": records.cached_records(),
                "state_locks": self.locks.held(), "swap_watches": len(sw) if sw is not None else 0,
                "reclaimed": len(self.reclaimed)}

    def _inotify_watches(self) -> int:
        # the swap watch's inotify watches (cgroup v2 hosts: one per watched sandbox; v1 uses none)
        b = self._backends.get("container")
        sw = getattr(b, "swap_watch", None)
        return len(sw) if sw is not None and sw.mode == "v2" else 0

    def fncall(self) -> FncallManager:
        """The node's fncall service (warm pools for run_code), created on first use; stop() closes it."""
        from shoal.backends.fncall import FncallBackend

        b = self.backend("fncall")
        assert isinstance(b, FncallBackend)
        return b.manager()

    def record(self, sandbox_id: str) -> SandboxRecord:
        """The on-disk record of a sandbox (SandboxNotFound when there is none)."""
        check_sandbox_id(sandbox_id)
        return SandboxRecord.load(self.paths.sandboxes / sandbox_id)

    async def record_async(self, sandbox_id: str) -> SandboxRecord:
        """`record` (shoal.front.Front: a gateway may have to ask a node; a node has its records here)."""
        return self.record(sandbox_id)

    def describe(self, rec: SandboxRecord) -> SandboxInfo:
        """The SandboxInfo of a record, with its backend's facts in `extra`."""
        extra: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            extra = self.backend(rec.backend).info(rec)
        if rec.state == "paused" and rec.extra.get("paused_by"):
            extra["paused_by"] = rec.extra["paused_by"]  # "preempt" or "tides": resumed on its next call
        return SandboxInfo(id=rec.id, image=rec.image, backend=rec.backend, state=rec.state,
                           created_at=rec.created_at, spec=rec.spec.to_dict(), runtime=rec.runtime,
                           expires_at=rec.expires_at, labels=rec.labels, node=self.config.node_id,
                           extra=extra)

    # ---- create / close -----------------------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        """Create one sandbox and wait until its agent answers (or hand out one from a warm pool)."""
        from shoal.spec import check_spec

        check_spec(spec)
        self.check_egress(spec)
        self.scheduling.check_job(spec)
        image = await self.resolve_image(spec.image)
        if self.pool.active:
            hit = await self.pool.take(spec, image)
            if hit is not None:
                return hit
        return await self.start_sandbox(spec, image)

    async def resolve_image(self, ref: str, *, pull_policy: str | None = None) -> Image:
        """Resolve an image for a create (or a build's base), after a bounded probe of the store
        (StoreUnavailable when it does not answer), off the event loop: a hung shared filesystem never
        blocks the node agent. A reference not in the store is pulled from its registry per `pull_policy`
        (default: the setting), once however many creates ask at once (shoal.images.pull)."""
        from shoal.images.pull import ensure_image

        await asyncio.to_thread(self.store_health.check)
        img = await ensure_image(self.store, ref, policy=pull_policy, work_dir=self.paths.home / "tmp")
        # a layer a node found a bad chunk in: refused until repaired (shoal.images.corruption)
        await asyncio.to_thread(corruption.check_layers, self.store.root, [lay.digest for lay in img.layers],
                                f"image {img.ref}")
        return img

    async def pull(self, ref: str, *, progress: Any = None) -> dict[str, Any]:
        """`shoal image pull`: ask the registry for `ref` now (as `docker pull` does: an image of that name
        in the store is checked against the registry and replaced when it changed). Once across the nodes
        sharing the store; returns the PullReport as a dict."""
        from shoal.images.pull import pull_image

        await asyncio.to_thread(self.store_health.check)

        def go() -> dict[str, Any]:
            return pull_image(self.store, ref, progress=progress, work_dir=self.paths.home / "tmp").to_dict()

        return await asyncio.to_thread(go)

    def _image_corrupt(self, ev: dict[str, Any]) -> None:
        """The layer reader found a bad (or missing) chunk: a node event (no sandbox of its own; `users` are
        the sandboxes of this node using the layer). Called from the reader's event thread."""
        self.events.emit("image_corrupt", "", layer=ev.get("layer"), chunk=ev.get("chunk"),
                         reason=ev.get("reason"), sandboxes=ev.get("users") or [], read_at=ev.get("t"))

    async def after_command(self, rec: SandboxRecord) -> None:
        """A command of a sandbox finished: when its layers' first start on this node is being recorded, the
        record is complete (shoal.images.prefetch)."""
        if rec.layers and self.layer_mounts.recording(rec.layers):
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.layer_mounts.finish_records, rec.layers)

    def set_warm_pool(self, spec: SandboxSpec, size: int) -> str:
        """Keep `size` sandboxes of `spec` ready for create() (0 removes the pool). See shoal.node.pool."""
        return self.pool.configure(spec, size)

    async def start_sandbox(self, spec: SandboxSpec, image: Image, *, extra: dict[str, Any] | None = None,
                            reservation: Reservation | None = None) -> SandboxInfo:
        """Start a new sandbox of a checked spec (never from the warm pool): admit, create, connect.
        Admission may pause idle lower-priority sandboxes to make room (shoal.node.scheduling); a gang
        passes the `reservation` it already holds."""
        backend = self.backend(spec.backend)
        backend.require(Capability.SANDBOXES)
        if spec.network:
            backend.require(Capability.NETWORK)
        if isinstance(spec.network, list) or spec.egress_mbps:
            backend.require(Capability.EGRESS_RULES)
        loops = self.layer_mounts.loop_devices_needed(image.layers) if backend.mounts_layers else 0
        refused = self.capacity.check(spec, loops=loops)
        if refused is not None:
            raise refused
        res = reservation if reservation is not None else await self.scheduling.admit(spec)
        self.capacity.in_flight += 1
        try:
            rec = self.context.new_record(
                backend=spec.backend, image=image.ref, image_digest=image.digest,
                layers=[lay.hex for lay in image.layers], spec=spec,
                extra={"workdir": image.config.workdir, "user": image.config.user, **(extra or {})},
                make_dir=backend.make_dir)
            # saved before anything is made for it: whatever a crash leaves from here on belongs to a record
            # naming a dead owner, which the next reconcile closes at once (shoal.faults)
            rec.save()
            crash_point("create.record")
            await backend.create(rec, spec, image)
            try:
                client = await backend.connect(rec, timeout=AGENT_READY_TIMEOUT_S)
            except Exception as e:
                with contextlib.suppress(Exception):
                    await backend.destroy(rec)
                if isinstance(e, ShoalError):
                    raise
                raise SandboxError(f"sandbox {rec.id} started but its agent did not answer: {e}") from e
            crash_point("create.connected")
        except BaseException as e:
            res.release()
            self.capacity.in_flight -= 1
            from shoal.node.capacity import from_oserror

            # a resource that ran out mid-way (the backend cleaned up): a refusal naming it, never a raw OSError
            cap = from_oserror(e) if isinstance(e, Exception) and not isinstance(e, ShoalError) else None
            if cap is None and isinstance(e, SandboxError):
                cap = from_oserror(e)
            if cap is not None:
                raise cap from e
            raise
        self.capacity.in_flight -= 1
        res.commit(rec.id)
        self.connections.put(rec.id, client, idle_close=backend.idle_close)
        rec.state = "running"
        rec.save()
        if not rec.extra.get("pool"):
            self.sandbox_created(rec)
        return self.describe(rec)

    def sandbox_created(self, rec: SandboxRecord) -> None:
        """A sandbox was handed out to its user (made for it, or taken from a warm pool): count it for
        its job and log it."""
        self.scheduling.created(rec)
        spec = rec.spec
        self.events.emit("created", rec.id, rec.project, image=rec.image, backend=rec.backend,
                         cpus=spec.cpus, memory_mb=spec.memory_mb, labels=rec.labels or None,
                         pooled=True if "pooled_s" in rec.extra else None)

    async def create_many(self, spec: SandboxSpec, n: int, concurrency: int | None = None,
                          on_done: Callable[[SandboxInfo | ShoalError], None] | None = None, *,
                          all_or_nothing: bool = False) -> list[SandboxInfo | ShoalError]:
        """Create `n` sandboxes with bounded parallelism; each item is an info or the error it met.
        `on_done` is called as each one becomes ready (or fails), e.g. to time a burst per sandbox.

        `all_or_nothing` (a gang): admission for all `n` is reserved before any starts, or
        GangUnsatisfiable is raised (with how many fit); if one then fails to start, the others are
        closed and its error is raised. Gangs do not draw from the warm pool."""
        from shoal.spec import check_spec

        check_spec(spec)
        self.check_egress(spec)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_BATCH:
            raise InvalidRequest(f"n={n!r} must be an integer between 1 and {MAX_BATCH}")
        self.scheduling.check_job(spec, n)
        image = await self.resolve_image(spec.image)
        sem = asyncio.Semaphore(concurrency or self.config.create_concurrency)
        if all_or_nothing:
            return await self._create_gang(spec, n, image, sem, on_done)

        async def one() -> SandboxInfo | ShoalError:
            async with sem:
                res: SandboxInfo | ShoalError
                try:
                    hit = await self.pool.take(spec, image) if self.pool.active else None
                    res = hit if hit is not None else await self.start_sandbox(spec.model_copy(), image)
                except ShoalError as e:
                    res = e
                except Exception as e:
                    res = SandboxError(f"create failed: {e}")
            if on_done is not None:
                on_done(res)
            return res

        return list(await asyncio.gather(*(one() for _ in range(n))))

    async def _create_gang(self, spec: SandboxSpec, n: int, image: Image, sem: asyncio.Semaphore,
                           on_done: Callable[[SandboxInfo | ShoalError], None] | None
                           ) -> list[SandboxInfo | ShoalError]:
        held = await self.scheduling.reserve_gang(spec, n)
        failed: list[BaseException] = []

        async def one(res: Reservation) -> SandboxInfo | None:
            async with sem:
                if failed:  # one already failed: the gang is off, do not start more
                    res.release()
                    return None
                try:
                    info = await self.start_sandbox(spec.model_copy(), image, reservation=res)
                except BaseException as e:
                    failed.append(e)
                    return None
            if on_done is not None:
                on_done(info)
            return info

        try:
            got = await asyncio.gather(*(one(r) for r in held))
        finally:
            for r in held:
                r.release()  # no-op for the committed ones
        infos = [i for i in got if i is not None]
        if failed:
            await asyncio.gather(*(self.close(i.id) for i in infos), return_exceptions=True)
            err = failed[0]
            if isinstance(err, ShoalError):
                raise err
            raise SandboxError(f"gang create failed ({len(infos)} of {n} had started and were closed): {err}") from err
        return list(infos)

    async def close(self, sandbox_id: str, *, reason: str = "user") -> None:
        """Destroy a sandbox and everything it had on the host. `reason` goes to the event log: "user",
        "timeout" (its TTL passed), "lost" (its init died)."""
        rec = self.record(sandbox_id)
        await self.connections.drop(sandbox_id)
        # the loop-safe lock: a blocking flock here would deadlock against a pause/snapshot in progress
        async with self.locks.state(sandbox_id):
            try:
                rec = self.record(sandbox_id)
            except SandboxNotFound:
                return  # someone else closed it meanwhile
            rec.state = "stopping"
            with contextlib.suppress(OSError):
                rec.save()
            if not rec.extra.get("pool"):
                self.check_oom(rec, when="before close")
            crash_point("close.stopping")
            try:
                await self.backend(rec.backend).destroy(rec)
            finally:
                self.admission.release(sandbox_id)
                self.scheduling.closed(rec)
                self.reclaimed.pop(sandbox_id, None)
                if not rec.extra.get("pool"):
                    self.events.emit("closed", sandbox_id, rec.project, reason=reason,
                                     lived_s=round(time.time() - rec.created_at, 3))
        self.locks.forget(sandbox_id)
        forget_record(rec.path)
        if rec.extra.get("forked"):
            from shoal.node.snapshot import drop_fork_snapshots

            await asyncio.to_thread(drop_fork_snapshots, self.store, rec)

    async def close_all(self, project: str | None = None, *, concurrency: int | None = None,
                        on_done: Callable[[str, BaseException | None], None] | None = None) -> int:
        """Close every sandbox (of one project), `concurrency` at a time (see `close_many`); returns how
        many were closed."""
        recs = await asyncio.to_thread(list_records, self.paths.sandboxes)  # 10,000 records: off the loop
        ids = [r.id for r in recs if project is None or r.project == project]
        await self.close_many(ids, concurrency=concurrency, on_done=on_done)
        return len(ids)

    async def close_many(self, sandbox_ids: builtins.list[str], *, concurrency: int | None = None,
                         on_done: Callable[[str, BaseException | None], None] | None = None) -> None:
        """Close these sandboxes in parallel, at most `concurrency` at a time (default CLOSE_CONCURRENCY):
        a close is mostly waiting (a killed init to exit, a cgroup to empty, an unmount), so 10,000 of them
        take the time the machine needs for the work, not 10,000 waits in a row — while a bound keeps the
        descriptors and threads they hold in check. Raises the first error (after every close ran);
        `on_done(id, error)` is called as each ends."""
        sem = asyncio.Semaphore(max(1, concurrency or CLOSE_CONCURRENCY))
        errs: builtins.list[BaseException] = []

        async def one(sid: str) -> None:
            err: BaseException | None = None
            async with sem:
                try:
                    await self.close(sid)
                except SandboxNotFound:
                    pass
                except Exception as e:
                    err = e
                    errs.append(e)
            if on_done is not None:
                on_done(sid, err)

        await asyncio.gather(*(one(sid) for sid in sandbox_ids))
        if errs:
            raise errs[0]

    # ---- queries ------------------------------------------------------------------------------
    async def get(self, sandbox_id: str) -> SandboxInfo:
        """Info about one sandbox; SandboxNotFound when it does not exist."""
        return self.describe(self.record(sandbox_id))

    async def list(self, project: str | None = None, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        """Every sandbox on this node (of a project, matching all `labels`)."""
        out = []
        for rec in list_records(self.paths.sandboxes):
            if project is not None and rec.project != project:
                continue
            if labels and any(rec.labels.get(k) != v for k, v in labels.items()):
                continue
            if rec.extra.get("pool"):
                continue  # warm, not handed out to anyone yet
            out.append(self.describe(rec))
        return out

    # ---- OOM kills ------------------------------------------------------------------------------
    def check_oom(self, rec: SandboxRecord, *, cmd: str | builtins.list[str] | None = None, when: str = "") -> int:
        """Log an `oom` event when the kernel's OOM killer killed processes of the sandbox since the last
        check (its memory cgroup's oom_kill counter); returns how many new kills. Cheap (one cgroup file),
        so it runs after a command killed by SIGKILL and before a close."""
        if not rec.cgroup:
            return 0
        from shoal.host.cgroups import oom_kills

        n = oom_kills(rec.cgroup)
        seen = int(rec.extra.get("oom_kills", 0))
        if n is None or n <= seen:
            return 0
        with contextlib.suppress(SandboxNotFound, OSError):
            fresh = self.record(rec.id)
            fresh.extra["oom_kills"] = n
            fresh.save()
        rec.extra["oom_kills"] = n
        data: dict[str, Any] = {"kills": n - seen, "memory_mb": rec.spec.memory_mb}
        if cmd is not None:
            data["cmd"] = (cmd if isinstance(cmd, str) else " ".join(cmd))[:300]
        if when:
            data["noticed"] = when
        self.events.emit("oom", rec.id, rec.project, **data)
        return n - seen

    # ---- reaching the agent -------------------------------------------------------------------
    async def client(self, sandbox_id: str, rec: SandboxRecord | None = None) -> AgentClient:
        """A live connection to the sandbox's agent, resuming the sandbox first if it is paused."""
        rec = rec or self.record(sandbox_id)
        self.scheduling.touched(sandbox_id)  # a call: not idle (preemption and tides look at this)
        if rec.state == "paused":
            # a request to a paused sandbox resumes it transparently
            await self.resume(sandbox_id)
            rec = self.record(sandbox_id)
        c = self.connections.get(sandbox_id)
        if c is not None:
            return c
        if rec.state != "running":
            raise SandboxError(f"sandbox {sandbox_id} is {rec.state}, not running")
        backend = self.backend(rec.backend)
        if not backend.alive(rec):
            raise SandboxError(f"sandbox {sandbox_id} has died (its init process is gone); close it")
        if self.capacity.descriptors_short():
            # requests to many sandboxes at once (an exec in each of 10,000): do not wait SHOAL_AGENT_IDLE_S
            # to give back the connections they are done with
            await self.connections.sweep(idle_s=1.0)
        return await self.connections.connect(rec, backend, timeout=AGENT_CONNECT_TIMEOUT_S)

    async def call(self, rec: SandboxRecord, fn: Callable[[AgentClient], Any]) -> Any:
        """Run `fn(client)`; a lost connection is reported as the sandbox having died, when it has."""
        c = await self.client(rec.id, rec)
        try:
            return await fn(c)
        except SandboxError as e:
            if not getattr(c, "closed", False):
                raise
            self.connections.forget(rec.id, c)
            if getattr(c, "closed_idle", False):
                # the idle sweep closed it between our get and the request (shoal.node.connections): once more
                return await fn(await self.client(rec.id, rec))
            if not self.backend(rec.backend).alive(rec):
                raise SandboxError(f"sandbox {rec.id} died: {e}") from e
            raise

    # ---- pause / resume -----------------------------------------------------------------------
    async def pause(self, sandbox_id: str, reclaim: bool | None = None, *, by: str | None = None) -> None:
        """Freeze the sandbox, then reclaim its memory (container.reclaim; `reclaim=None`: the config's).
        Its memory stops counting against the node's limit until it resumes. `by` names who paused it
        when it was not its user ("preempt", "tides": `info.extra["paused_by"]` until it resumes)."""
        rec = self.record(sandbox_id)  # SandboxNotFound before any lock file is made
        backend = self.backend(rec.backend)
        backend.require(Capability.PAUSE)
        async with self.locks.state(sandbox_id):
            rec = self.record(sandbox_id)
            if rec.state == "paused":
                return
            if rec.state != "running":
                raise SandboxError(f"cannot pause sandbox {sandbox_id}: it is {rec.state}")
            await backend.pause(rec)
            rec.state = "paused"
            rec.extra["paused_at"] = time.time()
            if by:
                rec.extra["paused_by"] = by
            rec.save()
            self.admission.paused(sandbox_id)
            self.scheduling.paused(sandbox_id, by or "user")
            if (self.config.reclaim_on_pause if reclaim is None else reclaim) and backend.can(Capability.RECLAIM):
                rec.extra["reclaim"] = await backend.reclaim(rec, record_working_set=self.config.prefetch_on_resume)
                rec.save()
                self.reclaimed[sandbox_id] = int(rec.extra["reclaim"].get("reclaimed") or 0)
            got = self.reclaimed.get(sandbox_id)
            self.events.emit("paused", sandbox_id, rec.project, by=by or "user",
                             reclaimed_mb=None if got is None else round(got / 2**20, 2))

    async def resume(self, sandbox_id: str, prefetch: bool | None = None) -> None:
        """Read the paused sandbox's working set back in (see shoal.backends.container.reclaim), then thaw it."""
        rec = self.record(sandbox_id)  # SandboxNotFound before any lock file is made
        backend = self.backend(rec.backend)
        async with self.locks.state(sandbox_id):
            rec = self.record(sandbox_id)
            if rec.state != "paused":
                return
            fetched: dict[str, Any] = {}
            if (self.config.prefetch_on_resume if prefetch is None else prefetch) and backend.can(Capability.RECLAIM):
                fetched = await backend.prefetch(rec)
            t0 = asyncio.get_running_loop().time()
            await backend.resume(rec)
            backend.forget_working_set(rec)
            rec.state = "running"
            rec.extra.pop("paused_by", None)
            rec.extra["resume"] = dict(fetched, thaw_s=round(asyncio.get_running_loop().time() - t0, 4), at=time.time())
            rec.save()
            self.admission.resumed(sandbox_id)
            self.scheduling.resumed(sandbox_id)
            self.reclaimed.pop(sandbox_id, None)
            self.events.emit("resumed", sandbox_id, rec.project)

    async def set_cpu_class(self, sandbox_id: str, cpu_class: str) -> dict[str, Any]:
        """Move a running sandbox to another CPU class (`interactive` or `batch`, see container.cpuclass),
        e.g. around a test suite it runs. Returns what was set."""
        check_cpu_class(cpu_class)
        rec = self.record(sandbox_id)
        backend = self.backend(rec.backend)
        backend.require(Capability.CPU_CLASS)
        async with self.locks.state(sandbox_id):
            rec = self.record(sandbox_id)
            got = await backend.set_cpu_class(rec, cpu_class)
            rec.spec = rec.spec.model_copy(update={"cpu_class": cpu_class})
            rec.extra["cpu"] = got
            rec.save()
        return got

    # ---- snapshot / fork / restore --------------------------------------------------------------
    async def snapshot(self, sandbox_id: str, name: str, *, memory: bool | None = None,
                       store_budget: int | None = None) -> dict[str, Any]:
        """Save the sandbox as `name`: its files as a new image (shoal.node.snapshot), or with
        `memory=True` its memory, processes and disks as a named memory snapshot (VM backends).
        `memory=None` takes what the backend offers, files first. `store_budget`: the most bytes a new
        image layer may take (a project's store quota)."""
        rec = self.record(sandbox_id)
        backend = self.backend(rec.backend)
        if _with_memory(backend, memory, Capability.SNAPSHOT_MEMORY):
            backend.require(Capability.SNAPSHOT_MEMORY)
            return await backend.snapshot_memory(rec, name)
        backend.require(Capability.SNAPSHOT_FILES)
        from shoal.node.snapshot import snapshot_sandbox

        return await snapshot_sandbox(self, sandbox_id, name, store_budget=store_budget)

    async def fork(self, sandbox_id: str, n: int, *, memory: bool | None = None, **kw: Any
                   ) -> builtins.list[SandboxInfo | ShoalError]:
        """`n` children of the sandbox; per-item errors like create_many. From its files (a snapshot,
        then create_many; options `name` and spec overrides), or with `memory=True` continuing its
        processes (backends with Capability.FORK_MEMORY). `memory=None` takes what the backend offers."""
        from shoal.node.snapshot import MAX_FORK, fork_sandbox

        if not isinstance(n, int) or not 1 <= n <= MAX_FORK:
            raise InvalidRequest(f"n={n!r} must be an integer between 1 and {MAX_FORK}")
        rec = self.record(sandbox_id)
        backend = self.backend(rec.backend)
        if _with_memory(backend, memory, Capability.FORK_MEMORY):
            backend.require(Capability.FORK_MEMORY)
            kw.pop("name", None)
            kw.pop("store_budget", None)  # a memory fork adds nothing to the image store
            return await backend.fork_memory(rec, n, **kw)
        backend.require(Capability.SNAPSHOT_FILES)
        return await fork_sandbox(self, sandbox_id, n, **kw)

    async def restore(self, name: str, n: int = 1, *, backend: str = "microvm"
                      ) -> builtins.list[SandboxInfo | ShoalError]:
        """`n` new sandboxes resumed from the named memory snapshot (taken on `backend`'s host kind)."""
        b = self.backend(backend)
        b.require(Capability.RESTORE)
        return await b.restore(name, n)

    # ---- fncall ---------------------------------------------------------------------------------
    async def run_code(self, code: str, **kw: Any) -> Any:
        """Run a snippet on the fncall backend's warm pool."""
        return await self.fncall().run_code(code, **kw)

    async def run_code_many(self, items: builtins.list[Any], **kw: Any) -> builtins.list[Any]:
        """Run many snippets on the fncall backend; one result per item, in order."""
        return await self.fncall().run_code_many(items, **kw)

    # ---- reaping and crash recovery (shoal.node.recovery) ---------------------------------------
    async def reconcile(self) -> dict[str, int]:
        """Re-adopt live sandboxes left by earlier processes; clean up dead, expired and half-made ones."""
        out = await self.recovery.reconcile()
        if not self.config.fake_backend:
            # the backends' own host leftovers (orphaned writable layers, CPU-class cgroups, runtime state)
            for b in self._host_backends():
                out.update(await b.host_reconcile())
        self.scheduling.recount(list_records(self.paths.sandboxes))
        return out

    def adopt(self, rec: SandboxRecord) -> SandboxInfo:
        """Take over a live sandbox another process made (counted by admission, reachable from here)."""
        return self.recovery.adopt(rec)

    async def reap_once(self) -> int:
        """Close sandboxes past their TTL and sandboxes whose init died. Returns how many were closed."""
        return await self.recovery.reap_once()

    async def heartbeat_leases(self, force: bool = False) -> None:
        """Renew this node's store leases (mounted layers) every SHOAL_LEASE_HEARTBEAT_S, so gc on other
        nodes can tell this node is alive (shoal.images.leases). The reaper calls it on every round."""
        from shoal.images.leases import heartbeat_s

        now = time.monotonic()
        if not force and now - self._leases_renewed < heartbeat_s():
            return
        self._leases_renewed = now
        await asyncio.to_thread(self.layer_mounts.renew_leases)

    async def finish_start_records(self) -> None:
        """Write the start records of layers recorded for longer than prefetch.RECORD_S (the reaper's round)."""
        from shoal.images.prefetch import RECORD_S

        if self.layer_mounts.recording():
            await asyncio.to_thread(self.layer_mounts.finish_records, only_older_than=RECORD_S)

    async def watch_store(self) -> None:
        """While sandboxes run, probe the store (the reaper calls this every round): an outage and its end
        are noticed even when no create asks (a probe is a stat and a 4 KiB read; a blocked one is never
        stacked), and the end of an outage re-opens loop-mounted layers (store_health.on_recover)."""
        if len(self.connections) or self.store_health.failing_since is not None:
            with contextlib.suppress(ShoalError):
                await asyncio.to_thread(self.store_health.check)

def _with_memory(backend: Backend, memory: bool | None, cap: Capability) -> bool:
    # None: files when the backend has them, else memory when it has that (VMs keep no host-side upper)
    if memory is None:
        return not backend.can(Capability.SNAPSHOT_FILES) and backend.can(cap)
    return bool(memory)


async def aiter_events(handle: Any) -> AsyncIterator[StreamEvent]:
    """Iterate a stream handle (helper for transports)."""
    async for ev in handle:
        yield ev
