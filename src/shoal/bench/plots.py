"""PNG figures of benchmark results (matplotlib, headless): latency CDFs, rates over time, memory vs count."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

SHOAL_COLOR = "#1f77b4"
DOCKER_COLOR = "#d62728"
_OTHERS = ["#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#17becf"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(i: int, label: str) -> str:
    # Docker is always red, shoal's first series blue, anything else from a palette without either
    low = label.lower()
    if low.startswith("docker"):
        return DOCKER_COLOR
    if low.startswith("shoal") and i == 0:
        return SHOAL_COLOR
    return _OTHERS[i % len(_OTHERS)]


def latency_cdf(path: Path, series: Mapping[str, Sequence[float]], title: str, xlabel: str = "latency (ms)") -> str:
    """CDF of latencies in ms per series, log x axis. Returns the path written."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    for i, (label, xs) in enumerate(series.items()):
        if not xs:
            continue
        s = sorted(xs)
        ys = [(k + 1) / len(s) for k in range(len(s))]
        ax.step(s, ys, where="post", label=f"{label} (n={len(s)})", color=_color(i, label))
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction ≤ x")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def rate_over_time(path: Path, series: Mapping[str, tuple[Sequence[float], Sequence[float], Sequence[float]]],
                   title: str, what: str = "sandboxes") -> str:
    """How many are ready over time, per series of (t, per_s, cumulative), with each mean rate in the legend.

    Per-bucket rates are kept in the JSON but not drawn: at sub-second buckets they are spikes that hide
    the shape; the slope of the cumulative curve is the rate."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    ends = []
    for i, (label, (t, _per_s, cum)) in enumerate(series.items()):
        if not len(t):
            continue
        ends.append(max(t))
        mean = cum[-1] / max(t) if max(t) > 0 else 0.0
        ax.plot(t, cum, color=_color(i, label), lw=1.4, label=f"{label}: {cum[-1]:,.0f} in {max(t):.1f} s "
                                                               f"({mean:,.0f} {what}/s)")
    if len(ends) > 1 and min(ends) > 0 and max(ends) / min(ends) > 5:
        # series of very different lengths (shoal's seconds beside Docker's minutes): a log time axis
        # keeps the short one readable
        ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("seconds since the burst started")
    ax.set_ylabel(f"{what} ready so far")
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def memory_vs_count(path: Path, series: Mapping[str, tuple[Sequence[float], Sequence[float]]], title: str,
                    ylabel: str = "host memory used (MiB)", xlabel: str = "idle sandboxes alive") -> str:
    """Host memory (MiB) against the number of live sandboxes/containers (or another count), per series."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    for i, (label, (n, mib)) in enumerate(series.items()):
        ax.plot(n, mib, marker="o", ms=3, lw=1.2, color=_color(i, label), label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def bars(path: Path, labels: Sequence[str], values: Mapping[str, Sequence[float]], title: str, ylabel: str,
         log: bool = False) -> str:
    """Grouped bars: one group per label, one bar per series."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    k = len(values)
    width = 0.8 / max(1, k)
    for i, (name, vals) in enumerate(values.items()):
        xs = [j + (i - (k - 1) / 2) * width for j in range(len(labels))]
        ax.bar(xs, vals, width=width, label=name, color=_color(i, name))
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
