"""The bench's closed loops (shoal.bench.scenarios.common.closed_loop and create.interleaved) on stand-in
work: what they count, and that the interleaved loop keeps exactly `concurrency` items alive."""

from __future__ import annotations

import asyncio
import itertools

from shoal.bench.scenarios.common import closed_loop
from shoal.bench.scenarios.create import interleaved


async def test_closed_loop_awaits_on_item_after_each_success_and_counts_errors() -> None:
    n = itertools.count()
    seen: list[int] = []

    async def work() -> int:
        await asyncio.sleep(0.001)
        i = next(n)
        if i % 5 == 4:
            raise ValueError("every fifth fails")
        return i

    async def after(item: int) -> None:
        seen.append(item)

    t = await closed_loop(work, 3, 0.2, on_item=after)
    assert t.items and seen == t.items  # each success, in order of completion
    assert len(t.errors) >= 1 and all("every fifth fails" in e for e in t.errors)
    assert len(t.latencies) == len(t.items) == len(t.done_at)


async def test_interleaved_keeps_concurrency_alive_and_closes_everything() -> None:
    n = itertools.count()
    alive: set[int] = set()
    most = 0

    async def create() -> int:
        nonlocal most
        await asyncio.sleep(0.001)
        i = next(n)
        alive.add(i)
        most = max(most, len(alive))
        return i

    async def close(i: int) -> None:
        await asyncio.sleep(0.001)
        alive.remove(i)

    t, closes = await interleaved(create, close, 4, 0.2)
    made = len(t.latencies)
    assert made > 8 and len(closes) == made - 4  # every create after the first four replaced one
    assert most <= 4 + 4  # at most one new sandbox per worker beside the four kept alive
    assert not alive  # the last ones are closed too
