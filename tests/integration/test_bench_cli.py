"""`shoal bench` end to end at --quick sizes without Docker: the scenarios run on real sandboxes, the JSON,
figures and Markdown report are written, and the benchmark leaves nothing mounted. Timings are not
asserted (benchmarks are for reading); only that every metric was measured."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.bench import homes
from tests.waiting import wait_for

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
    # its own home only: other benchmarks may be running on this machine with homes of their own
    home = Path(doc["home"])
    assert home.parent == Path("/tmp") and home.name.startswith("shoal-bench-")
    assert not homes.left_in(home), "the benchmark left mounts or loop devices behind"
    assert not home.exists()


def test_unknown_scenario_is_a_clear_error() -> None:
    r = _shoal("bench", "nosuch")
    assert r.returncode == 2 and "unknown scenario(s) nosuch" in r.stderr and "create" in r.stderr


def _sandboxes_in(home: Path) -> int:
    with contextlib.suppress(OSError):
        return len(list((home / "sandboxes").iterdir()))
    return 0


def _endless_bench(log: Path) -> subprocess.Popen[bytes]:
    # sequential creates that go on for much longer than the test waits: it is always stopped mid-run.
    # Output goes to a file: a pipe would be held open by the sandboxes a killed run leaves
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "shoal.cli.main", "bench", "create", "--quick",
                                 "--no-docker", "-p", "seq=100000"], stdout=f, stderr=subprocess.STDOUT)


def test_a_killed_run_is_cleaned_up_by_the_next_and_sigterm_tears_down(tmp_path: Path, base_image: str) -> None:
    killed = _endless_bench(tmp_path / "killed.log")
    killed_home = homes.home_for(killed.pid)
    try:
        wait_for(lambda: _sandboxes_in(killed_home) >= 2, timeout=120, what=f"sandboxes in {killed_home}")
    finally:
        killed.kill()  # SIGKILL: no teardown can run
        killed.wait(timeout=60)
    assert homes.left_in(killed_home).mounts, "a run killed mid-way leaves its mounts (the case to clean up)"
    assert not homes.owner_alive(killed_home)

    log = tmp_path / "term.log"
    term = _endless_bench(log)
    term_home = homes.home_for(term.pid)
    try:
        # the next run removes the dead run's home before it starts its own sandboxes
        wait_for(lambda: _sandboxes_in(term_home) >= 2, timeout=180, what=f"sandboxes in {term_home}")
        assert not killed_home.exists() and not homes.left_in(killed_home)
        term.send_signal(signal.SIGTERM)
        term.wait(timeout=300)
    finally:
        if term.poll() is None:
            term.kill()
            term.wait(timeout=60)
    out = log.read_text(errors="replace")[-3000:]
    assert term.returncode == 143, out
    assert not homes.left_in(term_home), out
    assert not term_home.exists()
