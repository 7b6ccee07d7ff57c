"""`shoal.Client("ray://ADDR")`: the SDK over every node agent of a Ray cluster.

- **Routing**: a sandbox ID starts with its node's id, and the node agent's Ray actor is named after it,
  so every call on a sandbox goes straight to its node's HTTP endpoint (no lookup beyond a per-client
  cache of the node's URL).
- **Placement**: `create`/`create_many` read the node agents' states (cached for a second), let the
  scheduler (`shoal.cluster.placement`, a pure function) split the request by free capacity with image
  locality, and send each node its share concurrently. A node's admission stays the authority: what it
  refuses is placed again on the other nodes. No central actor is on this path: every client places for
  itself.
- **Failures**: a node agent that does not answer is looked up in Ray. If its Ray node is gone, its
  sandboxes raise `SandboxLost` (and list as `lost`, from the index each agent keeps in Ray's key-value
  store). If the node is alive (the agent is restarting), idempotent calls are retried until the agent
  is back; other calls that may have reached it raise `NodeUnavailable` (retryable) — see IDEMPOTENT.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import random
import time
from dataclasses import dataclass
from typing import Any

from shoal.cluster import placement
from shoal.cluster.raylink import (
    KV_INDEX_PREFIX,
    NAMESPACE,
    agent_name,
    agent_names,
    check_node_id,
    connect,
    kv_del,
    kv_get,
    kv_keys,
    kv_put,
    parse_ray_url,
)
from shoal.errors import (
    CapacityExceeded,
    GangUnsatisfiable,
    InvalidRequest,
    NodeUnavailable,
    SandboxError,
    SandboxLost,
    SandboxNotFound,
    ShellNotFound,
    ShoalError,
)
from shoal.limits import MAX_BATCH
from shoal.models import DirEntry, ExecResult, SandboxInfo, SandboxSpec, StreamEvent
from shoal.records import check_sandbox_id, node_of
from shoal.sdk.transport import Transport

#: operations the SDK sends again by itself after a node agent failure, even when the first attempt
#: may have reached the node: repeating them cannot do anything twice
IDEMPOTENT = frozenset({"get", "list", "close", "read_file", "write_file", "list_dir", "pause", "resume",
                        "shell_close", "images", "set_cpu_class"})
#: how long a call waits for a restarting node agent before raising NodeUnavailable (seconds)
RETRY_WINDOW_S = 120.0
#: how old the node states placement reads may be (seconds)
STATE_TTL_S = 1.0


@dataclass
class _Agent:
    """What a client knows about one node agent."""

    node_id: str
    actor: Any
    hello: dict[str, Any]
    http: Any  # HttpTransport to its endpoint

    @property
    def ray_node_id(self) -> str:
        return str(self.hello.get("ray_node_id", ""))


class ClusterStream:
    """A stream from a node's endpoint whose connection errors are reported as the node's fate."""

    def __init__(self, inner: Any, owner: ClusterTransport, node_id: str) -> None:
        self._h = inner
        self._owner = owner
        self._node = node_id

    def __aiter__(self) -> ClusterStream:
        return self

    async def __anext__(self) -> StreamEvent:
        from shoal.sdk.http import TransportError

        try:
            return await self._h.__anext__()
        except TransportError as e:
            raise await self._owner._fate(self._node, e, "stream") from None

    async def write_stdin(self, data: bytes) -> None:
        """Send bytes to the command's stdin (or PTY)."""
        await self._h.write_stdin(data)

    async def close_stdin(self) -> None:
        """Signal end of input."""
        await self._h.close_stdin()

    async def send_signal(self, sig: int) -> None:
        """Deliver a signal to the command's process group."""
        await self._h.send_signal(sig)

    async def resize(self, rows: int, cols: int) -> None:
        """Resize the PTY."""
        await self._h.resize(rows, cols)

    async def wait(self) -> ExecResult:
        """Consume the rest; return the result."""
        from shoal.sdk.http import TransportError

        try:
            return await self._h.wait()
        except TransportError as e:
            raise await self._owner._fate(self._node, e, "stream") from None

    async def aclose(self) -> None:
        """Close the stream's connection (a command still running is killed)."""
        await self._h.aclose()


