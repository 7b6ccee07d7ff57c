"""The node agent: owns the sandboxes of one host (create, reach, pause, reap, clean up).

It is a library object, embedded in the SDK's local client by default or served over HTTP by
`shoal serve`. Its only durable state is one record per sandbox on local disk, so any number of
node-agent processes can come and go (the CLI, a server, a test) and all see the same sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.agentbin import find_agent_binary
from shoal.backends.base import Backend
from shoal.backends.container import ContainerBackend
from shoal.backends.runtime import RuntimeStatus, probe_runtimes
from shoal.config import NodeConfig
from shoal.errors import (
    BackendUnavailable,
    InvalidRequest,
    SandboxError,
    SandboxNotFound,
    ShoalError,
)
from shoal.fsutil import sha256_file
from shoal.images.mounts import LayerMounts
from shoal.images.store import Image, ImageStore
from shoal.models import DirEntry, ExecResult, SandboxInfo, SandboxSpec, StreamEvent
from shoal.node.records import (
    SandboxRecord,
    check_sandbox_id,
    list_records,
    my_identity,
    new_sandbox_id,
    validate_labels,
)

if TYPE_CHECKING:
    from shoal.agentproto.client import AgentClient

DEFAULT_EXEC_TIMEOUT = 300.0


def validate_spec(spec: SandboxSpec) -> SandboxSpec:
    """Reject impossible limits with a message naming the field."""
    if spec.backend not in ("container", "microvm", "vm", "fncall"):
        raise InvalidRequest(f"unknown backend {spec.backend!r}: choose container, microvm, vm or fncall")
    checks = [
        ("cpus", 0.01 <= float(spec.cpus) <= 256, "between 0.01 and 256"),
        ("memory_mb", 16 <= int(spec.memory_mb) <= 1 << 20, "between 16 and 1048576"),
        ("pids", 8 <= int(spec.pids) <= 1 << 22, "between 8 and 4194304"),
        ("disk_mb", 1 <= int(spec.disk_mb) <= 1 << 24, "between 1 and 16777216"),
        ("max_output_bytes", 0 <= int(spec.max_output_bytes) <= 1 << 30, "between 0 and 1 GiB"),
    ]
    for name, ok, rng in checks:
        if not ok:
            raise InvalidRequest(f"{name}={getattr(spec, name)!r} is out of range: must be {rng}")
    if spec.ttl_s is not None and not (0 < float(spec.ttl_s) <= 30 * 86400):
        raise InvalidRequest(f"ttl_s={spec.ttl_s!r} must be positive and at most 30 days (or None)")
    if not isinstance(spec.env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
            for k, v in spec.env.items()):
        raise InvalidRequest("env must map non-empty names without '=' or NUL to strings")
    validate_labels(spec.labels)
    if spec.hostname is not None and not (0 < len(spec.hostname) <= 63 and all(
            c.isalnum() or c == "-" for c in spec.hostname)):
        raise InvalidRequest(f"hostname {spec.hostname!r} must be 1-63 letters, digits or '-'")
    return spec


log = logging.getLogger(__name__)


class Node:
    """One host's sandboxes. Use `async with Node() as node:` or call start()/stop()."""

    def __init__(self, config: NodeConfig | None = None) -> None:
        self.config = config or NodeConfig()
        self.paths = self.config.paths
        self.store = ImageStore(self.paths.store)
        for d in (self.paths.home, self.paths.sandboxes, self.paths.run, self.paths.locks):
            d.mkdir(parents=True, exist_ok=True)
        self.layer_mounts = LayerMounts(self.paths)
        from shoal.images.probe import StoreHealth

        #: bounded probes of SHOAL_STORE: creates fail fast (StoreUnavailable) when a shared store is down
        self.store_health = StoreHealth(self.paths.store)
        self._leases_renewed = 0.0
        self._clients: dict[str, AgentClient] = {}
        self._client_locks: dict[str, asyncio.Lock] = {}
        self._backends: dict[str, Backend] = {}
        self._statuses: dict[str, RuntimeStatus] | None = None
        self._reaper: asyncio.Task | None = None
        self._started = False
        self.guest_dir = self.paths.home / "guest"
        self._network = None
        #: memory promised to live sandboxes (MiB), for admission; recomputed by reconcile()
        self._committed_mb = 0
        from shoal.node.pool import WarmPool

        #: sandboxes created ahead of time and handed out by create() (off until configured)
        self.pool = WarmPool(self)

    # ---- lifecycle of the node agent itself ---------------------------------------------------
    async def start(self, reap: bool = True, reconcile: bool = True) -> Node:
        """Install the guest agent, re-adopt or clean up sandboxes left by earlier processes, start the reaper."""
        if self._started:
            return self
        _raise_nofile()
        self._install_guest_agent()
        if self.config.zram_swap:
            from shoal.node.reclaim import setup_zram_swap

            # compressed swap in RAM is what lets pause() return a sandbox's anonymous memory
            await asyncio.to_thread(setup_zram_swap, self.config.zram_swap)
        if reconcile:
            await self.reconcile()
            with contextlib.suppress(Exception):
                await self._heartbeat_leases(force=True)
        if reap:
            self._reaper = asyncio.create_task(self._reap_loop(), name="shoal-reaper")
        self._started = True
        for image, size in self.config.warm_pool.items():
            self.set_warm_pool(SandboxSpec(image=image), size)
        return self

    async def stop(self) -> None:
        """Stop the reaper and drop agent connections. Sandboxes keep running (crash-only); pooled ones,
        never handed out, are closed."""
        if self.pool.active:
            await self.pool.close()
        fncall = getattr(self, "_fncall_manager", None)
        if fncall is not None:
            # pooled fncall containers serve only this process's pools: they go with it
            with contextlib.suppress(Exception):
                await fncall.close()
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reaper
            self._reaper = None
        for c in list(self._clients.values()):
            with contextlib.suppress(Exception):
                await c.close()
        self._clients.clear()
        self._started = False

    async def __aenter__(self) -> Node:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _install_guest_agent(self) -> None:
        # a stable copy under SHOAL_HOME: rebuilding the repo never swaps the binary under live sandboxes
        src = find_agent_binary()
        self.guest_dir.mkdir(parents=True, exist_ok=True)
        dst = self.guest_dir / "shoal-agent"
        if dst.exists() and dst.stat().st_size == src.stat().st_size and sha256_file(dst) == sha256_file(src):
            return
        tmp = self.guest_dir / f".shoal-agent.{os.getpid()}"
        shutil.copy2(src, tmp)
        os.chmod(tmp, 0o755)
        os.rename(tmp, dst)

    @property
    def runtime_statuses(self) -> dict[str, RuntimeStatus]:
        """Which OCI runtimes work here (probed once per boot)."""
        if self._statuses is None:
            self._statuses = probe_runtimes(self.paths, self.guest_dir / "shoal-agent")
        return self._statuses

    def network(self) -> Any:
        """The node's network manager (veth + NAT), created on first use."""
        if self._network is None:
            from shoal.node.network import NetworkManager

            self._network = NetworkManager(self.paths)
        return self._network

    def backend(self, name: str) -> Backend:
        """The backend object for `name`, created on first use."""
        if name not in self._backends:
            if name == "container":
                self._backends[name] = ContainerBackend(
                    self.paths, self.layer_mounts, self.runtime_statuses, self.guest_dir,
                    self.config.runtime, network=self.network())
            elif name in ("microvm", "vm"):
                try:
                    from shoal.backends.vm import make_vm_backend
                except ImportError:
                    raise BackendUnavailable(f"the {name} backend is not available in this build") from None
                self._backends[name] = make_vm_backend(name, self)
            else:
                raise BackendUnavailable(f"backend {name!r} cannot host sandboxes directly; use run_code for fncall")
        return self._backends[name]

    # ---- records ------------------------------------------------------------------------------
    def _record(self, sandbox_id: str) -> SandboxRecord:
        check_sandbox_id(sandbox_id)
        return SandboxRecord.load(self.paths.sandboxes / sandbox_id)

    @contextlib.contextmanager
    def _sandbox_lock(self, sandbox_id: str) -> Iterator[None]:
        # host-wide: another process (CLI, server) may act on the same sandbox
        fd = os.open(self.paths.locks / f"sb-{sandbox_id}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _info(self, rec: SandboxRecord) -> SandboxInfo:
        extra: dict[str, Any] = {}
        with contextlib.suppress(Exception):
            extra = self.backend(rec.backend).info(rec)
        return SandboxInfo(id=rec.id, image=rec.image, backend=rec.backend, state=rec.state,
                           created_at=rec.created_at, spec=rec.spec, runtime=rec.runtime,
                           expires_at=rec.expires_at, labels=rec.labels, node=self.config.node_id,
                           extra=extra)

    # ---- admission ----------------------------------------------------------------------------
    def _admit(self, spec: SandboxSpec) -> None:
        from shoal.node.admission import check_admission

        check_admission(self, spec)

    # ---- create / close -----------------------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        """Create one sandbox and wait until its agent answers (or hand out one from a warm pool)."""
        validate_spec(spec)
        image = await self.resolve_image(spec.image)
        if self.pool.active:
            hit = await self.pool.take(spec, image)
            if hit is not None:
                return hit
        return await self._create(spec, image)

    async def resolve_image(self, ref: str) -> Image:
        """Resolve an image for a create, after a bounded probe of the store (StoreUnavailable when it
        does not answer), off the event loop: a hung shared filesystem never blocks the node agent."""
        def go() -> Image:
            self.store_health.check()
            return self.store.resolve(ref)

        return await asyncio.to_thread(go)

    def set_warm_pool(self, spec: SandboxSpec, size: int) -> str:
        """Keep `size` sandboxes of `spec` ready for create() (0 removes the pool). See shoal.node.pool."""
        return self.pool.configure(spec, size)

    async def _create(self, spec: SandboxSpec, image: Image, extra: dict[str, Any] | None = None) -> SandboxInfo:
        self._admit(spec)
        backend = self.backend(spec.backend)
        sid = new_sandbox_id(self.config.node_id)
        d = self.paths.sandboxes / sid
        make_dir = getattr(backend, "make_dir", None)  # containers: a symlink into a tmpfs (node.volatile)
        make_dir(d) if make_dir is not None else d.mkdir()
        owner_pid, owner_start = my_identity()
        now = time.time()
        rec = SandboxRecord(
            id=sid, backend=spec.backend, image=image.ref, image_digest=image.digest,
            layers=[lay.hex for lay in image.layers], spec=_spec_dict(spec), dir=str(d),
            owner_pid=owner_pid, owner_start=owner_start, created_at=now,
            expires_at=(now + float(spec.ttl_s)) if spec.ttl_s else None,
            project=spec.project, labels=dict(spec.labels),
            extra={"workdir": image.config.workdir, "user": image.config.user, **(extra or {})})
        self._committed_mb += spec.memory_mb
        try:
            await backend.create(rec, spec, image)
        except BaseException:
            self._committed_mb -= spec.memory_mb
            raise
        try:
            client = await backend.connect(rec, timeout=30.0)
        except BaseException as e:
            self._committed_mb -= spec.memory_mb
            with contextlib.suppress(Exception):
                await backend.destroy(rec)
            if isinstance(e, ShoalError):
                raise
            raise SandboxError(f"sandbox {sid} started but its agent did not answer: {e}") from e
        self._clients[sid] = client
        rec.state = "running"
        rec.save()
        return self._info(rec)

    async def create_many(self, spec: SandboxSpec, n: int, concurrency: int | None = None,
                          on_done: Callable[[SandboxInfo | ShoalError], None] | None = None,
                          ) -> list[SandboxInfo | ShoalError]:
        """Create `n` sandboxes with bounded parallelism; each item is an info or the error it met.
        `on_done` is called as each one becomes ready (or fails), e.g. to time a burst per sandbox."""
        validate_spec(spec)
        if not 1 <= int(n) <= 100_000:
            raise InvalidRequest(f"n={n} must be between 1 and 100000")
        image = await self.resolve_image(spec.image)
        sem = asyncio.Semaphore(concurrency or self.config.create_concurrency)

        async def one() -> SandboxInfo | ShoalError:
            async with sem:
                res: SandboxInfo | ShoalError
                try:
                    hit = await self.pool.take(spec, image) if self.pool.active else None
                    res = hit if hit is not None else await self._create(replace(spec), image)
                except ShoalError as e:
                    res = e
                except Exception as e:
                    res = SandboxError(f"create failed: {e}")
            if on_done is not None:
                on_done(res)
            return res

        return list(await asyncio.gather(*(one() for _ in range(int(n)))))

    async def close(self, sandbox_id: str) -> None:
        """Destroy a sandbox and everything it had on the host."""
        rec = self._record(sandbox_id)
        client = self._clients.pop(sandbox_id, None)
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()
        from shoal.node.statelock import sandbox_state_lock

        # the loop-safe lock: a blocking flock here would deadlock against a pause/snapshot in progress
        async with sandbox_state_lock(self, sandbox_id):
            try:
                rec = self._record(sandbox_id)
            except SandboxNotFound:
                return  # someone else closed it meanwhile
            rec.state = "stopping"
            with contextlib.suppress(OSError):
                rec.save()
            try:
                await self.backend(rec.backend).destroy(rec)
            finally:
                self._committed_mb = max(0, self._committed_mb - int(rec.spec.get("memory_mb", 0)))
        with contextlib.suppress(FileNotFoundError):
            (self.paths.locks / f"sb-{sandbox_id}.lock").unlink()
        if rec.extra.get("forked"):
            await asyncio.to_thread(self._drop_fork_snapshots, rec)

    def _drop_fork_snapshots(self, rec: SandboxRecord) -> None:
        """Untag the snapshots that fork(n) made of this sandbox under their automatic names
        (`forks/<id>:…`, or a project's `projects/<p>/forks/<id>:…`): an RL loop forking every step would
        otherwise grow the store without end. Live children keep their layers (gc never removes a
        layer a sandbox uses); snapshots forked under a name of the caller's choosing stay."""
        from shoal.node.snapshot import fork_image_prefix

        for name in (fork_image_prefix(rec.id), f"projects/{rec.project}/{fork_image_prefix(rec.id)}"):
            try:
                self.store.remove_name(name)
            except OSError as e:  # a shared store that is briefly unavailable: gc can still do it later
                log.warning("could not untag the fork snapshots of %s: %s", rec.id, e)

    async def close_all(self, project: str | None = None) -> int:
        """Close every sandbox (of one project); returns how many were closed."""
        recs = [r for r in list_records(self.paths.sandboxes) if project is None or r.project == project]
        results = await asyncio.gather(*(self.close(r.id) for r in recs), return_exceptions=True)
        errs = [r for r in results if isinstance(r, BaseException) and not isinstance(r, SandboxNotFound)]
        if errs:
            raise errs[0]
        return len(recs)

    # ---- queries ------------------------------------------------------------------------------
    async def get(self, sandbox_id: str) -> SandboxInfo:
        """Info about one sandbox; SandboxNotFound when it does not exist."""
        return self._info(self._record(sandbox_id))

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
            out.append(self._info(rec))
        return out

    def record(self, sandbox_id: str) -> SandboxRecord:
        """The on-disk record of a sandbox (for backends and the API server)."""
        return self._record(sandbox_id)

    # ---- reaching the agent -------------------------------------------------------------------
    async def client(self, sandbox_id: str, rec: SandboxRecord | None = None) -> AgentClient:
        """A live connection to the sandbox's agent, resuming the sandbox first if it is paused."""
        rec = rec or self._record(sandbox_id)
        if rec.state == "paused":
            # a request to a paused sandbox resumes it transparently
            await self.resume(sandbox_id)
            rec = self._record(sandbox_id)
        c = self._clients.get(sandbox_id)
        if c is not None and not c.closed:
            return c
        lock = self._client_locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            c = self._clients.get(sandbox_id)
            if c is not None and not c.closed:
                return c
            if rec.state != "running":
                raise SandboxError(f"sandbox {sandbox_id} is {rec.state}, not running")
            backend = self.backend(rec.backend)
            if not backend.alive(rec):
                raise SandboxError(f"sandbox {sandbox_id} has died (its init process is gone); close it")
            c = await backend.connect(rec, timeout=10.0)
            self._clients[sandbox_id] = c
            return c

    async def _call(self, rec: SandboxRecord, fn: Any) -> Any:
        """Run `fn(client)`; a lost connection is reported as the sandbox having died, when it has."""
        c = await self.client(rec.id, rec)
        try:
            return await fn(c)
        except SandboxError as e:
            if not getattr(c, "closed", False):
                raise
            self._clients.pop(rec.id, None)
            if not self.backend(rec.backend).alive(rec):
                raise SandboxError(f"sandbox {rec.id} died: {e}") from e
            raise

    def _argv(self, cmd: str | list[str]) -> list[str]:
        if isinstance(cmd, str):
            if not cmd.strip():
                raise InvalidRequest("command is empty")
            return ["/bin/sh", "-c", cmd] if self.config.posix_sh else ["/bin/bash", "-c", cmd]
        if not cmd or not all(isinstance(a, str) for a in cmd):
            raise InvalidRequest("command must be a non-empty string or list of strings")
        return list(cmd)

    def _exec_defaults(self, rec: SandboxRecord, cwd: str | None, user: str | None) -> tuple[str, str | None]:
        spec = rec.spec
        return (cwd or spec.get("workdir") or rec.extra.get("workdir") or "/",
                user or spec.get("user") or rec.extra.get("user") or None)

    async def exec(self, sandbox_id: str, cmd: str | list[str], *, timeout: float | None = DEFAULT_EXEC_TIMEOUT,
                   cwd: str | None = None, env: dict[str, str] | None = None, user: str | None = None,
                   stdin: bytes | None = None, max_output: int | None = None) -> ExecResult:
        """Run a command to completion in the sandbox."""
        argv = self._argv(cmd)
        rec = self._record(sandbox_id)
        cwd, user = self._exec_defaults(rec, cwd, user)
        cap = rec.spec.get("max_output_bytes", 1 << 20) if max_output is None else max_output
        _check_timeout(timeout)
        return await self._call(rec, lambda c: c.exec(
            argv, env=env, cwd=cwd, user=user, timeout=timeout, max_output=cap, stdin=stdin))

    async def stream(self, sandbox_id: str, cmd: str | list[str], *, timeout: float | None = DEFAULT_EXEC_TIMEOUT,
                     cwd: str | None = None, env: dict[str, str] | None = None, user: str | None = None,
                     tty: bool = False, stdin: bool = False) -> Any:
        """Start a command and return its stream handle (async iterator of StreamEvent)."""
        argv = self._argv(cmd)
        rec = self._record(sandbox_id)
        cwd, user = self._exec_defaults(rec, cwd, user)
        _check_timeout(timeout)
        cap = rec.spec.get("max_output_bytes", 1 << 20)
        c = await self.client(sandbox_id, rec)
        return await c.exec_stream(argv, env=env, cwd=cwd, user=user, timeout=timeout, max_output=cap,
                                   tty=tty, stdin=stdin)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        """Read a whole file from the sandbox (relative paths start at the sandbox's workdir)."""
        rec = self._record(sandbox_id)
        path = self._abspath(rec, path)
        return await self._call(rec, lambda c: c.read_file(path, limit=self.config.max_file_bytes))

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file in the sandbox (atomically; parent directories are created)."""
        rec = self._record(sandbox_id)
        path = self._abspath(rec, path)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidRequest("data must be bytes")
        if len(data) > self.config.max_file_bytes:
            raise InvalidRequest(f"file too large ({len(data)} bytes > {self.config.max_file_bytes})")
        await self._call(rec, lambda c: c.write_file(path, bytes(data), mode=mode))

    async def list_dir(self, sandbox_id: str, path: str) -> list[DirEntry]:
        """List a directory in the sandbox."""
        rec = self._record(sandbox_id)
        path = self._abspath(rec, path)
        return await self._call(rec, lambda c: c.list_dir(path))

    def _abspath(self, rec: SandboxRecord, path: str) -> str:
        if isinstance(path, str) and path and not path.startswith("/"):
            path = self._exec_defaults(rec, None, None)[0].rstrip("/") + "/" + path
        _check_path(path)
        return path

    # ---- shells -------------------------------------------------------------------------------
    async def shell_open(self, sandbox_id: str, *, cwd: str | None = None, env: dict[str, str] | None = None,
                         user: str | None = None) -> str:
        """Start a persistent bash session in the sandbox; returns its id."""
        rec = self._record(sandbox_id)
        cwd, user = self._exec_defaults(rec, cwd, user)
        return await self._call(rec, lambda c: c.shell_open(cwd=cwd, env=env, user=user))

    async def shell_run(self, sandbox_id: str, shell_id: str, cmd: str, *,
                        timeout: float | None = DEFAULT_EXEC_TIMEOUT, max_output: int | None = None) -> ExecResult:
        """Run one command in a shell session; state (cwd, env, functions) carries over."""
        if not isinstance(cmd, str):
            raise InvalidRequest("shell commands are strings")
        _check_timeout(timeout)
        rec = self._record(sandbox_id)
        cap = rec.spec.get("max_output_bytes", 1 << 20) if max_output is None else max_output
        return await self._call(rec, lambda c: c.shell_run(shell_id, cmd, timeout=timeout, max_output=cap))

    async def shell_close(self, sandbox_id: str, shell_id: str) -> None:
        """End a shell session and its processes."""
        rec = self._record(sandbox_id)
        await self._call(rec, lambda c: c.shell_close(shell_id))

    # ---- pause / resume -----------------------------------------------------------------------
    async def pause(self, sandbox_id: str, reclaim: bool | None = None) -> None:
        """Freeze the sandbox, then reclaim its memory (see shoal.node.reclaim; `reclaim=None`: the config's)."""
        from shoal.node.reclaim import reclaim_paused
        from shoal.node.statelock import sandbox_state_lock

        self._record(sandbox_id)  # SandboxNotFound before any lock file is made
        async with sandbox_state_lock(self, sandbox_id):
            rec = self._record(sandbox_id)
            if rec.state == "paused":
                return
            if rec.state != "running":
                raise SandboxError(f"cannot pause sandbox {sandbox_id}: it is {rec.state}")
            await self.backend(rec.backend).pause(rec)
            rec.state = "paused"
            rec.extra["paused_at"] = time.time()
            rec.save()
            if (self.config.reclaim_on_pause if reclaim is None else reclaim) and rec.cgroup \
                    and rec.backend == "container":
                rec.extra["reclaim"] = await reclaim_paused(rec.cgroup, rec.path,
                                                            prefetch=self.config.prefetch_on_resume)
                rec.save()

    async def resume(self, sandbox_id: str, prefetch: bool | None = None) -> None:
        """Read the paused sandbox's working set back in (see shoal.node.reclaim), then thaw it."""
        from shoal.node.reclaim import drop_working_set, prefetch_before_thaw
        from shoal.node.statelock import sandbox_state_lock

        self._record(sandbox_id)  # SandboxNotFound before any lock file is made
        async with sandbox_state_lock(self, sandbox_id):
            rec = self._record(sandbox_id)
            if rec.state != "paused":
                return
            fetched: dict[str, Any] = {}
            if self.config.prefetch_on_resume if prefetch is None else prefetch:
                fetched = await prefetch_before_thaw(rec.path)
            t0 = time.monotonic()
            await self.backend(rec.backend).resume(rec)
            drop_working_set(rec.path)
            rec.state = "running"
            rec.extra.pop("paused_by", None)
            rec.extra["resume"] = dict(fetched, thaw_s=round(time.monotonic() - t0, 4), at=time.time())
            rec.save()

    # ---- snapshot / fork / fncall (filled in by their modules) ---------------------------------
    async def snapshot(self, sandbox_id: str, name: str, *, store_budget: int | None = None) -> dict[str, Any]:
        """Pack the sandbox's writable layer into a new image (see shoal.node.snapshot); `store_budget`:
        the most bytes the new layer may take (a project's store quota)."""
        from shoal.node.snapshot import snapshot_sandbox

        return await snapshot_sandbox(self, sandbox_id, name, store_budget=store_budget)

    async def fork(self, sandbox_id: str, n: int, **kw: Any) -> list[SandboxInfo | ShoalError]:
        """`n` children from a fresh snapshot of the sandbox."""
        from shoal.node.snapshot import fork_sandbox

        return await fork_sandbox(self, sandbox_id, n, **kw)

    async def run_code(self, code: str, **kw: Any) -> Any:
        """Run a snippet on the fncall backend's warm pool."""
        try:
            from shoal.backends.fncall import get_pool_manager
        except ImportError:
            raise BackendUnavailable("the fncall backend is not available in this build") from None
        return await get_pool_manager(self).run_code(code, **kw)

    async def run_code_many(self, items: list[Any], **kw: Any) -> list[Any]:
        """Run many snippets on the fncall backend; one result per item, in order."""
        try:
            from shoal.backends.fncall import get_pool_manager
        except ImportError:
            raise BackendUnavailable("the fncall backend is not available in this build") from None
        return await get_pool_manager(self).run_code_many(items, **kw)

    # ---- reaping and crash recovery -----------------------------------------------------------
    async def reconcile(self) -> dict[str, int]:
        """Re-adopt live sandboxes left by earlier processes; clean up dead, expired and half-made ones."""
        adopted = cleaned = 0
        live_ids = set()
        for rec in list_records(self.paths.sandboxes):
            dead = False
            if rec.state in ("creating", "stopping"):
                dead = not rec.owner_alive() or rec.state == "stopping"
                if rec.state == "creating" and not dead:
                    live_ids.add(rec.id)
                    continue
            elif rec.state in ("running", "paused"):
                try:
                    dead = not self.backend(rec.backend).alive(rec)
                except ShoalError:
                    dead = False
            if rec.extra.get("pool") and not rec.owner_alive():
                dead = True  # a warm sandbox of a node process that is gone: nobody will hand it out
            if dead:
                with contextlib.suppress(Exception):
                    await self.close(rec.id)
                cleaned += 1
            else:
                live_ids.add(rec.id)
                adopted += 1
        # leftover directories without a record (crash between mkdir and the first save)
        from shoal.node.volatile import remove_sandbox_dir

        for entry in os.scandir(self.paths.sandboxes):
            if entry.is_symlink() and not os.path.exists(entry.path):
                # its directory was on the node's tmpfs, gone with a reboot
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
            elif entry.is_dir() and not (Path(entry.path) / "record.json").exists():
                age = time.time() - entry.stat().st_mtime
                if age > 60:
                    from shoal.host import syscalls

                    # a half-made container sandbox may have its overlay mounted
                    for mp in syscalls.mounts_under(entry.path):
                        with contextlib.suppress(OSError):
                            syscalls.umount(mp, detach=True)
                    if not syscalls.mounts_under(entry.path):
                        remove_sandbox_dir(Path(entry.path))
        with contextlib.suppress(Exception):
            from shoal.node.disk import UpperPool

            # writable layers whose sandbox directory is gone (crash before the first record, reboot)
            UpperPool(self.paths).sweep_orphans(self.paths.sandboxes)
        with contextlib.suppress(Exception):
            self.layer_mounts.reconcile(live_ids)
        self._committed_mb = sum(int(r.spec.get("memory_mb", 0)) for r in list_records(self.paths.sandboxes)
                                 if r.id in live_ids)
        return {"adopted": adopted, "cleaned": cleaned}

    async def reap_once(self) -> int:
        """Close sandboxes past their TTL and sandboxes whose init died. Returns how many were closed."""
        n = 0
        now = time.time()
        for rec in list_records(self.paths.sandboxes):
            expired = rec.expires_at is not None and now >= rec.expires_at
            dead = rec.state in ("running", "paused") and not self._alive_safe(rec)
            if (expired and rec.state in ("running", "paused", "failed")) or dead:
                with contextlib.suppress(SandboxNotFound):
                    try:
                        await self.close(rec.id)
                        n += 1
                    except ShoalError:
                        pass
        return n

    def _alive_safe(self, rec: SandboxRecord) -> bool:
        try:
            return self.backend(rec.backend).alive(rec)
        except ShoalError:
            return True

    async def _heartbeat_leases(self, force: bool = False) -> None:
        """Renew this node's store leases (mounted layers) every SHOAL_LEASE_HEARTBEAT_S, so gc on other
        nodes can tell this node is alive (shoal.images.leases)."""
        from shoal.images.leases import heartbeat_s

        now = time.monotonic()
        if not force and now - self._leases_renewed < heartbeat_s():
            return
        self._leases_renewed = now
        await asyncio.to_thread(self.layer_mounts.renew_leases)

    async def _reap_loop(self) -> None:
        pause = self.config.reap_interval_s
        while True:
            await asyncio.sleep(pause)
            t0 = time.monotonic()
            with contextlib.suppress(Exception):
                await self.reap_once()
            with contextlib.suppress(Exception):
                await self._heartbeat_leases()
            # a scan reads every record: with thousands of sandboxes, keep it under ~5% of one core
            pause = max(self.config.reap_interval_s, 20 * (time.monotonic() - t0))


def _raise_nofile() -> None:
    # one agent connection per live sandbox: 5,000 sandboxes need more than the usual soft limit of 1,024
    import resource

    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _spec_dict(spec: SandboxSpec) -> dict[str, Any]:
    # what dataclasses.asdict gives for this flat spec, without its recursive deep copy
    return {**vars(spec), "env": dict(spec.env), "labels": dict(spec.labels)}


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not (0 < float(timeout) <= 7 * 86400):
        raise InvalidRequest(f"timeout={timeout!r} must be positive seconds (at most 7 days) or None")


def _check_path(path: str) -> None:
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidRequest(f"path {path!r} must be an absolute path inside the sandbox")
    if len(path) > 4096:
        raise InvalidRequest("path longer than 4096 bytes")


async def aiter_events(handle: Any) -> AsyncIterator[StreamEvent]:
    """Iterate a stream handle (helper for transports)."""
    async for ev in handle:
        yield ev
