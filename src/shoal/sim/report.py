"""What `shoal sim` writes: result JSON, PNG figures (matplotlib, headless) and a text summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shoal.sim.engine import SimResult

_PRIO_COLORS = {"train-rollout": "#d62728", "eval": "#ff7f0e", "interactive": "#1f77b4", "batch": "#7f7f7f"}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    if x < 1:
        return f"{x * 1000:.0f} ms"
    if x < 120:
        return f"{x:.1f} s"
    return f"{x / 60:.1f} min"


def summary(res: SimResult, label: str = "") -> str:
    """A text summary of one run."""
    c = res.counts
    s = res.series
    cfg = res.config
    lines = [f"shoal sim{(' — ' + label) if label else ''}: {cfg['nodes']} nodes × {cfg['node_cpus']:g} cores × "
             f"{cfg['node_memory_mb'] / 1024:.0f} GiB, preemption {'on' if cfg['preempt'] else 'off'}, "
             f"tides {'on' if cfg['tides'] else 'off'}, memory overcommit {cfg['policy']['memory_overcommit']:g}"]
    peak = max(s["live"]) if s["live"] else 0
    lines.append(f"  sandboxes: {c['arrived']:,} arrived, {c['placed']:,} placed, {c['rejected']:,} rejected "
                 f"(waited over {cfg['max_wait_s']:g} s); peak {peak:,} alive")
    lines.append("  placement delay (arrival → node chosen), per priority class:")
    for name, d in res.delays.items():
        if d.get("n"):
            r = res.ready_delays[name]
            lines.append(f"    {name:<14} n={d['n']:>9,}  p50 {_fmt_s(d['p50']):>9}  p99 {_fmt_s(d['p99']):>9}  "
                         f"max {_fmt_s(d['max']):>9}  rejected {d['rejected']:,}   ready p50 {_fmt_s(r['p50'])} "
                         f"p99 {_fmt_s(r['p99'])}")
    full = [b for b in res.bursts if b["completion_s"] is not None]
    if res.bursts:
        big = res.bursts[0]
        done = [b["completion_s"] for b in full]
        done.sort()
        lines.append(f"  bursts: {len(res.bursts):,} (largest {big['size']:,}: placed in {_fmt_s(big['placed_s'])}, "
                     f"all ready in {_fmt_s(big['completion_s'])}); completion p50 "
                     f"{_fmt_s(done[len(done) // 2] if done else None)}, p99 "
                     f"{_fmt_s(done[min(len(done) - 1, int(0.99 * len(done)))] if done else None)}")
    lines.append(f"  pauses: {c['preempted']:,} by preemption, {c['tide_paused']:,} by tides; {c['resumed']:,} "
                 f"resumed on their next call, {c['closed_paused']:,} closed while paused; memory returned "
                 f"{(res.tides['returned_mb_preempt'] + res.tides['returned_mb_tides']) / 1024 / 1024:.1f} TiB")
    rw = res.tides["resume_wait_s"]
    if rw.get("n"):
        lines.append(f"  resume wait for room p50 {_fmt_s(rw['p50'])} p99 {_fmt_s(rw['p99'])}; resume cost p50 "
                     f"{_fmt_s(res.tides['resume_cost_s']['p50'])}")
    if s["committed_mb"]:
        limit = cfg["nodes"] * cfg["node_memory_mb"] * cfg["policy"]["memory_overcommit"]
        ram = cfg["nodes"] * cfg["node_memory_mb"]
        lines.append(f"  memory: committed peak {max(s['committed_mb']) / limit:.0%} of the promise limit, used peak "
                     f"{max(s['used_mb']) / ram:.0%} of RAM")
    if res.per_node_at_peak:
        pn = sorted(res.per_node_at_peak)
        lines.append(f"  sandboxes per node at the peak: min {pn[0]:,}, median {pn[len(pn) // 2]:,}, max {pn[-1]:,}")
    sc = res.scheduler
    lines.append(f"  scheduler: {sc['decisions']:,} decisions in {sc['cpu_s']:.2f} s of CPU = "
                 f"{sc['decisions_per_s']:,} decisions/s"
                 + (f"; largest burst ({sc['largest_burst']:,}) placed in {sc['largest_burst_sched_s_max']:.3f} s "
                    "of scheduler time" if "largest_burst" in sc else ""))
    inv = res.invariants
    lines.append(f"  invariants: {'ok' if inv['ok'] else 'VIOLATED'} (limit violations {inv['limit_violations']}, "
                 f"unplaced {inv['arrived'] - inv['placed_plus_rejected']}, left paused {inv['left_paused']}, "
                 f"left waiting to resume {inv['left_waiting_resume']})")
    lines.append(f"  simulated {s['t'][-1] / 3600 if s['t'] else 0:.1f} h in {res.wall_s:.1f} s wall")
    return "\n".join(lines)


def write(res: SimResult, out: Path, *, compare: SimResult | None = None, extra: dict[str, Any] | None = None
          ) -> dict[str, str]:
    """Write result.json, summary.txt and the figures under `out`; returns name -> path."""
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    doc: dict[str, Any] = {"run": res.to_dict(), **(extra or {})}
    text = summary(res, "preemption on" if compare is not None else "")
    if compare is not None:
        doc["without_preemption"] = compare.to_dict()
        text += "\n\n" + summary(compare, "preemption off") + "\n\n" + _compare_text(res, compare)
    p = out / "result.json"
    p.write_text(json.dumps(doc, indent=1))
    files["json"] = str(p)
    p = out / "summary.txt"
    p.write_text(text + "\n")
    files["summary"] = str(p)
    files["timeline"] = _timeline(res, out / "sim_timeline.png")
    files["delays"] = _delays(res, out / "sim_delays.png", compare)
    files["nodes"] = _nodes(res, out / "sim_nodes.png")
    if res.bursts:
        files["bursts"] = _bursts(res, out / "sim_bursts.png", compare)
    return files


def _compare_text(on: SimResult, off: SimResult) -> str:
    lines = ["with vs without preemption (placement delay p50 / p99 per class):"]
    for name in on.delays:
        a, b = on.delays[name], off.delays[name]
        if a.get("n") or b.get("n"):
            lines.append(f"  {name:<14} on {_fmt_s(a.get('p50'))} / {_fmt_s(a.get('p99'))}   off "
                         f"{_fmt_s(b.get('p50'))} / {_fmt_s(b.get('p99'))}   rejected on {a.get('rejected', 0):,} "
                         f"off {b.get('rejected', 0):,}")
    return "\n".join(lines)


def _timeline(res: SimResult, path: Path) -> str:
    plt = _plt()
    s = res.series
    cfg = res.config
    h = [t / 3600 for t in s["t"]]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6), dpi=100, sharex=True)
    a1.plot(h, s["live"], label="alive", color="#1f77b4")
    a1.plot(h, s["paused"], label="paused", color="#2ca02c")
    a1.plot(h, s["waiting"], label="waiting for a node", color="#d62728")
    a1.set_ylabel("sandboxes")
    a1.legend(fontsize=8, loc="upper left")
    a1.grid(True, alpha=0.3)
    a1.set_title(f"shoal sim: {cfg['nodes']} nodes, preemption {'on' if cfg['preempt'] else 'off'}", fontsize=10)
    tib = 1024 * 1024
    ram = cfg["nodes"] * cfg["node_memory_mb"] / tib
    a2.plot(h, [x / tib for x in s["committed_mb"]], label="promised (running)", color="#9467bd")
    a2.plot(h, [x / tib for x in s["used_mb"]], label="used", color="#8c564b")
    a2.axhline(ram, color="k", lw=0.8, ls="--", label="RAM")
    a2.axhline(ram * cfg["policy"]["memory_overcommit"], color="#9467bd", lw=0.8, ls=":", label="promise limit")
    a2.set_ylabel("memory (TiB)")
    a2.set_xlabel("hours")
    a2.legend(fontsize=8, loc="upper left")
    a2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def _cdf(ax: Any, xs: list[float], label: str, color: str, ls: str = "-") -> None:
    if not xs:
        return
    s = sorted(max(x, 1e-3) for x in xs)  # zero delays drawn at 1 ms on the log axis
    step = max(1, len(s) // 2000)
    pts = [*s[::step], s[-1]]
    ys = [*(min(1.0, (i * step + 1) / len(s)) for i in range(len(pts) - 1)), 1.0]
    ax.step(pts, ys, where="post", label=f"{label} (n={len(s):,})", color=color, ls=ls)


def _delays(res: SimResult, path: Path, compare: SimResult | None) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    for name, xs in res.raw_delays.items():
        _cdf(ax, xs, name + (" (preemption on)" if compare is not None else ""), _PRIO_COLORS.get(name, "k"))
    if compare is not None:
        for name, xs in compare.raw_delays.items():
            _cdf(ax, xs, name + " (off)", _PRIO_COLORS.get(name, "k"), ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("placement delay (s; 0 drawn at 1 ms)")
    ax.set_ylabel("fraction ≤ x")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("placement delay per priority class", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def _nodes(res: SimResult, path: Path) -> str:
    plt = _plt()
    s = res.series
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5), dpi=100)
    if res.per_node_at_peak:
        a1.hist(res.per_node_at_peak, bins=min(40, max(5, len(res.per_node_at_peak) // 4)), color="#1f77b4")
    a1.set_xlabel("sandboxes on the node at the peak")
    a1.set_ylabel("nodes")
    a1.grid(True, alpha=0.3)
    h = [t / 3600 for t in s["t"]]
    a2.plot(h, s["node_live_max"], label="fullest node", color="#d62728")
    a2.plot(h, s["node_live_min"], label="emptiest node", color="#2ca02c")
    a2.set_xlabel("hours")
    a2.set_ylabel("sandboxes per node")
    a2.legend(fontsize=8)
    a2.grid(True, alpha=0.3)
    fig.suptitle("spreading: sandboxes per node", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def _bursts(res: SimResult, path: Path, compare: SimResult | None) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=100)
    for r, tag, mk in ((res, "", "o"), (compare, " (preemption off)", "x")):
        if r is None:
            continue
        by: dict[str, tuple[list[int], list[float]]] = {}
        for b in r.bursts:
            if b["completion_s"] is not None:
                xs, ys = by.setdefault(b["priority"], ([], []))
                xs.append(b["size"])
                ys.append(max(b["completion_s"], 1e-3))
        for name, (xs, ys) in by.items():
            ax.scatter(xs, ys, s=8, marker=mk, label=name + tag, color=_PRIO_COLORS.get(name, "k"), alpha=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("burst size (sandboxes)")
    ax.set_ylabel("until all are ready (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("burst completion time", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
