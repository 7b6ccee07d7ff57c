"""Settings reach a real node: SHOAL_WARM_POOL fills a warm pool at start, SHOAL_SH picks the shell of string
commands, and a bad value stops the node before it touches the host."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.config import InvalidSetting
from shoal.models import SandboxSpec
from shoal.node.node import Node
from tests.conftest import runtime_containers

pytestmark = [pytest.mark.root]


async def test_warm_pool_setting_fills_the_pool_at_start(shoal_home: Path, base_image: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_WARM_POOL", f"{base_image}=2")
    monkeypatch.setenv("SHOAL_SH", "1")
    node = Node()
    assert node.config.warm_pool == {base_image: 2} and node.config.posix_sh
    pooled: list[str] = []
    async with node:
        await node.pool.wait_full(timeout=120)
        [st] = node.pool.status()
        assert (st["size"], st["ready"]) == (2, 2)
        pooled = list(node.pool.pools[next(iter(node.pool.pools))].ready)
        info = await node.create(SandboxSpec(image=base_image))
        assert info.id in pooled and node.pool.hits == 1
        # SHOAL_SH=1: a string command runs under /bin/sh -c, so $0 names sh
        r = await node.exec(info.id, "echo $0")
        assert r.stdout.strip() in (b"/bin/sh", b"sh"), r.stdout
        await node.close(info.id)
    # stopping the node closed the sandboxes it kept ready
    assert not [c for c in runtime_containers() if any(sid in c for sid in pooled)]


def test_bad_setting_stops_the_node_before_it_starts(shoal_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_WARM_POOL", "base")
    with pytest.raises(InvalidSetting, match=r"SHOAL_WARM_POOL='base' \(from env\): .*IMAGE=COUNT"):
        Node()
