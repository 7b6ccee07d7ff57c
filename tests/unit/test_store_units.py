"""Store pieces that need no root: the per-node integrity memory, store probes and their recovery hook,
lease ages, the layer cache's LRU, and the `store` bench scenario's registration."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest

from shoal.errors import ImageCorrupt, StoreUnavailable
from shoal.images import leases
from shoal.images.cache import LayerCache
from shoal.images.integrity import LayerVerifier
from shoal.images.probe import StoreHealth


def _file(tmp: Path, name: str, data: bytes) -> tuple[str, Path]:
    p = tmp / name
    p.write_bytes(data)
    return "sha256:" + hashlib.sha256(data).hexdigest(), p


def test_verifier_hashes_once_per_file_identity(tmp_path: Path) -> None:
    digest, p = _file(tmp_path, "l.erofs", os.urandom(100_000))
    v = LayerVerifier(tmp_path / "verified", enabled=True)
    assert v.check(digest, p, 100_000) is True
    assert v.check(digest, p, 100_000) is False, "remembered"
    assert LayerVerifier(tmp_path / "verified", enabled=True).check(digest, p, 100_000) is False, "on disk"
    data = bytearray(p.read_bytes())
    data[50_000] ^= 0xFF
    p.write_bytes(bytes(data))  # a write changes the ctime: checked again, and caught
    with pytest.raises(ImageCorrupt):
        v.check(digest, p, 100_000)
    with pytest.raises(ImageCorrupt, match="truncated"):
        v.check(digest, p, 200_000)


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


def test_layer_cache_evicts_least_recently_used_but_never_what_is_in_use(tmp_path: Path) -> None:
    layers = [_file(tmp_path, f"{i}.src", os.urandom(40_000)) for i in range(3)]
    c = LayerCache(tmp_path / "cache", limit_bytes=100_000)
    for d, p in layers[:2]:
        c.get(d, p, 40_000, set())
    first = layers[0][0].split(":")[1]
    os.utime(c.path(first), (1, 1))  # the oldest
    c.get(layers[2][0], layers[2][1], 40_000, {first})  # needs room: layer 1 goes, layer 0 is in use
    assert c.path(first).exists() and not c.path(layers[1][0].split(":")[1]).exists()
    assert c.evicted == 1 and c.usage() <= 100_000
    assert c.get(layers[0][0], layers[0][1], 40_000, set()) == (c.path(first), False)
    assert c.get("sha256:" + "0" * 64, layers[0][1], 200_000, set()) == (None, False), "too big: not cached"


def test_the_store_scenario_is_registered_with_its_parameters() -> None:
    from shoal.bench import registry

    scen = registry.get("store")
    names = {p.name for p in scen.describe()}
    assert {"trials", "nodes", "per_node", "images", "cache_rounds"} <= names
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
