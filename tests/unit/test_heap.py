"""shoal.host.heap: the malloc heap's figures and giving its free pages back (issue 24: the node's RSS
grew with free heap, not live objects, under 100,000 cycles of churn)."""

from __future__ import annotations

import threading

import pytest

from shoal.host import heap


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


pytestmark = pytest.mark.skipif(heap.stats() is None, reason="not glibc >= 2.33 (no mallinfo2): nothing to trim")


def test_freed_scattered_memory_stays_free_heap_until_trim_gives_it_back() -> None:
    kept: list[bytes] = []

    def churn() -> None:
        # 48 MiB of 8 KiB buffers (malloc'd: beyond Python's small-object allocator), every 64th kept, so the
        # free space is scattered between live chunks and the heap's top cannot simply shrink
        bufs = [bytes(8192) for _ in range(6144)]
        kept.extend(bufs[::64])

    t = threading.Thread(target=churn)  # a thread of its own: its own arena, like the node's worker threads
    t.start()
    t.join()
    before, rss_before = heap.stats(), _rss_kib()
    assert before is not None and before.free >= 32 << 20, before
    heap.trim()
    after, rss_after = heap.stats(), _rss_kib()
    assert after is not None
    # the live chunks are untouched; the free pages between them went back to the kernel
    assert after.used >= len(kept) * 8192
    assert rss_before - rss_after >= 24 << 10, (rss_before, rss_after)
    assert len(kept) == 96 and all(len(b) == 8192 for b in kept)
