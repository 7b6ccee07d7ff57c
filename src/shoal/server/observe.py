"""What the dashboard, `shoal top` and `shoal events` read, over one node or a whole cluster.

`view_for(state)` gives the server's `View`: a `NodeView` when the app serves an embedded Node, a
`ClusterView` when it is a gateway (`shoal serve --cluster`). Both answer the same questions —
nodes, a page of sandboxes, a sandbox's events/commands/usage, recent events, live stats, image usage —
so the routes (shoal.server.api_observe) and the dashboard never know which one they talk to. The
cluster view asks every node agent's own API (the same routes, answered by its NodeView) and merges.

Sandbox pages are answered from an in-memory index of the node's records (`SandboxIndex`), refreshed
only when asked: at once after this server's own changes, in the background when it is older than
`INDEX_MAX_AGE_S`. Filtering, sorting and paging 50,000 rows is a pass over a list, never a read of
50,000 files per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from shoal.config import settings
from shoal.errors import SandboxNotFound, ShoalError
from shoal.node.events import EventIndex, EventLog
from shoal.server.live import LiveStats

if TYPE_CHECKING:
    from shoal.cluster.transport import ClusterTransport
    from shoal.node.node import Node
    from shoal.server.deps import ServerState

#: a sandbox index older than this is rebuilt before it answers (seconds)
INDEX_MAX_AGE_S = 1.0
log = logging.getLogger(__name__)
#: the label naming a sandbox's job (shoal.sched)
LABEL_JOB = "shoal.job"
SORT_KEYS = ("created_at", "id", "state", "image", "backend", "project", "memory_mb", "cpus", "node")
#: most rows one page may hold
MAX_PAGE = 500


# ---- sandbox rows and queries ---------------------------------------------------------------------
@dataclass
class SandboxQuery:
    """Filters, order and page of a sandbox list (every filter optional; all must match)."""

    project: str | None = None
    job: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    states: tuple[str, ...] = ()
    backend: str | None = None
    #: substring of the image reference
    image: str | None = None
    min_age_s: float | None = None
    max_age_s: float | None = None
    #: substring of the sandbox ID
    q: str | None = None
    node: str | None = None
    sort: str = "created_at"
    desc: bool = True
    offset: int = 0
    limit: int = 50

    def to_params(self, *, offset: int | None = None, limit: int | None = None) -> list[tuple[str, str]]:
        """The query as URL parameters of GET /v1/sandboxes/page (a gateway asks its nodes with these)."""
        p: list[tuple[str, str]] = []
        for k in ("project", "job", "backend", "image", "q", "node"):
            v = getattr(self, k)
            if v is not None:
                p.append((k, str(v)))
        p += [("label", f"{k}={v}") for k, v in self.labels.items()]
        p += [("state", s) for s in self.states]
        for k in ("min_age_s", "max_age_s"):
            v = getattr(self, k)
            if v is not None:
                p.append((k, repr(float(v))))
        p += [("sort", self.sort), ("order", "desc" if self.desc else "asc"),
              ("offset", str(self.offset if offset is None else offset)),
              ("limit", str(self.limit if limit is None else limit))]
        return p


def row_of(rec: Any, node_id: str) -> dict[str, Any]:
    """One sandbox record as a list row (what pages, filters and facets read)."""
    spec = rec.spec
    row = {"id": rec.id, "project": rec.project, "state": rec.state, "backend": rec.backend, "image": rec.image,
           "created_at": rec.created_at, "expires_at": rec.expires_at, "labels": rec.labels,
           "job": rec.labels.get(LABEL_JOB), "cpus": spec.cpus, "memory_mb": spec.memory_mb,
           "node": node_id, "runtime": rec.runtime, "layers": rec.layers}
    if rec.state == "paused":
        row["paused_by"] = rec.extra.get("paused_by") or "user"
    return row


def _matches(r: dict[str, Any], q: SandboxQuery, now: float) -> bool:
    if q.project is not None and r["project"] != q.project:
        return False
    if q.job is not None and r.get("job") != q.job:
        return False
    if q.states and r["state"] not in q.states:
        return False
    if q.backend is not None and r["backend"] != q.backend:
        return False
    if q.image is not None and q.image not in r["image"]:
        return False
    if q.q is not None and q.q not in r["id"]:
        return False
    if q.node is not None and r.get("node") != q.node:
        return False
    if q.labels:
        lab = r["labels"]
        if any(lab.get(k) != v for k, v in q.labels.items()):
            return False
    age = now - r["created_at"]
    if q.min_age_s is not None and age < q.min_age_s:
        return False
    return not (q.max_age_s is not None and age > q.max_age_s)


def _sort_key(key: str) -> Any:
    if key in ("memory_mb", "cpus"):
        return lambda r: r.get(key) or 0
    if key == "created_at":
        return itemgetter("created_at")
    return lambda r: r.get(key) or ""


def _filtered(q: SandboxQuery) -> bool:
    return any(v is not None for v in (q.project, q.job, q.backend, q.image, q.q, q.node, q.min_age_s, q.max_age_s)) \
        or bool(q.states) or bool(q.labels)


def page_rows(rows: list[dict[str, Any]], q: SandboxQuery, now: float | None = None,
              cache: dict[str, Any] | None = None) -> dict[str, Any]:
    """Filter, count, sort and slice `rows` (oldest first, as the index keeps them): {total, offset, limit,
    items, facets}. Facets count the matching rows by state, backend, project, job and node (for the filter
    menus). One pass in C where it can be (no filter: no pass at all; counting: Counter over itemgetter);
    `cache` (a dict emptied whenever `rows` changes) keeps the unfiltered facets between requests."""
    now = time.time() if now is None else now
    filtered = _filtered(q)
    hit = [r for r in rows if _matches(r, q, now)] if filtered else rows
    facets = None if filtered or cache is None else cache.get("facets")
    if facets is None:
        facets = {}
        for k in ("state", "backend", "project", "job", "node"):
            c = Counter(map(itemgetter(k), hit))
            c.pop(None, None)
            facets[k] = dict(c.most_common(50))
        if not filtered and cache is not None:
            cache["facets"] = facets
    n = len(hit)
    if q.sort == "created_at" or q.sort not in SORT_KEYS:
        # already in creation order: slice from the right end, no sort and no copy of the whole list
        if q.desc:
            lo, hi = max(0, n - q.offset - q.limit), max(0, n - q.offset)
            window = hit[lo:hi][::-1]
        else:
            window = hit[q.offset:q.offset + q.limit]
    else:
        key = _sort_key(q.sort)
        # a page needs only its own rows in order: heapq picks offset+limit of them without sorting all
        need = q.offset + q.limit
        pick = heapq.nlargest(need, hit, key=key) if q.desc else heapq.nsmallest(need, hit, key=key)
        window = pick[q.offset:]
    items = [{k: v for k, v in r.items() if k != "layers"} for r in window]
    return {"total": n, "offset": q.offset, "limit": q.limit, "items": items, "facets": facets}


def merge_pages(pages: list[dict[str, Any]], q: SandboxQuery) -> dict[str, Any]:
    """Pages of the same query from several nodes (each asked for offset 0, limit offset+limit) as one page."""
    rows = [r for p in pages for r in p.get("items", [])]
    rows.sort(key=_sort_key(q.sort if q.sort in SORT_KEYS else "created_at"), reverse=q.desc)
    facets: dict[str, Counter[str]] = {}
    for p in pages:
        for k, d in (p.get("facets") or {}).items():
            facets.setdefault(k, Counter()).update(d)
    return {"total": sum(int(p.get("total", 0)) for p in pages), "offset": q.offset, "limit": q.limit,
            "items": rows[q.offset:q.offset + q.limit],
            "facets": {k: dict(c.most_common(50)) for k, c in facets.items()}}


class SandboxIndex:
    """Rows of a node's live records, rebuilt on demand (see `snapshot`)."""

    def __init__(self, node: Node, max_age_s: float = INDEX_MAX_AGE_S) -> None:
        self.node = node
        self.max_age_s = max_age_s
        #: the rows and what page_rows may keep between requests over exactly these rows, swapped as one
        #: (a page computed over the old rows never fills the new rows' cache)
        self._snap: tuple[list[dict[str, Any]], dict[str, Any]] = ([], {})
        self.built_at = 0.0
        self.build_s = 0.0
        self.builds = 0
        self._seen = -1
        self._lock = asyncio.Lock()
        self._bg: asyncio.Task[None] | None = None

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The rows of the last build."""
        return self._snap[0]

    def build(self) -> list[dict[str, Any]]:
        """Read the records now (blocking; the parsed records are cached by file identity)."""
        from shoal.records import list_records

        t0 = time.perf_counter()
        nid = self.node.config.node_id
        rows = [row_of(r, nid) for r in list_records(self.node.paths.sandboxes)
                if not r.extra.get("pool") and r.state != "stopping"]
        self._snap = (rows, {})
        self.built_at, self.build_s = time.monotonic(), time.perf_counter() - t0
        self.builds += 1
        return rows

    async def snapshot(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The rows and their page cache. Rebuilt first (off the event loop) on the first call and when this
        process's node has logged an event since the last build (its own creates, pauses and closes show at
        once). An index that is only older than `max_age_s` (what other processes may have changed) is
        answered as it is while a rebuild runs in the background: with 5,000 sandboxes a rebuild takes
        seconds on a busy machine, and a page must not wait for it."""
        if self.node.events.counts.total() != self._seen or not self.built_at:
            async with self._lock:
                seen = self.node.events.counts.total()
                if seen != self._seen or not self.built_at:  # not already rebuilt while this one waited
                    self._seen = seen
                    await asyncio.to_thread(self.build)
        elif time.monotonic() - self.built_at > self.max_age_s and (self._bg is None or self._bg.done()):
            self._bg = asyncio.create_task(self._refresh())
        return self._snap

    async def fresh(self) -> list[dict[str, Any]]:
        """The rows (see `snapshot`)."""
        return (await self.snapshot())[0]

    async def _refresh(self) -> None:
        try:
            async with self._lock:
                if time.monotonic() - self.built_at > self.max_age_s:
                    await asyncio.to_thread(self.build)
        except Exception:  # a failed background rebuild: the next request tries again
            log.exception("rebuilding the sandbox index failed")

    async def stop(self) -> None:
        """Cancel a background rebuild."""
        if self._bg is not None and not self._bg.done():
            self._bg.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._bg


