"""The node agent of a Ray node: one detached Ray actor per node, wrapping an embedded `Node`.

`shoal cluster up` starts one on every Ray node offering the `shoal` resource, pinned to it with a hard
node-affinity strategy and restarted by Ray when it dies (`max_restarts=-1`). A restarted agent makes a new
`Node` over the same SHOAL_HOME, whose start re-adopts the sandboxes still running (crash-only records).

Two planes reach it:
- **Ray actor calls** for what concerns the node as a whole: where its endpoint is (`ensure_started`),
  its state for placement (`state`), its sandboxes' sizes for cluster-wide quotas (`usage`), `teardown`.
- **its own HTTP/WebSocket endpoint** (the `shoal serve` app around the same Node, bound to the node's
  address) for everything about sandboxes: create and batches, exec, streams and PTYs, files, shells,
  pause, snapshot, fork. Chosen by measurement over Ray actor calls (docs/cluster.md has the figures;
  `call` is the Ray path the benchmark compares with). The endpoint takes one cluster-internal bearer
  token, kept in SHOAL_HOME (0600) and handed out through Ray, so only processes that can join the Ray
  cluster reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.errors import InvalidRequest, NodeUnavailable, ShoalError
from shoal.models import SandboxInfo

if TYPE_CHECKING:
    from shoal.front import Front
    from shoal.node.node import Node

log = logging.getLogger(__name__)

#: sandbox operations `NodeAgent.call` runs over Ray (name → Node method)
CONTROL_OPS = frozenset({"get", "close", "pause", "resume", "snapshot", "fork", "exec", "read_file", "write_file",
                         "list_dir", "shell_open", "shell_run", "shell_close"})
#: how often the agent checks whether its sandbox index changed (a stat), and rewrites it anyway
_INDEX_POLL_S = 0.05
_INDEX_FULL_S = 10.0
#: how often the agent re-reads the Ray nodes' addresses (nodes that join are blocked from then on)
_BLOCK_REFRESH_S = 15.0


def _ok(value: Any) -> dict[str, Any]:
    return {"ok": value}


def _err(e: BaseException) -> dict[str, Any]:
    if not isinstance(e, ShoalError):
        from shoal.errors import SandboxError

        e = SandboxError(f"node agent error: {type(e).__name__}: {e}")
    return {"error": e.to_dict()}


class InternalTokens:
    """The node agent's HTTP endpoint accepts exactly one bearer token (shaped like any shoal token):
    the cluster's clients and gateways act as operators of this node."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.token = self._load_or_make()

    def _load_or_make(self) -> str:
        with contextlib.suppress(FileNotFoundError):
            tok = self.path.read_text().strip()
            if tok:
                return tok
        self.path.parent.mkdir(parents=True, exist_ok=True)
        b32 = "abcdefghijklmnopqrstuvwxyz234567"
        tok = f"shoal_{''.join(secrets.choice(b32) for _ in range(10))}_{secrets.token_urlsafe(32)}"
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(tok)
        os.rename(tmp, self.path)
        return tok

    # the subset of TokenStore the API app uses
    def has_tokens(self) -> bool:
        """Always: the endpoint never serves without its token."""
        return True

    def tokens(self) -> list[Any]:
        """One (unnamed) token."""
        return [None]

    def authenticate(self, token: str) -> Any:
        """An operator principal for the cluster token, None for anything else."""
        from shoal.server.tokens import Principal

        if token and hmac.compare_digest(token.encode(), self.token.encode()):
            return Principal(project="default", admin=True, token_id="cluster")
        return None

    def quota(self, project: str) -> Any:
        """No per-project quota at a node (the gateway enforces them cluster-wide)."""
        from shoal.server.tokens import Quota

        return Quota()

    def policy(self, project: str) -> Any:
        """No per-project policy at a node: the gateway applies it (its specs carry the egress grants)."""
        from shoal.server.tokens import ProjectPolicy

        return ProjectPolicy()


