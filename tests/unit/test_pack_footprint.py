"""What packing a tree is charged (issue 19 item 3): holes count as their size, hard links once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shoal.errors import QuotaExceeded
from shoal.images.pack import check_layer_budget, footprint


def test_footprint_counts_holes_and_each_inode_once(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with open(tmp_path / "d" / "sparse", "wb") as f:
        f.truncate(64 << 20)
    (tmp_path / "small").write_bytes(b"x" * 5000)
    os.link(tmp_path / "small", tmp_path / "again")
    (tmp_path / "skipme").write_bytes(b"y" * (1 << 20))
    fp = footprint(tmp_path, exclude=["skipme"])
    assert fp.files == 4  # d, d/sparse, small, again
    assert fp.apparent == (64 << 20) + 5000
    assert fp.holes >= (64 << 20) - (1 << 20)
    assert fp.largest[0] == (64 << 20, "d/sparse")
    check_layer_budget(fp, 80 << 20, "this tree", "a test limit")
    with pytest.raises(QuotaExceeded, match=r"this tree holds 65 MiB .* a test limit .* /d/sparse \(64 MiB\)"):
        check_layer_budget(fp, 32 << 20, "this tree", "a test limit")
