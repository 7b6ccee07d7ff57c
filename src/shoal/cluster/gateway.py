"""`shoal serve --cluster ray://ADDR`: the HTTP API over a whole Ray cluster.

The API app is the same as `shoal serve`'s; in place of an embedded Node it gets a `ClusterFront`, which
offers what the routes use of a node and carries each call to the sandbox's node through a
`ClusterTransport` (placement, routing by ID, failure handling). Tokens, projects and quotas are the
gateway's: tokens live in its SHOAL_HOME, quotas count every sandbox of the cluster, from a usage snapshot
of all nodes refreshed in the background. Nothing lives only in the gateway's memory: a restarted
gateway rebuilds the snapshot (and its cache of who owns which sandbox) from the nodes before serving.

The gateway reads images from the shared store (`SHOAL_STORE`): run it where the store is mounted. Image
operations that need only the store (list, look up, remove, import, export, push) run here on it
(`shoal.images.frontops.StoreImages`); a registry pull and a recipe or `base` build go to one node agent
(they write into the same shared store); a Dockerfile build (its context is on the gateway) is not relayed.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from shoal.cluster.transport import ClusterTransport
from shoal.config import Paths
from shoal.errors import SandboxNotFound, ShoalError, Unsupported
from shoal.images.frontops import StoreImages
from shoal.images.store import Image, ImageStore
from shoal.models import DirEntry, ExecResult, SandboxInfo, SandboxSpec
from shoal.records import check_sandbox_id, node_of

if TYPE_CHECKING:
    from collections.abc import Callable

    from shoal.backends.fncall import FncallManager
    from shoal.images.dockerbuild import BuildOptions, BuildResult
    from shoal.images.recipe import Recipe

log = logging.getLogger(__name__)
#: seconds between usage snapshots of every node (cluster-wide quotas)
USAGE_EVERY_S = 2.0
#: sandbox owners remembered (project, spec) without asking their node again
_OWNER_CACHE = 200_000


@dataclass
class SandboxOwner:
    """What the routes read of a sandbox's record: its project and spec."""

    id: str
    project: str
    spec: SandboxSpec
    state: str = "running"


@dataclass
class _Config:
    node_id: str = "gateway"


class _ShellStreams:
    """A gateway's `client(id)` (shoal.front.SandboxClient): shell commands streamed from the owner node; the
    agent's file-system calls are not relayed (Unsupported)."""

    def __init__(self, transport: ClusterTransport, sandbox_id: str) -> None:
        self.t, self.sid = transport, sandbox_id

    async def shell_run_stream(self, shell_id: str, cmd: str, *, timeout: float | None = None,
                               max_output: int | None = None) -> Any:
        """Stream a shell command from the sandbox's node."""
        return await self.t.shell_stream(self.sid, shell_id, cmd, timeout=timeout, max_output=max_output)

    def _unrelayed(self, what: str) -> Unsupported:
        return Unsupported(f"{what} in sandbox {self.sid!r} is an agent call on its node: a cluster gateway does not "
                           "relay it; use that node's server")

    async def stat(self, path: str) -> dict[str, Any]:
        """Not through a cluster gateway."""
        raise self._unrelayed(f"stat of {path!r}")

    async def mkdir(self, path: str, parents: bool = True, mode: int = 0o755) -> None:
        """Not through a cluster gateway."""
        raise self._unrelayed(f"mkdir of {path!r}")

    async def remove(self, path: str, recursive: bool = False) -> None:
        """Not through a cluster gateway."""
        raise self._unrelayed(f"removing {path!r}")


