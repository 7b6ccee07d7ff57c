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
    """Memory and CPUs committed/limit/free (the node's admission figures), sandboxes by state, mounted layers
    and images in use."""
    from shoal.backends.registry import backend_names
    from shoal.records import list_records

    adm = node.admission.snapshot()
    by_state: Counter[str] = Counter()
    images: Counter[str] = Counter()
    recs = list_records(node.paths.sandboxes)
    for rec in recs:
        by_state[rec.state] += 1
        if rec.state in LIVE_STATES:
            images[rec.image] += 1
    layers = sorted(node.layer_mounts.mounted())
    # the promise policy's free memory, and what measured admission (working sets, free memory) would still
    # take: `room` more sandboxes of the expected size
    return_mem = {"total_mb": adm.total_mb, "limit_mb": adm.limit_mb, "committed_mb": adm.committed_mb,
                  "available_mb": adm.available_mb, "used_mb": adm.total_mb - adm.available_mb,
                  "free_mb": adm.free_mb, "headroom_mb": adm.headroom_mb, "room": adm.room,
                  "expected_mb": round(float(adm.expected_mb), 1),
                  "reclaimed_mb": round(sum(node.reclaimed.values()) / 2**20, 1)}
    return {
        "node_id": node.config.node_id, "ray_node_id": ray_node_id, "url": url,
        "memory": return_mem,
        "cpus": {"count": os.cpu_count() or 1, "committed": adm.committed_cpus,
                 "load1": round(os.getloadavg()[0], 2)},
        "sandboxes": dict(by_state),
        "live": sum(by_state[s] for s in LIVE_STATES),
        "layers": layers,
        # what this node may be asked to create (a backend its host cannot run answers BackendUnavailable)
        "backends": backend_names(),
        # container runtimes that passed this node's probe ("auto" takes the first of crun, runc)
        "runtimes": sorted(name for name, st in node.runtime_statuses.items() if st.works),
        "images": dict(images),
        # memory of running sandboxes idle long enough to be paused for a higher class, per class
        "idle_mb": node.scheduling.idle_mb(recs),
    }
