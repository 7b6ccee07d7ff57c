"""Placement for the cluster runtime: node agents' reports in, how many sandboxes each node gets out.

A pure function of (request, node states): no I/O, no clock; the randomness comes from the caller's
`random.Random`. The node's own admission stays the authority: the runtime places what a node refuses
again, with that node in `avoid`.

Policy (until the scheduler package `shoal.sched` of the scheduling issue replaces it, with the same
inputs and outputs): a node's room for a request is how many copies its memory commitment limit still
takes (what its admission checks); a burst is split in proportion to room (spreading), nodes that already
have the image's layers mounted weigh more (locality, at most LOCALITY_SLACK times their share); one
create is power-of-two-choices by the same score.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import Any

from shoal.models import SandboxSpec

#: extra weight of a node holding all the image's layers (1.0 = twice the share of an equal cold node)
LOCALITY_WEIGHT = 1.0
#: a warm node takes at most this multiple of its room-proportional share of a burst
LOCALITY_SLACK = 2.0

Report = Mapping[str, Any]


def room(report: Report, spec: SandboxSpec) -> int:
    """How many copies of `spec` the node's admission would still take (memory commitment)."""
    free = int(report.get("memory", {}).get("free_mb", 0))
    return max(0, free // max(1, int(spec.memory_mb)))


def warmth(report: Report, layers: tuple[str, ...]) -> float:
    """The fraction of the image's layers already mounted on the node."""
    if not layers:
        return 0.0
    have = set(report.get("layers") or ())
    return sum(1 for d in layers if d in have) / len(layers)


def split(spec: SandboxSpec, n: int, reports: Iterable[Report], *, layers: tuple[str, ...] = (),
          avoid: Iterable[str] = (), rng: random.Random | None = None) -> dict[str, int]:
    """Node id → copies, for `n` copies of `spec` (fewer in all when the cluster has less room)."""
    skip = set(avoid)
    rooms: dict[str, int] = {}
    weights: dict[str, float] = {}
    for r in reports:
        nid = str(r["node_id"])
        if nid in skip:
            continue
        k = room(r, spec)
        if k <= 0:
            continue
        rooms[nid] = k
        weights[nid] = k * min(1.0 + LOCALITY_WEIGHT * warmth(r, layers), LOCALITY_SLACK)
    if not rooms or n <= 0:
        return {}
    if n == 1:
        nid = _best_of_two(weights, rng or random.Random())
        return {nid: 1}
    if sum(rooms.values()) <= n:
        return dict(rooms)
    return _water_fill(n, rooms, weights)


def pick_one(reports: Iterable[Report], rng: random.Random | None = None) -> str:
    """Any node for work that is not a sandbox of its own (images, run_code): power of two choices by
    free memory."""
    weights = {str(r["node_id"]): float(r.get("memory", {}).get("free_mb", 0)) + 1.0 for r in reports}
    if not weights:
        raise ValueError("no nodes")
    return _best_of_two(weights, rng or random.Random())


def _best_of_two(weights: dict[str, float], rng: random.Random) -> str:
    ids = sorted(weights)
    if len(ids) == 1:
        return ids[0]
    a, b = rng.sample(ids, 2)
    return a if weights[a] >= weights[b] else b


def _water_fill(n: int, rooms: dict[str, int], weights: dict[str, float]) -> dict[str, int]:
    """`n` copies in proportion to `weights`, no node over its room (largest remainder)."""
    counts = dict.fromkeys(rooms, 0)
    open_ = set(rooms)
    left = n
    while left > 0 and open_:
        total = sum(weights[i] for i in open_)
        shares = {i: left * weights[i] / total for i in open_}
        full = [i for i in open_ if counts[i] + shares[i] >= rooms[i]]
        if full:
            for i in full:
                left -= rooms[i] - counts[i]
                counts[i] = rooms[i]
                open_.discard(i)
            continue
        base = {i: int(shares[i]) for i in open_}
        for i, k in base.items():
            counts[i] += k
        left -= sum(base.values())
        for i in sorted(open_, key=lambda i: (shares[i] - base[i], i), reverse=True)[:left]:
            counts[i] += 1
        left = 0
    return {i: k for i, k in counts.items() if k > 0}
