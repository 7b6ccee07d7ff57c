"""Packing an overlay upper dir into a layer: runtime artifacts left out, overlay bookkeeping stripped."""

from __future__ import annotations

from pathlib import Path

from shoal.images.pack import runtime_excludes, upper_is_empty


def _upper(tmp_path: Path) -> Path:
    up = tmp_path / "upper"
    for d in (".shoal", "proc", "sys", "dev", "etc"):
        (up / d).mkdir(parents=True)
    (up / "etc" / "resolv.conf").write_bytes(b"")
    return up


def test_runtime_artifacts_are_not_changes(tmp_path: Path) -> None:
    up = _upper(tmp_path)
    assert set(runtime_excludes(up, network=True)) == {".shoal", "proc", "sys", "dev", "etc/resolv.conf"}
    assert upper_is_empty(up, network=True)
    assert not upper_is_empty(up, network=False), "without network, an empty resolv.conf is the sandbox's"
    (up / "proc" / "x").write_text("1")  # cannot happen under a mount, but then it is data
    assert "proc" not in runtime_excludes(up) and not upper_is_empty(up, network=True)
    (up / "etc" / "resolv.conf").write_text("nameserver 1.1.1.1\n")
    assert "etc/resolv.conf" not in runtime_excludes(up, network=True)
