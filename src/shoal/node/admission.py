"""Admission at the node: the node has the final say on whether a new sandbox fits (as in DSec's edge).

Memory is oversubscribed on purpose (90% of agent sandboxes idle), but bounded: the node refuses
when promised memory passes `memory_overcommit` × RAM, or when little memory is actually free.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from shoal.errors import CapacityExceeded
from shoal.models import SandboxSpec

if TYPE_CHECKING:
    from shoal.node.node import Node


def meminfo() -> dict[str, int]:
    """/proc/meminfo in KiB."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            parts = v.split()
            if parts and parts[0].isdigit():
                out[k] = int(parts[0])
    return out


_MEMINFO_TTL_S = 0.05
_cached: tuple[float, dict[str, int]] = (-1.0, {})


def _recent_meminfo() -> dict[str, int]:
    # a burst asks for admission hundreds of times a second; /proc/meminfo 20 times a second is enough
    global _cached
    now = time.monotonic()
    if now - _cached[0] > _MEMINFO_TTL_S:
        _cached = (now, meminfo())
    return _cached[1]


def check_admission(node: Node, spec: SandboxSpec) -> None:
    """Raise CapacityExceeded (HTTP 429 with Retry-After) when `spec` does not fit on this node now."""
    info = _recent_meminfo()
    total_mb = info.get("MemTotal", 0) // 1024
    avail_mb = info.get("MemAvailable", 0) // 1024
    cfg = node.config
    limit_mb = int(total_mb * cfg.memory_overcommit)
    if node._committed_mb + spec.memory_mb > limit_mb:
        raise CapacityExceeded(
            f"node memory commitment would reach {node._committed_mb + spec.memory_mb} MiB, over its limit "
            f"of {limit_mb} MiB ({cfg.memory_overcommit}x RAM); close sandboxes or ask for less memory_mb",
            retry_after_s=2.0, committed_mb=node._committed_mb, limit_mb=limit_mb)
    if avail_mb < cfg.min_free_memory_mb:
        raise CapacityExceeded(
            f"only {avail_mb} MiB of memory is free on this node (minimum {cfg.min_free_memory_mb} MiB); "
            "retry later", retry_after_s=5.0, available_mb=avail_mb)
