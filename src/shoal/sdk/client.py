"""The async client: `async with shoal.Client() as client: sb = await client.create("base")`."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
from typing import TYPE_CHECKING, Any

from shoal.errors import ShoalError
from shoal.models import SandboxInfo
from shoal.sdk.sandbox import Sandbox
from shoal.sdk.transport import Transport

if TYPE_CHECKING:
    from shoal.node.events import SandboxEvent
    from shoal.sdk.jobs import Job
    from shoal.spec import SandboxSpec


class Client:
    """Entry point of the SDK.

    `Client()` embeds a node agent in this process; `Client("http://host:8700", token=...)` talks to
    `shoal serve`; `Client("ray://ADDR")` drives every node agent of a Ray cluster (see docs/cluster.md).
    All have the same surface. Sandboxes created through a client are closed when the
    client closes, unless `keep=True` (they then live until closed or their TTL passes).
    """

    def __init__(self, url: str | None = None, *, token: str | None = None, transport: Transport | None = None,
                 home: str | None = None, store: str | None = None, keep: bool = False,
                 timeout: float = 600.0) -> None:
        if transport is None:
            if url and url.startswith("ray://"):
                from shoal.cluster.transport import ClusterTransport

                transport = ClusterTransport(url, timeout=timeout)
            elif url:
                from shoal.sdk.http import HttpTransport

                transport = HttpTransport(url, token=token, timeout=timeout)
            else:
                from shoal.sdk.local import LocalTransport

                transport = LocalTransport(home=home, store=store)
        self._transport = transport
        self._keep = keep
        self._owned: set[str] = set()
        self._started = False
        self._start_lock = asyncio.Lock()

    async def _ensure(self) -> Transport:
        if not self._started:
            async with self._start_lock:
                if not self._started:
                    await self._transport.start()
                    self._started = True
        return self._transport

    @property
    def transport(self) -> Transport:
        """The transport under this client (LocalTransport exposes `.node`)."""
        return self._transport

    async def __aenter__(self) -> Client:
        await self._ensure()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close sandboxes this client created (unless keep=True), then the transport."""
        if not self._started:
            return
        if not self._keep and self._owned:
            await asyncio.gather(*(self._close_quietly(sid) for sid in list(self._owned)))
        self._owned.clear()
        await self._transport.aclose()
        self._started = False

    async def _close_quietly(self, sid: str) -> None:
        with contextlib.suppress(ShoalError):
            await self._transport.close(sid)

    @staticmethod
    def _spec(image: str, kw: dict[str, Any]) -> SandboxSpec:
        from shoal.spec import SandboxSpec  # loads pydantic: not before the first create

        return SandboxSpec.from_options(image, **kw)

    async def create(self, image: str = "base", **kw: Any) -> Sandbox:
        """Create one sandbox (options: backend, runtime, cpus, memory_mb, pids, disk_mb, network, ttl_s,
        env, labels, workdir, user, hostname, max_output_bytes)."""
        t = await self._ensure()
        info = await t.create(self._spec(image, kw))
        self._owned.add(info.id)
        return Sandbox(self, info)

    async def create_many(self, image: str = "base", n: int = 1, *, all_or_nothing: bool = False,
                          return_errors: bool = True, **kw: Any) -> list[Sandbox | ShoalError]:
        """Create a burst of `n` sandboxes; each item is a Sandbox or the error that one met.

        `all_or_nothing=True` (gang admission): capacity for all `n` is reserved before any sandbox starts,
        or the call fails at once with `GangUnsatisfiable` (its `available` says how many fit); if one of
        them then fails to start, the others are closed and that error is raised."""
        t = await self._ensure()
        spec = self._spec(image, kw)
        if all_or_nothing:
            items = await t.create_many(spec, n, all_or_nothing=True)
        else:
            items = await t.create_many(spec, n)
        out: list[Sandbox | ShoalError] = []
        for it in items:
            if isinstance(it, SandboxInfo):
                self._owned.add(it.id)
                out.append(Sandbox(self, it))
            else:
                out.append(it)
        if not return_errors:
            errs = [e for e in out if isinstance(e, ShoalError)]
            if errs:
                raise errs[0]
        return out

    async def restore(self, name: str, n: int = 1, *, backend: str = "microvm") -> list[Sandbox]:
        """`n` new sandboxes resumed from the named VM memory snapshot (`snapshot(memory=True)` or
        `shoal vm snapshot`) of the node that took it; over HTTP an admin token's. If any fails, the first
        error is raised (the ones that were made stay owned by the client and close with it)."""
        t = await self._ensure()
        items = await t.restore(name, n, backend=backend)
        out: list[Sandbox] = []
        for it in items:
            if isinstance(it, SandboxInfo):
                self._owned.add(it.id)
                out.append(Sandbox(self, it))
        for it in items:
            if isinstance(it, ShoalError):
                raise it
        return out

    def job(self, name: str, *, priority: str | None = None, max_sandboxes: int | None = None,
            weight: float | None = None) -> Job:
        """A job: its sandboxes carry its name, priority class (train-rollout > eval > interactive > batch),
        cap on live sandboxes and fair-share weight (see shoal.sdk.jobs and docs/scheduling.md)."""
        from shoal.sdk.jobs import Job

        return Job(self, name, priority=priority, max_sandboxes=max_sandboxes, weight=weight)

    async def get(self, sandbox_id: str) -> Sandbox:
        """A handle to an existing sandbox (created by any client or process)."""
        t = await self._ensure()
        return Sandbox(self, await t.get(sandbox_id))

    async def list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        """Every sandbox visible to this client (optionally matching all `labels`)."""
        t = await self._ensure()
        return await t.list(labels=labels)

    async def images(self) -> builtins.list[dict[str, Any]]:
        """Images in the store."""
        t = await self._ensure()
        return await t.images()

    async def image(self, ref: str) -> dict[str, Any]:
        """One image: {"name", "tag", "digest", "layers", "config": {entrypoint, cmd, env, workdir, user,
        labels, exposed_ports, healthcheck, …}, "lineage"}; ImageNotFound when it is not there."""
        t = await self._ensure()
        return await t.image(ref)

    async def build_image(self, tag: str, context: str = ".", *, dockerfile: str | None = None,
                          build_args: dict[str, str] | None = None, target: str | None = None,
                          no_cache: bool = False, platform: str | None = None,
                          from_map: dict[str, str] | None = None, network: bool | builtins.list[str] = True,
                          log: Any = None) -> dict[str, Any]:
        """`docker build -t TAG [-f DOCKERFILE] [--build-arg K=V] [--target T] [--no-cache] CONTEXT`: build a
        Dockerfile into image `tag` where the sandboxes run (a server gets the context as a tarball, after
        .dockerignore). Returns {"image": {...}, "stages", "steps_run", "steps_cached", "seconds", "warnings"}.
        `from_map` (FROM names -> images) works on an embedded node; `network` is RUN's: True, False or egress
        rules (embedded node); `log` (a callable) gets its build lines."""
        t = await self._ensure()
        opts: dict[str, Any] = {"dockerfile": dockerfile, "build_args": dict(build_args or {}), "target": target,
                                "no_cache": no_cache, "platform": platform, "network": network}
        if from_map:
            opts["from_map"] = dict(from_map)
        if log is not None:
            opts["log"] = log
        return await t.build_image(tag, str(context), **opts)

    async def pull(self, reference: str) -> dict[str, Any]:
        """Pull an image from its registry into the store now, like `docker pull` (creates pull what they lack
        by themselves, per the `pull_policy` setting). Returns the pull's report: the image, layers fetched
        and already in the store, bytes fetched. Raises ImageNotFound, RegistryAuthFailed or
        RegistryUnavailable."""
        t = await self._ensure()
        return await t.pull(reference)

    async def export_image(self, image: str, path: str, *, tags: builtins.list[str] | None = None) -> None:
        """Write an image as a docker-archive to the local file `path` (`docker load -i path` reads it); over
        HTTP the server makes the archive and this client downloads it."""
        t = await self._ensure()
        await t.export_image(image, path, tags)

    async def push(self, image: str, target: str) -> dict[str, Any]:
        """Push an image of the store to a registry (`target`: registry/repository:tag); blobs the registry has
        are not uploaded. Over HTTP it needs an admin token (the server pushes with its credentials)."""
        t = await self._ensure()
        return await t.push(image, target)

    async def events(self, sandbox_id: str | None = None, *, commands: bool = False,
                     kinds: builtins.list[str] | None = None, since: float | None = None,
                     limit: int = 200) -> builtins.list[SandboxEvent]:
        """The event log: a sandbox's lifecycle events (created, paused, resumed, oom, timeout, lost, closed),
        or with `commands` the commands it ran (exit code, duration); without a sandbox, the newest events of
        every sandbox this client may see. Oldest first; readable after a sandbox was closed."""
        t = await self._ensure()
        return await t.events(sandbox_id, commands=commands, kinds=kinds, since=since, limit=limit)

    async def run_code(self, code: str, language: str = "python", **kw: Any) -> Any:
        """Run a short snippet on the fncall backend (a warm pool; no sandbox to manage)."""
        t = await self._ensure()
        return await t.run_code(code, language=language, **kw)

    async def run_code_many(self, items: builtins.list[Any], **kw: Any) -> builtins.list[Any]:
        """Run many snippets concurrently on the fncall backend; one RunCodeResult per item, in order.

        Items are code strings or dicts of run_code arguments; keyword arguments (language, timeout,
        concurrency ...) apply to every item. A bad item gets a result with status "error", never an exception.
        """
        t = await self._ensure()
        return await t.run_code_many(list(items), **kw)
