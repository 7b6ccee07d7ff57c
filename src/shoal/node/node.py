"""The node agent's front: one host's sandboxes, as their users see them.

It is a library object, embedded in the SDK's local client by default or served over HTTP by
`shoal serve`. Its only durable state is one record per sandbox on local disk, so any number of
node-agent processes can come and go (the CLI, a server, a test) and all see the same sandboxes.

`Node`'s methods are the user-facing API: the front protocol (shoal.front.Front) plus the node-only
extras named in tests/unit/test_node_surface.py. The work lives in the node's parts, each a public object
of its own module: `core` (shoal.node.core: the tables and the per-sandbox steps — start, close, pause,
reach the agent — that every part and backend is given instead of the Node), `admission` (what fits),
`connections` (agent connections), `locks` (per-sandbox state locks), `scheduling` (jobs, preemption,
tides), `recovery` (reconcile, adopt, reap), `pool` (warm sandboxes), the backends (built from
shoal.backends.registry with the core as their `NodeContext`), and `shoal.node.snapshot` (file snapshots
and forks). Exec, files and shells go through the in-sandbox agent, identical on every backend
(shoal.node.dataplane).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Literal

from shoal.backends.base import Backend, Capability, RuntimeStatus
from shoal.config import NodeConfig
from shoal.errors import InvalidRequest, SandboxError, SandboxNotFound, ShoalError
from shoal.images.store import Image
from shoal.limits import MAX_BATCH, check_cpu_class
from shoal.models import SandboxInfo, StreamEvent
from shoal.node.admission import Reservation
from shoal.node.core import NodeCore
from shoal.node.dataplane import DataPlane
from shoal.node.frontops import NodeFrontOps
from shoal.node.pool import WarmPool
from shoal.node.recovery import Recovery
from shoal.records import SandboxRecord, list_records

if TYPE_CHECKING:
    from shoal.agentproto.client import AgentClient
    from shoal.backends.fncall import FncallManager
    from shoal.config import Paths
    from shoal.images.mounts import LayerMounts
    from shoal.images.probe import StoreHealth
    from shoal.images.store import ImageStore
    from shoal.node.admission import Admission
    from shoal.node.capacity import HostCapacity
    from shoal.node.connections import AgentConnections
    from shoal.node.events import EventLog
    from shoal.node.network import NetworkManager
    from shoal.node.protect import Protection
    from shoal.node.scheduling import NodeScheduling
    from shoal.node.statelock import SandboxLocks
    from shoal.spec import SandboxSpec

#: closes run at once by close_all / close_many (a close mostly waits: for a killed init, a cgroup, an unmount)
CLOSE_CONCURRENCY = 64


class Node(DataPlane, NodeFrontOps):
    """One host's sandboxes. Use `async with Node() as node:` or call start()/stop(). Implements the front
    protocol (shoal.front.Front) the server, compat APIs and transports use."""

    #: shoal.front.Front.kind: records and admission are here
    kind: Literal["node", "cluster"] = "node"

    def local_node(self) -> Node:
        """This node (shoal.front.Front.local_node: observability reads it)."""
        return self

    def cluster_transport(self) -> None:
        """None: an embedded node has no cluster behind it (shoal.front.Front.cluster_transport)."""

    def __init__(self, config: NodeConfig | None = None) -> None:
        #: the node's internals: what its parts and backends are given (shoal.node.core), never the Node
        self.core = core = NodeCore(config or NodeConfig(), sandboxes=self)
        # the parts users and tools read (each documented where the core makes it)
        self.config: NodeConfig = core.config
        self.paths: Paths = core.paths
        self.store: ImageStore = core.store
        self.events: EventLog = core.events
        self.layer_mounts: LayerMounts = core.layer_mounts
        self.store_health: StoreHealth = core.store_health
        self.reclaimed: dict[str, int] = core.reclaimed
        self.admission: Admission = core.admission
        self.capacity: HostCapacity = core.capacity
        self.scheduling: NodeScheduling = core.scheduling
        self.connections: AgentConnections = core.connections
        self.locks: SandboxLocks = core.locks
        #: reconcile, adopt and reap
        self.recovery = Recovery(core)
        #: sandboxes created ahead of time and handed out by create() (off until configured)
        self.pool = WarmPool(core)
        self._image_shells: dict[str, str] = {}
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
        self.core.install_guest_agent()
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
            for b in self.core.host_backends():
                await b.host_start()
        if reconcile:
            await self.reconcile()
            with contextlib.suppress(Exception):
                await self.core.heartbeat_leases(force=True)
        if reap:
            self.recovery.start_reaper()
            self.scheduling.start()
        self.connections.start()  # idle connections go in every node process (a CLI's create -n 10000 too)
        self._started = True
        if self.config.warm_pool:
            from shoal.spec import SandboxSpec

            for image, size in self.config.warm_pool.items():
                self.pool.configure(SandboxSpec(image=image), size)
        return self

    async def stop(self) -> None:
        """Stop the reaper and drop agent connections. Sandboxes keep running (crash-only); pooled ones,
        never handed out, are closed, and so are the backends' services (fncall's pools)."""
        if self.pool.active:
            await self.pool.close()
        for b in self.core.built_backends():
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

    async def reconcile(self) -> dict[str, int]:
        """Re-adopt live sandboxes left by earlier processes; clean up dead, expired and half-made ones
        (at start, and `shoal gc`)."""
        out = await self.recovery.reconcile()
        if not self.config.fake_backend:
            # the backends' own host leftovers (orphaned writable layers, CPU-class cgroups, runtime state)
            for b in self.core.host_backends():
                out.update(await b.host_reconcile())
        self.scheduling.recount(list_records(self.paths.sandboxes))
        return out

    # ---- what the node runs on ----------------------------------------------------------------
    def backend(self, name: str) -> Backend:
        """The backend object for `name` (see shoal.backends.registry), created on first use."""
        return self.core.backend(name)

    def network(self) -> NetworkManager:
        """The node's network manager (veth + NAT), created on first use."""
        return self.core.network()

    @property
    def runtime_statuses(self) -> dict[str, RuntimeStatus]:
        """Which runtimes the node's backends run sandboxes on work here (the container's OCI runtimes;
        probed once per boot)."""
        return self.core.runtime_statuses

    def table_sizes(self) -> dict[str, int]:
        """How many entries the node keeps in each per-sandbox table (what `shoal bench soak` checks)."""
        return self.core.table_sizes()

    def fncall(self) -> FncallManager:
        """The node's fncall service (warm pools for run_code), created on first use; stop() closes it."""
        from shoal.backends.fncall import FncallBackend

        b = self.backend("fncall")
        assert isinstance(b, FncallBackend)
        return b.manager()

    # ---- records ------------------------------------------------------------------------------
    def record(self, sandbox_id: str) -> SandboxRecord:
        """The on-disk record of a sandbox (SandboxNotFound when there is none)."""
        return self.core.record(sandbox_id)

    async def record_async(self, sandbox_id: str) -> SandboxRecord:
        """`record` (shoal.front.Front: a gateway may have to ask a node; a node has its records here)."""
        return self.core.record(sandbox_id)

    # ---- create / close -----------------------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        """Create one sandbox and wait until its agent answers (or hand out one from a warm pool)."""
        from shoal.spec import check_spec

        check_spec(spec)
        self.core.check_egress(spec)
        self.scheduling.check_job(spec)
        image = await self.core.resolve_image(spec.image)
        if self.pool.active:
            hit = await self.pool.take(spec, image)
            if hit is not None:
                return hit
        return await self.core.start_sandbox(spec, image)

    async def resolve_image(self, ref: str, *, pull_policy: str | None = None) -> Image:
        """Resolve an image for a create (or a build's base): a bounded probe of the store first
        (StoreUnavailable), a reference not in the store pulled per `pull_policy` (default: the setting)."""
        return await self.core.resolve_image(ref, pull_policy=pull_policy)

    async def pull(self, ref: str, *, progress: Any = None) -> dict[str, Any]:
        """`shoal image pull`: ask the registry for `ref` now (as `docker pull` does: an image of that name
        in the store is checked against the registry and replaced when it changed). Once across the nodes
        sharing the store; returns the PullReport as a dict."""
        from shoal.images.pull import pull_image

        await asyncio.to_thread(self.store_health.check)

        def go() -> dict[str, Any]:
            return pull_image(self.store, ref, progress=progress, work_dir=self.paths.home / "tmp").to_dict()

        return await asyncio.to_thread(go)

    async def create_many(self, spec: SandboxSpec, n: int, concurrency: int | None = None,
                          on_done: Callable[[SandboxInfo | ShoalError], None] | None = None, *,
                          all_or_nothing: bool = False) -> builtins.list[SandboxInfo | ShoalError]:
        """Create `n` sandboxes with bounded parallelism; each item is an info or the error it met.
        `on_done` is called as each one becomes ready (or fails), e.g. to time a burst per sandbox.

        `all_or_nothing` (a gang): admission for all `n` is reserved before any starts, or
        GangUnsatisfiable is raised (with how many fit); if one then fails to start, the others are
        closed and its error is raised. Gangs do not draw from the warm pool."""
        from shoal.spec import check_spec

        check_spec(spec)
        self.core.check_egress(spec)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_BATCH:
            raise InvalidRequest(f"n={n!r} must be an integer between 1 and {MAX_BATCH}")
        self.scheduling.check_job(spec, n)
        image = await self.core.resolve_image(spec.image)
        sem = asyncio.Semaphore(concurrency or self.config.create_concurrency)
        if all_or_nothing:
            return await self._create_gang(spec, n, image, sem, on_done)

        async def one() -> SandboxInfo | ShoalError:
            async with sem:
                res: SandboxInfo | ShoalError
                try:
                    hit = await self.pool.take(spec, image) if self.pool.active else None
                    res = hit if hit is not None else await self.core.start_sandbox(spec.model_copy(), image)
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
                           ) -> builtins.list[SandboxInfo | ShoalError]:
        held = await self.scheduling.reserve_gang(spec, n)
        failed: builtins.list[BaseException] = []

        async def one(res: Reservation) -> SandboxInfo | None:
            async with sem:
                if failed:  # one already failed: the gang is off, do not start more
                    res.release()
                    return None
                try:
                    info = await self.core.start_sandbox(spec.model_copy(), image, reservation=res)
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
        await self.core.close(sandbox_id, reason=reason)

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
        return self.core.describe(self.core.record(sandbox_id))

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
            out.append(self.core.describe(rec))
        return out

    # ---- reaching the agent, pause / resume ------------------------------------------------------
    async def client(self, sandbox_id: str, rec: SandboxRecord | None = None) -> AgentClient:
        """A live connection to the sandbox's agent, resuming the sandbox first if it is paused."""
        return await self.core.client(sandbox_id, rec)

    async def pause(self, sandbox_id: str, reclaim: bool | None = None, *, by: str | None = None) -> None:
        """Freeze the sandbox, then reclaim its memory (`reclaim=None`: the config's). Its memory stops
        counting against the node's limit until it resumes. `by` names who paused it when it was not its
        user ("preempt", "tides": `info.extra["paused_by"]` until it resumes)."""
        await self.core.pause(sandbox_id, reclaim, by=by)

    async def resume(self, sandbox_id: str, prefetch: bool | None = None) -> None:
        """Read the paused sandbox's working set back in (`prefetch=None`: the config's), then thaw it."""
        await self.core.resume(sandbox_id, prefetch)

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

        return await snapshot_sandbox(self.core, sandbox_id, name, store_budget=store_budget)

    async def fork(self, sandbox_id: str, n: int, *, memory: bool | None = None, **kw: Any
                   ) -> builtins.list[SandboxInfo | ShoalError]:
        """`n` children of the sandbox; per-item errors like create_many. From its files (a snapshot,
        then create_many; options `name` and spec overrides), or with `memory=True` continuing its
        processes (backends with Capability.FORK_MEMORY). `memory=None` takes what the backend offers."""
        from shoal.node.snapshot import MAX_FORK, fork_snapshot

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
        return await self.create_many(await fork_snapshot(self.core, sandbox_id, **kw), n)

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


def _with_memory(backend: Backend, memory: bool | None, cap: Capability) -> bool:
    # None: files when the backend has them, else memory when it has that (VMs keep no host-side upper)
    if memory is None:
        return not backend.can(Capability.SNAPSHOT_FILES) and backend.can(cap)
    return bool(memory)


async def aiter_events(handle: Any) -> AsyncIterator[StreamEvent]:
    """Iterate a stream handle (helper for transports)."""
    async for ev in handle:
        yield ev
