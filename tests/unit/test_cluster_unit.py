"""Cluster mode without a cluster: addresses and node ids, the placement driver over shoal.sched, the
cluster-wide quota source, the node agent's endpoint token, the lost-sandbox index entries."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from shoal.cluster.placement import ClusterView, node_state
from shoal.cluster.raylink import check_node_id, is_loopback, node_id_for, offers_shoal, parse_ray_url
from shoal.errors import InvalidRequest, NodeUnavailable, QuotaExceeded, SandboxLost, error_from_dict
from shoal.models import SandboxSpec
from shoal.sched import Policy


def report(nid: str, *, committed_mb: int = 0, total_mb: int = 16_000, layers: tuple[str, ...] = (),
           running: int = 0) -> dict:
    return {"node_id": nid, "memory": {"total_mb": total_mb, "limit_mb": 4 * total_mb, "committed_mb": committed_mb,
                                       "used_mb": 1000, "available_mb": total_mb - 1000},
            "cpus": {"count": 2, "committed": 0.0}, "sandboxes": {"running": running}, "layers": list(layers)}


def test_ray_urls_and_loopback() -> None:
    assert parse_ray_url("ray://127.0.0.1:6379") == "127.0.0.1:6379"
    assert parse_ray_url("ray://auto") == "auto"
    for bad in ("http://x", "ray://", "127.0.0.1:6379"):
        with pytest.raises(InvalidRequest):
            parse_ray_url(bad)
    assert is_loopback("127.0.0.1:1234") and is_loopback("localhost:1") and not is_loopback("10.0.0.2:6379")


def test_ray_cluster_mode_follows_each_address_and_leaks_into_no_later_ray_start(monkeypatch) -> None:
    """Ray's switch (off: loopback kept, `ray start` of a worker aborts) is off for a loopback cluster only:
    a loopback LocalCluster started from a process once left RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in its
    environment, and the netns cluster harness's `ray start --address` workers then aborted in CI."""
    pytest.importorskip("ray")
    import ray._private.ray_constants as rc

    from shoal.cluster.raylink import RAY_CLUSTER_ENV, loopback_children, set_cluster_mode

    monkeypatch.delenv(RAY_CLUSTER_ENV, raising=False)
    monkeypatch.setattr(rc, "ENABLE_RAY_CLUSTER", rc.ENABLE_RAY_CLUSTER)
    with loopback_children():
        assert os.environ[RAY_CLUSTER_ENV] == "0" and rc.ENABLE_RAY_CLUSTER is False  # the cluster's processes
    assert RAY_CLUSTER_ENV not in os.environ  # a later child (`ray start` on real addresses) is not refused
    set_cluster_mode(loopback=False)
    assert rc.ENABLE_RAY_CLUSTER is True  # a driver joining a cluster on real addresses uses its outward address
    set_cluster_mode(loopback=True)
    assert rc.ENABLE_RAY_CLUSTER is False
    monkeypatch.setenv(RAY_CLUSTER_ENV, "0")  # the user's own choice is Ray's default for real addresses
    set_cluster_mode(loopback=False)
    assert rc.ENABLE_RAY_CLUSTER is False
    with loopback_children():
        pass
    assert os.environ[RAY_CLUSTER_ENV] == "0"  # put back as it was


def test_node_ids_from_ray_nodes() -> None:
    n = {"NodeID": "0123456789abcdef" * 3, "Alive": True, "Resources": {"shoal": 1.0}}
    assert node_id_for(n) == "r01234567"
    assert node_id_for({**n, "Labels": {"shoal-node": "GPU_host.7"}}) == "gpu-host-7"
    assert offers_shoal(n) and not offers_shoal({**n, "Alive": False}) and not offers_shoal({**n, "Resources": {}})
    with pytest.raises(InvalidRequest):
        check_node_id("-bad")


def test_reports_become_scheduler_states_with_the_nodes_own_limits() -> None:
    st = node_state(report("a", committed_mb=2000, layers=("l1",)), Policy())
    assert st.mem_limit_mb == 64_000 and st.committed_mb == 2000 and st.layers == {"l1"}
    assert st.cpu_limit >= 1e6  # a node does not refuse for CPUs: placement must not either