class ClusterTransport(Transport):
    """Every Transport method over the node agents of a Ray cluster (see the module doc)."""

    def __init__(self, url: str, *, timeout: float = 600.0, retry_window_s: float = RETRY_WINDOW_S,
                 state_ttl_s: float = STATE_TTL_S, seed: int | None = None) -> None:
        self.address = parse_ray_url(url)
        self.url = url
        self.timeout = float(timeout)
        self.retry_window_s = float(retry_window_s)
        self.state_ttl_s = float(state_ttl_s)
        self._agents: dict[str, _Agent] = {}
        self._agent_locks: dict[str, asyncio.Lock] = {}
        self._states: tuple[float, list[dict[str, Any]]] | None = None
        self._states_lock: asyncio.Lock | None = None
        self._ray_nodes: tuple[float, set[str]] | None = None
        self._layers: dict[str, tuple[str, ...]] = {}
        self._rng = random.Random(seed)
        self._view = placement.ClusterView(seed=seed)
        self._started = False

    # ---- plumbing -------------------------------------------------------------------------------
    async def start(self) -> None:
        if not self._started:
            await asyncio.to_thread(connect, self.address)
            self._started = True

    async def aclose(self) -> None:
        agents, self._agents = self._agents, {}
        for a in agents.values():
            with contextlib.suppress(Exception):
                await a.http.aclose()
        self._started = False

    async def _agent(self, node_id: str, *, fresh: bool = False) -> _Agent:
        """The node agent `node_id` (its URL asked once per client, again after a failure)."""
        if not fresh:
            a = self._agents.get(node_id)
            if a is not None:
                return a
        lock = self._agent_locks.setdefault(node_id, asyncio.Lock())
        async with lock:
            a = self._agents.get(node_id)
            if a is not None and not fresh:
                return a
            await self.start()
            actor = a.actor if a is not None else await self._lookup(node_id)
            hello = await self._ray(actor.ensure_started.remote(), node_id, timeout=self.retry_window_s)
            from shoal.sdk.http import HttpTransport

            if a is not None and a.hello.get("url") == hello["url"] and a.hello.get("token") == hello["token"]:
                a.hello = hello
                return a
            if a is not None:
                with contextlib.suppress(Exception):
                    await a.http.aclose()
            http = HttpTransport(hello["url"], token=hello["token"], timeout=self.timeout, retry=False)
            await http.start()
            a = _Agent(node_id, actor, hello, http)
            self._agents[node_id] = a
            return a

    async def _lookup(self, node_id: str) -> Any:
        import ray

        try:
            check_node_id(node_id)
        except InvalidRequest:
            raise SandboxNotFound(f"no node {node_id!r} in this cluster (malformed ID)") from None
        try:
            return await asyncio.to_thread(ray.get_actor, agent_name(node_id), NAMESPACE)
        except ValueError:
            pass
        if await self._index(node_id) is not None:
            raise SandboxLost(f"node {node_id} has left the cluster: its sandboxes are lost; close them to "
                              "forget them and create new ones", node=node_id)
        raise SandboxNotFound(f"no node agent {node_id!r} in the cluster at {self.address} (no such sandbox; "
                              "`shoal cluster status` lists the nodes)", node=node_id)

    async def _ray(self, ref: Any, node_id: str, *, timeout: float | None = None) -> Any:
        """Await a Ray call to a node agent, mapping Ray's failures to shoal's."""
        import ray

        try:
            return await asyncio.wait_for(ref, timeout)
        except TimeoutError:
            raise NodeUnavailable(f"node agent {node_id} did not answer within {timeout:g}s", node=node_id) from None
        except ray.exceptions.RayTaskError as e:
            raise SandboxError(f"node agent {node_id} failed: {e}") from None
        except ray.exceptions.ActorUnschedulableError:
            # its node-affinity target is gone: Ray has declared the node dead
            raise SandboxLost(f"node {node_id} has left the cluster: its sandboxes are lost", node=node_id) from None
        except ray.exceptions.RayError as e:
            if await self._node_gone_by_actor(node_id):
                raise SandboxLost(f"node {node_id} has left the cluster: its sandboxes are lost", node=node_id) \
                    from None
            raise NodeUnavailable(f"node agent {node_id} is unavailable ({type(e).__name__}); retry",
                                  node=node_id) from None

    async def _alive_ray_nodes(self, max_age_s: float = 0.5) -> set[str]:
        now = time.monotonic()
        if self._ray_nodes is None or now - self._ray_nodes[0] > max_age_s:
            from shoal.cluster.raylink import alive_ray_nodes

            self._ray_nodes = (now, set(await asyncio.to_thread(alive_ray_nodes)))
        return self._ray_nodes[1]

    async def _node_gone_by_actor(self, node_id: str) -> bool:
        a = self._agents.get(node_id)
        if a is not None and a.ray_node_id:
            return a.ray_node_id not in await self._alive_ray_nodes(0.0)
        return False

    async def _fate(self, node_id: str, exc: BaseException, op: str) -> ShoalError:
        """What a failed call to a node means, once known: SandboxLost when its Ray node is gone;
        NodeUnavailable (retryable) once its agent answers again after a restart, or when the retry window
        passes without either."""
        deadline = time.monotonic() + self.retry_window_s
        attempt = 0
        while True:
            attempt += 1
            if await self._node_gone_by_actor(node_id):
                return SandboxLost(f"node {node_id} has left the cluster: its sandboxes are lost; close them to "
                                   "forget them and create new ones", node=node_id)
            try:
                await self._agent(node_id, fresh=True)  # Ray answers once the agent is back (or gone for good)
                return NodeUnavailable(f"node agent {node_id} failed during {op} ({exc}) and was restarted: "
                                       "retry", node=node_id)
            except SandboxLost as e:
                return e
            except NodeUnavailable:
                if time.monotonic() > deadline:
                    return NodeUnavailable(f"node agent {node_id} failed during {op} ({exc}) and has not come "
                                           "back; retry later", node=node_id)
                await asyncio.sleep(min(1.0, 0.05 * 2 ** min(attempt, 5)) * self._rng.uniform(0.8, 1.2))

    async def _on_node(self, node_id: str, op: str, fn: Any) -> Any:
        """Run `fn(http)` against a node's endpoint, riding out an agent restart (see IDEMPOTENT)."""
        from shoal.sdk.http import TransportError

        deadline = time.monotonic() + self.retry_window_s
        attempt = 0
        fresh = False
        while True:
            attempt += 1
            try:
                a = await self._agent(node_id, fresh=fresh)
            except NodeUnavailable:
                # Ray is restarting the agent: our call has not been sent anywhere yet
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(min(2.0, 0.1 * 2 ** min(attempt, 5)) * self._rng.uniform(0.8, 1.2))
                continue
            try:
                return await fn(a.http)
            except TransportError as e:
                sent = e.details.get("sent", True)
                fate = await self._fate(node_id, e, op)  # waits until the node is back or known to be gone
                if isinstance(fate, SandboxLost):
                    raise fate from None
                if (sent and op not in IDEMPOTENT) or time.monotonic() > deadline:
                    raise fate from None
                fresh = False  # _fate looked the agent up again

    async def _on_sandbox(self, sandbox_id: str, op: str, fn: Any) -> Any:
        check_sandbox_id(sandbox_id)
        return await self._on_node(node_of(sandbox_id), op, fn)

    # ---- placement ------------------------------------------------------------------------------
    async def states(self, max_age_s: float | None = None) -> list[dict[str, Any]]:
        """The node agents' states (cached for `state_ttl_s`); unreachable agents are left out."""
        if self._states_lock is None:
            self._states_lock = asyncio.Lock()
        age = self.state_ttl_s if max_age_s is None else max_age_s
        async with self._states_lock:
            now = time.monotonic()
            if self._states is not None and now - self._states[0] <= age:
                return self._states[1]
            await self.start()
            names = await asyncio.to_thread(agent_names)
            nids = [n[len("shoal-node-"):] for n in names]
            got = await asyncio.gather(*(self._state_of(nid) for nid in nids))
            states = [s for s in got if s is not None]
            self._states = (time.monotonic(), states)
            self._view.update(states)
            return states

    async def _state_of(self, node_id: str) -> dict[str, Any] | None:
        try:
            a = await self._agent(node_id)
            st = await self._ray(a.actor.state.remote(), node_id, timeout=10.0)
        except ShoalError:
            return None
        if st.get("ray_node_id") not in await self._alive_ray_nodes():
            return None
        return dict(st)

    async def _image_layers(self, image: str) -> tuple[str, ...]:
        """The image's layer digests, for locality (from the shared store when this process sees it)."""
        if image in self._layers:
            return self._layers[image]
        layers: tuple[str, ...] = ()
        with contextlib.suppress(Exception):
            from shoal.config import Paths
            from shoal.images.store import ImageStore

            store = Paths.from_env().store
            if store.is_dir():
                img = await asyncio.to_thread(ImageStore(store).resolve, image)
                layers = tuple(lay.hex for lay in img.layers)
        self._layers[image] = layers
        return layers

    async def _plan(self, spec: SandboxSpec, n: int, avoid: set[str]) -> dict[str, int]:
        await self.states()
        layers = await self._image_layers(spec.image)
        return self._view.split(spec, n, layers=layers, avoid=avoid)

    # ---- sandboxes ------------------------------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        items = await self.create_many(spec, 1)
        it = items[0]
        if isinstance(it, ShoalError):
            raise it
        return it

    async def create_many(self, spec: SandboxSpec, n: int, *, all_or_nothing: bool = False
                          ) -> list[SandboxInfo | ShoalError]:
        """Split by free capacity over the nodes, run the shares concurrently; what a node refuses is
        placed again elsewhere, until every node refused (then wait as it asks) or the deadline.
        `all_or_nothing`: a gang over the cluster (see `_create_gang`)."""
        from shoal.spec import check_spec

        check_spec(spec)
        n = int(n)
        if not 1 <= n <= 100_000:
            raise InvalidRequest(f"n={n} must be between 1 and {MAX_BATCH}")
        if all_or_nothing:
            return await self._create_gang(spec, n)
        out: list[SandboxInfo | ShoalError] = []
        todo = n
        avoid: set[str] = set()
        deadline = time.monotonic() + self.timeout
        attempt = 0
        last_refusal: ShoalError | None = None
        waited_for_room = False
        while todo > 0:
            attempt += 1
            plan = await self._plan(spec, todo, avoid)
            if not plan:
                if (avoid or waited_for_room) and time.monotonic() < deadline:
                    # every node refused this round: the view was stale; wait as they ask, then look again
                    wait = max(0.5, getattr(last_refusal, "retry_after_s", 1.0)) * self._rng.uniform(0.8, 1.2)
                    if time.monotonic() + wait < deadline:
                        await asyncio.sleep(wait)
                        avoid.clear()
                        self._states = None
                        continue
                err = last_refusal or CapacityExceeded(
                    "no node of the cluster has room for this sandbox (or no node agent runs: `shoal cluster "
                    "status`); close sandboxes, ask for less memory_mb, or add nodes", retry_after_s=2.0)
                out += [err] * todo
                break
            results = await asyncio.gather(*(self._create_on(nid, spec, k) for nid, k in plan.items()))
            short = todo - sum(plan.values())  # what no node had room for in this view: placed again below
            todo = short
            if short:
                waited_for_room = True
                self._states = None  # the nodes re-measure their room as they fill: ask them again
            for nid, items in zip(plan, results, strict=True):
                refused = 0
                for it in items:
                    if isinstance(it, (CapacityExceeded, NodeUnavailable, SandboxLost)):
                        # the node's admission (or its absence) moves this create elsewhere
                        avoid.add(nid)
                        last_refusal = it if isinstance(it, CapacityExceeded) else last_refusal
                        refused += 1
                    else:
                        out.append(it)
                if refused:
                    self._view.refused(nid, spec, refused)
                    todo += refused
            if todo:
                self._states = None  # what we thought we knew was wrong somewhere
        return out

    async def _create_gang(self, spec: SandboxSpec, n: int) -> list[SandboxInfo | ShoalError]:
        """All `n` or none: the scheduler splits the gang over the nodes (pausing idle lower classes where
        that makes room), each node reserves its share in its own admission before starting any
        (`all_or_nothing` at the node); if any share fails, what the others started is closed."""
        plan = await self._plan(spec, n, set())
        placed = sum(plan.values())
        if placed < n:
            for nid, k in plan.items():
                self._view.refused(nid, spec, k)
            raise GangUnsatisfiable(
                f"only {placed} of {n} sandboxes fit on the cluster now (all_or_nothing: none were created); "
                f"ask for at most {placed}, retry later, or drop all_or_nothing to get as many as fit",
                requested=n, available=placed)
        got = await asyncio.gather(*(self._on_node(nid, "create_many", lambda h, k=k: _gang(h, spec, k))
                                     for nid, k in plan.items()), return_exceptions=True)
        infos = [i for r in got if isinstance(r, list) for i in r]
        errs = [r for r in got if isinstance(r, BaseException)]
        if not errs:
            return list(infos)
        self._states = None
        for nid, r in zip(plan, got, strict=True):
            if isinstance(r, BaseException):
                self._view.refused(nid, spec, plan[nid])
        await asyncio.gather(*(self.close(i.id) for i in infos), return_exceptions=True)
        e = errs[0]
        if isinstance(e, GangUnsatisfiable):
            short = sum(x.requested - x.available for x in errs if isinstance(x, GangUnsatisfiable))
            raise GangUnsatisfiable(
                f"a node had less room than it reported, so the gang of {n} did not start ({len(infos)} "
                "sandboxes that had started were closed); retry", requested=n, available=max(0, n - short))
        if isinstance(e, ShoalError):
            raise e
        raise SandboxError(f"gang create failed: {type(e).__name__}: {e}") from e

    async def _create_on(self, node_id: str, spec: SandboxSpec, k: int) -> list[SandboxInfo | ShoalError]:
        try:
            if k == 1:
                return [await self._on_node(node_id, "create", lambda h: h.create(spec))]
            return list(await self._on_node(node_id, "create_many", lambda h: _batch(h, spec, k)))
        except ShoalError as e:
            return [e] * k

    async def get(self, sandbox_id: str) -> SandboxInfo:
        try:
            return await self._on_sandbox(sandbox_id, "get", lambda h: h.get(sandbox_id))
        except SandboxLost:
            lost = await self._lost_entry(sandbox_id)
            if lost is None:
                raise
            return lost

    async def list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        return await self.list_all(labels=labels)

    async def list_all(self, labels: dict[str, str] | None = None, project: str | None = None
                       ) -> builtins.list[SandboxInfo]:
        """Every sandbox of the cluster (of one project), those of nodes that are gone as `lost`."""
        from shoal.spec import SandboxSpec as Spec  # (the module's SandboxSpec is shoal.models' lazy name)

        await self.start()
        names = await asyncio.to_thread(agent_names)
        nids = [n[len("shoal-node-"):] for n in names]

        gone: set[str] = set()

        async def one(nid: str) -> list[SandboxInfo]:
            try:
                return list(await self._on_node(nid, "list", lambda h: _list(h, labels, project)))
            except SandboxLost:
                gone.add(nid)  # its actor is still registered, but Ray has declared its node dead
                return []
        per_node = await asyncio.gather(*(one(nid) for nid in nids))
        out = [i for items in per_node for i in items]
        live_nodes = set(nids) - gone
        for nid in await self._lost_nodes(live_nodes):
            for i in await self._lost_infos(nid):
                if labels and any(i.labels.get(k) != v for k, v in labels.items()):
                    continue
                if project is not None and Spec.from_wire(i.spec).project != project:
                    continue
                out.append(i)
        out.sort(key=lambda i: i.created_at)
        return out

    async def close(self, sandbox_id: str) -> None:
        attempts = 0

        async def once(h: Any) -> None:
            nonlocal attempts
            attempts += 1
            try:
                await h.close(sandbox_id)
            except SandboxNotFound:
                if attempts == 1:
                    raise  # (a retried close that finds nothing: the first attempt closed it)

        try:
            await self._on_sandbox(sandbox_id, "close", once)
        except SandboxLost:
            await self._forget_lost(sandbox_id)

    # ---- commands, files, shells: straight to the owner node's endpoint ----------------------------
    async def exec(self, sandbox_id: str, cmd: str | builtins.list[str], **kw: Any) -> ExecResult:
        return await self._on_sandbox(sandbox_id, "exec", lambda h: h.exec(sandbox_id, cmd, **kw))

    async def stream(self, sandbox_id: str, cmd: str | builtins.list[str], **kw: Any) -> ClusterStream:
        nid = node_of(check_sandbox_id(sandbox_id))
        inner = await self._on_node(nid, "stream", lambda h: h.stream(sandbox_id, cmd, **kw))
        return ClusterStream(inner, self, nid)

    async def shell_stream(self, sandbox_id: str, shell_id: str, cmd: str, **kw: Any) -> ClusterStream:
        """Run a command in a persistent shell and stream its output."""
        nid = node_of(check_sandbox_id(sandbox_id))
        inner = await self._on_node(nid, "stream", lambda h: h.shell_stream(sandbox_id, shell_id, cmd, **kw))
        return ClusterStream(inner, self, nid)

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self._on_sandbox(sandbox_id, "read_file", lambda h: h.read_file(sandbox_id, path))

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        await self._on_sandbox(sandbox_id, "write_file", lambda h: h.write_file(sandbox_id, path, data, mode))

    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[DirEntry]:
        return await self._on_sandbox(sandbox_id, "list_dir", lambda h: h.list_dir(sandbox_id, path))

    async def shell_open(self, sandbox_id: str, **kw: Any) -> str:
        return await self._on_sandbox(sandbox_id, "shell_open", lambda h: h.shell_open(sandbox_id, **kw))

    async def shell_run(self, sandbox_id: str, shell_id: str, cmd: str, **kw: Any) -> ExecResult:
        return await self._on_sandbox(sandbox_id, "shell_run", lambda h: h.shell_run(sandbox_id, shell_id, cmd, **kw))

    async def shell_close(self, sandbox_id: str, shell_id: str) -> None:
        try:
            await self._on_sandbox(sandbox_id, "shell_close", lambda h: h.shell_close(sandbox_id, shell_id))
        except ShellNotFound:
            pass  # gone already (a retried close, or it ended): what was asked is true

    async def pause(self, sandbox_id: str) -> None:
        await self._on_sandbox(sandbox_id, "pause", lambda h: h.pause(sandbox_id))

    async def resume(self, sandbox_id: str) -> None:
        await self._on_sandbox(sandbox_id, "resume", lambda h: h.resume(sandbox_id))

    async def set_cpu_class(self, sandbox_id: str, cpu_class: str) -> dict[str, Any]:
        return dict(await self._on_sandbox(sandbox_id, "set_cpu_class",
                                           lambda h: h.set_cpu_class(sandbox_id, cpu_class)))

    async def snapshot(self, sandbox_id: str, name: str) -> dict[str, Any]:
        return await self._on_sandbox(sandbox_id, "snapshot", lambda h: h.snapshot(sandbox_id, name))

    async def fork(self, sandbox_id: str, n: int, **kw: Any) -> builtins.list[SandboxInfo | ShoalError]:
        return await self._on_sandbox(sandbox_id, "fork", lambda h: h.fork(sandbox_id, n, **kw))

    # ---- images and fncall: any node (they share the store) ------------------------------------------
    async def _any_node(self) -> str:
        await self.states()
        nid = self._view.pick_node()
        if nid is None:
            raise NodeUnavailable(f"no node agent answers in the cluster at {self.address}: run "
                                  "`shoal cluster up --address ...`")
        return nid

    async def images(self) -> builtins.list[dict[str, Any]]:
        nid = await self._any_node()
        return await self._on_node(nid, "images", lambda h: h.images())

    async def pull(self, reference: str) -> dict[str, Any]:
        nid = await self._any_node()  # into the shared store: every node sees it
        return await self._on_node(nid, "pull", lambda h: h.pull(reference))

    async def build(self, body: dict[str, Any]) -> dict[str, Any]:
        """An image build request (POST /v1/images/build) on one node, into the shared store."""
        nid = await self._any_node()

        async def go(h: Any) -> dict[str, Any]:
            r = await h._request("POST", "/v1/images/build", json_body=body, read_timeout=None)
            return dict(r.json())

        return dict(await self._on_node(nid, "build", go))

    async def run_code(self, code: str, **kw: Any) -> Any:
        nid = await self._any_node()
        return await self._on_node(nid, "run_code", lambda h: h.run_code(code, **kw))

    async def run_code_many(self, items: builtins.list[Any], **kw: Any) -> builtins.list[Any]:
        nid = await self._any_node()
        return await self._on_node(nid, "run_code", lambda h: h.run_code_many(items, **kw))

    # ---- what the dashboard asks of every node (shoal.server.observe) --------------------------------
    async def node_json(self, node_id: str, method: str, path: str, *, params: Any = None) -> Any:
        """One request to a node agent's own API (as the cluster-internal admin), its JSON answer."""
        async def go(h: Any) -> Any:
            r = await h._request(method, path, params=params)
            return r.json()

        return await self._on_node(node_id, "get", go)

    async def events(self, sandbox_id: str | None = None, *, commands: bool = False,
                     kinds: builtins.list[str] | None = None, since: float | None = None,
                     limit: int = 200) -> builtins.list[Any]:
        """A sandbox's events from its node; without a sandbox, the newest events of every node."""
        if sandbox_id is not None:
            return list(await self._on_sandbox(sandbox_id, "get", lambda h: h.events(
                sandbox_id, commands=commands, kinds=kinds, since=since, limit=limit)))
        nids = [s["node_id"] for s in await self.states(max_age_s=1.0)]
        per = await asyncio.gather(*(self._on_node(nid, "get", lambda h: h.events(
            kinds=kinds, since=since, limit=limit)) for nid in nids), return_exceptions=True)
        out = [e for got in per if not isinstance(got, BaseException) for e in got]
        out.sort(key=lambda e: e.t)
        return out[-limit:]

    async def node_text(self, node_id: str, path: str) -> str:
        """A node agent's text answer (its /metrics)."""
        async def go(h: Any) -> str:
            r = await h._request("GET", path)
            return str(r.text)

        return str(await self._on_node(node_id, "get", go))

    async def lost_sandboxes(self) -> builtins.list[SandboxInfo]:
        """Sandboxes of nodes that have left the cluster (state `lost`), from the nodes' published indexes."""
        alive = {s["node_id"] for s in await self.states(max_age_s=2.0)}
        out: list[SandboxInfo] = []
        for nid in await self._lost_nodes(alive):
            out += await self._lost_infos(nid)
        return out

    # ---- sandboxes of nodes that are gone ---------------------------------------------------------
    async def _index(self, node_id: str) -> builtins.list[dict[str, Any]] | None:
        raw = await asyncio.to_thread(kv_get, KV_INDEX_PREFIX + node_id)
        if raw is None:
            return None
        try:
            return list(json.loads(raw))
        except ValueError:
            return []

    async def _lost_nodes(self, live_nodes: set[str]) -> builtins.list[str]:
        keys = await asyncio.to_thread(kv_keys, KV_INDEX_PREFIX)
        return [k[len(KV_INDEX_PREFIX):] for k in keys if k[len(KV_INDEX_PREFIX):] not in live_nodes]

    async def _lost_infos(self, node_id: str) -> builtins.list[SandboxInfo]:
        return [_lost_info(d) for d in await self._index(node_id) or []]

    async def _lost_entry(self, sandbox_id: str) -> SandboxInfo | None:
        for d in await self._index(node_of(sandbox_id)) or []:
            if d.get("id") == sandbox_id:
                return _lost_info(d)
        return None

    async def _forget_lost(self, sandbox_id: str) -> None:
        nid = node_of(sandbox_id)
        entries = await self._index(nid)
        if entries is None:
            return
        keep = [d for d in entries if d.get("id") != sandbox_id]
        key = KV_INDEX_PREFIX + nid
        if keep:
            await asyncio.to_thread(kv_put, key, json.dumps(keep, separators=(",", ":")).encode())
        else:
            await asyncio.to_thread(kv_del, key)


