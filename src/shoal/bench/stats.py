"""Small statistics for benchmark samples: percentiles, latency summaries, rates over time."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def percentile(xs: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100) by linear interpolation between closest ranks; NaN when empty."""
    if not xs:
        return math.nan
    s = sorted(xs)
    if len(s) == 1:
        return float(s[0])
    k = (len(s) - 1) * p / 100.0
    lo = math.floor(k)
    hi = math.ceil(k)
    return float(s[lo] + (s[hi] - s[lo]) * (k - lo))


def latency_summary(seconds: Sequence[float]) -> dict[str, Any]:
    """n, p50, p90, p99, mean, min, max of latencies given in seconds, reported in milliseconds."""
    if not seconds:
        return {"n": 0}
    ms = [x * 1000.0 for x in seconds]
    return {"n": len(ms), "p50_ms": round(percentile(ms, 50), 3), "p90_ms": round(percentile(ms, 90), 3),
            "p99_ms": round(percentile(ms, 99), 3), "mean_ms": round(statistics.fmean(ms), 3),
            "min_ms": round(min(ms), 3), "max_ms": round(max(ms), 3)}


def rate_timeline(done_at: Sequence[float], bucket_s: float = 0.1, start: float = 0.0) -> dict[str, list[float]]:
    """Completions per second in buckets of `bucket_s`, from times (seconds since `start`) at which items finished."""
    if not done_at:
        return {"t_s": [], "per_s": [], "cumulative": []}
    end = max(done_at) - start
    nb = max(1, math.ceil(end / bucket_s + 1e-9))
    counts = [0] * nb
    for t in done_at:
        i = min(nb - 1, max(0, int((t - start) / bucket_s)))
        counts[i] += 1
    cum, total = [], 0
    for c in counts:
        total += c
        cum.append(total)
    return {"t_s": [round((i + 1) * bucket_s, 4) for i in range(nb)],
            "per_s": [round(c / bucket_s, 2) for c in counts], "cumulative": cum}


def linear_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys over xs (NaN with fewer than two distinct xs)."""
    if len(xs) < 2 or len(set(xs)) < 2:
        return math.nan
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    num = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    den = sum((x - mx) ** 2 for x in xs)
    return num / den


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or not b or (isinstance(a, float) and math.isnan(a)) or \
            (isinstance(b, float) and math.isnan(b)):
        return None
    return a / b
