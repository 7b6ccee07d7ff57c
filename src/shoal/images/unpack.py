"""Unpack one OCI/Docker layer tar into a directory that overlayfs (and mkfs.erofs) understands.

Strict by design, because a layer tar is untrusted input:
- member names must be relative, without `..`, and never pass through a symlink (nothing can be
  written outside the target directory); hard links must point at an earlier member of the same tar;
- device nodes are created only as root, and a literal 0/0 character device is refused (overlayfs
  would read it as a whiteout);
- `trusted.overlay.*` xattrs in the tar are dropped: only whiteout conversion may create them.

OCI whiteouts become overlayfs ones: `dir/.wh.name` -> a 0/0 character device `dir/name`;
`dir/.wh..wh..opq` -> the `trusted.overlay.opaque=y` xattr on `dir`. Owners, modes (setuid too),
xattrs, mtimes, symlinks and hard links are kept. Directories the tar does not list get mode 0755,
owner 0:0 and mtime 0, so the result is a pure function of the tar's bytes (same tar -> same layer).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from shoal.errors import InvalidRequest

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"
_XATTR_PAX = "SCHILY.xattr."
_CHUNK = 1 << 20


@dataclass
class UnpackStats:
    """What one layer contained."""

    entries: int = 0
    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    hardlinks: int = 0
    devices: int = 0
    whiteouts: int = 0
    opaque_dirs: int = 0
    bytes: int = 0
    skipped_xattrs: list[str] = field(default_factory=list)


class LayerTarError(InvalidRequest):
    """A layer tar is malformed or tries something unsafe (the message names the member)."""


def _split(name: str, what: str = "member") -> list[str]:
    """Validate a member name and return its components ([] for the root)."""
    if "\0" in name:
        raise LayerTarError(f"{what} name {name!r} contains NUL")
    if name.startswith("/"):
        raise LayerTarError(f"{what} {name!r} is an absolute path; layer tars hold relative paths only")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise LayerTarError(f"{what} {name!r} contains '..'; refusing to write outside the layer")
    if len(name.encode()) > 4096 or any(len(p.encode()) > 255 for p in parts):
        raise LayerTarError(f"{what} {name!r} is too long")
    return parts


class LayerUnpacker:
    """Unpacks a layer tar into `dest` (an empty directory). One instance per layer."""

    def __init__(self, dest: Path, *, allow_devices: bool | None = None) -> None:
        self.dest = Path(dest)
        self.root = os.geteuid() == 0
        self.allow_devices = self.root if allow_devices is None else allow_devices
        self.stats = UnpackStats()
        self._whiteouts: set[str] = set()   # relpaths of whiteout devices we made
        self._dir_times: dict[str, int] = {}  # relpath -> mtime ns, applied at the end
        self._implicit: set[str] = set()
        os.chmod(self.dest, 0o755)
        if self.root:
            os.chown(self.dest, 0, 0)
        self._dir_times[""] = 0

    # ---- helpers ------------------------------------------------------------------------------
    def _abs(self, parts: list[str]) -> str:
        return os.path.join(self.dest, *parts)

    def _ensure_parents(self, parts: list[str], name: str) -> None:
        """Create missing parent dirs; refuse to go through symlinks or non-directories."""
        for i in range(len(parts) - 1):
            rel = "/".join(parts[: i + 1])
            p = self._abs(parts[: i + 1])
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                os.mkdir(p, 0o755)
                if self.root:
                    os.chown(p, 0, 0)
                self._implicit.add(rel)
                self._dir_times[rel] = 0
                continue
            if stat.S_ISDIR(st.st_mode):
                continue
            if stat.S_ISLNK(st.st_mode):
                raise LayerTarError(f"member {name!r} goes through the symlink {rel!r}; refusing to follow it")
            if rel in self._whiteouts:
                # the lower path was deleted, then this layer puts things below it: an opaque dir
                os.unlink(p)
                self._whiteouts.discard(rel)
                os.mkdir(p, 0o755)
                self._set_opaque(p)
                self._implicit.add(rel)
                self._dir_times[rel] = 0
                continue
            raise LayerTarError(f"member {name!r} needs {rel!r} to be a directory, but the tar made it a file")

    def _set_opaque(self, path: str) -> None:
        os.setxattr(path, OPAQUE_XATTR, b"y", follow_symlinks=False)
        self.stats.opaque_dirs += 1

    def _clear(self, parts: list[str], new_is_dir: bool) -> bool:
        """Make room for a new entry at `parts`. Returns True when an existing dir is kept (dir over dir)."""
        p = self._abs(parts)
        rel = "/".join(parts)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            return False
        if rel in self._whiteouts:
            os.unlink(p)
            self._whiteouts.discard(rel)
            if new_is_dir:
                # deleted in the layer, then re-created: the lower's content must stay hidden
                os.mkdir(p, 0o700)
                self._set_opaque(p)
                return True
            return False
        if stat.S_ISDIR(st.st_mode):
            if new_is_dir:
                return True
            shutil.rmtree(p)
            self._drop_under(rel)
        else:
            os.unlink(p)
        return False

    def _drop_under(self, rel: str) -> None:
        pre = rel + "/"
        for k in [k for k in self._dir_times if k == rel or k.startswith(pre)]:
            del self._dir_times[k]
        self._whiteouts = {w for w in self._whiteouts if not w.startswith(pre)}
        self._implicit = {w for w in self._implicit if w != rel and not w.startswith(pre)}

    def _apply_meta(self, path: str, m: tarfile.TarInfo, is_link: bool) -> None:
        if self.root:
            os.chown(path, m.uid, m.gid, follow_symlinks=False)
        if not is_link:
            # after chown: chown clears setuid/setgid bits
            os.chmod(path, m.mode & 0o7777)
        for key, val in (m.pax_headers or {}).items():
            if not key.startswith(_XATTR_PAX):
                continue
            attr = key[len(_XATTR_PAX):]
            if attr.startswith("trusted.overlay."):
                self.stats.skipped_xattrs.append(attr)
                continue
            raw = val.encode("utf-8", "surrogateescape") if isinstance(val, str) else bytes(val)
            try:
                os.setxattr(path, attr, raw, follow_symlinks=False)
            except OSError:
                # e.g. user.* on a symlink, or security.* this filesystem refuses
                self.stats.skipped_xattrs.append(attr)

    @staticmethod
    def _mtime_ns(m: tarfile.TarInfo) -> int:
        return round(float(m.mtime) * 1e9)

    # ---- the walk -----------------------------------------------------------------------------
    def unpack(self, fileobj: IO[bytes]) -> UnpackStats:
        """Read an uncompressed layer tar from `fileobj` (a stream) and build the tree."""
        try:
            tf = tarfile.open(fileobj=fileobj, mode="r|", errorlevel=2)  # noqa: SIM115 - `with tf` below
        except tarfile.TarError as e:
            raise LayerTarError(f"not a tar archive: {e}") from None
        try:
            with tf:
                for m in tf:
                    self._member(tf, m)
        except (tarfile.TarError, EOFError) as e:
            raise LayerTarError(f"corrupt or truncated layer tar: {e}") from None
        self._finish()
        return self.stats

    def _member(self, tf: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        parts = _split(m.name)
        self.stats.entries += 1
        if not parts:
            # the layer root ("./"): take its metadata
            if m.isdir():
                self._apply_meta(str(self.dest), m, False)
                self._dir_times[""] = self._mtime_ns(m)
            return
        base = parts[-1]
        if base.startswith(WHITEOUT_PREFIX):
            self._whiteout(parts, m)
            return
        self._ensure_parents(parts, m.name)
        p = self._abs(parts)
        rel = "/".join(parts)
        if m.islnk():
            tparts = _split(m.linkname, "hard link target")
            if not tparts:
                raise LayerTarError(f"hard link {m.name!r} points at the layer root")
            trel = "/".join(tparts)
            tpath = self._abs(tparts)
            if trel in self._whiteouts or trel == rel:
                raise LayerTarError(f"hard link {m.name!r} -> {m.linkname!r} points at nothing usable")
            self._check_no_symlink_parents(tparts, m.name)
            try:
                tst = os.lstat(tpath)
            except FileNotFoundError:
                raise LayerTarError(
                    f"hard link {m.name!r} -> {m.linkname!r}: the target is not an earlier member of this layer"
                ) from None
            if stat.S_ISDIR(tst.st_mode):
                raise LayerTarError(f"hard link {m.name!r} points at the directory {m.linkname!r}")
            self._clear(parts, False)
            os.link(tpath, p, follow_symlinks=False)
            self.stats.hardlinks += 1
            return
        if m.isdir():
            kept = self._clear(parts, True)
            if not kept:
                os.mkdir(p, 0o700)
            self._implicit.discard(rel)
            self._apply_meta(p, m, False)
            self._dir_times[rel] = self._mtime_ns(m)
            self.stats.dirs += 1
            return
        self._clear(parts, False)
        if m.isreg():
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as out:
                src = tf.extractfile(m)
                if src is not None:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        self.stats.bytes += len(chunk)
            self.stats.files += 1
        elif m.issym():
            if not m.linkname or "\0" in m.linkname:
                raise LayerTarError(f"symlink {m.name!r} has an empty or invalid target")
            # any target is fine: it is resolved inside the sandbox's root, never followed here
            os.symlink(m.linkname, p)
            self.stats.symlinks += 1
        elif m.ischr() or m.isblk():
            if m.ischr() and m.devmajor == 0 and m.devminor == 0:
                raise LayerTarError(
                    f"member {m.name!r} is a 0/0 character device, which overlayfs reads as a whiteout; "
                    "OCI layers express deletions with .wh. files")
            if not self.allow_devices:
                raise LayerTarError(f"member {m.name!r} is a device node: importing it needs root")
            kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
            os.mknod(p, kind | 0o600, os.makedev(m.devmajor, m.devminor))
            self.stats.devices += 1
        elif m.isfifo():
            os.mkfifo(p, 0o600)
        else:
            raise LayerTarError(f"member {m.name!r} has an unsupported tar type {m.type!r}")
        self._apply_meta(p, m, m.issym())
        ns = self._mtime_ns(m)
        os.utime(p, ns=(ns, ns), follow_symlinks=False)

    def _check_no_symlink_parents(self, parts: list[str], name: str) -> None:
        for i in range(len(parts) - 1):
            p = self._abs(parts[: i + 1])
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISLNK(os.lstat(p).st_mode):
                    raise LayerTarError(f"hard link {name!r} goes through the symlink {'/'.join(parts[: i + 1])!r}")

    def _whiteout(self, parts: list[str], m: tarfile.TarInfo) -> None:
        base = parts[-1]
        if base == OPAQUE_MARKER:
            self._ensure_parents(parts, m.name)
            self._set_opaque(self._abs(parts[:-1]) if len(parts) > 1 else str(self.dest))
            return
        if base.startswith(WHITEOUT_PREFIX + WHITEOUT_PREFIX):
            return  # other AUFS metadata (.wh..wh.plnk, …): meaningless here
        target = base[len(WHITEOUT_PREFIX):]
        if target in ("", ".", ".."):
            raise LayerTarError(f"whiteout {m.name!r} names no file")
        tparts = [*parts[:-1], target]
        self._ensure_parents(tparts, m.name)
        p = self._abs(tparts)
        rel = "/".join(tparts)
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            st = None
        if st is not None:
            # the same layer also has an entry there: it replaces the lower one; a dir must hide it
            if stat.S_ISDIR(st.st_mode):
                self._set_opaque(p)
            return
        if not self.allow_devices:
            raise LayerTarError(f"whiteout {m.name!r}: making overlayfs whiteouts (0/0 devices) needs root")
        os.mknod(p, stat.S_IFCHR | 0o000, os.makedev(0, 0))
        ns = self._mtime_ns(m)
        os.utime(p, ns=(ns, ns), follow_symlinks=False)
        self._whiteouts.add(rel)
        self.stats.whiteouts += 1

    def _finish(self) -> None:
        # directory mtimes last: creating their children changed them
        for rel, ns in self._dir_times.items():
            p = os.path.join(self.dest, rel) if rel else str(self.dest)
            with contextlib.suppress(FileNotFoundError):
                os.utime(p, ns=(ns, ns), follow_symlinks=False)


def unpack_layer(fileobj: IO[bytes], dest: Path, *, allow_devices: bool | None = None) -> UnpackStats:
    """Unpack an uncompressed layer tar stream into the empty directory `dest` (see module docs)."""
    return LayerUnpacker(dest, allow_devices=allow_devices).unpack(fileobj)
