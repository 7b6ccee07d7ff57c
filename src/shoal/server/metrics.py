"""Prometheus metrics of one API server: sandboxes alive by state, create/exec latency, errors by code.

Each app gets its own registry (several apps may live in one process, e.g. in tests).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from shoal.node.records import list_records

if TYPE_CHECKING:
    from shoal.node.node import Node
    from shoal.server.limits import TokenLimiter

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
STATES = ("creating", "running", "paused", "stopping", "failed")


class _NodeCollector(Collector):
    """Reads the node's records at scrape time (the records are the truth, not a counter)."""

    def __init__(self, node: Node, limiter: TokenLimiter) -> None:
        self.node = node
        self.limiter = limiter

    def collect(self) -> Iterator[GaugeMetricFamily]:
        by_state: collections.Counter[str] = collections.Counter()
        by_project: collections.Counter[str] = collections.Counter()
        mem = 0
        for rec in list_records(self.node.paths.sandboxes):
            by_state[rec.state] += 1
            by_project[rec.project] += 1
            if rec.state in ("creating", "running", "paused"):
                mem += int(rec.spec.get("memory_mb", 0))
        g = GaugeMetricFamily("shoal_sandboxes", "Sandboxes on this node by state", labels=["state"])
        for st in sorted(set(STATES) | set(by_state)):
            g.add_metric([st], by_state.get(st, 0))
        yield g
        p = GaugeMetricFamily("shoal_project_sandboxes", "Sandboxes on this node by project", labels=["project"])
        for proj, n in sorted(by_project.items()):
            p.add_metric([proj], n)
        yield p
        yield GaugeMetricFamily("shoal_committed_memory_mb", "Memory promised to live sandboxes (MiB)", value=mem)
        inflight = GaugeMetricFamily("shoal_api_inflight_requests", "API requests in progress (all tokens)",
                                     value=sum(self.limiter.stats().values()))
        yield inflight


class Metrics:
    """The metric objects the routes update."""

    def __init__(self, node: Node, limiter: TokenLimiter) -> None:
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
        r.register(_NodeCollector(node, limiter))
