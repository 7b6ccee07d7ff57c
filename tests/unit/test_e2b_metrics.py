"""E2B metrics series (shoal.server.compat.e2b_metrics): one sampling round for every series, on one clock."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from shoal.server.compat import e2b_metrics as em


def _series(sid: str, last_at: float | None) -> em.Series:
    s = em.Series(sandbox_id=sid, cgroup=f"shoal/{sid}", cpus=1, mem_total=1 << 30, disk_total=1 << 30,
                  upper="", created_at=time.time() - 60)
    if last_at is not None:
        s.add((last_at, 0.0, 0, 0, 0))
    return s


def test_a_round_skips_a_series_sampled_moments_ago(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox tracked just before the shared round gets no second point in the same second: timestamps of
    one series are distinct and E2B's are whole seconds."""
    monkeypatch.setattr(em, "sample", lambda s, now: (now, 1.0, 1, 0, 0))
    node = SimpleNamespace(record=lambda sid: SimpleNamespace(state="running"))
    rec = em.Recorder(SimpleNamespace(node=node))  # type: ignore[arg-type]
    rec._disk_at = time.time()  # no disk walk
    now = time.time()
    rec.series = {"fresh": _series("fresh", now - 0.2), "due": _series("due", now - em.SAMPLE_S),
                  "empty": _series("empty", None)}
    rec._round()
    assert len(rec.series["fresh"].points) == 1
    assert len(rec.series["due"].points) == 2
    assert len(rec.series["empty"].points) == 1
    for s in rec.series.values():
        whole = [int(p[0]) for p in s.points]
        assert len(set(whole)) == len(whole)