def test_a_burst_is_split_by_room_and_refusals_are_released() -> None:
    view = ClusterView(seed=1)
    view.update([report("a"), report("b"), report("c", committed_mb=32_000)])  # c: half the room left
    spec = SandboxSpec(memory_mb=1000)
    plan = view.split(spec, 50, avoid=())
    assert sum(plan.values()) == 50 and set(plan) == {"a", "b", "c"}
    assert plan["c"] < plan["a"] and plan["c"] < plan["b"]
    again = view.split(spec, 10, avoid={"a", "b"})  # a and b refused: everything goes to c
    assert set(again) == {"c"}
    view.refused("c", spec, 10)
    view.update([report("a"), report("b")])  # c left the cluster
    assert set(view.split(spec, 10)) <= {"a", "b"}


def test_single_creates_prefer_nodes_holding_the_image() -> None:
    view = ClusterView(seed=3)
    view.update([report("cold1"), report("warm", layers=("base", "task")), report("cold2")])
    spec = SandboxSpec(memory_mb=100)
    for _ in range(5):
        assert view.split(spec, 1, layers=("base", "task")) == {"warm": 1}
    assert view.split(SandboxSpec(memory_mb=1 << 20), 1) == {}  # fits nowhere (the largest spec allowed)


def test_quota_tracker_counts_the_cluster_snapshot_and_keeps_newer_commits() -> None:
    from shoal.server.quotas import QuotaTracker
    from shoal.server.tokens import Principal, Quota

    snap: list = [time.monotonic(), [("n1-x", "p", 1.0, 100), ("n2-y", "p", 1.0, 100)]]
    qt = QuotaTracker("/nonexistent", source=lambda: (snap[0], snap[1]), min_forced_refresh_s=0.0)
    qt.refresh()
    who = Principal(project="p", quota=Quota(max_sandboxes=3))
    res = qt.reserve(who, 1, 1.0, 100)
    res.commit("n3-z")
    qt.refresh()  # the snapshot predates n3-z: it stays counted
    with pytest.raises(QuotaExceeded):
        qt.reserve(who, 1, 1.0, 100)
    snap[0], snap[1] = time.monotonic(), [("n1-x", "p", 1.0, 100)]  # n2-y and n3-z closed meanwhile
    qt.refresh()
    assert qt.usage("p").sandboxes == 1


def test_agent_endpoint_token(tmp_path: Path) -> None:
    from shoal.cluster.agent import InternalTokens

    t = InternalTokens(tmp_path / "cluster" / "agent-token")
    assert (tmp_path / "cluster" / "agent-token").stat().st_mode & 0o777 == 0o600
    assert InternalTokens(tmp_path / "cluster" / "agent-token").token == t.token  # kept across restarts
    who = t.authenticate(t.token)
    assert who is not None and who.admin
    assert t.authenticate("shoal_aaaaaaaaaa_" + "b" * 43) is None and t.authenticate("") is None


def test_new_errors_travel_typed() -> None:
    lost = error_from_dict(SandboxLost("gone", node="r1").to_dict())
    assert isinstance(lost, SandboxLost) and lost.http_status == 410 and isinstance(lost, LookupError)
    na = error_from_dict(NodeUnavailable("restarting").to_dict())
    assert isinstance(na, NodeUnavailable) and na.retryable


def test_lost_entries_list_as_lost() -> None:
    from shoal.cluster.agent import _index_entry
    from shoal.cluster.transport import _lost_info
    from shoal.models import SandboxInfo

    info = SandboxInfo(id="r1-" + "a" * 26, image="base:latest", backend="container", state="running",
                       created_at=1.0, spec={"project": "p", "memory_mb": 64, "env": {"SECRET": "x"}},
                       labels={"k": "v"}, node="r1")
    entry = _index_entry(info)
    assert "env" not in entry["spec"]  # the index in Ray's store carries no environment values
    back = _lost_info(entry)
    assert back.state == "lost" and back.id == info.id and back.labels == {"k": "v"} and back.spec["project"] == "p"


def test_measured_room_caps_what_a_node_is_given() -> None:
    view = ClusterView(seed=5)
    full, two = report("full"), report("two", running=3)
    full["memory"]["room"] = 0  # measured admission takes nothing more there
    two["memory"]["room"] = 2
    view.update([full, two, report("free")])
    plan = view.split(SandboxSpec(memory_mb=64), 30)
    assert "full" not in plan and plan.get("two", 0) <= 2 and sum(plan.values()) == 30
