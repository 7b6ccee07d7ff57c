"""Mount each EROFS layer once per host and share it between every sandbox that uses it.

A layer is mounted read-only at $SHOAL_HOME/layers/<hex> and reference-counted with one empty file per
user in $SHOAL_HOME/layers/<hex>.users/. The counts live on disk, so a restarted node agent (or a CLI
process next to a server) sees the same truth; a per-layer flock serializes mount/unmount on this host.

File-backed EROFS mounts (Linux >= 6.12) read the store file directly, so nothing is copied or
unpacked and the kernel reads only the blocks a sandbox touches. Older kernels fall back to a
read-only loop device with autoclear. SHOAL_EROFS_MOUNT=loop|file forces one way (default: auto).

File-backed mounts use EROFS' `directio` option where the kernel has it (Linux >= 6.13): data is then
cached once, in the EROFS files' page cache shared by every sandbox, instead of twice (also in the layer
file's page cache), and the backing disk's readahead (often megabytes) does not inflate what a sandbox
reads. SHOAL_EROFS_DIRECTIO=0 turns it off.

While a layer is mounted, a lease file `<store>/leases/<hex>/<host key>` tells `shoal image gc` on
any host sharing the store that the layer is in use here; it is removed at the last unmount, and renewed
(its mtime) by the node agent's heartbeat so that gc can tell a dead node's leases (shoal.images.leases).

Before a layer's first mount on this node its bytes are checked against its digest (shoal.images.integrity);
a corrupt layer, or one whose filesystem the kernel refuses, raises ImageCorrupt and is never mounted.
Errors name the layer's digest, never a host path (they reach API clients).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import socket
from pathlib import Path

from shoal.config import Paths, settings
from shoal.errors import ImageCorrupt, InvalidRequest, StoreUnavailable
from shoal.fsutil import atomic_write, flocked
from shoal.host import syscalls
from shoal.host.spawn import run_sync
from shoal.images import leases
from shoal.images.cache import LayerCache
from shoal.images.integrity import LayerVerifier
from shoal.images.store import Layer

#: errnos with which the kernel refuses an EROFS image it cannot parse (EUCLEAN = EFSCORRUPTED)
_CORRUPT_ERRNOS = {errno.EINVAL, errno.EUCLEAN, errno.EBADMSG, errno.EOVERFLOW, errno.EFBIG, errno.EOPNOTSUPP}
#: errnos of a store that does not answer (a shared filesystem whose servers are gone)
_UNREACHABLE_ERRNOS = {errno.EIO, errno.ENXIO, errno.ETIMEDOUT, errno.ENOTCONN, errno.EHOSTUNREACH,
                       errno.ECONNREFUSED, errno.ESTALE, errno.ENODEV}

_file_backed_ok: bool | None = None
_directio_ok: bool | None = None
_last_mode = "unknown"
MOUNT_MODES = ("auto", "file", "loop")


def erofs_mode() -> str:
    """How the last layer was mounted: 'file-backed+directio', 'file-backed', 'loop' (or 'unknown')."""
    return _last_mode


class LayerMounts:
    """Reference-counted, host-wide read-only mounts of store layers."""

    def __init__(self, paths: Paths, mode: str | None = None) -> None:
        self.root = paths.layer_mounts
        self.locks = paths.locks
        self.root.mkdir(parents=True, exist_ok=True)
        self.locks.mkdir(parents=True, exist_ok=True)
        s = settings()
        self.mode = mode or s.erofs_mount
        #: file-backed mounts with EROFS' directio option when the kernel has it
        self.directio = s.erofs_directio
        if self.mode not in MOUNT_MODES:
            raise InvalidRequest(f"EROFS mount mode {self.mode!r} must be one of {', '.join(MOUNT_MODES)}")
        #: names this host's leases in a shared store: host name + which SHOAL_HOME mounted it
        self.lease_key = lease_key(self.root)
        #: remembers which layer files this node has hashed (checked before a layer's first mount)
        self.verifier = LayerVerifier(paths.home / "verified")
        #: node-local copies of hot layers (off unless SHOAL_LAYER_CACHE_MB > 0)
        self.cache = LayerCache(paths.home / "layer-cache")

    def mountpoint(self, layer_hex: str) -> Path:
        """Where a layer is (or would be) mounted."""
        return self.root / layer_hex

    def _locked(self, layer_hex: str) -> contextlib.AbstractContextManager[int]:
        return flocked(self.locks / f"layer-{layer_hex}.lock")

    def acquire(self, layers: list[Layer], user: str) -> list[Path]:
        """Make sure every layer is mounted and record `user` as one of its users."""
        out = []
        done: list[Layer] = []
        try:
            for layer in layers:
                out.append(self._acquire_one(layer, user))
                done.append(layer)
        except BaseException:
            self.release([lay.hex for lay in done], user)
            raise
        return out

    def _acquire_one(self, layer: Layer, user: str) -> Path:
        mp = self.mountpoint(layer.hex)
        users = self.root / f"{layer.hex}.users"
        with self._locked(layer.hex):
            users.mkdir(exist_ok=True)
            if not syscalls.is_mountpoint(str(mp)):
                mp.mkdir(exist_ok=True)
                try:
                    self._check_and_mount(layer, mp)
                except BaseException:
                    # nothing mounted: leave no trace (an empty users dir would look like a mounted layer)
                    for d in (mp, users):
                        with contextlib.suppress(OSError):
                            d.rmdir()
                    raise
                self._take_lease(layer, mp)
            elif not (self.root / f"{layer.hex}.lease").exists():
                self._take_lease(layer, mp)  # mounted by an older shoal, before leases existed
            (users / user).touch()
        return mp

    def verify(self, layers: list[Layer]) -> None:
        """Check layers used without a mount here (VM drives read the store files directly) against their
        digests (remembered per node like a mount's check); ImageCorrupt / StoreUnavailable."""
        for layer in layers:
            try:
                with self._locked(layer.hex):
                    self.verifier.check(layer.digest, layer.path, layer.size)
            except OSError as e:
                raise StoreUnavailable(f"cannot read layer {layer.digest} from the layer store "
                                       f"({errno.errorcode.get(e.errno or 0, 'error')}: {e.strerror}): "
                                       "check that SHOAL_STORE is mounted and its servers are up "
                                       "(`shoal store check`)") from None

    def _check_and_mount(self, layer: Layer, mp: Path) -> None:
        """Verify the layer (first mount on this node), then mount it; typed errors without host paths."""
        src = layer.path
        try:
            if self.cache.enabled:
                local, copied = self.cache.get(layer.digest, layer.path, layer.size, self._mounted_hexes())
                if local is not None:
                    src = local
                    if copied:  # hashed while copied: that was the check
                        self.verifier.remember(layer.digest, local)
            self.verifier.check(layer.digest, src, layer.size)
        except OSError as e:
            raise StoreUnavailable(f"cannot read layer {layer.digest} from the layer store "
                                   f"({errno.errorcode.get(e.errno or 0, 'error')}: {e.strerror}): "
                                   "check that SHOAL_STORE is mounted and its servers are up "
                                   "(`shoal store check`)") from None
        try:
            _mount_erofs(src, mp, self.mode, self.directio)
        except OSError as e:
            code = errno.errorcode.get(e.errno or 0, "error")
            if e.errno in _UNREACHABLE_ERRNOS:
                raise StoreUnavailable(f"cannot mount layer {layer.digest}: the layer store did not answer "
                                       f"({code}: {e.strerror}); check SHOAL_STORE (`shoal store check`)") from None
            if e.errno in _CORRUPT_ERRNOS:
                self.verifier.forget(layer.hex)
                raise ImageCorrupt(f"layer {layer.digest} does not mount as EROFS ({code}: {e.strerror}): "
                                   "its file is damaged; rebuild or re-import the images that use it "
                                   "(`shoal image verify` lists them)") from None
            raise

    def _mounted_hexes(self) -> set[str]:
        return {p.name for p in self.root.iterdir()
                if len(p.name) == 64 and syscalls.is_mountpoint(str(p))}

    def _take_lease(self, layer: Layer, mp: Path) -> None:
        # best effort: a store we cannot write to (read-only share) still mounts fine
        store_root = layer.path.parent.parent.parent
        try:
            lease = leases.write_lease(store_root, layer.hex, self.lease_key, mp)
            atomic_write(self.root / f"{layer.hex}.lease", str(lease).encode(), fsync=False)
        except OSError:
            pass

    def renew_leases(self) -> int:
        """Heartbeat: renew the store leases of every layer mounted here (re-create any that vanished,
        e.g. removed by a gc that took this node for dead); returns how many were renewed."""
        n = 0
        for note in self.root.glob("*.lease"):
            h = note.name[: -len(".lease")]
            mp = self.mountpoint(h)
            try:
                lease = Path(note.read_text())
            except OSError:
                continue
            if not syscalls.is_mountpoint(str(mp)):
                continue
            if leases.renew(lease):
                n += 1
                continue
            with self._locked(h), contextlib.suppress(OSError):
                if syscalls.is_mountpoint(str(mp)):
                    leases.write_lease(lease.parent.parent.parent, h, self.lease_key, mp)
                    n += 1
        return n

    def _drop_lease(self, layer_hex: str) -> None:
        note = self.root / f"{layer_hex}.lease"
        with contextlib.suppress(OSError):
            lease = Path(note.read_text())
            lease.unlink()
            with contextlib.suppress(OSError):
                lease.parent.rmdir()
        with contextlib.suppress(OSError):
            note.unlink()

    def release(self, layer_hexes: list[str], user: str) -> None:
        """Drop `user` from each layer; unmount layers nobody uses any more."""
        for h in layer_hexes:
            users = self.root / f"{h}.users"
            with self._locked(h):
                if user:  # "" only asks to unmount an unused layer (reconcile)
                    with contextlib.suppress(FileNotFoundError):
                        (users / user).unlink()
                try:
                    remaining = os.listdir(users)
                except FileNotFoundError:
                    remaining = []
                if remaining:
                    continue
                mp = self.mountpoint(h)
                if syscalls.is_mountpoint(str(mp)):
                    try:
                        syscalls.umount(str(mp))
                    except OSError as e:
                        if e.errno != errno.EBUSY:
                            raise
                        # still busy (a process of a dying sandbox): detach, the kernel frees it later
                        syscalls.umount(str(mp), detach=True)
                self._drop_lease(h)
                with contextlib.suppress(OSError):
                    mp.rmdir()
                with contextlib.suppress(OSError):
                    users.rmdir()

    def reopen_loops(self) -> int:
        """Point every loop-mounted layer at a freshly opened store file (LOOP_CHANGE_FD), in place, under
        running sandboxes; returns how many. Some shared-filesystem clients (MooseFS' mfsmount) fail every
        later read on a file handle that once hit an I/O error, even after the servers are back: the node
        calls this when the store answers again after an outage, so loop-mounted layers recover.
        File-backed EROFS mounts have no such switch (see docs/images.md, "Outage")."""
        n = 0
        for p in self.root.iterdir():
            if p.name.endswith((".users", ".lease")) or not syscalls.is_mountpoint(str(p)):
                continue
            src = mount_source(p)
            if not src or not src.startswith("/dev/loop"):
                continue
            try:
                backing = Path(f"/sys/block/{os.path.basename(src)}/loop/backing_file").read_text().strip()
            except OSError:
                continue
            if not backing.endswith(f"/{p.name}.erofs"):
                continue
            with self._locked(p.name), contextlib.suppress(OSError):
                _change_loop_file(src, Path(backing.removesuffix(" (deleted)")))
                n += 1
        return n

    def users(self, layer_hex: str) -> list[str]:
        """Sandbox IDs currently using a layer on this host."""
        try:
            return sorted(os.listdir(self.root / f"{layer_hex}.users"))
        except FileNotFoundError:
            return []

    def mounted(self) -> dict[str, list[str]]:
        """Layer hex -> users, for every layer mounted on this host."""
        out = {}
        for p in self.root.iterdir():
            if p.is_dir() and not p.name.endswith(".users") and syscalls.is_mountpoint(str(p)):
                out[p.name] = self.users(p.name)
        return out

    def reconcile(self, live_users: set[str]) -> None:
        """Forget users that no longer exist (crash leftovers), then unmount unused layers."""
        for p in list(self.root.glob("*.users")):
            h = p.name[: -len(".users")]
            stale = [u for u in self.users(h) if u not in live_users]
            for u in stale:
                self.release([h], u)
            if not self.users(h):
                self.release([h], "")


def lease_key(mounts_root: Path) -> str:
    """`<hostname>-<12 hex>`: one key per (host, SHOAL_HOME), valid as a file name."""
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname())[:64] or "host"
    return f"{host}-{hashlib.sha256(str(Path(mounts_root).resolve()).encode()).hexdigest()[:12]}"


