"""Host protection (shoal.node.protect) against a cgroup tree in a temporary directory. This host has
hybrid cgroups, so the cgroup v2 paths (memory.max, memory.min) cannot run for real here: the tree is
made of plain files, which is all the code writes; the v1 limit is checked for real in
tests/integration/test_density.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shoal.host import oom
from shoal.node import protect


def test_reserve_is_a_sixteenth_of_ram_within_bounds() -> None:
    assert protect.auto_reserve_mb(24 * 1024) == 1536
    assert protect.auto_reserve_mb(4 * 1024) == 1024
    assert protect.auto_reserve_mb(1024 * 1024) == 8192


def test_sandbox_parent_limit_v1_and_v2(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    assert protect.limit_sandbox_parent(1000, "hybrid", tmp_path) == (True, "")
    assert (tmp_path / "memory" / "shoal" / "memory.limit_in_bytes").read_text() == str(1000 << 20)
    assert protect.limit_sandbox_parent(2000, "v2", tmp_path) == (True, "")
    assert (tmp_path / "shoal" / "memory.max").read_text() == str(2000 << 20)
    assert (tmp_path / "shoal" / "cgroup.subtree_control").read_text() == "+memory"
    ok, why = protect.limit_sandbox_parent(1000, "v1", tmp_path / "absent")
    assert not ok and "cannot make" in why


def test_node_memory_min_only_on_a_cgroup_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    svc = tmp_path / "system.slice" / "shoal.service"
    svc.mkdir(parents=True)
    monkeypatch.setattr(protect, "_own_cgroup_v2", lambda: "/system.slice/shoal.service")
    (svc / "cgroup.procs").write_text(f"{os.getpid()}\n")
    assert protect.protect_node_cgroup_v2(256, tmp_path) == (256, "")
    assert (svc / "memory.min").read_text() == str(256 << 20)
    # another process in the same cgroup: its memory.min is not ours to set
    (svc / "memory.min").unlink()
    (svc / "cgroup.procs").write_text(f"{os.getpid()}\n1\n")
    got, why = protect.protect_node_cgroup_v2(256, tmp_path)
    assert got is None and "other processes" in why and not (svc / "memory.min").exists()
    monkeypatch.setattr(protect, "_own_cgroup_v2", lambda: "/")
    assert protect.protect_node_cgroup_v2(256, tmp_path)[0] is None


def test_node_score_is_only_lowered_where_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    cur = oom.read_adj()
    assert cur is not None
    monkeypatch.setattr(oom, "can_lower", lambda: False)
    got, why = oom.protect_self(-1000)
    assert got == cur and (cur <= -1000 or "CAP_SYS_RESOURCE" in why)
    # a value at or above the current one needs nothing
    assert oom.protect_self(cur) == (cur, "")
