"""Turn a sandbox's writable layer (an overlayfs upper dir) into an immutable store layer.

An upper dir already speaks the layer format: deleted files are 0/0 character devices (whiteouts) and
replaced directories carry the `trusted.overlay.opaque` xattr. mkfs.erofs keeps both, so the packed
layer stacks under a new upper exactly as the files looked in the sandbox.

overlayfs also leaves private bookkeeping in an upper (`trusted.overlay.origin`, `.impure`, `.uuid`, …:
file handles of the lower filesystems of *that* mount). They mean nothing in another stack and make
layers irreproducible; `clean=True` strips them (in place: only for an upper about to be discarded).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import ImageBuildError, QuotaExceeded
from shoal.fsutil import tmp_name
from shoal.images.erofs import build_erofs
from shoal.images.store import ImageStore, Layer

# Created by the OCI runtime as the agent's mountpoints (its binary; its socket under gVisor); not part of
# the sandbox's own files.
RUNTIME_ARTIFACTS = [".shoal", ".shoal-run"]
# Mountpoints the runtime creates when the image lacks them; nothing can be written beneath them.
_RUNTIME_MOUNT_DIRS = ["proc", "sys", "dev"]
OPAQUE_XATTR = "trusted.overlay.opaque"
_KEEP_XATTRS = {OPAQUE_XATTR}


def _is_empty_dir(p: Path) -> bool:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    with os.scandir(p) as it:
        return next(it, None) is None


def _empty_file(p: Path) -> bool:
    try:
        st = os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size == 0


def runtime_excludes(upper: Path, network: bool = False) -> list[str]:
    """Paths (relative to `upper`) that the runtime, not the sandbox, put there: the agent's mountpoint,
    mountpoints of /proc, /sys, /dev when the image lacks them (nothing can be written beneath a
    mountpoint, so an empty one is the runtime's), and, with network, resolv.conf's bind-mount target."""
    upper = Path(upper)
    out = [rel for rel in RUNTIME_ARTIFACTS if _is_empty_dir(upper / rel)]
    out += [rel for rel in _RUNTIME_MOUNT_DIRS if _is_empty_dir(upper / rel)]
    if network and _empty_file(upper / "etc" / "resolv.conf"):
        out.append("etc/resolv.conf")
    return out


def clean_upper(upper: Path, network: bool = False) -> int:
    """Strip overlayfs bookkeeping xattrs and runtime mountpoints from a discarded upper; returns how
    many xattrs were removed. Whiteouts and opaque markers (the layer's meaning) are kept."""
    upper = Path(upper)
    removed = 0
    for rel in _RUNTIME_MOUNT_DIRS:
        # nothing a sandbox does can land under a mountpoint, so an empty one was made by the runtime
        p = upper / rel
        if _is_empty_dir(p) and not _overlay_xattrs(p, keep_opaque=False):
            with contextlib.suppress(OSError):
                p.rmdir()
    if network:
        # the runtime bind-mounts the host's resolv.conf there; an empty upper file is its mountpoint
        p = upper / "etc" / "resolv.conf"
        with contextlib.suppress(OSError):
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and st.st_size == 0:
                p.unlink()
    for dirpath, dirnames, filenames in os.walk(upper):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
            for attr in _overlay_xattrs(Path(name)):
                with contextlib.suppress(OSError):
                    os.removexattr(name, attr, follow_symlinks=False)
                    removed += 1
    return removed


def _overlay_xattrs(p: Path, keep_opaque: bool = True) -> list[str]:
    try:
        names = os.listxattr(p, follow_symlinks=False)
    except OSError:
        return []
    return [n for n in names if n.startswith("trusted.overlay.") and not (keep_opaque and n in _KEEP_XATTRS)]


@dataclass
class Footprint:
    """What packing a tree would write: sizes of its files as seen (`apparent`) and as stored (`allocated`)."""

    files: int = 0
    apparent: int = 0
    allocated: int = 0
    #: bytes of holes in sparse files (apparent beyond allocated)
    holes: int = 0
    #: the largest files by apparent size: (bytes, path relative to the tree)
    largest: list[tuple[int, str]] = field(default_factory=list)

    def layer_bytes(self) -> int:
        """What the layer is charged: every file's size as seen, holes included, and ~1 KiB of metadata
        per file. Packing keeps holes as holes (the file in the store is smaller), but mkfs.erofs still
        reads them (hole detection by content: ~35 s of CPU for a 2 GiB hole here), so they count."""
        return self.allocated + self.holes + 1024 * self.files + (1 << 20)

    def describe_largest(self, n: int = 3) -> str:
        """`/tmp/sparse (2048 MiB, 0 MiB on disk), ...` for error messages."""
        return ", ".join(f"/{rel} ({size / 2**20:.0f} MiB)" for size, rel in self.largest[:n])


def footprint(root: Path, exclude: list[str] | None = None, keep: int = 3) -> Footprint:
    """Walk `root` (not following symlinks, each inode once) and add up what packing it would store."""
    fp = Footprint()
    skip = {os.path.join(str(root), rel) for rel in exclude or []}
    seen: set[int] = set()
    stack = [str(root)]
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for e in it:
                if e.path in skip:
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                fp.files += 1
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
                elif stat.S_ISREG(st.st_mode) and st.st_ino not in seen:
                    seen.add(st.st_ino)
                    alloc = st.st_blocks * 512
                    fp.apparent += st.st_size
                    fp.allocated += min(alloc, st.st_size + 4095)
                    fp.holes += max(0, st.st_size - alloc)
                    if len(fp.largest) < keep or st.st_size > fp.largest[-1][0]:
                        fp.largest.append((st.st_size, os.path.relpath(e.path, root)))
                        fp.largest.sort(reverse=True)
                        del fp.largest[keep:]
    return fp


def check_layer_budget(fp: Footprint, max_bytes: int, what: str, why: str) -> None:
    """QuotaExceeded when the layer of `fp` is charged more than `max_bytes` (`what` = "the snapshot of
    sandbox X", `why` = which limit, for the message)."""
    need = fp.layer_bytes()
    if need <= max_bytes:
        return
    raise QuotaExceeded(
        f"{what} holds {need / 2**20:.0f} MiB of files, over {why} ({max_bytes / 2**20:.0f} MiB); largest "
        f"files: {fp.describe_largest()}. Delete or shrink them (the holes of sparse files count as their "
        "size), or ask for a larger limit",
        reason="layer_too_large", need_bytes=need, limit_bytes=max_bytes, files=fp.files,
        apparent_bytes=fp.apparent, allocated_bytes=fp.allocated)


def pack_upper(store: ImageStore, upper: Path, source: dict[str, Any], compress: str | None = None, *,
               clean: bool = False, network: bool = False, max_bytes: int | None = None,
               what: str = "this layer", why: str = "its limit") -> Layer:
    """Pack `upper` (excluding runtime artifacts) into a layer in `store`; returns it (deduplicated).

    Holes in sparse files stay holes (uncompressed layers). `max_bytes`: refuse (QuotaExceeded, before
    reading or writing anything) a tree charged more (Footprint.layer_bytes: holes count); `what`/`why`
    name it and the limit in the message.
    `clean=True` first strips overlayfs bookkeeping in place (see `clean_upper`); use it only when the
    sandbox owning `upper` is paused or stopped and will not be resumed."""
    upper = Path(upper)
    if not upper.is_dir():
        raise ImageBuildError(f"no writable layer at {upper}")
    exclude = runtime_excludes(upper, network)
    if max_bytes is not None:
        check_layer_budget(footprint(upper, exclude), max_bytes, what, why)
    if clean:
        clean_upper(upper, network=network)
    tmp = store.tmp_dir / (tmp_name("upper-") + ".erofs")
    local = None
    try:
        if _on_fuse(store.tmp_dir):
            # sparse (chunk-based) images are written with copy_file_range, which FUSE filesystems refuse
            # across devices (EXDEV; mkfs.erofs reports EIO): build on local disk (not in the upper: its
            # quota is the sandbox's), then copy in
            local = Path("/var/tmp") / (tmp_name("upper-") + ".erofs")
            build_erofs(upper, local, compress=compress, exclude=exclude, sparse=True)
            shutil.copyfile(local, tmp)
        else:
            build_erofs(upper, tmp, compress=compress, exclude=exclude, sparse=True)
        return store.add_layer_file(tmp, source)
    finally:
        for f in (tmp, local):
            if f is not None:
                with contextlib.suppress(FileNotFoundError):
                    f.unlink()


FUSE_SUPER_MAGIC = 0x65735546


def _on_fuse(path: Path) -> bool:
    """True when `path` is on a FUSE filesystem (MooseFS, JuiceFS, 3FS' client …)."""
    import ctypes
    import ctypes.util

    class _Statfs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    buf = _Statfs()
    if libc.statfs(str(path).encode(), ctypes.byref(buf)) != 0:
        return False
    return (buf.f_type & 0xFFFFFFFF) == FUSE_SUPER_MAGIC


def upper_is_empty(upper: Path, network: bool = False) -> bool:
    """True when an upper holds nothing but runtime artifacts (the sandbox changed no file)."""
    upper = Path(upper)
    artifacts = set(runtime_excludes(upper, network))
    with os.scandir(upper) as it:
        names = {e.name for e in it}
    if "etc/resolv.conf" in artifacts and "etc" in names:
        with os.scandir(upper / "etc") as it:
            if {e.name for e in it} == {"resolv.conf"}:
                names.discard("etc")
    return not (names - artifacts)
