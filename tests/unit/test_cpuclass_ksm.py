"""CPU classes (backends/container/cpuclass.py) and KSM setup (shoal.host.ksm) against cgroup and sysfs trees of plain
files in a temporary directory — the files are all the code writes; moving real processes between cpu
cgroups and real merging are checked in tests/integration/test_density.py and `shoal bench sharing`."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.backends.container import cpuclass
from shoal.errors import InvalidRequest
from shoal.host import cgroups, ksm
from shoal.models import SandboxSpec
from shoal.spec import check_spec


def test_classes_and_their_settings() -> None:
    assert cpuclass.DEFAULT_CPU_CLASS == "interactive" == SandboxSpec().cpu_class
    with pytest.raises(InvalidRequest, match="cpu_class='turbo' is not a CPU class: choose interactive or batch"):
        check_spec(SandboxSpec(cpu_class="turbo"))
    with pytest.raises(InvalidRequest):
        check_spec(SandboxSpec(cpu_class=cpuclass.NEUTRAL))  # the benchmark's reference, not for users
    i = cpuclass.settings_for("interactive", 2)
    assert (i.shares, i.quota_us, i.burst_us, i.idle, i.weight) == (2048, 200_000, 200_000, False, 200)
    b = cpuclass.settings_for("batch", 0.5)
    assert (b.quota_us, b.burst_us, b.idle) == (50_000, 0, True)
    n = cpuclass.settings_for(cpuclass.NEUTRAL, 1)
    assert (n.shares, n.burst_us, n.idle) == (1024, 0, False)


def _v1_tree(root: Path, sid: str) -> Path:
    home = root / "cpu" / "shoal" / sid
    home.mkdir(parents=True)
    (home / "cgroup.procs").write_text("")
    return home


def test_v1_batch_moves_to_the_idle_parent_and_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroups, "cgroup_mode", lambda: "hybrid")
    sid = "n0-abc"
    home = _v1_tree(tmp_path, sid)
    got = cpuclass.apply(f"/shoal/{sid}", "batch", 1.0, root=tmp_path)
    parent = tmp_path / "cpu" / cpuclass.BATCH_PARENT
    assert (parent / "cpu.idle").read_text() == "1"
    assert (parent / sid / "cpu.cfs_quota_us").read_text() == "100000"
    assert got["cgroup"] == f"/{cpuclass.BATCH_PARENT}/{sid}" and got["class"] == "batch"
    # back (a real cgroup directory is then removed; these plain files keep this one: see the integration test)
    got = cpuclass.apply(f"/shoal/{sid}", "interactive", 1.0, root=tmp_path)
    assert got["shares"] == 1024 and got["burst"] == 100_000 and "cgroup" not in got
    assert (home / "cpu.cfs_burst_us").read_text() == "100000"
    assert cpuclass.forget("n0-never-batch", root=tmp_path)  # nothing to remove: fine


def test_v2_uses_the_sandbox_cgroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroups, "cgroup_mode", lambda: "v2")
    d = tmp_path / "shoal" / "n0-x"
    d.mkdir(parents=True)
    got = cpuclass.apply("/shoal/n0-x", "batch", 1.0, root=tmp_path)
    assert (d / "cpu.idle").read_text() == "1" and (d / "cpu.max.burst").read_text() == "0"
    assert (d / "cpu.weight").read_text() == "1" and got["idle"]
    cpuclass.apply("/shoal/n0-x", "interactive", 1.0, root=tmp_path)
    assert (d / "cpu.idle").read_text() == "0" and (d / "cpu.weight").read_text() == "100"


def test_sweep_leaves_young_and_busy_batch_cgroups(tmp_path: Path) -> None:
    parent = tmp_path / "cpu" / cpuclass.BATCH_PARENT
    (parent / "young").mkdir(parents=True)
    (parent / "busy").mkdir()
    (parent / "busy" / "cgroup.procs").write_text("123\n")
    assert cpuclass.sweep(min_age_s=3600, root=tmp_path) == 0  # a sandbox being made keeps its cgroup
    assert cpuclass.sweep(min_age_s=0, root=tmp_path) == 1  # the empty one goes; one with processes stays
    assert not (parent / "young").exists() and (parent / "busy").exists()


def test_ksm_enable_on_a_sysfs_tree(tmp_path: Path) -> None:
    assert ksm.enable(tmp_path / "absent") == {"available": False, "why": "this kernel has no KSM (CONFIG_KSM)"}
    root = tmp_path / "ksm"
    root.mkdir()
    for name, value in (("run", "0"), ("use_zero_pages", "0"), ("pages_to_scan", "100"), ("advisor_mode", "none"),
                        ("pages_sharing", "300"), ("ksm_zero_pages", "20"), ("pages_shared", "10")):
        (root / name).write_text(value)
    got = ksm.enable(root)
    assert got["run"] and got["advisor"] == "scan-time" and got["use_zero_pages"]
    assert (root / "run").read_text() == "1" and (root / "use_zero_pages").read_text() == "1"
    assert ksm.enable(root) == {"available": True, "already_on": True}  # an admin's setup is left alone
    assert ksm.saved_bytes(ksm.stats(root)) == 320 * 4096
