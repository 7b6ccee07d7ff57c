"""Item 7 of issue 23: any project could label its sandboxes `shoal.priority=train-rollout` and preempt
(pause) another project's idle sandboxes.

Over the session's real `shoal serve`: a project may use only the priority classes granted to it (by
default the default class and those below it); a class above is 403 naming it, through the native API
and E2B's metadata alike; the operator's grant (`shoal token policy --priorities`) opens it. On a node
(the fake backend: admission is what matters here): a create that does not fit pauses idle lower-class
sandboxes of its own project only, unless the operator sets SHOAL_PREEMPT_ACROSS_PROJECTS."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shoal.errors import CapacityExceeded
from shoal.models import SandboxSpec
from shoal.node.admission import meminfo
from shoal.node.node import Node
from shoal.server.tokens import ProjectPolicy, TokenStore
from tests.unit.conftest import AGENT_BUILT, add_image, agents_under, fake_config

pytestmark = [pytest.mark.root]


def test_priority_classes_are_granted_per_project(api_server: Any) -> None:
    store = TokenStore(Path(os.environ["SHOAL_HOME"]))
    project = f"prio-{secrets.token_hex(3)}"
    tok = store.create(project, name="priority test")
    h = {"Authorization": f"Bearer {tok}"}
    url = api_server.url
    made: list[str] = []

    def create(cls: str | None) -> httpx.Response:
        labels = {"shoal.priority": cls} if cls else {}
        r = httpx.post(f"{url}/v1/sandboxes", json={"image": "base", "memory_mb": 64, "labels": labels}, headers=h,
                       timeout=120)
        if r.status_code == 201:
            made.append(r.json()["id"])
        return r

    try:
        for cls in ("train-rollout", "eval"):
            r = create(cls)
            err = r.json()["error"]
            assert r.status_code == 403 and err["code"] == "forbidden" and err["details"]["value"] == cls, r.text
            assert err["details"]["granted"] == ["interactive", "batch"]
            r = httpx.post(f"{url}/sandboxes", json={"templateID": "base", "metadata": {"shoal.priority": cls}},
                           headers={"X-API-KEY": tok}, timeout=120)  # E2B's create: metadata are labels
            assert r.status_code == 403, r.text
        for cls in (None, "interactive", "batch"):
            assert create(cls).status_code == 201
        store.set_policy(project, ProjectPolicy(priorities=["train-rollout", "batch"]))
        assert create("train-rollout").status_code == 201
        assert create("eval").status_code == 403  # not in the grant
    finally:
        for sid in made:
            httpx.delete(f"{url}/v1/sandboxes/{sid}", headers=h, timeout=60)


@pytest.fixture
async def small(tmp_path: Path) -> AsyncIterator[Node]:
    """A started fake-backend node whose admission takes 300 MiB of promised memory."""
    if not AGENT_BUILT:
        pytest.skip("the agent is not built: run `make agent`")
    node = Node(fake_config(tmp_path, memory_overcommit=300 / (meminfo()["MemTotal"] // 1024)))
    add_image(node.store, "t:1", {"/work/x": "x"})
    await node.start(reap=False)
    try:
        yield node
    finally:
        await node.close_all()
        await node.stop()
        assert not agents_under(tmp_path)


def _spec(project: str, cls: str) -> SandboxSpec:
    return SandboxSpec(image="t:1", backend="fake", memory_mb=100, project=project, labels={"shoal.priority": cls})


async def test_preemption_stays_in_the_project_unless_the_operator_allows(small: Node) -> None:
    theirs = [await small.create(_spec("other", "batch")) for _ in range(3)]  # the node is full
    for s in theirs:
        small.scheduling.last_used[s.id] = time.time() - 3600  # long idle
    with pytest.raises(CapacityExceeded):
        await small.create(_spec("mine", "train-rollout"))
    assert all([(await small.get(s.id)).state == "running" for s in theirs])  # another project's: untouched
    # its own idle lower-class sandbox is fair game
    await small.close(theirs[0].id)
    own = await small.create(_spec("mine", "batch"))
    small.scheduling.last_used[own.id] = time.time() - 3600
    hi = await small.create(_spec("mine", "train-rollout"))
    assert hi.state == "running" and (await small.get(own.id)).state == "paused"
    # the operator's policy allows preemption across projects
    small.scheduling.preempt_across_projects = True
    await small.create(_spec("mine", "train-rollout"))
    assert sorted([(await small.get(s.id)).state for s in theirs[1:]]) == ["paused", "running"]
