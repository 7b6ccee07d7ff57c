"""Mount each EROFS layer once per host and share it between every sandbox that uses it.

A layer is mounted read-only at $SHOAL_HOME/layers/<hex> and reference-counted with one empty file per
user in $SHOAL_HOME/layers/<hex>.users/. The counts live on disk, so a restarted node agent (or a CLI
process next to a server) sees the same truth; a per-layer flock serializes mount/unmount on this host.

What is mounted is not the store's bytes directly but the layer's file on the node's layer reader
(shoal.images.chunkd: $SHOAL_HOME/chunkfs/<store>/<hex>.erofs, served by shoal-chunkd over FUSE): the layer is
stored as chunks, and the reader fetches a chunk the first time a read needs it, checks it against its
digest, keeps it in the node's chunk cache and serves it from there. So a sandbox reads only the chunks it
touches (plus a bounded read-ahead), every byte it gets was checked, and nothing is hashed at mount. A
chunk that fails its check fails the read (EIO) inside the sandbox; the reader marks the layer in the store
(shoal.images.corruption) and reports it here, and LayerMounts hands the report to the node (`on_corrupt`),
which logs an `image_corrupt` event. Before a mount the layer's chunk table is checked against the layer
digest, and a layer marked corrupt raises ImageCorrupt. A layer still in the earlier whole-file format is
converted to chunks on its first mount (shoal.images.migrate).

The first mount of a layer on a node records which chunks its first sandbox read while it started
(shoal.images.prefetch); a later first mount of the layer on any node fetches that set in the background
at once, in parallel, instead of chunk by chunk as the sandbox faults them in.

File-backed EROFS mounts (Linux >= 6.12) read the reader's file directly; older kernels fall back to a
read-only loop device with autoclear. SHOAL_EROFS_MOUNT=loop|file forces one way (default: auto).
File-backed mounts use EROFS' `directio` option where the kernel has it (Linux >= 6.13): data is then
cached once, in the EROFS files' page cache shared by every sandbox. SHOAL_EROFS_DIRECTIO=0 turns it off.

While a layer is in use (mounted, or a VM drive), a lease file `<store>/leases/<hex>/<host key>` tells
`shoal image gc` on any host sharing the store that the layer is in use here; it is removed at the last
release, and renewed (its mtime) by the node agent's heartbeat so that gc can tell a dead node's leases
(shoal.images.leases). Errors name the layer's digest, never a host path (they reach API clients).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.config import Paths, settings
from shoal.errors import ImageCorrupt, ImageNotFound, InvalidRequest, StoreUnavailable
from shoal.fsutil import atomic_write, flocked
from shoal.host import syscalls
from shoal.host.spawn import run_sync
from shoal.images import corruption, leases, prefetch
from shoal.images.chunkd import ChunkDaemon
from shoal.images.chunking import ChunkTable
from shoal.images.store import ImageStore, Layer

log = logging.getLogger(__name__)

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


#: the first kernel with file-backed EROFS mounts (no loop device needed)
FILE_BACKED_KERNEL = (6, 12)


def _kernel() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def mounts_through_loop(mode: str) -> bool:
    """True when a new layer mount on this host takes a loop device: mode 'loop', or 'auto' where a
    file-backed mount failed (or, before the first mount tells, on a kernel older than 6.12)."""
    if mode == "loop":
        return True
    if mode == "file":
        return False
    if _file_backed_ok is None:
        return _kernel() < FILE_BACKED_KERNEL
    return not _file_backed_ok


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
        self.store_root = Path(paths.store)
        #: the node's layer reader (one shoal-chunkd per SHOAL_HOME; started on the first mount)
        self.daemon = ChunkDaemon(paths.home, paths.store)
        #: called with each image_corrupt report of the reader ({"layer", "chunk", "reason", "t", "users"})
        self.on_corrupt: list[Callable[[dict[str, Any]], None]] = []
        #: record prefetch sets (False: only benchmarks turn it off to measure without)
        self.record_starts = True
        self.prefetch_enabled = True
        #: "chunks" (the default: through the node's reader) or "whole-file": mount a layer's whole file
        #: straight from the store, unchecked, as shoal did before chunked layers (benchmarks' baseline only;
        #: layers without a whole file still go through the reader)
        self.source = "chunks"
        #: a long-running node keeps its reader between sandboxes (it stops it in Node.stop when unused);
        #: otherwise the reader stops with the release of the last layer in use
        self.keep_reader = False
        self._store: ImageStore | None = None
        self._tables: dict[str, ChunkTable] = {}
        #: layers whose first sandbox this process is recording: hex -> monotonic time of the mount
        self._recording: dict[str, float] = {}
        self._rec_lock = threading.Lock()

    def mountpoint(self, layer_hex: str) -> Path:
        """Where a layer is (or would be) mounted."""
        return self.root / layer_hex

    def loop_devices_needed(self, layers: list[Layer]) -> int:
        """Loop devices mounting `layers` takes now: one per layer not mounted on this host yet, when new
        mounts go through a loop device (`mounts_through_loop`); 0 otherwise (admission, shoal.node.capacity)."""
        if not mounts_through_loop(self.mode):
            return 0
        return sum(1 for lay in {lay.hex for lay in layers} if not syscalls.is_mountpoint(str(self.mountpoint(lay))))

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

    def acquire_files(self, layers: list[Layer], user: str) -> list[Path]:
        """The reader's file of each layer, for a VM drive (nothing is mounted on the host), and record
        `user` as one of its users (release with `release`). The guest's reads are checked chunk by chunk
        like a mount's."""
        out = []
        done: list[Layer] = []
        try:
            for layer in layers:
                out.append(self._acquire_one(layer, user, mount=False))
                done.append(layer)
        except BaseException:
            self.release([lay.hex for lay in done], user)
            raise
        return out

    def _acquire_one(self, layer: Layer, user: str, mount: bool = True) -> Path:
        mp = self.mountpoint(layer.hex)
        users = self.root / f"{layer.hex}.users"
        with self._locked(layer.hex), self.daemon.using():
            fresh = not users.is_dir() or not any(os.scandir(users))
            users.mkdir(exist_ok=True)
            try:
                if mount and not syscalls.is_mountpoint(str(mp)):
                    mp.mkdir(exist_ok=True)
                    try:
                        self._check_and_mount(layer, mp)
                    except BaseException:
                        with contextlib.suppress(OSError):
                            mp.rmdir()
                        raise
                    self._take_lease(layer, mp)
                elif not mount:
                    f = self._prepare(layer)
                    if fresh:
                        self._start_of_use(layer)
                    self._take_lease(layer, mp)
                    (users / user).touch()
                    return f
                elif not (self.root / f"{layer.hex}.lease").exists():
                    self._take_lease(layer, mp)  # mounted by an older shoal, before leases existed
            except BaseException:
                # nothing in use: leave no trace (an empty users dir would look like a used layer)
                with contextlib.suppress(OSError):
                    users.rmdir()
                raise
            (users / user).touch()
        return mp

    def verify(self, layers: list[Layer]) -> None:
        """Check that layers can be served (table against digest, no corrupt mark), without mounting them
        or recording a user; ImageCorrupt / StoreUnavailable. Reads are checked chunk by chunk anyway."""
        for layer in layers:
            with self._locked(layer.hex):
                self._prepare(layer)

    def store(self) -> ImageStore:
        """The store the layers come from."""
        if self._store is None:
            self._store = ImageStore(self.store_root)
        return self._store

    def table(self, layer: Layer) -> ChunkTable:
        """A layer's chunk table, checked against its digest (converting a whole-file layer first)."""
        t = self._tables.get(layer.hex)
        if t is not None:
            return t
        store = self.store()
        try:
            if not layer.chunked and not store.chunks.has(layer.hex):
                store.convert_layer(layer.digest)
            t = store.chunks.table(layer.hex)
        except OSError as e:
            raise StoreUnavailable(f"cannot read layer {layer.digest} from the layer store "
                                   f"({errno.errorcode.get(e.errno or 0, 'error')}: {e.strerror}): "
                                   "check that SHOAL_STORE is mounted and its servers are up "
                                   "(`shoal store check`)") from None
        except ImageNotFound as e:
            raise ImageCorrupt(f"layer {layer.digest} cannot be read: {e.message}") from None
        if len(self._tables) > 4096:
            self._tables.clear()
        self._tables[layer.hex] = t
        return t

    def _prepare(self, layer: Layer) -> Path:
        """The reader's file of a layer: checked table exported, reader running, no corrupt mark."""
        if Path(layer.path).parent.parent.parent.resolve() != self.store_root.resolve():
            raise InvalidRequest(f"layer {layer.digest} is not in this node's store")
        corruption.check_layers(self.store_root, [layer.digest], what=f"layer {layer.digest}")
        t = self.table(layer)
        self.daemon.ensure()
        self.daemon.subscribe(self._on_event)
        self.daemon.export(layer.hex, t)
        return self.daemon.file(layer.hex)

    def _check_and_mount(self, layer: Layer, mp: Path) -> None:
        """Mount a layer through the node's reader; typed errors without host paths."""
        if self.source == "whole-file" and layer.path.exists():
            _mount_erofs(layer.path, mp, self.mode, self.directio)
            return
        src = self._prepare(layer)
        self._start_of_use(layer)
        try:
            _mount_erofs(src, mp, self.mode, self.directio)
        except OSError as e:
            code = errno.errorcode.get(e.errno or 0, "error")
            corruption.forget_cached()
            if corruption.marks(self.store_root).get(layer.hex):
                # the reader found a bad chunk in the superblock or metadata it read for the mount
                corruption.check_layers(self.store_root, [layer.digest], what=f"layer {layer.digest}")
            if e.errno in _UNREACHABLE_ERRNOS:
                raise StoreUnavailable(f"cannot mount layer {layer.digest}: the layer store did not answer "
                                       f"({code}: {e.strerror}); check SHOAL_STORE (`shoal store check`)") from None
            if e.errno in _CORRUPT_ERRNOS:
                raise ImageCorrupt(f"layer {layer.digest} does not mount as EROFS ({code}: {e.strerror}): "
                                   "its bytes match its digest but are no EROFS image; rebuild or re-import the "
                                   "images that use it (`shoal image verify` lists them)") from None
            raise

    # ---- start records and prefetch ------------------------------------------------------------
    def _start_of_use(self, layer: Layer) -> None:
        """A layer's first use on this node: prefetch its start record, or record one."""
        rec = prefetch.load(self.store_root, layer.hex) if self.prefetch_enabled else None
        if rec:
            with contextlib.suppress(Exception):
                self.daemon.prefetch(layer.hex, rec)
        elif self.record_starts:
            with self._rec_lock:
                self._recording.setdefault(layer.hex, time.monotonic())

    def recording(self, hexes: list[str] | None = None) -> list[str]:
        """Layers (of `hexes`) whose start this process is recording."""
        with self._rec_lock:
            return [h for h in (hexes if hexes is not None else list(self._recording)) if h in self._recording]

    def finish_records(self, hexes: list[str] | None = None, *, only_older_than: float | None = None) -> int:
        """Write the start records of layers being recorded (of `hexes`; with `only_older_than`, only those
        recorded for longer); returns how many were written."""
        now = time.monotonic()
        with self._rec_lock:
            todo = [h for h in (hexes if hexes is not None else list(self._recording))
                    if h in self._recording and (only_older_than is None or
                                                 now - self._recording[h] >= only_older_than)]
            for h in todo:
                self._recording.pop(h, None)
        n = 0
        for h in todo:
            try:
                touched = self.daemon.touched(h)
            except Exception:
                continue
            t = self._tables.get(h)
            if not touched or t is None:
                continue
            keep, total = [], 0
            for i in touched:
                if 0 <= i < len(t.chunks):
                    total += t.chunks[i][1]
                    if total > prefetch.MAX_RECORD_BYTES:
                        break
                    keep.append(i)
            with contextlib.suppress(OSError):
                n += prefetch.save(self.store_root, h, keep, total)
        return n

    # ---- corruption ---------------------------------------------------------------------------
    def _on_event(self, ev: dict[str, Any]) -> None:
        if ev.get("event") != "image_corrupt":
            return
        corruption.forget_cached()
        layer_hex = str(ev.get("layer", "")).split(":", 1)[-1]
        ev = dict(ev, users=self.users(layer_hex) if len(layer_hex) == 64 else [])
        for cb in list(self.on_corrupt):
            try:
                cb(ev)
            except Exception:
                log.exception("image_corrupt handler failed")

    def in_use(self) -> bool:
        """True when a layer served by this node's reader (of this store) is mounted or has a user."""
        if self.daemon.mounted_files():
            return True
        for p in self.root.glob("*.users"):
            with contextlib.suppress(OSError):
                h = p.name[: -len(".users")]
                if any(os.scandir(p)) and self.daemon.exported(h):
                    return True
        return False

    def stop_reader_if_unused(self) -> bool:
        """Stop the node's layer reader when no layer of this home is in use; True when it was stopped."""
        if self.in_use() or self.daemon.pid() is None:
            return False
        with self.daemon.using(exclusive=True):
            if self.in_use():
                return False
            with self._rec_lock:
                self._recording.clear()
            return self.daemon.stop()

    def _mounted_hexes(self) -> set[str]:
        return {p.name for p in self.root.iterdir()
                if len(p.name) == 64 and syscalls.is_mountpoint(str(p))}

    def _take_lease(self, layer: Layer, mp: Path) -> None:
        # best effort: a store we cannot write to (read-only share) still mounts fine
        store_root = layer.path.parent.parent.parent
        try:
            lease = leases.write_lease(store_root, layer.hex, self.lease_key, mp,
                                       users=self.root / f"{layer.hex}.users")
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
            if not self._used_here(h):
                continue
            if leases.renew(lease):
                n += 1
                continue
            with self._locked(h), contextlib.suppress(OSError):
                if self._used_here(h):
                    leases.write_lease(lease.parent.parent.parent, h, self.lease_key, mp,
                                       users=self.root / f"{h}.users")
                    n += 1
        return n

    def _used_here(self, layer_hex: str) -> bool:
        if syscalls.is_mountpoint(str(self.mountpoint(layer_hex))):
            return True
        with contextlib.suppress(OSError):
            return any(os.scandir(self.root / f"{layer_hex}.users"))
        return False

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
                if _any_entry(users):  # not os.listdir: 10,000 users of `base` made every close O(n)
                    continue
                if self.recording([h]):
                    # its first sandbox is gone: what it read is the start record (before the reader forgets)
                    with contextlib.suppress(Exception):
                        self.finish_records([h])
                mp = self.mountpoint(h)
                if syscalls.is_mountpoint(str(mp)):
                    # still busy (a process of a dying sandbox): detached, the kernel frees it later
                    syscalls.umount_or_detach(str(mp))
                self._drop_lease(h)
                with contextlib.suppress(OSError):
                    mp.rmdir()
                with contextlib.suppress(OSError):
                    users.rmdir()
        if not self.keep_reader:
            self.stop_reader_if_unused()

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


def _any_entry(d: Path) -> bool:
    """True when directory `d` has an entry (reads one block of it, not all of it); False when it is gone."""
    try:
        with os.scandir(d) as it:
            return next(it, None) is not None
    except FileNotFoundError:
        return False
