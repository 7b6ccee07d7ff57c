"""The scheduler's view of a cluster: node states plus the indexes that keep decisions cheap.

`Cluster` holds one `NodeState` per node and three indexes over them, kept current by its methods:

* the healthy nodes in a list (power-of-k-choices samples it in O(1) per choice);
* layer digest -> nodes holding it (image locality without a scan);
* a lazy max-heap of promised-memory headroom (the fallback when sampling finds no room: O(log n));
* per node and priority class, a lazy min-heap of tracked sandboxes by last call (preemption and tides
  find the longest-idle sandboxes of the lowest classes in O(k log n), without a scan).

Drivers change the view only through the methods below (a node report, a placement reserved, a
sandbox closed, paused, resumed, a mount finished), so the indexes never go stale. No I/O, no clock,
no threads: the caller owns the time and the randomness seed.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable, Iterator

from shoal.errors import InvalidRequest
from shoal.sched.policy import Policy
from shoal.sched.state import NodeState, Placement, Request, SandboxView


class _IdSet:
    """A set of node ids with O(1) add, remove and random choice."""

    __slots__ = ("ids", "pos")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.pos: dict[str, int] = {}

    def add(self, nid: str) -> None:
        if nid not in self.pos:
            self.pos[nid] = len(self.ids)
            self.ids.append(nid)

    def discard(self, nid: str) -> None:
        i = self.pos.pop(nid, None)
        if i is None:
            return
        last = self.ids.pop()
        if i < len(self.ids):
            self.ids[i] = last
            self.pos[last] = i

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, nid: object) -> bool:
        return nid in self.pos


class Cluster:
    """Node states and their indexes (see the module docstring). Pass it to `place`, `place_many`, ..."""

    def __init__(self, nodes: Iterable[NodeState] = (), policy: Policy | None = None, seed: int | None = 0) -> None:
        self.policy = policy or Policy()
        self.rng = random.Random(seed)
        self._nodes: dict[str, NodeState] = {}
        self._up = _IdSet()
        # healthy nodes with a free cold-mount slot (power-of-k samples these for a cold request)
        self._mount_free = _IdSet()
        self._layer_nodes: dict[str, _IdSet] = {}
        self._heap: list[tuple[float, str, int]] = []
        # node id -> priority rank -> heap of (last_used, seq, view); stale entries are skipped lazily
        self._idle: dict[str, dict[int, list[tuple[float, int, SandboxView]]]] = {}
        self._idle_len: dict[str, int] = {}
        # sandbox id -> seq of its newest heap entry (older entries of it are stale)
        self._idle_key: dict[str, int] = {}
        self._seq = 0
        for n in nodes:
            self.upsert(n)

    # ---- reading ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[NodeState]:
        return iter(self._nodes.values())

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def node(self, node_id: str) -> NodeState:
        """The state of one node (KeyError when unknown)."""
        return self._nodes[node_id]

    def healthy_ids(self) -> list[str]:
        """Ids of the nodes that take new sandboxes (do not modify the list)."""
        return self._up.ids

    def mount_free_ids(self) -> list[str]:
        """Ids of the healthy nodes that may start a cold layer mount now (do not modify the list)."""
        return self._mount_free.ids

    def nodes_with_layer(self, digest: str) -> list[str]:
        """Ids of the nodes that hold a layer (do not modify the list)."""
        s = self._layer_nodes.get(digest)
        return s.ids if s is not None else []

    def free_mb(self, node: NodeState) -> float:
        """Promised memory the node can still give (its headroom; paused memory at the policy's weight)."""
        return node.mem_limit_mb - node.committed_mb - self.policy.paused_commit_weight * node.paused_mb

    def most_free(self) -> NodeState | None:
        """The healthy node with the most promised-memory headroom (O(log n) amortized)."""
        h = self._heap
        while h:
            _, nid, ver = h[0]
            n = self._nodes.get(nid)
            if n is not None and n.version == ver and n.healthy:
                return n
            heapq.heappop(h)
        return None

    # ---- node reports ----------------------------------------------------------------------------
    def upsert(self, node: NodeState) -> None:
        """Add a node or replace its state with a fresh report (re-indexes its layers and health)."""
        old = self._nodes.get(node.node_id)
        if old is not None and old is not node:
            for d in old.layers - node.layers:
                self._unindex_layer(node.node_id, d)
            node.version = old.version + 1
        self._nodes[node.node_id] = node
        for d in node.layers:
            self._index_layer(node.node_id, d)
        self._idle_rebuild(node)
        if node.healthy:
            self._up.add(node.node_id)
        else:
            self._up.discard(node.node_id)
        self._mount_slots(node)
        self._touch(node)

    def remove(self, node_id: str) -> NodeState | None:
        """Forget a node (it left the cluster)."""
        node = self._nodes.pop(node_id, None)
        if node is not None:
            self._up.discard(node_id)
            self._mount_free.discard(node_id)
            self._idle.pop(node_id, None)
            self._idle_len.pop(node_id, None)
            for d in node.layers:
                self._unindex_layer(node_id, d)
        return node

    def set_healthy(self, node_id: str, healthy: bool) -> None:
        """Mark a node (un)able to take new sandboxes."""
        node = self._nodes[node_id]
        node.healthy = healthy
        (self._up.add if healthy else self._up.discard)(node_id)
        self._mount_slots(node)
        self._touch(node)

    # ---- accounting (a driver calls these as things happen) --------------------------------------
    def reserve(self, placement: Placement, req: Request, count: int = 1) -> NodeState:
        """Count `count` copies of `req` on the placement's node now (before the node confirms)."""
        node = self._nodes[placement.node_id]
        node.committed_mb += req.memory_mb * count
        node.committed_cpus += req.cpus * count
        node.running += count
        bp = node.by_priority
        bp[req.priority] = bp.get(req.priority, 0) + count
        bj = node.by_job
        bj[req.job] = bj.get(req.job, 0) + count
        if placement.cold_layers:
            self.mount_started(node, placement.cold_layers)
        self._touch(node)
        return node

    def release(self, node_id: str, req: Request, count: int = 1, *, paused: bool = False) -> None:
        """Undo `reserve` (the node refused, the create failed) or account closed sandboxes."""
        node = self._nodes.get(node_id)
        if node is None:
            return
        if paused:
            node.paused_mb -= req.memory_mb * count
            node.paused -= count
        else:
            node.committed_mb -= req.memory_mb * count
            node.committed_cpus -= req.cpus * count
            node.running -= count
        bp = node.by_priority
        left = bp.get(req.priority, 0) - count
        if left > 0:
            bp[req.priority] = left
        else:
            bp.pop(req.priority, None)
        bj = node.by_job
        left = bj.get(req.job, 0) - count
        if left > 0:
            bj[req.job] = left
        else:
            bj.pop(req.job, None)
        self._touch(node)

    def track(self, view: SandboxView) -> None:
        """Let preemption and tides consider a live sandbox."""
        node = self._nodes[view.node_id]
        node.sandboxes[view.id] = view
        self._idle_push(view)
        if self._idle_len[view.node_id] > 2 * len(node.sandboxes) + 64:
            self._idle_rebuild(node)

    def touched(self, view: SandboxView, now: float) -> None:
        """A tracked sandbox served a call at `now` (it is not idle)."""
        view.last_used = now
        if view.state == "running":
            self._idle_push(view)

    def idle_victims(self, node_id: str, lowest_rank: int, idle_before: float) -> list[SandboxView]:
        """Running tracked sandboxes of rank >= `lowest_rank` on a node whose last call was at or before
        `idle_before`: lowest class first, longest idle first inside a class. Leaves the index as it was."""
        return list(self.iter_idle(node_id, lowest_rank, idle_before))

    def iter_idle(self, node_id: str, lowest_rank: int, idle_before: float) -> Iterator[SandboxView]:
        """`idle_victims` one at a time (O(log n) each): stop early when you have enough. Close the
        iterator (or run it out) before changing the cluster."""
        heaps = self._idle.get(node_id)
        if not heaps:
            return
        node = self._nodes[node_id]
        for rank in sorted((r for r in heaps if r >= lowest_rank), reverse=True):
            h = heaps[rank]
            taken: list[tuple[float, int, SandboxView]] = []
            try:
                while h and h[0][0] <= idle_before:
                    ent = heapq.heappop(h)
                    v = ent[2]
                    if (v.state != "running" or node.sandboxes.get(v.id) is not v
                            or self._idle_key.get(v.id) != ent[1]):
                        self._idle_len[node_id] -= 1
                        continue  # paused, closed, or filed again since: this entry is stale
                    if ent[0] != v.last_used:
                        # the driver moved last_used without touched(): file it under its new time
                        self._idle_len[node_id] -= 1
                        self._idle_push(v)
                        continue
                    taken.append(ent)
                    yield v
            finally:
                for ent in taken:
                    heapq.heappush(h, ent)

    def untrack(self, node_id: str, sandbox_id: str) -> SandboxView | None:
        """Forget a sandbox (closed)."""
        node = self._nodes.get(node_id)
        self._idle_key.pop(sandbox_id, None)
        return node.sandboxes.pop(sandbox_id, None) if node is not None else None

    def paused(self, view: SandboxView, returned_mb: int = 0) -> None:
        """A running sandbox was paused; `returned_mb` of used memory went back to the host."""
        node = self._nodes[view.node_id]
        if view.state == "paused":
            return
        view.state = "paused"
        node.committed_mb -= view.memory_mb
        node.committed_cpus -= view.cpus
        node.paused_mb += view.memory_mb
        node.running -= 1
        node.paused += 1
        node.used_mb -= returned_mb
        self._touch(node)

    def resumed(self, view: SandboxView, now: float, taken_mb: int = 0) -> None:
        """A paused sandbox runs again; it holds `taken_mb` more memory."""
        node = self._nodes[view.node_id]
        if view.state != "paused":
            return
        view.state = "running"
        view.last_used = now
        node.committed_mb += view.memory_mb
        node.committed_cpus += view.cpus
        node.paused_mb -= view.memory_mb
        node.running += 1
        node.paused -= 1
        node.used_mb += taken_mb
        if node.sandboxes.get(view.id) is view:
            self._idle_push(view)
        self._touch(node)

    def mount_started(self, node: NodeState, layers: Iterable[str]) -> None:
        """The node began mounting these layers (they count for locality already)."""
        for d in layers:
            if d not in node.layers:
                node.layers.add(d)
                self._index_layer(node.node_id, d)
                node.cold_mounts += 1
        self._mount_slots(node)

    def mount_done(self, node_id: str, count: int = 1) -> None:
        """`count` of the node's layer mounts finished (its cold-mount slots free up)."""
        node = self._nodes.get(node_id)
        if node is not None:
            node.cold_mounts = max(0, node.cold_mounts - count)
            self._mount_slots(node)

    def unmounted(self, node_id: str, layers: Iterable[str]) -> None:
        """The node let these layers go (no sandbox uses them)."""
        node = self._nodes.get(node_id)
        if node is None:
            return
        for d in layers:
            if d in node.layers:
                node.layers.discard(d)
                self._unindex_layer(node_id, d)

    # ---- internals ---------------------------------------------------------------------------------
    def _mount_slots(self, node: NodeState) -> None:
        if node.healthy and (not node.cold_slots or node.cold_mounts < node.cold_slots):
            self._mount_free.add(node.node_id)
        else:
            self._mount_free.discard(node.node_id)

    def _touch(self, node: NodeState) -> None:
        node.version += 1
        if node.healthy:
            heapq.heappush(self._heap, (-self.free_mb(node), node.node_id, node.version))
            if len(self._heap) > 8 * len(self._nodes) + 64:
                self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(-self.free_mb(n), n.node_id, n.version) for n in self._nodes.values() if n.healthy]
        heapq.heapify(self._heap)

    def _idle_push(self, view: SandboxView) -> None:
        self._seq += 1
        heaps = self._idle.setdefault(view.node_id, {})
        h = heaps.get(view.priority)
        if h is None:
            h = heaps[view.priority] = []
        heapq.heappush(h, (view.last_used, self._seq, view))
        self._idle_key[view.id] = self._seq
        self._idle_len[view.node_id] = self._idle_len.get(view.node_id, 0) + 1

    def _idle_rebuild(self, node: NodeState) -> None:
        heaps: dict[int, list[tuple[float, int, SandboxView]]] = {}
        for v in node.sandboxes.values():
            if v.state == "running":
                self._seq += 1
                heaps.setdefault(v.priority, []).append((v.last_used, self._seq, v))
                self._idle_key[v.id] = self._seq
        for h in heaps.values():
            heapq.heapify(h)
        self._idle[node.node_id] = heaps
        self._idle_len[node.node_id] = sum(len(h) for h in heaps.values())

    def _index_layer(self, nid: str, digest: str) -> None:
        s = self._layer_nodes.get(digest)
        if s is None:
            s = self._layer_nodes[digest] = _IdSet()
        s.add(nid)

    def _unindex_layer(self, nid: str, digest: str) -> None:
        s = self._layer_nodes.get(digest)
        if s is not None:
            s.discard(nid)
            if not s.ids:
                del self._layer_nodes[digest]


def as_cluster(nodes: Cluster | Iterable[NodeState], policy: Policy | None = None) -> Cluster:
    """`nodes` itself when it is a Cluster, else a new Cluster over a copy-free list of states."""
    if isinstance(nodes, Cluster):
        if policy is not None and policy is not nodes.policy:
            raise InvalidRequest("pass the policy when building the Cluster, not with each decision")
        return nodes
    return Cluster(nodes, policy)
