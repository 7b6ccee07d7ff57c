"""`shoal bench` end to end at --quick sizes without Docker: the scenarios run on real sandboxes, the JSON,
figures and Markdown report are written, and the benchmark leaves nothing mounted. Timings are not
asserted (benchmarks are for reading); only that every metric was measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _shoal(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shoal.cli.main", *args], capture_output=True, text=True,
                          timeout=600)


def test_quick_bench_writes_json_figures_and_report(tmp_path: Path, base_image: str) -> None:
    out, img, md = tmp_path / "bench.json", tmp_path / "img", tmp_path / "report.md"
    r = _shoal("bench", "create", "exec", "disk", "--quick", "--no-docker", "--json", str(out), "--plot", str(img),
               "--markdown", str(md))
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    doc = json.loads(out.read_text())
    assert list(doc["scenarios"]) == ["create", "exec", "disk"]
    for name, sc in doc["scenarios"].items():
        assert sc["error"] is None, (name, sc["error"])
        assert sc["metrics"] and all(isinstance(m["shoal"], (int, float)) and m["shoal"] >= 0
                                     for m in sc["metrics"]), name
        assert sc["docker"] != "ran"
    p50 = next(m for m in doc["scenarios"]["exec"]["metrics"] if m["name"].startswith("exec round trip p50"))
    assert p50["unit"] == "ms" and p50["shoal"] > 0
    assert any(m["name"].startswith("exec round trip p50, agent alone") for m in doc["scenarios"]["exec"]["metrics"])
    # each scenario records the parameters it ran with: here the --quick values
    assert doc["scenarios"]["exec"]["params"]["rtt"] == 200 and doc["scenarios"]["disk"]["params"]["n"] == 20
    figures = sorted(p.name for p in img.iterdir())
    assert "create_latency_cdf.png" in figures and "exec_rtt_cdf.png" in figures
    assert all((img / f).stat().st_size > 1000 for f in figures)
    assert "| scenario | metric | shoal |" in md.read_text()
    assert not doc.get("leaks")
    with open("/proc/self/mountinfo") as f:
        assert not [line for line in f if "/shoal-bench-" in line], "the benchmark left mounts behind"


def test_unknown_scenario_is_a_clear_error() -> None:
    r = _shoal("bench", "nosuch")
    assert r.returncode == 2 and "unknown scenario(s) nosuch" in r.stderr and "create" in r.stderr
