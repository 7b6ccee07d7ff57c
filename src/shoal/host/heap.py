"""This process's malloc heap (glibc): how much is in use, how much is free but kept, and giving the free
part back to the kernel.

Why the node needs it: a node churning sandboxes allocates and frees buffers from several threads (record
reads, agent frames, `asyncio.to_thread` work). glibc keeps freed chunks for reuse, and with one arena per
thread the free space scatters; over 100,000 create/exec/close cycles the node's RSS grew ~0.18 MiB per
1,000 cycles while Python's live objects and the heap in use stayed flat — all of the growth was free heap
(`shoal bench soak`, issue 24). `trim()` (malloc_trim(0)) returns whole free pages of every arena to the
kernel; the node calls it from its housekeeping loop. Elsewhere (musl, no glibc) both functions do nothing.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

MIB = 1 << 20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


@dataclass(frozen=True)
class HeapStats:
    """glibc's heap over all arenas, in bytes: `used` (allocated, mmapped chunks included), `free` (kept by
    malloc for reuse: the part `trim` can give back where it spans whole pages)."""

    used: int
    free: int


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None  # not glibc (or glibc < 2.33: no mallinfo2)
    return libc


def stats() -> HeapStats | None:
    """The heap's figures now, or None where glibc's mallinfo2 is missing."""
    libc = _libc()
    if libc is None:
        return None
    mi = libc.mallinfo2()
    return HeapStats(used=int(mi.uordblks + mi.hblkhd), free=int(mi.fordblks))


def trim() -> bool:
    """Give the heap's free pages back to the kernel (every arena); True if any memory was released. Takes
    each arena's lock in turn (a few ms with tens of MiB free): call it from a thread, not the event loop."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