class NodeAgent:
    """The actor class (wrapped by `ray.remote` in shoal.cluster.control). All methods run on the
    actor's event loop, like the embedded node's."""

    def __init__(self, node_id: str, home: str | None = None, store: str | None = None, host: str = "127.0.0.1",
                 env: dict[str, str] | None = None) -> None:
        from shoal import config
        from shoal.cluster.raylink import check_node_id

        self.node_id = check_node_id(node_id)
        # `env` holds settings (SHOAL_*=…, from `shoal cluster up --env`): resolved once, here at the agent's
        # edge, over the worker's own environment, and injected (the node's config; settings() for the rest
        # of this actor process) — never written into os.environ
        #: this agent's settings
        self.settings = config.Settings.load(env={**os.environ, **(env or {})})
        config.use(self.settings)
        self.home = Path(home) if home else self.settings.paths().home
        self.store = store
        self.host = host
        #: the node this agent runs (made by _start): the cluster's calls reach it as a Front (_control_op,
        #: the HTTP app); the agent itself also drives its host side (network blocks, records, teardown)
        self.node: Node | None = None
        self.url = ""
        self._server: Any = None
        self._serve_task: asyncio.Task[Any] | None = None
        self._index_task: asyncio.Task[Any] | None = None
        self._block_task: asyncio.Task[Any] | None = None
        self._start_lock: asyncio.Lock | None = None
        self._state_cache: tuple[float, dict[str, Any]] | None = None
        self.started_at = 0.0
        self.adopted: dict[str, int] = {}
        self.tokens = InternalTokens(self.home / "cluster" / "agent-token")
        import ray

        ctx = ray.get_runtime_context()
        self.ray_node_id = ctx.get_node_id()
        # a restarted agent starts its node at once (re-adopting its sandboxes and resuming TTL reaping),
        # not at the first client call: queue a call to itself, run as soon as __init__ returns
        with contextlib.suppress(Exception):
            ctx.current_actor.ensure_started.remote()

    # ---- lifecycle ------------------------------------------------------------------------------
    async def ensure_started(self) -> dict[str, Any]:
        """Start the embedded node (re-adopting live sandboxes) and the data-plane endpoint, once."""
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self.node is None:
                await self._start()
        return self.hello()

    async def _start(self) -> None:
        from shoal.config import NodeConfig, Paths
        from shoal.node.node import Node

        paths = Paths.from_env(self.home, self.store)
        node = Node(NodeConfig(settings=self.settings, paths=paths, node_id=self.node_id))
        await node.start()
        # probe the container runtimes now, off the event loop (state reports them; creates need them)
        await asyncio.to_thread(lambda: node.runtime_statuses)
        self.adopted = {"sandboxes": len(await node.list())}
        self.node = node
        # before any sandbox is made here: the cluster's own addresses are out of their reach (issue 23)
        await self._block_cluster_addresses()
        await self._serve_http()
        self.started_at = time.time()
        self._index_task = asyncio.create_task(self._publish_index_loop(), name="shoal-agent-index")
        self._block_task = asyncio.create_task(self._block_loop(), name="shoal-agent-block")
        log.info("node agent %s ready at %s (%d sandboxes adopted)", self.node_id, self.url,
                 self.adopted["sandboxes"])

    def _endpoint_file(self) -> Path:
        return self.home / "cluster" / "endpoint.json"

    def _bind(self) -> socket.socket:
        # the same port as before a restart when it is free, so clients' cached URLs stay valid
        want = 0
        with contextlib.suppress(Exception):
            prev = json.loads(self._endpoint_file().read_text())
            if prev.get("host") == self.host:
                want = int(prev.get("port", 0))
        for port in (want, 0) if want else (0,):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((self.host, port))
            except OSError:
                s.close()
                continue
            return s
        raise InvalidRequest(f"node agent {self.node_id}: cannot bind a port on {self.host}")

    async def _serve_http(self) -> None:
        import uvicorn

        from shoal.server.app import create_app
        from shoal.server.run import uvicorn_config
        from shoal.server.settings import ServerSettings

        sock = self._bind()
        sock.listen(4096)
        port = sock.getsockname()[1]
        settings = ServerSettings(host=self.host, port=port, log_level="warning")
        # InternalTokens offers what the app asks of a TokenStore (one internal admin token)
        app = create_app(self._node(), settings, tokens=self.tokens, manage_node=False)  # type: ignore[arg-type]
        config = uvicorn_config(app, settings)
        server = uvicorn.Server(config)
        self._server = server
        self._serve_task = asyncio.create_task(server.serve(sockets=[sock]), name="shoal-agent-http")
        while not server.started:
            if self._serve_task.done():
                self._serve_task.result()
                raise InvalidRequest(f"node agent {self.node_id}: its HTTP endpoint did not start")
            await asyncio.sleep(0.01)
        self.url = f"http://{self.host}:{port}"
        f = self._endpoint_file()
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps({"host": self.host, "port": port}))

    def _node(self) -> Node:
        """The started node (callers run ensure_started first)."""
        if self.node is None:
            raise NodeUnavailable(f"node agent {self.node_id} has no node running (starting or torn down)",
                                  node=self.node_id)
        return self.node

    def hello(self) -> dict[str, Any]:
        """Who this agent is and how to reach its data plane."""
        return {"node_id": self.node_id, "ray_node_id": self.ray_node_id, "url": self.url,
                "token": self.tokens.token, "pid": os.getpid(), "home": str(self.home),
                "started_at": self.started_at, "adopted": self.adopted}

    async def teardown(self, force: bool = False, purge: bool = False) -> dict[str, Any]:
        """Stop serving, close the sandboxes (only with `force`; otherwise refuse while any live) and undo
        every mount in this node's SHOAL_HOME. The caller then kills the actor."""
        from shoal.node.teardown import purge_home, teardown_home

        await self.ensure_started()
        node = self._node()
        live = await node.list()
        if live and not force:
            return _err(InvalidRequest(
                f"node {self.node_id} still has {len(live)} sandbox(es) (e.g. {live[0].id}); close them or "
                "pass --force", sandboxes=len(live)))
        await self._stop_serving()
        with contextlib.suppress(Exception):
            await asyncio.to_thread(node.network().set_blocked, f"cluster-{self.node_id}", [])
        paths = node.paths
        await node.stop()
        self.node = None
        try:
            rep = await teardown_home(paths, close_sandboxes=force)
            if purge:
                purge_home(paths)
        except ShoalError as e:
            return _err(e)
        with contextlib.suppress(Exception):
            from shoal.cluster.raylink import KV_INDEX_PREFIX, kv_del

            kv_del(KV_INDEX_PREFIX + self.node_id)
        return _ok({"closed": rep.closed, "node_id": self.node_id})

    async def _stop_serving(self) -> None:
        for t in (self._index_task, self._block_task):
            if t is not None:
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
        self._index_task = self._block_task = None
        if self._server is not None:
            self._server.should_exit = True
            if self._serve_task is not None:
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(self._serve_task, 15)
        self._server = self._serve_task = None

    # ---- control plane --------------------------------------------------------------------------
    async def state(self, fresh: bool = False) -> dict[str, Any]:
        """This node as placement sees it: memory and CPUs committed/limit/free, sandboxes, mounted layers
        (reused for 0.2 s unless `fresh`: clients refreshing together cost one scan)."""
        await self.ensure_started()
        now = time.monotonic()
        if not fresh and self._state_cache is not None and now - self._state_cache[0] < 0.2:
            return self._state_cache[1]
        from shoal.cluster.nodestate import node_state

        st = node_state(self._node(), ray_node_id=self.ray_node_id, url=self.url)
        self._state_cache = (now, st)
        return st

    async def usage(self) -> list[tuple[str, str, float, int, str, dict[str, Any]]]:
        """(id, project, cpus, memory_mb, state, spec) of every sandbox here: cluster-wide quotas and the
        gateway's knowledge of who owns what (the spec as JSON: `SandboxSpec.from_wire` reads it)."""
        await self.ensure_started()
        from shoal.records import list_records

        return [(r.id, r.project, float(r.spec.cpus), int(r.spec.memory_mb), r.state, r.spec.to_dict())
                for r in list_records(self._node().paths.sandboxes) if not r.extra.get("pool")]

    async def call(self, op: str, sandbox_id: str, args: tuple[Any, ...] = (),
                   kw: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run one Node operation on a sandbox of this node over Ray: the data path `shoal bench cluster`
        compares with the HTTP endpoint (clients use the endpoint)."""
        await self.ensure_started()
        if op not in CONTROL_OPS:
            return _err(InvalidRequest(f"unknown node operation {op!r}"))
        try:
            res = await self._control_op(op)(sandbox_id, *args, **(kw or {}))
        except Exception as e:
            return _err(e)
        if op in ("close", "fork"):
            self._state_cache = None
        return _ok(res)

    def _control_op(self, op: str) -> Callable[..., Awaitable[Any]]:
        """The node's front operation named `op` (one of CONTROL_OPS): an explicit table, not a lookup by name."""
        n: Front = self._node()
        ops: dict[str, Callable[..., Awaitable[Any]]] = {
            "get": n.get, "close": n.close, "pause": n.pause, "resume": n.resume, "snapshot": n.snapshot,
            "fork": n.fork, "exec": n.exec, "read_file": n.read_file, "write_file": n.write_file,
            "list_dir": n.list_dir, "shell_open": n.shell_open, "shell_run": n.shell_run,
            "shell_close": n.shell_close}
        return ops[op]

    # ---- the cluster's own addresses, out of sandboxes' reach ---------------------------------------
    async def _block_cluster_addresses(self) -> None:
        """Every Ray node's address and the GCS's go into the node's @infra set (shoal.node.network): a
        networked sandbox reaches none of their ports (Ray runs whatever a client that reaches it submits)."""
        try:
            addrs = await asyncio.to_thread(cluster_addresses)
            await asyncio.to_thread(self._node().network().set_blocked, f"cluster-{self.node_id}", addrs)
        except Exception as e:  # no nft here (then no sandbox has a network either), Ray busy: next round
            log.warning("node agent %s: could not update the cluster's blocked addresses: %s", self.node_id, e)

    async def _block_loop(self) -> None:
        while True:
            await asyncio.sleep(_BLOCK_REFRESH_S)
            await self._block_cluster_addresses()

    # ---- the sandbox index (read by clients when this node is gone) ------------------------------
    async def _publish_index_loop(self) -> None:
        from shoal.cluster.raylink import KV_INDEX_PREFIX, kv_put

        last = b""
        seen: tuple[int, float] = (-1, 0.0)
        while True:
            with contextlib.suppress(Exception):
                # a create or close adds or removes an entry of the sandboxes directory: one stat tells
                node = self._node()
                mtime = os.stat(node.paths.sandboxes).st_mtime_ns
                now = time.monotonic()
                if mtime != seen[0] or now - seen[1] > _INDEX_FULL_S:
                    seen = (mtime, now)
                    infos = await node.list()
                    data = json.dumps([_index_entry(i) for i in infos], separators=(",", ":")).encode()
                    if data != last:
                        await asyncio.to_thread(kv_put, KV_INDEX_PREFIX + self.node_id, data)
                        last = data
            await asyncio.sleep(_INDEX_POLL_S)


def _index_entry(info: SandboxInfo) -> dict[str, Any]:
    from shoal.spec import SandboxSpec

    spec = SandboxSpec.from_wire(info.spec)
    return {"id": info.id, "image": info.image, "backend": info.backend, "created_at": info.created_at,
            "labels": info.labels, "node": info.node, "expires_at": info.expires_at,
            "spec": {k: getattr(spec, k) for k in _INDEX_SPEC}}


#: what a node's index in the KV keeps of each sandbox's spec (a lost node's sandboxes are listed from it)
_INDEX_SPEC = ("cpus", "memory_mb", "project", "image", "backend")


def cluster_addresses() -> list[str]:
    """The IPv4 addresses of the Ray cluster's nodes (every node Ray knows, alive or not) and of its GCS."""
    import ipaddress

    import ray

    found = {str(n.get("NodeManagerAddress") or "") for n in ray.nodes()}
    with contextlib.suppress(Exception):
        found.add(str(ray.get_runtime_context().gcs_address).rsplit(":", 1)[0])
    out = []
    for a in found:
        with contextlib.suppress(ValueError):
            out.append(str(ipaddress.IPv4Address(a)))
    return sorted(out)
