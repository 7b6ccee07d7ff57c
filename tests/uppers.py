"""An overlay upper dir as a stopped container leaves it, for the layer-packing tests (unit and root)."""

from __future__ import annotations

from pathlib import Path


def make_upper(tmp_path: Path) -> Path:
    """`tmp_path/upper` holding only what the runtime makes in every sandbox: the /.shoal, /proc, /sys and
    /dev mountpoints and an empty /etc/resolv.conf — no change of the sandbox's own."""
    up = tmp_path / "upper"
    for d in (".shoal", "proc", "sys", "dev", "etc"):
        (up / d).mkdir(parents=True)
    (up / "etc" / "resolv.conf").write_bytes(b"")
    return up