def mount_source(mp: Path) -> str | None:
    """The source of the mount at `mp` (a layer file for file-backed mounts, /dev/loopN otherwise)."""
    p = os.path.realpath(mp)
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            parts = line.decode("utf-8", "surrogateescape").split()
            if syscalls._unescape(parts[4]) == p:
                sep = parts.index("-")
                return syscalls._unescape(parts[sep + 2])
    return None


LOOP_CHANGE_FD = 0x4C06


def _change_loop_file(dev: str, file: Path) -> None:
    """Swap a read-only loop device's backing file for a new open of `file` (same size, same bytes)."""
    new = os.open(file, os.O_RDONLY | os.O_CLOEXEC)
    try:
        lfd = os.open(dev, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(lfd, LOOP_CHANGE_FD, new)
        finally:
            os.close(lfd)
    finally:
        os.close(new)


def _mount_file_backed(file: Path, mp: Path, flags: int, directio: bool) -> None:
    global _directio_ok, _last_mode
    if directio and _directio_ok is not False:
        try:
            syscalls.mount(str(file), str(mp), "erofs", flags, "directio")
            _directio_ok = True
            _last_mode = "file-backed+directio"
            return
        except OSError as e:
            # EINVAL: a kernel without the option (< 6.13); ENOTBLK: no file-backed mounts at all
            if e.errno != errno.EINVAL or _directio_ok:
                raise
    syscalls.mount(str(file), str(mp), "erofs", flags, None)
    if directio:
        _directio_ok = False
    _last_mode = "file-backed"


def _mount_erofs(file: Path, mp: Path, mode: str = "auto", directio: bool = True) -> None:
    global _file_backed_ok, _last_mode
    flags = syscalls.MS_RDONLY | syscalls.MS_NODEV
    if mode == "file":
        _mount_file_backed(file, mp, flags, directio)
        return
    probing = False
    if mode == "auto" and _file_backed_ok is not False:
        try:
            _mount_file_backed(file, mp, flags, directio)
            _file_backed_ok = True
            return
        except OSError as e:
            # ENOTBLK: this kernel wants a block device (file-backed mounts need Linux >= 6.12); EINVAL may
            # mean the same on some kernels, or a damaged image: the loop mount below tells them apart
            if e.errno not in (errno.ENOTBLK, errno.EINVAL) or _file_backed_ok:
                raise
            probing = e.errno == errno.EINVAL
            if not probing:
                _file_backed_ok = False
    r = run_sync(["losetup", "--find", "--show", "--read-only", str(file)], check=True)
    dev = r.stdout.decode().strip()
    try:
        syscalls.mount(dev, str(mp), "erofs", flags, None)
        _last_mode = "loop"
        if probing:
            _file_backed_ok = False  # the loop mount works where the file-backed one did not
    finally:
        # on a mounted device this only sets autoclear: the loop goes away with the last unmount
        run_sync(["losetup", "--detach", dev])
