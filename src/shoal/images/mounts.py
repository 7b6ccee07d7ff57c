"""Mount each EROFS layer once per host and share it between every sandbox that uses it.

A layer is mounted read-only at $SHOAL_HOME/layers/<hex> and reference-counted with one empty file per
user in $SHOAL_HOME/layers/<hex>.users/. The counts live on disk, so a restarted node agent (or a CLI
process next to a server) sees the same truth; a per-layer flock serializes mount/unmount on this host.

File-backed EROFS mounts (Linux >= 6.12) read the store file directly, so nothing is copied or
unpacked and the kernel reads only the blocks a sandbox touches. Older kernels fall back to a
read-only loop device with autoclear.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from shoal.config import Paths
from shoal.host import syscalls
from shoal.host.spawn import run_sync
from shoal.images.store import Layer

_file_backed_ok: bool | None = None


def erofs_mode() -> str:
    """'file-backed' or 'loop' — how this kernel mounts EROFS images (decided on first mount)."""
    if _file_backed_ok is None:
        return "unknown"
    return "file-backed" if _file_backed_ok else "loop"


class LayerMounts:
    """Reference-counted, host-wide read-only mounts of store layers."""

    def __init__(self, paths: Paths) -> None:
        self.root = paths.layer_mounts
        self.locks = paths.locks
        self.root.mkdir(parents=True, exist_ok=True)
        self.locks.mkdir(parents=True, exist_ok=True)

    def mountpoint(self, layer_hex: str) -> Path:
        """Where a layer is (or would be) mounted."""
        return self.root / layer_hex

    @contextlib.contextmanager
    def _locked(self, layer_hex: str) -> Iterator[None]:
        fd = os.open(self.locks / f"layer-{layer_hex}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

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
                _mount_erofs(layer.path, mp)
            (users / user).touch()
        return mp

    def release(self, layer_hexes: list[str], user: str) -> None:
        """Drop `user` from each layer; unmount layers nobody uses any more."""
        for h in layer_hexes:
            users = self.root / f"{h}.users"
            with self._locked(h):
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
                with contextlib.suppress(OSError):
                    mp.rmdir()
                with contextlib.suppress(OSError):
                    users.rmdir()

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


def _mount_erofs(file: Path, mp: Path) -> None:
    global _file_backed_ok
    flags = syscalls.MS_RDONLY | syscalls.MS_NODEV
    if _file_backed_ok is not False:
        try:
            syscalls.mount(str(file), str(mp), "erofs", flags, None)
            _file_backed_ok = True
            return
        except OSError as e:
            # ENOTBLK: this kernel wants a block device (file-backed mounts need Linux >= 6.12)
            if e.errno not in (errno.ENOTBLK, errno.EINVAL) or _file_backed_ok:
                raise
            _file_backed_ok = False
    r = run_sync(["losetup", "--find", "--show", "--read-only", str(file)], check=True)
    dev = r.stdout.decode().strip()
    try:
        syscalls.mount(dev, str(mp), "erofs", flags, None)
    finally:
        # on a mounted device this only sets autoclear: the loop goes away with the last unmount
        run_sync(["losetup", "--detach", dev])
