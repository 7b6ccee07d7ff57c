"""Packing an overlay upper dir into a layer: runtime artifacts left out, overlay bookkeeping stripped."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest

from shoal.host import syscalls
from shoal.images.pack import OPAQUE_XATTR, clean_upper, pack_upper, runtime_excludes, upper_is_empty
from shoal.images.store import ImageStore

IS_ROOT = os.geteuid() == 0


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


@pytest.mark.root
@pytest.mark.skipif(not IS_ROOT, reason="trusted.* xattrs, whiteouts and mounts need root")
def test_pack_upper_keeps_meaning_and_drops_bookkeeping(tmp_path: Path) -> None:
    up = _upper(tmp_path)
    (up / "data").mkdir()
    (up / "data" / "f").write_text("kept")
    os.setxattr(up / "data", OPAQUE_XATTR, b"y")
    os.setxattr(up / "data" / "f", "trusted.overlay.origin", b"\x00\xfb")
    os.setxattr(up, "trusted.overlay.impure", b"y")
    os.mknod(up / "gone", stat.S_IFCHR, os.makedev(0, 0))
    store = ImageStore(tmp_path / "store")
    assert clean_upper(up, network=True) == 2
    lay = pack_upper(store, up, {"type": "test"}, network=True)
    mp = Path(tempfile.mkdtemp(prefix="shoal-pack-"))
    syscalls.mount(str(lay.path), str(mp), "erofs", syscalls.MS_RDONLY, None)
    try:
        names = sorted(os.listdir(mp))
        assert names == ["data", "etc", "gone"], names
        assert os.listdir(mp / "etc") == []
        assert (mp / "data" / "f").read_text() == "kept"
        assert os.getxattr(mp / "data", OPAQUE_XATTR) == b"y"
        assert "trusted.overlay.origin" not in os.listxattr(mp / "data" / "f")
        st = os.lstat(mp / "gone")
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
    finally:
        syscalls.umount(str(mp))
        mp.rmdir()
