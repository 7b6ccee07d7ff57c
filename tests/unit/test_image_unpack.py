"""The strict layer-tar unpacker: unsafe members are refused, whiteouts become overlayfs whiteouts."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from shoal.images.archive import layer_tar
from shoal.images.unpack import LayerTarError, unpack_layer

IS_ROOT = os.geteuid() == 0


def _tar(members: list[tarfile.TarInfo], data: dict[str, bytes] | None = None) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for m in members:
            payload = (data or {}).get(m.name)
            if payload is not None:
                m.size = len(payload)
                tf.addfile(m, io.BytesIO(payload))
            else:
                tf.addfile(m)
    return buf.getvalue()


def _ti(name: str, kind: bytes = tarfile.REGTYPE, **kw: object) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    for k, v in kw.items():
        setattr(ti, k, v)
    return ti


def _unpack(tmp_path: Path, data: bytes, **kw: object) -> Path:
    dest = tmp_path / "out"
    dest.mkdir()
    unpack_layer(io.BytesIO(data), dest, **kw)  # type: ignore[arg-type]
    return dest


@pytest.mark.parametrize("name", ["/etc/passwd", "../evil", "a/../../evil", "a/../../../tmp/x"])
def test_paths_outside_the_layer_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(LayerTarError):
        _unpack(tmp_path, _tar([_ti(name)], {name: b"x"}))
    assert not (tmp_path / "evil").exists()


def test_writes_through_a_symlink_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.mkdir()
    data = _tar([_ti("lnk", tarfile.SYMTYPE, linkname=str(target)), _ti("lnk/pwned")], {"lnk/pwned": b"x"})
    with pytest.raises(LayerTarError, match="symlink"):
        _unpack(tmp_path, data)
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("link", ["../../etc/passwd", "/etc/passwd", "missing", "lnk/x"])
def test_hard_links_must_point_inside_at_earlier_members(tmp_path: Path, link: str) -> None:
    members = [_ti("lnk", tarfile.SYMTYPE, linkname="/etc"), _ti("h", tarfile.LNKTYPE, linkname=link)]
    with pytest.raises(LayerTarError):
        _unpack(tmp_path, _tar(members))


def test_device_nodes_need_permission_and_0_0_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LayerTarError, match="device"):
        _unpack(tmp_path, _tar([_ti("dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3)]), allow_devices=False)
    dest = tmp_path / "out2"
    dest.mkdir()
    with pytest.raises(LayerTarError, match="whiteout"):
        unpack_layer(io.BytesIO(_tar([_ti("x", tarfile.CHRTYPE, devmajor=0, devminor=0)])), dest, allow_devices=True)


def test_truncated_and_garbage_tars_give_clear_errors(tmp_path: Path) -> None:
    good = layer_tar([("file", "a", b"x" * 5000, 0o644)])
    for i, cut in enumerate((700, 2000, 4000)):
        dest = tmp_path / f"t{i}"
        dest.mkdir()
        with pytest.raises(LayerTarError, match=r"corrupt or truncated|not a tar"):
            unpack_layer(io.BytesIO(good[:cut]), dest)
    dest = tmp_path / "g"
    dest.mkdir()
    with pytest.raises(LayerTarError):
        unpack_layer(io.BytesIO(os.urandom(4096)), dest)


def test_plain_members_keep_their_metadata(tmp_path: Path) -> None:
    x = _ti("bin/tool", mode=0o4755, mtime=1234567, uid=0, gid=0)
    x.pax_headers = {"SCHILY.xattr.user.k": "v", "SCHILY.xattr.trusted.overlay.redirect": "/evil"}
    members = [_ti("bin", tarfile.DIRTYPE, mode=0o711, mtime=42), x,
               _ti("bin/link", tarfile.SYMTYPE, linkname="tool", mtime=99),
               _ti("bin/hard", tarfile.LNKTYPE, linkname="bin/tool"),
               _ti("fifo", tarfile.FIFOTYPE, mode=0o640)]
    out = _unpack(tmp_path, _tar(members, {"bin/tool": b"#!/bin/sh\n"}))
    st = os.lstat(out / "bin" / "tool")
    assert stat.S_IMODE(st.st_mode) == 0o4755 and st.st_mtime == 1234567 and st.st_nlink == 2
    assert os.lstat(out / "bin" / "hard").st_ino == st.st_ino
    assert os.readlink(out / "bin" / "link") == "tool" and os.lstat(out / "bin" / "link").st_mtime == 99
    assert stat.S_IMODE(os.lstat(out / "bin").st_mode) == 0o711 and os.lstat(out / "bin").st_mtime == 42
    assert stat.S_ISFIFO(os.lstat(out / "fifo").st_mode)
    assert os.getxattr(out / "bin" / "tool", "user.k") == b"v"
    if IS_ROOT:
        assert "trusted.overlay.redirect" not in os.listxattr(out / "bin" / "tool")
    # the layer root is world-readable and has a fixed mtime (same tar -> same bytes)
    assert stat.S_IMODE(os.lstat(out).st_mode) == 0o755 and os.lstat(out).st_mtime == 0


def test_implicit_parents_are_deterministic(tmp_path: Path) -> None:
    out = _unpack(tmp_path, _tar([_ti("a/b/c", mtime=5)], {"a/b/c": b"1"}))
    for d in (out / "a", out / "a" / "b"):
        st = os.lstat(d)
        assert stat.S_IMODE(st.st_mode) == 0o755 and st.st_mtime == 0
