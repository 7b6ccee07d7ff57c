"""The host's memory as admission and the pressure response see it: /proc/meminfo and PSI.

`sample()` is cheap enough for every create (at most 20 reads a second; a burst asks hundreds of times
a second). PSI (pressure stall information, /proc/pressure/memory, Linux >= 4.20) says how much of the
last 10 s tasks spent stalled waiting for memory: `some` = at least one task, `full` = every non-idle
task at once (the host was thrashing). Where the kernel has no PSI the figures are None.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

MIB = 1 << 20


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo in KiB."""
    out = {}
    with open(path) as f:
        for line in f:
            k, _, v = line.partition(":")
            parts = v.split()
            if parts and parts[0].isdigit():
                out[k] = int(parts[0])
    return out


def parse_psi(text: str) -> dict[str, dict[str, float]]:
    """The lines of a /proc/pressure/* file: {"some": {"avg10": .., "avg60": .., "avg300": .., "total": ..},
    "full": {...}} (avg* in percent, total in microseconds)."""
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        vals = {}
        for item in rest.split():
            k, _, v = item.partition("=")
            try:
                vals[k] = float(v)
            except ValueError:
                continue
        if kind in ("some", "full"):
            out[kind] = vals
    return out


def psi(resource: str = "memory") -> dict[str, dict[str, float]] | None:
    """Pressure stall information of the host for `resource` (memory, cpu, io); None without PSI."""
    try:
        with open(f"/proc/pressure/{resource}") as f:
            return parse_psi(f.read())
    except OSError:
        return None


@dataclass(frozen=True)
class MemorySample:
    """The host's memory at one instant (MiB; PSI in percent of the last 10 s, None without PSI)."""

    total_mb: int
    #: MemAvailable: free memory plus what the kernel can reclaim without swapping (page cache, slab)
    available_mb: int
    free_mb: int
    swap_total_mb: int = 0
    swap_free_mb: int = 0
    psi_some10: float | None = None
    psi_full10: float | None = None
    at: float = 0.0

    @property
    def used_mb(self) -> int:
        """What the kernel cannot give back without swapping or killing (total − available)."""
        return max(0, self.total_mb - self.available_mb)


def read_sample() -> MemorySample:
    """A fresh MemorySample from /proc/meminfo and /proc/pressure/memory."""
    info = meminfo()
    p = psi("memory")
    return MemorySample(
        total_mb=info.get("MemTotal", 0) // 1024, available_mb=info.get("MemAvailable", 0) // 1024,
        free_mb=info.get("MemFree", 0) // 1024, swap_total_mb=info.get("SwapTotal", 0) // 1024,
        swap_free_mb=info.get("SwapFree", 0) // 1024,
        psi_some10=p["some"].get("avg10") if p and "some" in p else None,
        psi_full10=p["full"].get("avg10") if p and "full" in p else None, at=time.monotonic())


_TTL_S = 0.05
_cached: MemorySample | None = None


def sample(max_age_s: float = _TTL_S) -> MemorySample:
    """The host's memory, read at most every `max_age_s` (a burst asks for admission hundreds of times a
    second; 20 reads a second are enough)."""
    global _cached
    c = _cached
    if c is None or time.monotonic() - c.at > max_age_s:
        c = _cached = read_sample()
    return c
