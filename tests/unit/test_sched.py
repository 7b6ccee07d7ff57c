"""Each scheduling policy on small, hand-made cluster states (shoal.sched is pure: no I/O, no clock)."""

from __future__ import annotations

import pytest

from shoal.errors import CapacityExceeded, GangUnsatisfiable, InvalidRequest, QuotaExceeded
from shoal.sched import (
    LABEL_JOB,
    LABEL_MAX_SANDBOXES,
    LABEL_PRIORITY,
    Cluster,
    FairQueue,
    JobBook,
    NodeState,
    Placement,
    Policy,
    Request,
    SandboxView,
    can_resume,
    job_labels,
    labels_for_job,
    place,
    place_many,
    plan_gang,
    plan_preemption,
    plan_tides,
    reserve_plan,
)


def mk(n: int, *, cpus: float = 16, mem: int = 16_384, policy: Policy | None = None, **kw: object) -> Cluster:
    pol = policy or Policy(memory_overcommit=1.0, min_free_mb=0)
    return Cluster([NodeState.new(f"n{i}", cpus, mem, pol, **kw) for i in range(n)], pol, seed=7)


# ---- place -----------------------------------------------------------------------------------------
def test_place_picks_a_node_with_room_and_reserve_counts_it() -> None:
    c = mk(3)
    for nid in ("n0", "n1"):
        c.node(nid).committed_mb = 16_000
        c.upsert(c.node(nid))
    req = Request(memory_mb=1024)
    p = place(req, c)
    assert p.node_id == "n2"
    c.reserve(p, req)
    assert c.node("n2").committed_mb == 1024 and c.node("n2").running == 1


def test_place_never_returns_a_node_that_refused() -> None:
    c = mk(2)
    req = Request(memory_mb=1024, avoid=frozenset({"n0"}))
    assert {place(req, c).node_id for _ in range(20)} == {"n1"}


def test_place_raises_capacity_exceeded_when_nothing_fits() -> None:
    c = mk(2, mem=4096)
    with pytest.raises(CapacityExceeded) as ei:
        place(Request(memory_mb=8192), c)
    assert ei.value.details["largest_free_mb"] == 4096


def test_place_finds_the_one_node_with_room_among_many_full_ones() -> None:
    # sampling sees mostly full nodes: the headroom fallback must still find the free one
    c = mk(64)
    for node in list(c):
        if node.node_id != "n41":
            node.committed_mb = node.mem_limit_mb
            c.upsert(node)
    assert all(place(Request(memory_mb=512), c).node_id == "n41" for _ in range(10))


def test_place_prefers_nodes_that_hold_the_image() -> None:
    c = mk(40)
    warm = c.node("n17")
    warm.layers |= {"base", "task"}
    c.upsert(warm)
    req = Request(memory_mb=512, layers=("base", "task"))
    picks = [place(req, c) for _ in range(20)]
    assert all(p.node_id == "n17" and p.cold_layers == () for p in picks)


def test_cold_mounts_per_node_are_bounded() -> None:
    pol = Policy(memory_overcommit=1.0, min_free_mb=0, cold_mount_slots=2)
    c = mk(2, policy=pol)
    busy = c.node("n0")
    c.mount_started(busy, ["x", "y"])  # both slots busy
    req = Request(memory_mb=512, layers=("base", "task"))
    assert all(place(req, c).node_id == "n1" for _ in range(10))
    c.mount_done("n0", 2)
    c.node("n1").committed_mb = c.node("n1").mem_limit_mb
    c.upsert(c.node("n1"))
    assert place(req, c).node_id == "n0"


def test_unhealthy_nodes_and_missing_backends_take_nothing() -> None:
    c = mk(3)
    c.set_healthy("n0", False)
    c.node("n1").backends = frozenset({"microvm"})
    assert {place(Request(), c).node_id for _ in range(20)} == {"n2"}
    assert place(Request(backend="microvm"), c).node_id == "n1"


def test_place_over_a_plain_list_of_states() -> None:
    pol = Policy(min_free_mb=0)
    nodes = [NodeState.new("a", 4, 1000, pol), NodeState.new("b", 4, 8000, pol)]
    assert place(Request(memory_mb=6000), nodes, pol).node_id == "b"


def test_cluster_reindexes_layers_and_forgets_removed_nodes() -> None:
    c = mk(2)
    n0 = NodeState.new("n0", 16, 16_384, c.policy, layers={"a"})
    c.upsert(n0)
    assert c.nodes_with_layer("a") == ["n0"]
    c.upsert(NodeState.new("n0", 16, 16_384, c.policy, layers={"b"}))
    assert c.nodes_with_layer("a") == [] and c.nodes_with_layer("b") == ["n0"]
    c.remove("n0")
    assert "n0" not in c and c.healthy_ids() == ["n1"] and c.nodes_with_layer("b") == []


