"""A node's state as placement and `shoal cluster status` see it, read from the node's public surface
(its records, its layer mounts, the host's memory)."""

from __future__ import annotations

import os
from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.node.node import Node

LIVE_STATES = ("creating", "running", "paused")


def node_state(node: Node, *, ray_node_id: str = "", url: str = "") -> dict[str, Any]:
    """Memory and CPUs committed/limit/free, sandboxes by state, mounted layers and images in use."""
    from shoal.node.admission import meminfo
    from shoal.node.records import list_records

    mi = meminfo()
    total_mb = mi.get("MemTotal", 0) // 1024
    avail_mb = mi.get("MemAvailable", 0) // 1024
    limit_mb = int(total_mb * node.config.memory_overcommit)
    by_state: Counter[str] = Counter()
    committed_mb = 0
    committed_cpus = 0.0
    images: Counter[str] = Counter()
    for rec in list_records(node.paths.sandboxes):
        by_state[rec.state] += 1
        if rec.state in LIVE_STATES:
            committed_mb += int(rec.spec.get("memory_mb", 0))
            committed_cpus += float(rec.spec.get("cpus", 0))
            images[rec.image] += 1
    layers = sorted(node.layer_mounts.mounted())
    ncpu = os.cpu_count() or 1
    # what admission would still accept now (it also refuses outright while free memory is low)
    free_mb = max(0, limit_mb - committed_mb) if avail_mb >= node.config.min_free_memory_mb else 0
    return {
        "node_id": node.config.node_id, "ray_node_id": ray_node_id, "url": url,
        "memory": {"total_mb": total_mb, "limit_mb": limit_mb, "committed_mb": committed_mb,
                   "available_mb": avail_mb, "used_mb": total_mb - avail_mb, "free_mb": free_mb},
        "cpus": {"count": ncpu, "committed": round(committed_cpus, 3),
                 "load1": round(os.getloadavg()[0], 2)},
        "sandboxes": dict(by_state),
        "live": sum(by_state[s] for s in LIVE_STATES),
        "layers": layers,
        # what this node may be asked to create (a backend its host cannot run answers BackendUnavailable)
        "backends": ["container", "microvm", "vm"],
        "images": dict(images),
    }
