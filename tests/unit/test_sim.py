"""`shoal sim`: small simulations through the real scheduler, with their invariants asserted."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shoal.errors import InvalidRequest
from shoal.sched import Policy
from shoal.sim.dsec import DsecShape, generate
from shoal.sim.engine import SimConfig, Simulation
from shoal.sim.trace import TraceRecord, read_trace, write_trace


def _invariants_hold(res) -> None:  # type: ignore[no-untyped-def]
    inv = res.invariants
    assert inv["limit_violations"] == 0, inv  # no node over its policy limits, ever
    assert inv["placed_plus_rejected"] == inv["arrived"] and inv["still_waiting"] == 0, inv  # every one placed
    assert inv["paused"] == inv["resumed"] + inv["closed_while_paused"], inv  # preempted ones resumed (or closed)
    assert inv["left_paused"] == 0 and inv["left_waiting_resume"] == 0 and inv["still_live"] == 0, inv
    assert inv["ok"]


def _crowded(burst: int = 40) -> list[TraceRecord]:
    """Batch sandboxes fill 4 small nodes and go idle; then a train-rollout burst needs the room."""
    recs = [TraceRecord(t=i * 0.01, lifetime=7200, image=f"b{i}", memory_mb=1024, priority="batch", job="batch",
                        active_s=120, used_mb=512) for i in range(64)]
    recs += [TraceRecord(t=1000 + i * 0.01, lifetime=600, image=f"task{i // 2}", memory_mb=1024,
                         priority="train-rollout", job="step-1", burst="step-1", used_mb=256) for i in range(burst)]
    return recs


def _cfg(preempt: bool) -> SimConfig:
    pol = Policy(memory_overcommit=1.0, min_free_mb=0, min_idle_s=60, tide_idle_s=600)
    return SimConfig(nodes=4, node_cpus=16, node_memory_mb=16_384, policy=pol, preempt=preempt, tides=False,
                     max_wait_s=30_000)


def test_a_high_priority_burst_pauses_idle_low_priority_sandboxes_which_resume_after() -> None:
    on = Simulation(_crowded(), _cfg(True)).run()
    off = Simulation(_crowded(), _cfg(False)).run()
    for res in (on, off):
        _invariants_hold(res)
    assert on.counts["preempted"] >= 40 and off.counts["preempted"] == 0
    # the batch sandboxes' final calls came after the burst had left: every paused one resumed
    assert on.counts["resumed"] == on.counts["preempted"] and on.counts["closed_paused"] == 0
    assert on.delays["train-rollout"]["p99"] < 60 < off.delays["train-rollout"]["p99"]
    burst = on.bursts[0]
    assert burst["id"] == "step-1" and burst["placed"] == 40 and burst["completion_s"] < 60


def test_sandboxes_still_active_are_never_preempted() -> None:
    recs = _crowded()
    for r in recs[:64]:
        r.active_s = 7200.0  # busy the whole time
    res = Simulation(recs, _cfg(True)).run()
    _invariants_hold(res)
    assert res.counts["preempted"] == 0 and res.delays["train-rollout"]["p99"] > 1000


def test_tides_pause_idle_sandboxes_when_memory_is_tight_and_they_resume_on_their_final_call() -> None:
    pol = Policy(memory_overcommit=4.0, min_free_mb=0, tide_high=0.8, tide_low=0.6, tide_idle_s=300)
    recs = [TraceRecord(t=i * 0.1, lifetime=3600, image="img", memory_mb=1024, used_mb=900, active_s=60,
                        priority="batch", job="b") for i in range(16)]
    res = Simulation(recs, SimConfig(nodes=1, node_cpus=64, node_memory_mb=16_384, policy=pol, preempt=False,
                                     reclaim_fraction=0.9)).run()
    _invariants_hold(res)
    # 16 × 900 MiB = 88% of RAM used: tides pause idle ones until under 60%
    assert res.counts["tide_paused"] >= 5 and res.counts["resumed"] == res.counts["tide_paused"]
    assert res.tides["returned_mb_tides"] == res.counts["tide_paused"] * 810


def test_a_small_dsec_day_keeps_every_invariant() -> None:
    shape = DsecShape(scale=0.004, seed=3)
    res = Simulation(generate(shape), SimConfig(nodes=shape.scaled_nodes, policy=Policy(memory_overcommit=3.0),
                                                seed=3)).run()
    _invariants_hold(res)
    assert res.counts["arrived"] > 10_000
    assert res.delays["train-rollout"]["n"] > 0 and res.bursts
    per_node = res.per_node_at_peak
    assert min(per_node) > 0.8 * max(per_node)  # spread, not piled on one node


def test_trace_jsonl_round_trip_and_node_event_logs(tmp_path: Path) -> None:
    recs = [TraceRecord(t=0.5, lifetime=60, image="x", layers=("base", "x"), priority="eval", job="e", burst="b1"),
            TraceRecord(t=1.0, lifetime=30, cpus=2, memory_mb=512, active_s=10, final_call=False)]
    buf = io.StringIO()
    assert write_trace(recs, buf) == 2
    p = tmp_path / "t.jsonl"
    p.write_text(buf.getvalue())
    back = read_trace(p)
    assert [r.to_dict() for r in back] == [r.to_dict() for r in recs]
    log = tmp_path / "events.jsonl"
    log.write_text("\n".join(json.dumps(e) for e in [
        {"event": "create", "t": 1000.0, "id": "n0-a", "node": "n0", "image": "base", "cpus": 1, "memory_mb": 256,
         "priority": "batch", "job": "j"},
        {"event": "create", "t": 1002.0, "id": "n0-b", "node": "n0", "image": "base", "cpus": 1, "memory_mb": 256},
        {"event": "pause", "t": 1003.0, "id": "n0-a"},
        {"event": "close", "t": 1010.0, "id": "n0-a"},
        {"event": "close", "t": 1012.5, "id": "n0-b"},
    ]) + "\n")
    got = read_trace(log)
    assert [(r.t, r.lifetime, r.priority) for r in got] == [(0.0, 10.0, "batch"), (2.0, 10.5, "")]


def test_bad_trace_lines_name_the_line_and_field(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"t": 1, "lifetime": 5}\n{"t": 2, "lifetime": 5, "colour": "red"}\n')
    with pytest.raises(InvalidRequest, match=r"bad.jsonl:2: unknown trace field"):
        read_trace(p)
    p.write_text('{"t": 1}\n')
    with pytest.raises(InvalidRequest, match="needs 'lifetime'"):
        read_trace(p)


def test_shoal_sim_cli_writes_json_figures_and_summary(tmp_path: Path) -> None:
    from shoal.cli.main import app

    out = tmp_path / "sim"
    r = CliRunner().invoke(app, ["sim", "--trace", "dsec", "--scale", "0.002", "--hours", "3", "--out", str(out),
                                 "--compare-preemption"])
    assert r.exit_code == 0, r.output
    assert "invariants: ok" in r.output and "with vs without preemption" in r.output
    doc = json.loads((out / "result.json").read_text())
    assert doc["run"]["invariants"]["ok"] and doc["without_preemption"]["config"]["preempt"] is False
    for f in ("sim_timeline.png", "sim_delays.png", "sim_nodes.png", "sim_bursts.png", "summary.txt"):
        assert (out / f).stat().st_size > 0
    r = CliRunner().invoke(app, ["sim", "--trace", str(tmp_path / "missing.jsonl"), "--out", str(out)])
    assert r.exit_code == 2 and "no trace file" in r.output