class ClusterFront(StoreImages):
    """The node side of the API app, for a whole cluster (see the module doc). Implements the front protocol
    (shoal.front.Front); what only an embedded node can do raises Unsupported, saying so."""

    #: shoal.front.Front.kind: the node agents hold the records
    kind: Literal["node", "cluster"] = "cluster"

    def __init__(self, url: str, *, home: str | None = None, store: str | None = None,
                 usage_every_s: float = USAGE_EVERY_S) -> None:
        self.transport = ClusterTransport(url)
        self.url = url
        self.paths = Paths.from_env(home, store)
        self.config = _Config()
        self.store = ImageStore(self.paths.store)
        self.usage_every_s = usage_every_s
        self._owners: OrderedDict[str, SandboxOwner] = OrderedDict()
        self._usage: tuple[float, list[tuple[str, str, float, int]]] = (0.0, [])
        self._usage_task: asyncio.Task[None] | None = None
        #: creates of one spec waiting to be placed together (see create)
        self._coalescing: dict[str, list[asyncio.Future[SandboxInfo]]] = {}
        self._bursts: set[asyncio.Task[None]] = set()

    # ---- lifecycle ------------------------------------------------------------------------------
    async def start(self, reap: bool = True) -> ClusterFront:
        """Connect to the cluster and take the first usage snapshot (before any request is served)."""
        await self.transport.start()
        await self.refresh_usage()
        self._usage_task = asyncio.create_task(self._usage_loop(), name="shoal-gateway-usage")
        return self

    async def stop(self) -> None:
        """Stop the background snapshot; sandboxes keep running on their nodes."""
        if self._usage_task is not None:
            self._usage_task.cancel()
            with contextlib.suppress(BaseException):
                await self._usage_task
            self._usage_task = None
        await self.transport.aclose()

    # ---- cluster-wide usage (quotas) ------------------------------------------------------------
    def usage_snapshot(self) -> tuple[float, list[tuple[str, str, float, int]]]:
        """The latest (taken_at, [(id, project, cpus, memory_mb)]) of every live sandbox of the cluster."""
        return self._usage

    async def refresh_usage(self) -> None:
        """Ask every node what its sandboxes hold (one Ray call per node, concurrently)."""
        taken = time.monotonic()
        states = await self.transport.states(max_age_s=0.0)
        nids = [s["node_id"] for s in states]
        got = await asyncio.gather(*(self._usage_of(nid) for nid in nids))
        entries = []
        for rows in got:
            for sid, project, cpus, mem, state, spec in rows:
                if state in ("stopped", "stopping"):
                    continue
                entries.append((sid, project, cpus, mem))
                self._remember(SandboxOwner(sid, project, SandboxSpec.from_wire(spec), state))
        self._usage = (taken, entries)

    async def _usage_of(self, node_id: str) -> list[tuple[Any, ...]]:
        try:
            a = await self.transport._agent(node_id)
            return list(await self.transport._ray(a.actor.usage.remote(), node_id, timeout=30.0))
        except ShoalError as e:
            log.warning("no usage from node %s this round: %s", node_id, e)
            return []

    async def _usage_loop(self) -> None:
        while True:
            await asyncio.sleep(self.usage_every_s)
            with contextlib.suppress(Exception):
                await self.refresh_usage()

    # ---- owners (project scoping) ---------------------------------------------------------------
    def _remember(self, owner: SandboxOwner) -> None:
        self._owners[owner.id] = owner
        self._owners.move_to_end(owner.id)
        while len(self._owners) > _OWNER_CACHE:
            self._owners.popitem(last=False)

    def _remember_info(self, info: SandboxInfo) -> None:
        spec = SandboxSpec.from_wire(info.spec)
        self._remember(SandboxOwner(info.id, spec.project, spec, info.state))

    def record(self, sandbox_id: str) -> SandboxOwner:
        """The owner of a sandbox this gateway knows of (SandboxNotFound otherwise: use record_async)."""
        check_sandbox_id(sandbox_id)
        own = self._owners.get(sandbox_id)
        if own is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}")
        return own

    async def record_async(self, sandbox_id: str) -> SandboxOwner:
        """The owner of a sandbox, asking its node when this gateway has not seen it yet."""
        check_sandbox_id(sandbox_id)
        own = self._owners.get(sandbox_id)
        if own is not None:
            return own
        info = await self.transport.get(sandbox_id)
        self._remember_info(info)
        return self._owners[sandbox_id]

    # ---- what the routes call -------------------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        """Place and create one sandbox somewhere in the cluster. Creates of one spec that arrive together
        (a batch request creates its items concurrently) are placed as one burst: split over the nodes
        by their room, one request per node, instead of one placement each."""
        import json

        key = json.dumps(spec.to_dict(), sort_keys=True, default=str)
        loop = asyncio.get_running_loop()
        waiting = self._coalescing.get(key)
        if waiting is None:
            waiting = self._coalescing[key] = []
            loop.call_soon(self._flush, key, spec)
        fut: asyncio.Future[SandboxInfo] = loop.create_future()
        waiting.append(fut)
        info = await fut
        self._remember_info(info)
        return info

    def _flush(self, key: str, spec: SandboxSpec) -> None:
        futs = self._coalescing.pop(key, [])
        if futs:
            t = asyncio.get_running_loop().create_task(self._create_burst(spec, futs))
            self._bursts.add(t)
            t.add_done_callback(self._bursts.discard)

    async def _create_burst(self, spec: SandboxSpec, futs: list[asyncio.Future[SandboxInfo]]) -> None:
        try:
            items: list[SandboxInfo | ShoalError] = await self.transport.create_many(spec, len(futs))
        except BaseException as e:
            for f in futs:
                if not f.done():
                    f.set_exception(e)
            return
        for f, it in zip(futs, items, strict=False):
            if f.done():  # the caller went away: do not leave its sandbox behind
                if isinstance(it, SandboxInfo):
                    with contextlib.suppress(ShoalError):
                        await self.transport.close(it.id)
            elif isinstance(it, SandboxInfo):
                f.set_result(it)
            else:
                f.set_exception(it)

    async def create_many(self, spec: SandboxSpec, n: int, concurrency: int | None = None, *,
                          all_or_nothing: bool = False) -> list[SandboxInfo | ShoalError]:
        """A burst split over the nodes (`all_or_nothing`: a gang, placed whole or not at all). `concurrency`
        bounds an embedded node's own parallelism: here each node bounds its share itself."""
        items = await self.transport.create_many(spec, n, all_or_nothing=all_or_nothing)
        for it in items:
            if isinstance(it, SandboxInfo):
                self._remember_info(it)
        return items

    async def list(self, project: str | None = None, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        """Every sandbox of the cluster (of a project)."""
        infos = await self.transport.list_all(labels=labels, project=project)
        for i in infos:
            if i.state != "lost":
                self._remember_info(i)
        return infos

    async def get(self, sandbox_id: str) -> SandboxInfo:
        """One sandbox (a lost one as state `lost`)."""
        return await self.transport.get(sandbox_id)

    async def close(self, sandbox_id: str) -> None:
        """Destroy a sandbox on its node."""
        await self.transport.close(sandbox_id)
        self._owners.pop(sandbox_id, None)

    async def exec(self, sandbox_id: str, cmd: str | list[str], **kw: Any) -> ExecResult:
        """Run a command on the sandbox's node."""
        return await self.transport.exec(sandbox_id, cmd, **kw)

    async def stream(self, sandbox_id: str, cmd: str | list[str], **kw: Any) -> Any:
        """Stream a command from the sandbox's node."""
        return await self.transport.stream(sandbox_id, cmd, **kw)

    async def client(self, sandbox_id: str) -> _ShellStreams:
        """Shell streams of a sandbox."""
        return _ShellStreams(self.transport, sandbox_id)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        """Read a file in the sandbox."""
        return await self.transport.read_file(sandbox_id, path)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file in the sandbox."""
        await self.transport.write_file(sandbox_id, path, data, mode)

    async def write_file_stream(self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes],
                                mode: int = 0o644) -> None:
        """Write a file from chunks. The cluster transport sends whole files: the gateway joins the chunks
        first, so here a file is held once in memory (the node's own write streams)."""
        data = bytearray()
        async for chunk in chunks:
            data += chunk
        await self.transport.write_file(sandbox_id, path, bytes(data), mode)

    async def list_dir(self, sandbox_id: str, path: str) -> list[DirEntry]:
        """List a directory in the sandbox."""
        return await self.transport.list_dir(sandbox_id, path)

    async def shell_open(self, sandbox_id: str, **kw: Any) -> str:
        """Open a persistent shell."""
        return await self.transport.shell_open(sandbox_id, **kw)

    async def shell_run(self, sandbox_id: str, shell_id: str, cmd: str, **kw: Any) -> ExecResult:
        """Run a command in a shell."""
        return await self.transport.shell_run(sandbox_id, shell_id, cmd, **kw)

    async def shell_close(self, sandbox_id: str, shell_id: str) -> None:
        """Close a shell."""
        await self.transport.shell_close(sandbox_id, shell_id)

    async def pause(self, sandbox_id: str) -> None:
        """Pause the sandbox."""
        await self.transport.pause(sandbox_id)

    async def resume(self, sandbox_id: str) -> None:
        """Resume the sandbox."""
        await self.transport.resume(sandbox_id)

    async def snapshot(self, sandbox_id: str, name: str, *, store_budget: int | None = None) -> dict[str, Any]:
        """Snapshot the sandbox into the shared store. A project's store budget (max_store_mb) is not relayed
        to the node yet: with one, Unsupported."""
        if store_budget is not None:
            raise Unsupported(f"a snapshot of {sandbox_id!r} under a project store quota (max_store_mb) needs the "
                              "budget on the sandbox's node: a cluster gateway does not relay it yet")
        return await self.transport.snapshot(sandbox_id, name)

    async def fork(self, sandbox_id: str, n: int, **kw: Any) -> list[SandboxInfo | ShoalError]:
        """Children of the sandbox (on its node)."""
        items = await self.transport.fork(sandbox_id, n, **kw)
        for it in items:
            if isinstance(it, SandboxInfo):
                self._remember_info(it)
        return items

    async def run_code(self, code: str, **kw: Any) -> Any:
        """A snippet on some node's fncall pool."""
        return await self.transport.run_code(code, **kw)

    async def run_code_many(self, items: list[Any], **kw: Any) -> list[Any]:
        """Snippets on some node's fncall pool."""
        return await self.transport.run_code_many(items, **kw)

    async def restore(self, name: str, n: int = 1, **kw: Any) -> builtins.list[SandboxInfo | ShoalError]:
        """Not through a cluster gateway: a VM memory snapshot lives in the SHOAL_HOME of the node that took it
        (not in the shared store), and nothing the gateway can read says which node that is."""
        raise Unsupported(f"restoring the memory snapshot {name!r} needs the node that holds it: a cluster "
                          "gateway cannot place it yet (memory snapshots stay in their node's SHOAL_HOME, not "
                          "the shared store); restore it through that node's own server (POST "
                          "/v1/sandboxes/restore) or an embedded node (shoal.Client() on that host), or fork "
                          "the running sandbox instead")

    async def set_cpu_class(self, sandbox_id: str, cpu_class: str) -> dict[str, Any]:
        """Move the sandbox to another CPU class on its node (that node's answer, errors included)."""
        return await self.transport.set_cpu_class(sandbox_id, cpu_class)

    async def resolve_image(self, ref: str, **kw: Any) -> None:
        """The nodes pull what they need: refuse here only what no node could get (ImageNotFound)."""
        from shoal.images.pull import check_available

        await asyncio.to_thread(check_available, self.store, ref)

    async def watch(self, sandbox_id: str, path: str, *, recursive: bool = False) -> Any:
        """Not through a cluster gateway yet."""
        raise Unsupported(f"watching files streams inotify events from the sandbox's node: a cluster gateway "
                          f"does not relay them (sandbox {sandbox_id!r}); use that node's server")

    async def open_port(self, sandbox_id: str, port: int, *, timeout: float | None = 10.0) -> Any:
        """Not through a cluster gateway yet."""
        raise Unsupported(f"port {port} of sandbox {sandbox_id!r} is reached through its node's own server: a "
                          "cluster gateway does not relay port streams")

    async def shell_of(self, rec: Any) -> str:
        """Not through a cluster gateway yet."""
        raise Unsupported("which shell a sandbox has is probed on its node: a cluster gateway does not relay "
                          "the probe; use that node's server")

    async def set_ttl(self, sandbox_id: str, seconds: float, *, only_extend: bool = False) -> None:
        """Not through a cluster gateway yet."""
        raise Unsupported(f"a sandbox's time to live is kept in its record on its node: a cluster gateway does "
                          f"not change it (sandbox {sandbox_id!r}); use that node's server")

    def fncall(self) -> FncallManager:
        """Not here: a gateway has no fncall pools of its own (run_code goes to a node)."""
        raise Unsupported("a cluster gateway has no fncall service of its own: use run_code / run_code_many "
                          "(sent to a node) or a node's own server")

    # ---- images: the shared store here (StoreImages), builds and pulls on a node ------------------
    async def pull(self, ref: str) -> dict[str, Any]:
        """Pull on one node agent, into the shared store every node reads."""
        return await self.transport.pull(ref)

    async def build_base(self, ref: str = "base:latest") -> Image:
        """Build `base` on one node agent, into the shared store."""
        await self.transport.build({"name": ref})
        return await self.image(ref)

    async def build_recipe(self, recipe: Recipe, *, no_cache: bool = False) -> Image:
        """Build a recipe on one node agent (its sandboxes run there), into the shared store. The recipe's
        names are store names already (the node agent is called as the cluster's internal admin)."""
        await self.transport.build({"name": recipe.ref, "recipe": recipe_json(recipe, no_cache=no_cache)})
        return await self.image(recipe.ref)

    async def build_dockerfile(self, opts: BuildOptions, *, log: Callable[[str], None] | None = None,
                               resolve_base: Callable[[str], Any] | None = None) -> BuildResult:
        """Not through a cluster gateway yet."""
        raise Unsupported(f"a Dockerfile build of {opts.tag!r} needs its context and the project's FROM names on "
                          "the building node: a cluster gateway does not relay it; build on a node's own server "
                          "(or push the image to a registry and pull it)")

    def local_node(self) -> None:
        """None: a gateway embeds no node (its dashboard asks the node agents)."""
        return None

    def cluster_transport(self) -> ClusterTransport:
        """The transport to the node agents (the gateway's dashboard asks their own APIs through it)."""
        return self.transport

    def node_of(self, sandbox_id: str) -> str:
        """The node that holds a sandbox (from its ID)."""
        return node_of(sandbox_id)


def recipe_json(recipe: Recipe, *, no_cache: bool = False) -> dict[str, Any]:
    """A recipe as the API's build request carries it (shoal.server.schemas.RecipeIn)."""
    from shoal.images import recipe as rmod

    steps: list[dict[str, Any]] = []
    for stp in recipe.steps:
        if isinstance(stp, rmod.Run):
            steps.append({"run": stp.cmd, "network": stp.network, "timeout": stp.timeout})
        elif isinstance(stp, rmod.Env):
            steps.append({"env": dict(stp.vars)})
        elif isinstance(stp, rmod.Workdir):
            steps.append({"workdir": stp.path})
        elif isinstance(stp, rmod.User):
            steps.append({"user": stp.name})
        else:
            raise Unsupported(f"a {type(stp).__name__} step copies files from this host: a cluster gateway "
                              "cannot send it to a node")
    return {"from": recipe.base, "steps": steps, "network": recipe.network, "env": dict(recipe.env),
            "workdir": recipe.workdir, "user": recipe.user, "cpus": recipe.cpus, "memory_mb": recipe.memory_mb,
            "disk_mb": recipe.disk_mb, "no_cache": no_cache}


def make_gateway_app(url: str, settings: Any = None, *, home: str | None = None, store: str | None = None) -> Any:
    """The API app backed by the cluster at `url` (ray://ADDR), with cluster-wide quotas."""
    from shoal.server.app import create_app
    from shoal.server.quotas import QuotaTracker
    from shoal.server.tokens import TokenStore

    front = ClusterFront(url, home=home, store=store)
    quotas = QuotaTracker(front.paths.sandboxes, source=front.usage_snapshot, refresh_s=front.usage_every_s,
                          min_forced_refresh_s=0.0)
    return create_app(front, settings, tokens=TokenStore(front.paths.home), quotas=quotas)


