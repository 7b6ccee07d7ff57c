"""Prometheus metrics of one API server: sandboxes alive by state, create/exec latency, errors by code.

Each app gets its own registry (several apps may live in one process, e.g. in tests).
"""

from __future__ import annotations

import asyncio
import collections
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shoal.node.events import LIFECYCLE
from shoal.records import list_records

if TYPE_CHECKING:
    from shoal.front import Front
    from shoal.node.node import Node
    from shoal.server.limits import TokenLimiter

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
STATES = ("creating", "running", "paused", "stopping", "failed")


class _NodeCollector(Collector):
    """Reads the node's records at scrape time (the records are the truth, not a counter)."""

    def __init__(self, node: Node, limiter: TokenLimiter) -> None:
        self.node = node
        self.limiter = limiter

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        by_state: collections.Counter[str] = collections.Counter()
        by_project: collections.Counter[str] = collections.Counter()
        mem = 0
        for rec in list_records(self.node.paths.sandboxes):
            by_state[rec.state] += 1
            by_project[rec.project] += 1
            if rec.state in ("creating", "running", "paused"):
                mem += int(rec.spec.memory_mb)
        g = GaugeMetricFamily("shoal_sandboxes", "Sandboxes on this node by state", labels=["state"])
        for st in sorted(set(STATES) | set(by_state)):
            g.add_metric([st], by_state.get(st, 0))
        yield g
        p = GaugeMetricFamily("shoal_project_sandboxes", "Sandboxes on this node by project", labels=["project"])
        for proj, n in sorted(by_project.items()):
            p.add_metric([proj], n)
        yield p
        yield GaugeMetricFamily("shoal_committed_memory_mb", "Memory promised to live sandboxes (MiB)", value=mem)
        snap = self.node.admission.snapshot()
        yield GaugeMetricFamily("shoal_memory_total_mb", "The host's memory (MiB)", value=snap.total_mb)
        yield GaugeMetricFamily("shoal_memory_used_mb", "The host's memory in use: total - available (MiB)",
                                value=snap.total_mb - snap.available_mb)
        yield GaugeMetricFamily("shoal_memory_limit_mb", "The node's promise limit: overcommit x RAM (MiB)",
                                value=snap.limit_mb)
        yield GaugeMetricFamily("shoal_memory_paused_mb", "Memory promised to paused sandboxes (MiB)",
                                value=snap.paused_mb)
        yield GaugeMetricFamily("shoal_memory_reclaimed_mb", "Memory the last pause of each paused sandbox "
                                "reclaimed (MiB)", value=round(sum(self.node.reclaimed.values()) / 2**20, 2))
        yield GaugeMetricFamily("shoal_admission_room", "More sandboxes of the expected size measured admission "
                                "would take now", value=snap.room)
        yield GaugeMetricFamily("shoal_node_load1", "The host's 1-minute load average", value=os.getloadavg()[0])
        ev = CounterMetricFamily("shoal_sandbox_events", "Sandbox events this node process logged, by kind",
                                 labels=["kind"])
        for kind in LIFECYCLE:
            ev.add_metric([kind], self.node.events.counts.get(kind, 0))
        yield ev
        inflight = GaugeMetricFamily("shoal_api_inflight_requests", "API requests in progress (all tokens)",
                                     value=sum(self.limiter.stats().values()))
        yield inflight


class Metrics:
    """The metric objects the routes update."""

    def __init__(self, front: Front, limiter: TokenLimiter) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.create_seconds = Histogram("shoal_create_seconds", "Time to create one sandbox (until its agent "
                                        "answers), as seen by the API server", ["backend"], buckets=_LAT, registry=r)
        self.exec_seconds = Histogram("shoal_exec_seconds", "Round trip of one exec or shell command, as seen by "
                                      "the API server", ["kind"], buckets=_LAT, registry=r)
        self.errors = Counter("shoal_api_errors_total", "Error responses by error code", ["code"], registry=r)
        self.requests = Counter("shoal_api_requests_total", "API requests by route and status",
                                ["method", "route", "status"], registry=r)
        self.request_seconds = Histogram("shoal_api_request_seconds", "API request latency by route",
                                         ["method", "route"], buckets=_LAT, registry=r)
        node = front.local_node()
        if node is not None:  # a cluster gateway's front has no records of its own: its nodes report
            r.register(_NodeCollector(node, limiter))


async def cluster_metrics(view: Any, own: CollectorRegistry) -> bytes:
    """A gateway's /metrics: every node agent's metrics with a `node` label, the gateway's own with
    node="gateway", and cluster totals (nodes by health, sandboxes by state), as one exposition."""
    from prometheus_client import generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    nids = await view.node_ids()

    async def one(nid: str) -> tuple[str, str | None]:
        try:
            return nid, await view.front.transport.node_text(nid, "/metrics")
        except Exception:
            return nid, None
    texts = await asyncio.gather(*(one(n) for n in nids))
    fams: dict[str, Metric] = {}

    def take(fam: Metric, node: str) -> None:
        out = fams.get(fam.name)
        if out is None:
            out = fams[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
        elif out.type != fam.type:
            return
        out.samples += [s._replace(labels={**s.labels, "node": node}) for s in fam.samples]

    for nid, text in texts:
        if text:
            for fam in text_string_to_metric_families(text):
                take(fam, nid)
    for fam in own.collect():
        take(fam, "gateway")
    nodes = await view.nodes()
    health = GaugeMetricFamily("shoal_cluster_nodes", "Node agents of the cluster by health", labels=["health"])
    for h in ("ok", "lost"):
        health.add_metric([h], sum(1 for n in nodes if n.get("health") == h))
    states: collections.Counter[str] = collections.Counter()
    for n in nodes:
        states.update({k: int(v) for k, v in (n.get("sandboxes") or {}).items()})
    sb = GaugeMetricFamily("shoal_cluster_sandboxes", "Sandboxes of the whole cluster by state", labels=["state"])
    for st in sorted(set(STATES) | set(states) | {"lost"}):
        sb.add_metric([st], states.get(st, 0))
    fams[health.name], fams[sb.name] = health, sb

    class _Merged(Collector):
        def collect(self) -> Iterator[Metric]:
            yield from fams.values()

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Merged())
    return generate_latest(reg)