# ---- bursts ----------------------------------------------------------------------------------------
def test_burst_is_split_by_free_capacity() -> None:
    c = mk(4)
    c.node("n0").committed_mb = 12_288  # n0 has a quarter of the others' room
    c.upsert(c.node("n0"))
    plan = place_many(Request(memory_mb=256), 52, c)
    assert plan.placed == 52 and plan.short == 0
    assert plan.counts["n0"] == 4 and all(plan.counts[f"n{i}"] == 16 for i in (1, 2, 3))


def test_no_node_takes_the_whole_burst_and_every_copy_is_placed_once() -> None:
    c = mk(160, cpus=190, mem=1_500_000, policy=Policy(min_free_mb=0))
    plan = place_many(Request(memory_mb=2048, layers=("base", "task")), 32_000, c)
    assert plan.placed == 32_000
    assert max(plan.counts.values()) <= 1.05 * 32_000 / 160
    assert len(plan.placements()) == 32_000


def test_burst_locality_bonus_is_bounded_by_the_slack() -> None:
    pol = Policy(memory_overcommit=1.0, min_free_mb=0, locality_weight=10.0, burst_share_slack=2.0)
    c = mk(4, policy=pol)
    c.node("n0").layers |= {"base", "task"}
    c.upsert(c.node("n0"))
    plan = place_many(Request(memory_mb=256, layers=("base", "task")), 50, c)
    assert plan.counts["n0"] == 20 and plan.counts["n1"] == 10  # 2x the share of a cold node, not all
    assert plan.cold_layers.get("n0") is None and plan.cold_layers["n1"] == ("base", "task")


def test_burst_skips_nodes_busy_mounting_and_reports_the_shortfall() -> None:
    pol = Policy(memory_overcommit=1.0, min_free_mb=0, cold_mount_slots=1)
    c = mk(3, mem=2048, policy=pol)
    c.mount_started(c.node("n2"), ["other"])
    plan = place_many(Request(memory_mb=512, layers=("img",)), 20, c)
    assert "n2" not in plan.counts and plan.placed == 8 and plan.short == 12


def test_reserving_a_burst_plan_counts_each_node_once_for_its_cold_mounts() -> None:
    c = mk(2)
    req = Request(memory_mb=512, layers=("img",))
    plan = place_many(req, 10, c)
    reserve_plan(c, plan, req)
    assert sum(n.running for n in c) == 10
    assert all(n.cold_mounts == 1 and "img" in n.layers for n in c)


# ---- gangs -----------------------------------------------------------------------------------------
def test_gang_is_all_or_nothing_and_says_how_many_fit() -> None:
    c = mk(2, mem=4096)
    req = Request(memory_mb=1024)
    with pytest.raises(GangUnsatisfiable) as ei:
        plan_gang(req, 9, c)
    assert ei.value.available == 8 and ei.value.requested == 9
    assert all(n.committed_mb == 0 for n in c)  # deciding reserved nothing
    plan = plan_gang(req, 8, c)
    assert plan.placed == 8 and plan.preempt == {}


def test_gang_may_preempt_idle_lower_priority_sandboxes() -> None:
    c = mk(1, mem=4096)
    _fill(c, "n0", [("b1", 3, 0.0), ("b2", 3, 0.0)], mem=2048)
    req = Request(memory_mb=1024, priority=0)
    with pytest.raises(GangUnsatisfiable):
        plan_gang(req, 2, c)
    plan = plan_gang(req, 2, c, now=1000.0, preempt=True)
    assert plan.counts == {"n0": 2} and plan.preempt == {"n0": ("b1",)}


