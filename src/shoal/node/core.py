"""The node's internals: its tables and the per-sandbox operations its parts and backends build on.

`Node` (node/node.py) is the node's user-facing API — the front protocol plus a few node-only extras.
`NodeCore` is what everything *inside* the node is given instead: it holds the tables (records, admission,
agent connections, state locks, backends, events, host capacity) and does the steps every part needs
(start a sandbox, close it, pause it, reach its agent). It implements the part ports of shoal.node.ports
(`RecoveryHost`, `PoolHost`, `SchedulingHost`, `SnapshotHost`) and the backends' `NodeContext`
(shoal.backends.context), so no part and no backend ever holds the Node — only the `sandboxes` door of
the NodeContext is the Node's public API (services built on ordinary sandboxes: fncall).

Node-side services that start sandboxes the user API cannot describe (an image build's bind mounts) and
tests reach it explicitly as `Node.core`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.agentbin import find_agent_binary
from shoal.backends.base import Backend, Capability, RuntimeStatus
from shoal.backends.registry import create_backend, host_backend_names
from shoal.config import NodeConfig, Paths, Settings
from shoal.errors import SandboxError, SandboxNotFound, ShoalError
from shoal.faults import configure as configure_faults
from shoal.faults import crash_point
from shoal.fsutil import install_copy
from shoal.images import corruption
from shoal.images.mounts import LayerMounts
from shoal.images.store import Image, ImageStore
from shoal.limits import AGENT_CONNECT_TIMEOUT_S, AGENT_READY_TIMEOUT_S
from shoal.models import SandboxInfo
from shoal.node.admission import Admission, Reservation
from shoal.node.connections import AgentConnections
from shoal.node.statelock import SandboxLocks
from shoal.records import SandboxRecord, check_sandbox_id, forget_record, my_identity, new_sandbox_id, spec_copy

if TYPE_CHECKING:
    from shoal.agentproto.client import AgentClient
    from shoal.backends.context import SandboxHost
    from shoal.node.network import NetworkManager
    from shoal.spec import SandboxSpec


class NodeCore:
    """One node's tables and the operations its parts share (see the module docstring)."""

    def __init__(self, config: NodeConfig, *, sandboxes: SandboxHost) -> None:
        self.config = config
        configure_faults(config.settings.fault)
        #: every setting, resolved once where the node was made (backends read these, never `settings()`)
        self.settings: Settings = config.settings
        self.paths: Paths = config.paths
        self.store = ImageStore(self.paths.store)
        for d in (self.paths.home, self.paths.sandboxes, self.paths.run, self.paths.locks):
            d.mkdir(parents=True, exist_ok=True)
        self.layer_mounts = LayerMounts(self.paths)
        #: where the node keeps its stable copy of the in-sandbox agent binary (shoal-agent)
        self.guest_dir = self.paths.home / "guest"
        #: what fits on this node (memory committed, limit, free): see shoal.node.admission
        self.admission = Admission(config)
        #: open agent connections by sandbox ID (closed when idle: shoal.node.connections)
        self.connections = AgentConnections(idle_s=config.agent_idle_s)
        from shoal.node.capacity import HostCapacity
        from shoal.node.network import BRIDGE

        #: descriptors, PIDs, inotify watches, bridge ports: what a create needs besides memory
        self.capacity = HostCapacity(bridge=BRIDGE, inotify_in_use=self._inotify_watches)
        #: per-sandbox state locks (pause, resume, snapshot, close)
        self.locks = SandboxLocks(self.paths.locks)
        from shoal.node.scheduling import NodeScheduling

        #: jobs, preemption by pausing, gangs, compute tides (shoal.sched's decisions on this node)
        self.scheduling = NodeScheduling(self)
        from shoal.node.events import EventLog

        #: what happened to each sandbox, and the commands it ran ($SHOAL_HOME/events; shoal.node.events)
        self.events = EventLog.from_settings(self.paths.home, config.node_id, config.settings)
        #: bytes the last pause reclaimed, per sandbox paused by this process (the dashboard's "reclaimed")
        self.reclaimed: dict[str, int] = {}
        #: the node's public sandbox API, for backends' services built on ordinary sandboxes (NodeContext)
        self.sandboxes = sandboxes
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

    # ---- the agent binary, backends, network --------------------------------------------------
    @property
    def agent_binary(self) -> Path:
        """The agent binary the node installed for its sandboxes."""
        return self.guest_dir / "shoal-agent"

    def install_guest_agent(self) -> None:
        """A stable copy of the agent under SHOAL_HOME: rebuilding the repo never swaps the binary under
        live sandboxes."""
        src = find_agent_binary()
        self.guest_dir.mkdir(parents=True, exist_ok=True)
        install_copy(src, self.agent_binary)

    def backend(self, name: str) -> Backend:
        """The backend object for `name` (see shoal.backends.registry), created on first use."""
        b = self._backends.get(name)
        if b is None:
            b = self._backends[name] = create_backend(name, self)
        return b

    def built_backends(self) -> list[Backend]:
        """The backends built so far (the ones a stopping node closes)."""
        return list(self._backends.values())

    def host_backends(self) -> list[Backend]:
        """The backends that keep host-wide machinery (registered with `host=True`): the node calls their
        host hooks (shoal.backends.base: host_start, host_reconcile, host_runtimes, host_teardown)."""
        return [self.backend(name) for name in host_backend_names()]

    @property
    def runtime_statuses(self) -> dict[str, RuntimeStatus]:
        """Which runtimes the node's backends run sandboxes on work here (probed once per boot)."""
        return {name: st for b in self.host_backends() for name, st in b.host_runtimes().items()}

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

    def table_sizes(self) -> dict[str, int]:
        """How many entries the node keeps in each per-sandbox table now (admission, last use, connections,
        parsed records, state locks, swap watches): what `shoal bench soak` checks stays flat under churn."""
        from shoal import records

        sw = getattr(self._backends.get("container"), "swap_watch", None)
        return {"admission_live": len(self.admission.live_ids()), "last_used": len(self.scheduling.last_used),
                "connections": len(self.connections), "parsed_records": records.cached_records(),
                "state_locks": self.locks.held(), "swap_watches": len(sw) if sw is not None else 0,
                "reclaimed": len(self.reclaimed)}

    def _inotify_watches(self) -> int:
        # the swap watch's inotify watches (cgroup v2 hosts: one per watched sandbox; v1 uses none)
        sw = getattr(self._backends.get("container"), "swap_watch", None)
        return len(sw) if sw is not None and sw.mode == "v2" else 0

    # ---- records ------------------------------------------------------------------------------
    def record(self, sandbox_id: str) -> SandboxRecord:
        """The on-disk record of a sandbox (SandboxNotFound when there is none)."""
        check_sandbox_id(sandbox_id)
        return SandboxRecord.load(self.paths.sandboxes / sandbox_id)

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

    def new_record(self, *, backend: str, image: str, image_digest: str, layers: list[str],
                   spec: SandboxSpec, extra: dict[str, Any], make_dir: Callable[[Path], None] | None = None,
                   runtime: str = "", project: str | None = None, labels: dict[str, str] | None = None,
                   ) -> SandboxRecord:
        """A record (not saved yet) for a new sandbox of this node, with its directory made and this
        process as its owner; it keeps its own copy of `spec`, and its TTL, project and labels come from
        `spec` unless given."""
        sid = new_sandbox_id(self.config.node_id)
        d = self.paths.sandboxes / sid
        (make_dir or Path.mkdir)(d)
        owner_pid, owner_start = my_identity()
        now = time.time()
        ttl = spec.ttl_s
        return SandboxRecord(
            id=sid, backend=backend, image=image, image_digest=image_digest, layers=layers, spec=spec_copy(spec),
            dir=str(d), owner_pid=owner_pid, owner_start=owner_start, created_at=now,
            expires_at=(now + float(ttl)) if ttl else None,
            project=project if project is not None else (spec.project or "default"),
            labels=dict(labels if labels is not None else spec.labels), runtime=runtime, extra=extra)

    # ---- images -------------------------------------------------------------------------------
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

    def _image_corrupt(self, ev: dict[str, Any]) -> None:
        # the layer reader found a bad (or missing) chunk: a node event (no sandbox of its own; `users` are
        # the sandboxes of this node using the layer). Called from the reader's event thread.
        self.events.emit("image_corrupt", "", layer=ev.get("layer"), chunk=ev.get("chunk"),
                         reason=ev.get("reason"), sandboxes=ev.get("users") or [], read_at=ev.get("t"))

    # ---- start / close ------------------------------------------------------------------------
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
            rec = self.new_record(
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

    # ---- OOM kills ----------------------------------------------------------------------------
    def check_oom(self, rec: SandboxRecord, *, cmd: str | list[str] | None = None, when: str = "") -> int:
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

    async def after_command(self, rec: SandboxRecord) -> None:
        """A command of a sandbox finished: when its layers' first start on this node is being recorded, the
        record is complete (shoal.images.prefetch)."""
        if rec.layers and self.layer_mounts.recording(rec.layers):
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.layer_mounts.finish_records, rec.layers)

    # ---- pause / resume -----------------------------------------------------------------------
    async def pause(self, sandbox_id: str, reclaim: bool | None = None, *, by: str | None = None) -> None:
        """Freeze the sandbox, then reclaim its memory (the backend's Capability.RECLAIM; `reclaim=None`:
        the config's). Its memory stops counting against the node's limit until it resumes. `by` names who
        paused it when it was not its user ("preempt", "tides": `info.extra["paused_by"]` until it resumes)."""
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
        """Read the paused sandbox's working set back in (the backend's prefetch), then thaw it."""
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

    # ---- the reaper's round (shoal.node.recovery) ---------------------------------------------
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
