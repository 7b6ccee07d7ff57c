"""Store pieces that need no root: store probes and their recovery hook, lease ages, and the `store` bench
scenario's registration (chunks, tables, marks and records: test_chunking.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from shoal.errors import StoreUnavailable
from shoal.images import leases
from shoal.images.probe import StoreHealth


def test_probe_reports_a_missing_store_and_calls_recovery_hooks(tmp_path: Path) -> None:
    h = StoreHealth(tmp_path / "store", timeout_s=2.0, ttl_s=1e-9)
    called: list[int] = []
    h.on_recover.append(lambda: called.append(1))
    with pytest.raises(StoreUnavailable, match="layers directory"):
        h.check()
    assert h.failing_since is not None and not called
    (tmp_path / "store" / "layers" / "sha256").mkdir(parents=True)
    assert h.check() >= 0
    assert called == [1] and h.failing_since is None and h.recoveries == 1
    h.check()
    assert called == [1], "only the end of an outage calls the hooks"


def test_lease_age_is_measured_in_the_store_clock(tmp_path: Path) -> None:
    p = leases.write_lease(tmp_path, "ab" * 32, "host-0123456789ab", tmp_path / "mp")
    old = time.time() - 3600
    os.utime(p, (old, old))
    now = leases.store_now(tmp_path)
    assert 3500 < leases.age_s(p, now) < 3700  # type: ignore[operator]
    assert leases.renew(p) and leases.age_s(p, leases.store_now(tmp_path)) < 60  # type: ignore[operator]
    p.unlink()
    assert not leases.renew(p) and leases.age_s(p, now) is None


def test_the_store_scenario_is_registered_with_its_parameters() -> None:
    from shoal.bench import registry

    scen = registry.get("store")
    names = {p.name for p in scen.describe()}
    assert {"trials", "warm_rounds", "family", "nodes", "images", "per_image"} <= names
    assert "store" not in registry.default_names(), "it needs MooseFS and minutes: run by name only"


def test_shoal_store_check_answers_or_says_why(tmp_path: Path) -> None:
    """`shoal store check`: exit 0 on a store that answers, 1 with the reason on one that is not there."""
    import subprocess
    import sys

    from shoal.images.store import ImageStore

    ImageStore(tmp_path / "store")
    env = dict(os.environ, SHOAL_HOME=str(tmp_path / "home"), SHOAL_STORE=str(tmp_path / "store"))
    cmd = [sys.executable, "-m", "shoal.cli.main", "store", "check", "--timeout", "5"]
    ok = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "answers" in ok.stdout, ok.stderr
    env["SHOAL_STORE"] = str(tmp_path / "not-mounted")
    bad = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "layers directory" in bad.stderr, bad.stdout + bad.stderr