# ---- preemption ------------------------------------------------------------------------------------
def _fill(c: Cluster, nid: str, sbs: list[tuple[str, int, float]], mem: int = 1024) -> None:
    """Put running sandboxes (id, priority rank, last_used) on a node."""
    for sid, prio, last in sbs:
        req = Request(memory_mb=mem, cpus=1, priority=prio, job=f"j{prio}")
        c.reserve(Placement(nid), req)
        c.track(SandboxView(sid, nid, mem, 1, prio, f"j{prio}", last_used=last, used_mb=mem // 2))


def test_preemption_pauses_lowest_class_then_longest_idle_never_busy_or_higher() -> None:
    c = mk(1, mem=4096)
    # batch (3) idle long, interactive (2) idle longer, batch busy (used just now), eval (1) idle
    _fill(c, "n0", [("i-old", 2, 0.0), ("b-old", 3, 100.0), ("b-busy", 3, 995.0), ("e-old", 1, 0.0)])
    plan = plan_preemption(Request(memory_mb=1024, priority=0), 1, c, now=1000.0)
    assert [v.id for v in plan["n0"][1]] == ["b-old"]
    plan = plan_preemption(Request(memory_mb=2048, priority=0), 1, c, now=1000.0)
    assert [v.id for v in plan["n0"][1]] == ["b-old", "i-old"]
    # an eval request may only pause interactive and batch sandboxes
    plan = plan_preemption(Request(memory_mb=4096, priority=1), 1, c, now=1000.0)
    assert plan == {}
    # the same class is never preempted
    assert plan_preemption(Request(memory_mb=1024, priority=3), 1, c, now=1000.0) == {}


def test_preemption_for_a_burst_spreads_over_nodes() -> None:
    c = mk(4, mem=4096)
    for i in range(4):
        _fill(c, f"n{i}", [(f"s{i}{k}", 3, 0.0) for k in range(4)])
    plan = plan_preemption(Request(memory_mb=1024, priority=0), 4, c, now=1000.0)
    assert sorted(plan) == ["n0", "n1", "n2", "n3"]
    assert all(k == 1 and len(vs) == 1 for k, vs in plan.values())


def test_paused_sandboxes_free_promised_memory_and_resume_when_room_returns() -> None:
    c = mk(1, mem=2048)
    _fill(c, "n0", [("low", 3, 0.0), ("low2", 3, 0.0)])
    req = Request(memory_mb=1024, priority=0, job="hi")
    with pytest.raises(CapacityExceeded):
        place(req, c)
    low = c.node("n0").sandboxes["low"]
    c.paused(low, returned_mb=low.used_mb)
    p = place(req, c)
    c.reserve(p, req)
    assert not can_resume(low, c)  # the high-priority sandbox holds its room now
    c.release("n0", req)
    assert can_resume(low, c)
    c.resumed(low, now=2000.0)
    assert low.state == "running" and c.node("n0").committed_mb == 2048 and c.node("n0").paused == 0


# ---- compute tides ---------------------------------------------------------------------------------
def test_tides_pause_idle_sandboxes_only_while_memory_is_tight() -> None:
    pol = Policy(tide_high=0.8, tide_low=0.5, tide_idle_s=300.0, min_free_mb=0)
    c = Cluster([NodeState.new("n0", 16, 10_000, pol)], pol)
    for sid, last, used in [("busy", 990.0, 3000), ("idle-a", 100.0, 2000), ("idle-b", 500.0, 2000),
                            ("idle-c", 600.0, 2000)]:
        c.track(SandboxView(sid, "n0", 4096, used_mb=used, last_used=last, priority=2))
    node = c.node("n0")
    node.used_mb = 7000
    assert plan_tides("n0", c, 1000.0) == []  # under tide_high
    node.used_mb = 9000
    # must come down by 4,000 MiB: the two longest idle; the busy one is never paused
    assert [v.id for v in plan_tides("n0", c, 1000.0)] == ["idle-a", "idle-b"]
    # deciding changed nothing: the same answer again; a call makes a sandbox busy
    assert [v.id for v in plan_tides("n0", c, 1000.0)] == ["idle-a", "idle-b"]
    c.touched(node.sandboxes["idle-a"], 999.0)
    assert [v.id for v in plan_tides("n0", c, 1000.0)] == ["idle-b", "idle-c"]
    # a paused sandbox is no candidate; resumed, it is one again once idle
    c.paused(node.sandboxes["idle-b"])
    assert [v.id for v in plan_tides("n0", c, 1000.0)] == ["idle-c"]
    c.resumed(node.sandboxes["idle-b"], now=200.0)
    assert [v.id for v in plan_tides("n0", c, 1000.0)] == ["idle-b", "idle-c"]


# ---- jobs, priorities, fair share ------------------------------------------------------------------
def test_priority_classes_go_first_then_fair_share_between_jobs() -> None:
    pol = Policy()
    q = FairQueue(pol)
    for i in range(4):
        q.push(f"a{i}", Request(priority=3, job="A"))
    for i in range(4):
        q.push(f"b{i}", Request(priority=3, job="B"))
    q.push("r0", Request(priority=0, job="R"))
    order = []
    while (it := q.pop()) is not None:
        item, req = it
        order.append(item)
        q.book.charge(req.job, req.project, 1)
    assert order[0] == "r0"
    assert order[1:] == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]  # A asked first, then equal turns


def test_fair_share_follows_weights_and_project_weights() -> None:
    pol = Policy(project_weights={"big": 3.0})
    q = FairQueue(pol)
    q.book.configure("heavy", weight=2.0)
    for i in range(6):
        q.push(("heavy", i), Request(job="heavy"))
        q.push(("light", i), Request(job="light"))
    got = []
    for _ in range(6):
        (name, _), req = q.pop()
        got.append(name)
        q.book.charge(req.job, req.project, 1)
    assert got.count("heavy") == 4 and got.count("light") == 2
    q2 = FairQueue(pol)
    for i in range(8):
        q2.push("big", Request(job=f"x{i}", project="big"))
        q2.push("small", Request(job=f"y{i}", project="small"))
    got = []
    for _ in range(8):
        name, req = q2.pop()
        got.append(name)
        q2.book.charge(req.job, req.project, 1)
    assert got.count("big") == 6 and got.count("small") == 2


def test_a_job_at_its_cap_waits_and_drivers_without_a_queue_get_quota_exceeded() -> None:
    pol = Policy()
    book = JobBook(pol)
    q = FairQueue(pol, book)
    book.configure("capped", max_sandboxes=1)
    q.push("c0", Request(job="capped", priority=0))
    q.push("c1", Request(job="capped", priority=0))
    q.push("o0", Request(job="other", priority=3))
    assert q.pop()[0] == "c0"
    book.charge("capped", "default", 1)
    assert q.pop()[0] == "o0"  # capped job waits; the lower class may go
    assert q.pop() is None and len(q) == 1
    with pytest.raises(QuotaExceeded):
        book.check("capped", "default")
    book.charge("capped", "default", -1)
    assert q.pop()[0] == "c1"


def test_job_labels_round_trip_and_bad_values_name_the_label() -> None:
    pol = Policy()
    lab = labels_for_job("step-3", priority="train-rollout", max_sandboxes=32_000, weight=2.0)
    jl = job_labels(lab, pol)
    assert (jl.job, jl.priority, jl.max_sandboxes, jl.weight) == ("step-3", 0, 32_000, 2.0)
    assert job_labels({}, pol, project="p").job == "project:p"
    assert job_labels({}, pol).priority == pol.rank("interactive")
    with pytest.raises(InvalidRequest, match=LABEL_PRIORITY):
        job_labels({LABEL_JOB: "x", LABEL_PRIORITY: "urgent"}, pol)
    with pytest.raises(InvalidRequest, match=LABEL_MAX_SANDBOXES):
        job_labels({LABEL_MAX_SANDBOXES: "lots"}, pol)


def test_policy_priorities_are_configurable() -> None:
    pol = Policy(priorities=("gold", "silver"), default_priority="silver")
    assert pol.rank("gold") == 0 and pol.rank(None) == 1 and pol.rank(1) == 1
    with pytest.raises(InvalidRequest):
        Policy(priorities=("a", "a"))
    with pytest.raises(InvalidRequest):
        Policy(priorities=("a",), default_priority="b")


# ---- preemption from node reports (a driver that tracks no sandboxes) ------------------------------
def test_preemptible_plan_sends_work_where_pausing_idle_lower_classes_frees_room() -> None:
    from shoal.sched import plan_preemptible

    c = mk(3, mem=4096)
    for node in c:
        node.committed_mb = 4096  # every node full
    c.node("n0").idle_mb = {3: 2048}  # idle batch sandboxes: room for two 1 GiB copies
    c.node("n1").idle_mb = {1: 4096}  # idle eval: only a train-rollout request may pause them
    for node in list(c):
        c.upsert(node)
    hi = Request(memory_mb=1024, priority=0)
    plan = plan_preemptible(hi, 10, c)
    assert plan.counts == {"n0": 2, "n1": 4}
    plan = plan_preemptible(hi, 3, c)
    assert plan.placed == 3 and set(plan.counts) <= {"n0", "n1"}
    assert plan_preemptible(Request(memory_mb=1024, priority=1), 10, c).counts == {"n0": 2}
    assert plan_preemptible(Request(memory_mb=1024, priority=3), 10, c).counts == {}
    # reserving a plan takes its room off the next plan's offer
    reserve_plan(c, plan_preemptible(hi, 2, c), hi)
    assert plan_preemptible(hi, 10, c).placed == 4
