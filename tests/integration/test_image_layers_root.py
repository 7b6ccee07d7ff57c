"""Layers whose contents need root: overlayfs whiteouts (0/0 character devices) and trusted.* xattrs, made by
unpacking an OCI layer tar and by packing an overlay upper dir (mounted as EROFS to read back). Moved here
from tests/unit: unit tests run without root."""

from __future__ import annotations

import io
import os
import stat
import tempfile
from pathlib import Path

import pytest

from shoal.host import syscalls
from shoal.images.archive import layer_tar
from shoal.images.pack import OPAQUE_XATTR, clean_upper, pack_upper
from shoal.images.store import ImageStore
from shoal.images.unpack import unpack_layer
from tests.uppers import make_upper

pytestmark = [pytest.mark.root]


def _unpack(tmp_path: Path, data: bytes) -> Path:
    dest = tmp_path / "out"
    dest.mkdir()
    unpack_layer(io.BytesIO(data), dest)
    return dest


def test_pack_upper_keeps_meaning_and_drops_bookkeeping(tmp_path: Path) -> None:
    up = make_upper(tmp_path)
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
    whole = store.export_layer(lay.digest, tmp_path / "layer.erofs")
    syscalls.mount(str(whole), str(mp), "erofs", syscalls.MS_RDONLY, None)
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


def test_oci_whiteouts_become_overlayfs_whiteouts(tmp_path: Path) -> None:
    data = layer_tar([("dir", "etc", 0o755), ("whiteout", "etc/gone"), ("dir", "var", 0o755),
                      ("opaque", "var"), ("file", "var/new", b"n", 0o644),
                      ("whiteout", "re"), ("dir", "re", 0o700), ("file", "re/x", b"x", 0o644),
                      ("file", "same", b"s", 0o644), ("whiteout", "same"),
                      ("file", ".wh..wh.plnk", b"", 0o644)])
    out = _unpack(tmp_path, data)
    st = os.lstat(out / "etc" / "gone")
    assert stat.S_ISCHR(st.st_mode) and os.major(st.st_rdev) == 0 and os.minor(st.st_rdev) == 0
    assert os.getxattr(out / "var", OPAQUE_XATTR) == b"y"
    assert (out / "var" / "new").read_bytes() == b"n"
    # deleted then re-created in the same layer: a dir that hides the lower one
    assert os.getxattr(out / "re", OPAQUE_XATTR) == b"y" and (out / "re" / "x").exists()
    assert stat.S_IMODE(os.lstat(out / "re").st_mode) == 0o700
    # an entry and its whiteout in one layer: the entry wins
    assert (out / "same").read_bytes() == b"s"
    assert not any(p.name.startswith(".wh.") for p in out.rglob("*"))