# ---- the views ------------------------------------------------------------------------------------
def _scope(who: Any) -> str | None:
    return None if who.admin else who.project


class NodeView:
    """The observability side of a server with an embedded Node."""

    kind = "node"

    def __init__(self, st: ServerState, node: Node) -> None:
        self.st = st
        #: the embedded node beneath the front (Front.local_node): its records, admission and cgroups
        self.node = node
        self.index = SandboxIndex(self.node)
        self.events = EventIndex(self.node.paths.home)
        self.live = LiveStats(self.figures)
        self.started_at = time.time()

    async def start(self) -> None:
        """Begin sampling live figures."""
        self.live.start()

    async def stop(self) -> None:
        """Stop sampling (and a background index rebuild)."""
        await self.live.stop()
        await self.index.stop()

    # ---- figures --------------------------------------------------------------------------------
    def figures(self) -> dict[str, Any]:
        """Sandboxes by state and memory of this node now (cheap: admission's counters and meminfo)."""
        snap = self.node.admission.snapshot()
        reclaimed = sum(self.node.reclaimed.values())
        return {"states": {"running": snap.sandboxes - snap.paused, "paused": snap.paused, "creating": snap.pending},
                "memory": {"committed_mb": snap.committed_mb, "paused_mb": snap.paused_mb,
                           "used_mb": snap.total_mb - snap.available_mb, "available_mb": snap.available_mb,
                           "total_mb": snap.total_mb, "limit_mb": snap.limit_mb,
                           "reclaimed_mb": round(reclaimed / 2**20, 1)}}

    async def nodes(self) -> list[dict[str, Any]]:
        """This node: health, load, CPUs, memory, sandboxes by state, backends."""
        from shoal.backends.registry import backend_names

        f = self.figures()
        return [{"node_id": self.node.config.node_id, "health": "ok", "load1": round(os.getloadavg()[0], 2),
                 "cpus": os.cpu_count() or 1, "sandboxes": f["states"], "memory": f["memory"],
                 "backends": backend_names(), "up_s": round(time.time() - self.started_at, 1)}]

    async def stats(self, since: float | None = None) -> dict[str, Any]:
        """Live series: per node and in total (the same here)."""
        pts = self.live.series(since)
        return {"interval_s": self.live.interval_s, "nodes": {self.node.config.node_id: pts}, "total": pts}

    # ---- sandboxes ------------------------------------------------------------------------------
    async def page(self, who: Any, q: SandboxQuery) -> dict[str, Any]:
        """One page of the caller's sandboxes (admin: all, or `q.project`)."""
        scope = _scope(who)
        if scope is not None:
            q.project = scope
        rows, cache = await self.index.snapshot()
        return page_rows(rows, q, cache=cache)

    async def usage(self, rec: Any) -> dict[str, Any]:
        """A live sandbox's measured use: memory, CPU time, processes, OOM kills (from its cgroup)."""
        from shoal.host.cgroups import usage

        out: dict[str, Any] = {"state": rec.state}
        if rec.cgroup:
            out.update(await asyncio.to_thread(usage, rec.cgroup))
        if rec.id in self.node.reclaimed:
            out["reclaimed_mb"] = round(self.node.reclaimed[rec.id] / 2**20, 2)
        return out

    async def sandbox_usage(self, who: Any, sandbox_id: str) -> dict[str, Any]:
        """`usage` of a sandbox the caller may see."""
        from shoal.server.deps import owned_record

        return await self.usage(owned_record(self.st, who, sandbox_id))

    # ---- events ---------------------------------------------------------------------------------
    async def sandbox_events(self, who: Any, sandbox_id: str, *, commands: bool = False) -> list[dict[str, Any]]:
        """A sandbox's events (or commands), also after it was closed; another project's are not found."""
        from shoal.records import check_sandbox_id

        check_sandbox_id(sandbox_id)
        self.events.refresh()
        evs = self.events.of(sandbox_id)
        project = evs[0].get("project") if evs else None
        if project is None:
            with contextlib.suppress(SandboxNotFound):
                project = self.node.record(sandbox_id).project
        if project is None or (not who.admin and project != who.project):
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} (nor events of one)")
        return self.events.of(sandbox_id, commands=True) if commands else evs

    async def recent_events(self, who: Any, *, kinds: list[str] | None = None, since: float | None = None,
                            limit: int = 200, project: str | None = None) -> list[dict[str, Any]]:
        """The newest lifecycle events of the caller's sandboxes."""
        self.events.refresh()
        scope = _scope(who) or project
        return self.events.query(project=scope, kinds=kinds, since=since, limit=limit)

    # ---- images ---------------------------------------------------------------------------------
    async def image_users(self, who: Any) -> dict[str, Any]:
        """How many live sandboxes (of the caller's project; admin: all) use each image and each layer."""
        scope = _scope(who)
        images: Counter[str] = Counter()
        layers: Counter[str] = Counter()
        for r in await self.index.fresh():
            if scope is not None and r["project"] != scope:
                continue
            images[r["image"]] += 1
            for h in r.get("layers") or ():
                layers[h] += 1
        return {"images": dict(images), "layers": dict(layers)}