def _lost_info(d: dict[str, Any]) -> SandboxInfo:
    return SandboxInfo(id=d["id"], image=d.get("image", ""), backend=d.get("backend", ""), state="lost",
                       created_at=float(d.get("created_at", 0.0)), spec=dict(d.get("spec") or {}),
                       expires_at=d.get("expires_at"), labels=dict(d.get("labels") or {}),
                       node=d.get("node", ""), extra={"lost": True})


async def _batch(h: Any, spec: SandboxSpec, k: int) -> list[SandboxInfo | ShoalError]:
    """One batch create at a node, with no capacity retries (the cluster places refusals elsewhere)."""
    from shoal.errors import error_from_dict
    from shoal.server.codec import decode_info

    body = h._spec_json(spec)
    r = await h._request("POST", "/v1/sandboxes/batch", json_body={**body, "n": k}, retry_capacity=False)
    return [decode_info(it["sandbox"]) if it.get("sandbox") is not None else error_from_dict(it.get("error") or {})
            for it in r.json()["items"]]


async def _gang(h: Any, spec: SandboxSpec, k: int) -> list[SandboxInfo]:
    """One node's share of a gang: all `k` (reserved in the node's admission first) or its error."""
    from shoal.server.codec import decode_info

    body = h._spec_json(spec)
    r = await h._request("POST", "/v1/sandboxes/batch", json_body={**body, "n": k, "all_or_nothing": True},
                         retry_capacity=False)
    return [decode_info(it["sandbox"]) for it in r.json()["items"]]


async def _list(h: Any, labels: dict[str, str] | None, project: str | None) -> list[SandboxInfo]:
    from shoal.server.codec import decode_info

    params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
    if project is not None:
        params.append(("project", project))
    r = await h._request("GET", "/v1/sandboxes", params=params)
    return [decode_info(d) for d in r.json()["sandboxes"]]

