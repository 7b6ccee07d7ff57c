"""Tokens, projects and quotas of the API server (no root, no sandboxes: the real TokenStore and
QuotaTracker on temp directories)."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import asdict
from pathlib import Path

import pytest

from shoal.errors import InvalidRequest, QuotaExceeded
from shoal.records import SandboxRecord, new_sandbox_id
from shoal.server.quotas import QuotaTracker
from shoal.server.tokens import Principal, Quota, TokenNotFound, TokenStore
from shoal.spec import SandboxSpec


def test_token_is_shown_once_and_stored_hashed(tmp_path: Path) -> None:
    st = TokenStore(tmp_path)
    tok = st.create("alpha", name="ci")
    raw = st.path.read_text()
    assert tok not in raw and tok.split("_", 2)[2] not in raw  # neither the token nor its secret is stored
    assert stat.S_IMODE(st.path.stat().st_mode) == 0o600
    assert stat.S_IMODE(st.dir.stat().st_mode) == 0o700
    who = st.authenticate(tok)
    assert who is not None and who.project == "alpha" and not who.admin
    assert st.authenticate(tok[:-1] + ("A" if tok[-1] != "A" else "B")) is None
    assert st.authenticate("") is None and st.authenticate("Bearer x") is None
    assert [t.project for t in st.tokens()] == ["alpha"]
    assert "sha256" not in st.tokens()[0].public()


def test_revoked_token_stops_working(tmp_path: Path) -> None:
    st = TokenStore(tmp_path)
    tok = st.create("alpha")
    server_view = TokenStore(tmp_path)  # another process's view (the server)
    assert server_view.authenticate(tok) is not None
    st.remove(tok.split("_")[1])
    assert server_view.authenticate(tok) is None
    with pytest.raises(TokenNotFound):
        st.remove("aaaaaaaaaa")


def test_quota_is_per_project_and_merges(tmp_path: Path) -> None:
    st = TokenStore(tmp_path)
    t1 = st.create("beta", quota=Quota(max_sandboxes=3))
    t2 = st.create("beta", quota=Quota(max_memory_mb=512))
    for t in (t1, t2):
        q = st.authenticate(t).quota
        assert (q.max_sandboxes, q.max_cpus, q.max_memory_mb) == (3, None, 512)
    st.set_quota("beta", Quota())
    assert st.quota("beta").is_unlimited()
    admin = st.authenticate(st.create("ops", admin=True))
    assert admin.admin


@pytest.mark.parametrize("bad", ["", "Upper", "-x", "x-", "a" * 64, "a/b", "a_b", "a.b"])
def test_bad_project_names_are_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(InvalidRequest, match="project"):
        TokenStore(tmp_path).create(bad)
    assert not (tmp_path / "api" / "tokens.json").exists()


def test_negative_quota_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="max_cpus"):
        TokenStore(tmp_path).create("p", quota=Quota(max_cpus=-1))


def _record(d: Path, project: str, cpus: float, mem: int, state: str = "running") -> str:
    sid = new_sandbox_id("t0")
    (d / sid).mkdir()
    rec = SandboxRecord(id=sid, backend="container", image="base:latest", image_digest="sha256:" + "0" * 64,
                        layers=[], spec=SandboxSpec(cpus=cpus, memory_mb=mem, project=project), dir=str(d / sid),
                        state=state, project=project, owner_pid=1)
    rec.save()
    return sid


def test_quota_tracker_counts_records_and_reservations(tmp_path: Path) -> None:
    d = tmp_path / "sandboxes"
    d.mkdir()
    _record(d, "p", 1.0, 256)
    _record(d, "other", 8.0, 4096)
    qt = QuotaTracker(d)
    who = Principal(project="p", quota=Quota(max_sandboxes=3, max_cpus=2.5, max_memory_mb=1024))
    r1 = qt.reserve(who, 1, 1.0, 256)  # p now holds 2 sandboxes, 2 cpus, 512 MiB
    with pytest.raises(QuotaExceeded) as ei:
        qt.reserve(who, 1, 1.0, 256)  # cpus 3 > 2.5
    e = ei.value
    assert e.http_status == 403 and e.details["quota"] == "max_cpus"
    assert e.details["limit"] == 2.5 and e.details["used"] == 2 and e.details["requested"] == 1
    assert "2.5" in e.message and "'p'" in e.message
    r1.release()
    r2 = qt.reserve(who, 1, 0.5, 256)
    r2.commit(_record(d, "p", 0.5, 256))
    assert qt.usage("p").sandboxes == 2 and qt.usage("p").memory_mb == 512


def test_partial_reservation_for_batches(tmp_path: Path) -> None:
    d = tmp_path / "sandboxes"
    d.mkdir()
    qt = QuotaTracker(d)
    who = Principal(project="p", quota=Quota(max_sandboxes=3))
    res = qt.reserve(who, 5, 1.0, 64, partial=True)
    assert res.granted == 3 and isinstance(res.refused, QuotaExceeded)
    assert res.refused.details["limit"] == 3
    with pytest.raises(QuotaExceeded):
        qt.reserve(who, 1, 1.0, 64, partial=True)  # nothing fits: a refusal, not an empty grant
    res.release()
    assert qt.usage("p").sandboxes == 0


def test_refusal_refreshes_stale_usage(tmp_path: Path) -> None:
    """A sandbox closed behind the tracker's back (reaper, another process) frees quota at once."""
    d = tmp_path / "sandboxes"
    d.mkdir()
    sid = _record(d, "p", 1.0, 64)
    qt = QuotaTracker(d, min_forced_refresh_s=0.0)
    qt.refresh()
    who = Principal(project="p", quota=Quota(max_sandboxes=1))
    import shutil

    shutil.rmtree(d / sid)
    qt.reserve(who, 1, 1.0, 64).release()


def test_token_file_survives_concurrent_writers(tmp_path: Path) -> None:
    import threading

    st = TokenStore(tmp_path)
    toks: list[str] = []

    def make() -> None:
        for _ in range(10):
            toks.append(TokenStore(tmp_path).create("c"))

    th = [threading.Thread(target=make) for _ in range(4)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    data = json.loads(st.path.read_text())
    assert len(data["tokens"]) == 40
    assert all(st.authenticate(t) for t in toks)
    assert not [p for p in os.listdir(st.dir) if p.startswith(".tmp")]
    assert asdict(Quota()) == {"max_sandboxes": None, "max_cpus": None, "max_memory_mb": None, "max_store_mb": None}
