"""Packing an overlay upper dir into a layer: runtime artifacts left out, overlay bookkeeping stripped."""

from __future__ import annotations

from pathlib import Path

from shoal.images.pack import runtime_excludes, upper_is_empty
from tests.uppers import make_upper


def test_runtime_artifacts_are_not_changes(tmp_path: Path) -> None:
    up = make_upper(tmp_path)
    assert set(runtime_excludes(up, network=True)) == {".shoal", "proc", "sys", "dev", "etc/resolv.conf"}
    assert upper_is_empty(up, network=True)
    assert not upper_is_empty(up, network=False), "without network, an empty resolv.conf is the sandbox's"
    (up / "proc" / "x").write_text("1")  # cannot happen under a mount, but then it is data
    assert "proc" not in runtime_excludes(up) and not upper_is_empty(up, network=True)
    (up / "etc" / "resolv.conf").write_text("nameserver 1.1.1.1\n")
    assert "etc/resolv.conf" not in runtime_excludes(up, network=True)