class ClusterView:
    """The observability side of a cluster gateway: every question goes to the node agents' own APIs
    (answered there by a NodeView) and the answers are merged; the gateway adds its own `lost` events."""

    kind = "cluster"

    def __init__(self, st: ServerState, transport: ClusterTransport) -> None:
        self.st = st
        self.front = st.node
        #: the gateway's transport to the node agents (Front.cluster_transport)
        self.transport = transport
        self.log = EventLog.from_settings(self.front.paths.home, "gateway", settings())
        self.events = EventIndex(self.front.paths.home)
        self.live = LiveStats(lambda: self._figures)
        self._figures: dict[str, Any] = {}
        self._lost_seen: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Sample the gateway's own latencies and the cluster's totals."""
        self.live.start()
        self._task = asyncio.get_running_loop().create_task(self._figures_loop(), name="shoal-cluster-figures")

    async def stop(self) -> None:
        """Stop sampling."""
        await self.live.stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def _figures_loop(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                self._figures = _sum_figures(await self.nodes())
            await asyncio.sleep(self.live.interval_s)

    # ---- fan-out --------------------------------------------------------------------------------
    async def node_ids(self) -> list[str]:
        return [s["node_id"] for s in await self.transport.states(max_age_s=1.0)]

    async def _ask(self, node_id: str, path: str, params: Any = None) -> Any:
        return await self.transport.node_json(node_id, "GET", path, params=params)

    async def _ask_all(self, path: str, params: Any = None) -> dict[str, Any]:
        nids = await self.node_ids()

        async def one(nid: str) -> Any:
            try:
                return await self._ask(nid, path, params)
            except ShoalError:
                return None
        got = await asyncio.gather(*(one(n) for n in nids))
        return {n: g for n, g in zip(nids, got, strict=True) if g is not None}

    # ---- figures --------------------------------------------------------------------------------
    async def nodes(self) -> list[dict[str, Any]]:
        """Every node agent with health and load (nodes that are gone, with their sandboxes, as `lost`)."""
        states = await self.transport.states(max_age_s=1.0)
        out = []
        for s in states:
            mem = dict(s.get("memory") or {})
            sb = dict(s.get("sandboxes") or {})
            out.append({"node_id": s["node_id"], "health": "ok", "load1": (s.get("cpus") or {}).get("load1"),
                        "cpus": (s.get("cpus") or {}).get("count"), "memory": mem,
                        "sandboxes": {"running": sb.get("running", 0), "paused": sb.get("paused", 0),
                                      "creating": sb.get("creating", 0)},
                        "backends": s.get("backends", []), "runtimes": s.get("runtimes", []), "url": s.get("url")})
        for nid, n in (await self._lost_counts()).items():
            out.append({"node_id": nid, "health": "lost", "sandboxes": {"lost": n}, "memory": {}, "backends": []})
        return out

    async def _lost_counts(self) -> dict[str, int]:
        counts: Counter[str] = Counter()
        with contextlib.suppress(ShoalError):
            for info in await self.transport.lost_sandboxes():
                counts[info.node] += 1
        return dict(counts)

    async def stats(self, since: float | None = None) -> dict[str, Any]:
        """Each node's series (from its agent) and the total: the gateway's own create/exec latencies with
        the cluster's summed sandboxes and memory."""
        params = [("since", repr(since))] if since is not None else None
        per = await self._ask_all("/v1/stats", params)
        nodes = {nid: (d.get("total") or []) for nid, d in per.items()}
        return {"interval_s": self.live.interval_s, "nodes": nodes, "total": self.live.series(since)}

    # ---- sandboxes ------------------------------------------------------------------------------
    async def page(self, who: Any, q: SandboxQuery) -> dict[str, Any]:
        """A page merged from every node's page of the same query (each asked for offset+limit rows)."""
        scope = _scope(who)
        if scope is not None:
            q.project = scope
        params = q.to_params(offset=0, limit=min(q.offset + q.limit, 100_000))
        per = await self._ask_all("/v1/sandboxes/page", params)
        pages = list(per.values())
        lost = await self._lost_rows(q)
        if lost:
            pages.append(page_rows(lost, SandboxQuery(**{**q.__dict__, "offset": 0,
                                                          "limit": q.offset + q.limit})))
        return merge_pages(pages, q)

    async def _lost_rows(self, q: SandboxQuery) -> list[dict[str, Any]]:
        from shoal.spec import SandboxSpec

        rows: list[dict[str, Any]] = []
        with contextlib.suppress(ShoalError):
            for i in await self.transport.lost_sandboxes():
                spec = SandboxSpec.from_wire(i.spec)  # (what the node's index in the KV kept of it)
                if i.id not in self._lost_seen:
                    self._lost_seen.add(i.id)
                    self.events.refresh()
                    if not any(e.get("kind") == "lost" for e in self.events.of(i.id)):
                        self.log.emit("lost", i.id, spec.project, node=i.node,
                                      reason=f"node {i.node} has left the cluster")
                rows.append({"id": i.id, "project": spec.project, "state": "lost",
                             "backend": i.backend, "image": i.image, "created_at": i.created_at,
                             "expires_at": i.expires_at, "labels": i.labels, "job": i.labels.get(LABEL_JOB),
                             "cpus": spec.cpus, "memory_mb": spec.memory_mb, "node": i.node,
                             "runtime": i.runtime})
        rows.sort(key=lambda r: r["created_at"])  # oldest first, like a node's index
        return rows

    async def sandbox_usage(self, who: Any, sandbox_id: str) -> dict[str, Any]:
        """Asked of the sandbox's node."""
        from shoal.records import node_of
        from shoal.server.deps import owned

        await owned(self.st, who, sandbox_id)
        return dict(await self._ask(node_of(sandbox_id), f"/v1/sandboxes/{sandbox_id}/usage"))

    # ---- events ---------------------------------------------------------------------------------
    async def sandbox_events(self, who: Any, sandbox_id: str, *, commands: bool = False) -> list[dict[str, Any]]:
        """The node's events of the sandbox, plus the gateway's own (`lost`)."""
        from shoal.records import check_sandbox_id, node_of

        check_sandbox_id(sandbox_id)
        self.events.refresh()
        evs: list[dict[str, Any]] = []
        with contextlib.suppress(ShoalError):
            got = await self._ask(node_of(sandbox_id), f"/v1/sandboxes/{sandbox_id}/events",
                                  [("commands", "true" if commands else "false")])
            evs = list(got.get("events") or [])
        if not commands:
            evs += self.events.of(sandbox_id)
            evs.sort(key=lambda e: e.get("t", 0.0))
        if not evs:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} (nor events of one)")
        project = evs[0].get("project")
        if not who.admin and project != who.project:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r} (nor events of one)")
        return evs

    async def recent_events(self, who: Any, *, kinds: list[str] | None = None, since: float | None = None,
                            limit: int = 200, project: str | None = None) -> list[dict[str, Any]]:
        """The newest events of every node (and the gateway's), merged by time."""
        scope = _scope(who) or project
        params: list[tuple[str, str]] = [("limit", str(limit))]
        if scope is not None:
            params.append(("project", scope))
        if since is not None:
            params.append(("since", repr(since)))
        params += [("kind", k) for k in kinds or []]
        per = await self._ask_all("/v1/events", params)
        self.events.refresh()
        evs = [e for d in per.values() for e in d.get("events") or []]
        evs += self.events.query(project=scope, kinds=kinds, since=since, limit=limit)
        evs.sort(key=lambda e: e.get("t", 0.0))
        return evs[-limit:]

    async def image_users(self, who: Any) -> dict[str, Any]:
        """Users of images and layers summed over the nodes."""
        scope = _scope(who)
        params = [("project", scope)] if scope is not None else None
        per = await self._ask_all("/v1/ui/image-users", params)
        images: Counter[str] = Counter()
        layers: Counter[str] = Counter()
        for d in per.values():
            images.update(d.get("images") or {})
            layers.update(d.get("layers") or {})
        return {"images": dict(images), "layers": dict(layers)}


def _sum_figures(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    states: Counter[str] = Counter()
    mem: dict[str, int | float] = {}  # some figures are fractional MB
    for n in nodes:
        if n.get("health") != "ok":
            continue
        states.update({k: int(v) for k, v in (n.get("sandboxes") or {}).items()})
        for k in ("committed_mb", "used_mb", "total_mb", "limit_mb", "reclaimed_mb", "available_mb"):
            v = (n.get("memory") or {}).get(k)
            if isinstance(v, (int, float)):
                mem[k] = mem.get(k, 0) + v
    return {"states": dict(states), "memory": mem}


def view_for(st: ServerState) -> NodeView | ClusterView:
    """The view of a server's node front (see the module doc): its embedded node's, or its cluster's."""
    node = st.node.local_node()
    if node is not None:
        return NodeView(st, node)
    transport = st.node.cluster_transport()
    if transport is None:
        raise TypeError(f"a {st.node.kind} front with neither an embedded node nor a cluster transport")
    return ClusterView(st, transport)
