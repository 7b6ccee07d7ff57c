"""Bounded store probes under concurrency: creates arriving together share one probe."""

from __future__ import annotations

import threading
from pathlib import Path

from shoal.images.probe import StoreHealth, ensure_marker


def test_concurrent_checks_share_the_probe_in_flight(tmp_path: Path) -> None:
    # a burst of creates resolves its image from many threads at once: none may be refused because another
    # thread's probe of a healthy store is still running (it was: "has not answered a probe for 0 s")
    (tmp_path / "layers" / "sha256").mkdir(parents=True)
    ensure_marker(tmp_path)
    for _ in range(20):
        health = StoreHealth(tmp_path, timeout_s=10.0, ttl_s=1e-9)
        errors: list[BaseException] = []
        go = threading.Barrier(16)

        def one(h: StoreHealth = health, go: threading.Barrier = go, errors: list[BaseException] = errors) -> None:
            go.wait()
            try:
                h.check()
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=one) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
