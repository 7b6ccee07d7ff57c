"""Admission by measured use (shoal.node.admission): the host's memory is given by a sampler here, so each
rule is checked against exact figures; the real /proc figures are read in the integration tests."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from shoal.config import NodeConfig, Paths
from shoal.errors import CapacityExceeded
from shoal.host.memory import MemorySample, parse_psi, read_sample
from shoal.models import SandboxSpec
from shoal.node.admission import DEFAULT_EXPECTED_MB, MIN_EXPECTED_MB, Admission

GIB = 1024


@dataclass
class Host:
    """A host whose memory the test sets."""

    s: MemorySample

    def __call__(self) -> MemorySample:
        return self.s


def admission(tmp_path, host: Host, **kw: object) -> Admission:
    cfg = NodeConfig(paths=Paths(home=tmp_path, store=tmp_path / "store"), min_free_memory_mb=512,
                     admission_psi_full=20.0, protect_host=False)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return Admission(cfg, sampler=host)


def host(total: int = 24 * GIB, available: int = 16 * GIB, psi_full: float | None = 0.0) -> Host:
    return Host(MemorySample(total_mb=total, available_mb=available, free_mb=available, psi_some10=0.0,
                             psi_full10=psi_full))


def test_default_spec_admitted_far_past_what_it_promises(tmp_path) -> None:
    # 5,000 sandboxes of 1 GiB promise 5,000 GiB on a 24 GiB host: the default policy lets measurement decide
    a = admission(tmp_path, host(), memory_overcommit=NodeConfig().memory_overcommit)
    spec = SandboxSpec()
    for i in range(5000):
        a.reserve(spec).commit(f"s{i}")
    snap = a.snapshot()
    assert snap.sandboxes == 5000 and snap.committed_mb == 5000 * 1024 and snap.committed_mb > snap.total_mb


def test_commitment_of_some_sandboxes_beside_the_rest(tmp_path) -> None:
    # a node counts sandboxes it adopted beside its own: committed_to() gives one group's share
    a = admission(tmp_path, host())
    a.reserve(SandboxSpec(memory_mb=300)).commit("theirs")
    for i in range(3):
        a.reserve(SandboxSpec(memory_mb=1024)).commit(f"ours{i}")
    assert sorted(a.live_ids()) == ["ours0", "ours1", "ours2", "theirs"]
    assert a.committed_to(["ours0", "ours1", "ours2"]) == 3 * 1024
    assert a.committed_to(["theirs", "gone"]) == 300
    a.paused("ours1")  # a paused sandbox's promise stops counting, in the total and in its group
    assert a.committed_to(["ours0", "ours1", "ours2"]) == 2 * 1024 == a.committed_mb - 300


def test_commitment_policy_can_be_tightened(tmp_path) -> None:
    a = admission(tmp_path, host(total=1000), memory_overcommit=1.0)
    a.reserve(SandboxSpec(memory_mb=600)).commit("a")
    with pytest.raises(CapacityExceeded, match="SHOAL_MEMORY_OVERCOMMIT=1") as ei:
        a.reserve(SandboxSpec(memory_mb=600))
    assert ei.value.details["reason"] == "promised" and ei.value.details["limit_mb"] == 1000
    a.release("a")
    a.reserve(SandboxSpec(memory_mb=600)).commit("b")


def test_measured_refusal_keeps_the_watermark_and_counts_creates_in_flight(tmp_path) -> None:
    h = host(available=512 + 100)
    a = admission(tmp_path, h)
    exp = a.expected_mb(1024)
    assert exp == DEFAULT_EXPECTED_MB
    held = []
    # 100 MiB above the watermark: as many reservations as their expected working sets fit, no more
    while True:
        try:
            held.append(a.reserve(SandboxSpec()))
        except CapacityExceeded as e:
            err = e
            break
    assert len(held) == int(100 // exp)
    assert err.details["reason"] == "memory" and err.details["pending"] == len(held)
    assert "SHOAL_MIN_FREE_MB" in err.message and "creates in flight" in err.message
    # committed sandboxes show up in the host's figures; the in-flight estimate goes away with them
    for i, r in enumerate(held):
        r.commit(f"s{i}")
    assert a.snapshot().pending == 0 and a.headroom_mb() == 100
    # released reservations give their expected share back
    r = a.reserve(SandboxSpec())
    r.release()
    assert a.headroom_mb() == 100
    h.s = replace(h.s, available_mb=400)
    with pytest.raises(CapacityExceeded, match="only 400 MiB of memory is available"):
        a.reserve(SandboxSpec())


def test_expected_working_set_follows_measurements_and_is_capped_by_the_limit(tmp_path) -> None:
    a = admission(tmp_path, host())
    a.note_usage(1.2)
    assert a.expected_mb() == MIN_EXPECTED_MB  # an idle container: the floor counts
    for _ in range(200):
        a.note_usage(300.0)
    assert 250 < a.expected_mb() <= 300
    assert a.expected_mb(64) == 64  # never more than the sandbox may use
    snap = a.snapshot()
    assert snap.expected_mb == pytest.approx(a.expected_mb(), abs=0.01) and snap.room == int(snap.headroom_mb
                                                                                            // snap.expected_mb)


def test_psi_pressure_refuses_and_can_be_ignored(tmp_path) -> None:
    a = admission(tmp_path, host(available=8 * GIB, psi_full=35.0))
    with pytest.raises(CapacityExceeded, match="stalled waiting for memory 35%") as ei:
        a.reserve(SandboxSpec())
    assert ei.value.details["reason"] == "pressure" and ei.value.retry_after_s > 0
    a.config.admission_psi_full = 0.0
    a.reserve(SandboxSpec()).release()
    # a kernel without PSI: nothing to refuse on
    b = admission(tmp_path, host(psi_full=None))
    b.reserve(SandboxSpec()).release()


def test_psi_stalls_with_most_memory_available_are_the_sandboxes_own(tmp_path) -> None:
    # memory bombs reclaiming inside their own limits stall too, and host-wide PSI counts them: with two
    # thirds of the host available that is not the host thrashing, and other creates go on
    a = admission(tmp_path, host(available=16 * GIB, psi_full=35.0))
    a.reserve(SandboxSpec()).release()
    b = admission(tmp_path, host(available=11 * GIB, psi_full=35.0))
    with pytest.raises(CapacityExceeded, match="stalled waiting for memory"):
        b.reserve(SandboxSpec())


def test_psi_file_format() -> None:
    p = parse_psi("some avg10=1.50 avg60=0.20 avg300=0.00 total=1234\n"
                  "full avg10=0.75 avg60=0.10 avg300=0.00 total=99\n")
    assert p["some"]["avg10"] == 1.5 and p["full"]["avg10"] == 0.75 and p["full"]["total"] == 99
    s = read_sample()  # this host's real figures
    assert 0 < s.available_mb <= s.total_mb and s.used_mb == s.total_mb - s.available_mb
