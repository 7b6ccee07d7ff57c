"""Disk limits for sandboxes' writable layers: one btrfs subvolume + qgroup limit per sandbox.

overlayfs has no size limit of its own, so the uppers live on one node-local btrfs filesystem (a
sparse file, loop-mounted at $SHOAL_HOME/uppers, quotas on) and each sandbox's upper is a subvolume
with a qgroup limit. Creating one is two ioctls (~0.3 ms) and deleting it one more, so the limit costs
nothing at create time. (XFS/ext4 project quotas would be the usual choice, but kernels built without
XFS_QUOTA/QFMT_V2 — like this project's CI hosts — cannot use them; btrfs qgroups only need BTRFS_FS.)
Where btrfs cannot be used, uppers fall back to plain directories and `shoal doctor` says so.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import struct
from pathlib import Path

from shoal.config import Paths, Settings
from shoal.fsutil import flocked
from shoal.host import syscalls
from shoal.host.spawn import run_sync

log = logging.getLogger(__name__)

# btrfs ioctls (linux/btrfs.h), magic 0x94
_SUBVOL_CREATE = 0x5000940E  # _IOW(14, btrfs_ioctl_vol_args = 4096 B)
_SNAP_DESTROY = 0x5000940F  # _IOW(15, vol_args)
_INO_LOOKUP = 0xD0009412  # _IOWR(18, btrfs_ioctl_ino_lookup_args = 4096 B)
_QUOTA_CTL = 0xC0109428  # _IOWR(40, {u64 cmd; u64 status})
_QGROUP_CREATE = 0x4010942A  # _IOW(42, {u64 create; u64 qgroupid})
_QGROUP_LIMIT = 0x8030942B  # _IOR(43, {u64 qgroupid; btrfs_qgroup_limit})
# linux/btrfs.h: BTRFS_QUOTA_CTL_ENABLE 1, _DISABLE 2, _RESCAN__NOTUSED 3, _ENABLE_SIMPLE_QUOTA 4. (3 was used here:
# EINVAL, so every pool fell back to full qgroups, which the kernel marks inconsistent when it deletes a
# subvolume whose tree is deeper than qgroups/drop_subtree_threshold (3 here; 4 KiB nodes make deep trees)
# — and an inconsistent pool enforced no limit at all: a disk_mb=32 sandbox wrote 64 MiB in CI.)
_QUOTA_ENABLE, _QUOTA_ENABLE_SIMPLE = 1, 4
_LIMIT_MAX_RFER = 1


#: pools smaller than this (GiB) are made with mixed block groups (see _mount); from 50 GiB on, a data chunk
#: is 1 GiB and the reserve (5%) is larger than it
MIXED_BELOW_GB = 64


def _vol_args(name: str) -> bytearray:
    b = bytearray(4096)
    raw = name.encode()
    b[8 : 8 + len(raw)] = raw
    return b


#: what mkfs.btrfs says when a mount elsewhere on the host cannot be looked at
_MOUNT_CHECK_FAILED = "cannot check mount status"
#: in a private mount namespace: detach the mounts named before the "--", then run the rest
_DETACH_THEN_EXEC = 'while [ "$1" != -- ]; do umount -l "$1" 2>/dev/null; shift; done; shift; exec "$@"'


def mkfs_btrfs(argv: list[str]) -> None:
    """Run mkfs.btrfs; when its check of the host's mounts trips over an unrelated dead one, run it again in
    a private mount namespace without the dead mounts.

    mkfs.btrfs refuses to format a file that is in use, so it looks at every btrfs mount on the host and
    stats the loop device's backing file behind it; a FUSE mount whose server died (ENOTCONN) or a stale
    NFS mount on that path makes the check fail, and the whole pool with it, although the mount has nothing
    to do with the pool. A private mount namespace (`unshare -m`, propagation private) is a copy of the
    host's mounts that the host never sees: detaching the dead ones there leaves the host as it is, and
    mkfs.btrfs still checks every live mount."""
    r = run_sync(argv, timeout=300)
    if r.returncode == 0:
        return
    err = r.stderr.decode(errors="replace").strip()
    dead = syscalls.dead_mounts() if _MOUNT_CHECK_FAILED in err else []
    if dead and shutil.which("unshare"):
        log.warning("mkfs.btrfs could not check the host's mounts (%s); dead mounts on this host: %s — "
                    "making the pool in a private mount namespace without them", err, ", ".join(dead[:5]))
        r = run_sync(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _DETACH_THEN_EXEC,
                      "sh", *dead, "--", *argv], timeout=300)
        if r.returncode == 0:
            return
        err = r.stderr.decode(errors="replace").strip()
    hint = f" (dead mounts on this host: {', '.join(dead[:5])}; unmount them with umount -l)" if dead else ""
    raise RuntimeError(f"mkfs.btrfs failed (exit {r.returncode}): {err}{hint}")


class UpperPool:
    """Where sandboxes' writable layers live, size-limited when btrfs quotas are available."""

    def __init__(self, paths: Paths, s: Settings, size_gb: int | None = None) -> None:
        self.paths = paths
        self.mountpoint = paths.home / "uppers"
        self.image = paths.home / "uppers.btrfs"
        self.size_gb = size_gb or s.upper_pool_gb
        self._fd: int | None = None
        self.enforced: bool | None = None
        self.reason = ""
        if not s.disk_limits:
            self.enforced, self.reason = False, "disk limits disabled by SHOAL_DISK_LIMITS=0"
        from shoal.backends.container.disk_guard import DiskGuard

        #: admission against the pool and pressure relief (shoal.backends.container.disk_guard)
        self.guard = DiskGuard(self, s.disk_overcommit, s.disk_reserve_mb)

    def _lock(self) -> contextlib.AbstractContextManager[int]:
        return flocked(self.paths.locks / "upper-pool.lock")

    def ensure(self) -> bool:
        """Mount the pool if needed; True when disk limits are enforced."""
        if self.enforced is False or (self.enforced and self._fd is not None):
            return bool(self.enforced)
        with self._lock():
            try:
                self.mountpoint.mkdir(parents=True, exist_ok=True)
                if not syscalls.is_mountpoint(str(self.mountpoint)):
                    self._mount()
                self._fd = os.open(self.mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                self.enforced = True
            except (OSError, RuntimeError) as e:
                self.enforced = False
                self.reason = f"disk limits not enforced: {e}"
                log.warning(self.reason)
        return bool(self.enforced)

    def close(self) -> None:
        """Drop this object's handle on the pool (the pool stays mounted). An open handle keeps the btrfs alive:
        the pool's unmount then only detaches it, and its loop device stays attached until this process
        exits."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.enforced:
            self.enforced = None  # the next ensure() opens a handle again

    def _mount(self) -> None:
        if not shutil.which("mkfs.btrfs"):
            raise RuntimeError("mkfs.btrfs missing (apt-get install btrfs-progs)")
        fresh = not self.image.exists()
        if fresh:
            st = os.statvfs(self.paths.home)
            free_gb = st.f_bavail * st.f_frsize // 2**30
            # sparse: costs nothing until sandboxes write
            size_gb = self.size_gb or max(2, min(1024, free_gb // 2))
            tmp = self.image.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.truncate(size_gb * 2**30)
            # 4 KiB metadata nodes (default 16 KiB): every sandbox's subvolume is a new tree whose root,
            # root item and qgroup items are written at the next commit; small nodes write ~3x less
            # per sandbox (measured: 23.7 -> 8.1 KiB per subvolume + qgroup + 2 dirs, after sync)
            # mixed block groups (data and metadata share chunks) below MIXED_BELOW_GB: a data chunk is 10%
            # of a small pool, more than its reserve (5%, >= 256 MiB), so a writer filling the pool leaves
            # data chunks holding all the unallocated space while data still has room; metadata cannot grow
            # and a bystander creating a file gets ENOSPC although the guard kept the reserve (measured: 1 GiB
            # pool, 8 MiB of metadata, the 13,038th new file failed). Mixed needs nodesize == sectorsize.
            mixed = ["--mixed"] if size_gb < MIXED_BELOW_GB else []
            mkfs_btrfs(["mkfs.btrfs", "-q", "-f", *mixed, "-m", "single", "-n", "4096", str(tmp)])
            os.rename(tmp, self.image)
        # nodatacow-free defaults; noatime because agents read a lot
        r = run_sync(["mount", "-o", "loop,noatime", str(self.image), str(self.mountpoint)], timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"cannot mount the upper pool: {r.stderr.decode(errors='replace').strip()}")
        fd = os.open(self.mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # simple quotas (Linux >= 6.7) account at extent level and cost far less than full qgroups
            for cmd in (_QUOTA_ENABLE_SIMPLE, _QUOTA_ENABLE):
                try:
                    fcntl.ioctl(fd, _QUOTA_CTL, bytearray(struct.pack("=QQ", cmd, 0)))
                    break
                except OSError as e:
                    simple_unsupported = e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTTY)
                    if (cmd == _QUOTA_ENABLE or not simple_unsupported) and e.errno != errno.EEXIST:
                        raise RuntimeError(f"cannot enable btrfs quotas: {e.strerror}") from e
        finally:
            os.close(fd)

    def allocate(self, sandbox_id: str, disk_mb: int) -> tuple[Path, Path, int]:
        """Make `{upper,work}` dirs for a sandbox with a size limit; returns (upper, work, subvolume id)."""
        if not self.ensure() or self._fd is None:
            base = self.paths.sandboxes / sandbox_id
            (base / "upper").mkdir(parents=True, exist_ok=True)
            (base / "work").mkdir(exist_ok=True)
            return base / "upper", base / "work", 0
        self.guard.admit(sandbox_id, disk_mb)
        try:
            fcntl.ioctl(self._fd, _SUBVOL_CREATE, _vol_args(sandbox_id))
        except BaseException:
            self.guard.forget(sandbox_id)
            raise
        base = self.mountpoint / sandbox_id
        try:
            sfd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                look = bytearray(4096)
                struct.pack_into("=QQ", look, 0, 0, 256)  # tree 0 = "the tree of this fd", 256 = its root
                fcntl.ioctl(sfd, _INO_LOOKUP, look)
                subvol_id = struct.unpack_from("=Q", look, 0)[0]
                # qgroupid 0 means "the qgroup of the subvolume this fd is in"
                fcntl.ioctl(sfd, _QGROUP_LIMIT,
                            bytearray(struct.pack("=QQQQQQ", 0, _LIMIT_MAX_RFER, disk_mb * 2**20, 0, 0, 0)))
            finally:
                os.close(sfd)
            (base / "upper").mkdir()
            (base / "work").mkdir()
        except BaseException:
            with contextlib.suppress(OSError):
                fcntl.ioctl(self._fd, _SNAP_DESTROY, _vol_args(sandbox_id))
            self.guard.forget(sandbox_id)
            raise
        return base / "upper", base / "work", subvol_id

    def set_limit(self, subvol_id: int, limit_bytes: int) -> None:
        """Change a sandbox subvolume's size limit (the disk guard clamps and releases with it)."""
        if self._fd is None:
            raise OSError("the upper pool is not mounted")
        fcntl.ioctl(self._fd, _QGROUP_LIMIT,
                    bytearray(struct.pack("=QQQQQQ", subvol_id, _LIMIT_MAX_RFER, limit_bytes, 0, 0, 0)))

    def usage_all(self) -> dict[int, int]:
        """Referenced bytes of every subvolume as of the last commit (id -> bytes)."""
        if not self.ensure() or self._fd is None:
            return {}
        r = run_sync(["btrfs", "qgroup", "show", "--raw", "-re", str(self.mountpoint)], timeout=30)
        out: dict[int, int] = {}
        for line in r.stdout.decode().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0].startswith("0/") and parts[1].isdigit():
                with contextlib.suppress(ValueError):
                    out[int(parts[0][2:])] = int(parts[1])
        return out

    def sweep_orphans(self, sandboxes_dir: Path) -> int:
        """Delete subvolumes whose sandbox directory is gone (a crash before the first record, or a reboot:
        sandbox directories live on tmpfs). Never mounts the pool just for this. Returns how many."""
        from shoal.records import check_sandbox_id

        if not syscalls.is_mountpoint(str(self.mountpoint)) or not self.ensure() or self._fd is None:
            return 0
        # subvolumes first, directories second: a sandbox's directory is made before its subvolume
        # and removed after it, so a subvolume listed here whose directory is missing below is garbage
        with os.scandir(self.mountpoint) as it:
            names = [e.name for e in it if e.is_dir(follow_symlinks=False)]
        try:
            with os.scandir(sandboxes_dir) as it:
                # a symlink whose tmpfs directory is gone (reboot) is not a live sandbox
                live = {e.name for e in it if not e.is_symlink() or os.path.exists(e.path)}
        except FileNotFoundError:
            live = set()
        n = 0
        for name in names:
            if name in live:
                continue
            try:
                check_sandbox_id(name)
            except Exception:
                continue  # not one of ours
            subvol_id = 0
            with contextlib.suppress(OSError):
                sfd = os.open(self.mountpoint / name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    look = bytearray(4096)
                    struct.pack_into("=QQ", look, 0, 0, 256)
                    fcntl.ioctl(sfd, _INO_LOOKUP, look)
                    subvol_id = struct.unpack_from("=Q", look, 0)[0]
                finally:
                    os.close(sfd)
            if not subvol_id:
                continue  # not a subvolume: not ours to delete
            try:
                self.release(name, subvol_id)
                n += 1
            except OSError as e:
                log.warning("could not delete orphan upper %s: %s", name, e)
        return n

    def usage(self, subvol_id: int) -> dict[str, int]:
        """Referenced bytes of a sandbox's subvolume and its limit (from `btrfs qgroup show`)."""
        if not subvol_id or not self.ensure():
            return {}
        r = run_sync(["btrfs", "qgroup", "show", "--raw", "-re", str(self.mountpoint)], timeout=30)
        for line in r.stdout.decode().splitlines():
            parts = line.split()
            if parts and parts[0] == f"0/{subvol_id}":
                limit = parts[3]
                return {"bytes": int(parts[1]), "limit_bytes": int(limit) if limit.isdigit() else 0}
        return {}

    def release(self, sandbox_id: str, subvol_id: int) -> None:
        """Delete the sandbox's subvolume (and its qgroup once btrfs let go of it)."""
        if not subvol_id or not self.ensure() or self._fd is None:
            return
        self.guard.forget(sandbox_id)
        try:
            fcntl.ioctl(self._fd, _SNAP_DESTROY, _vol_args(sandbox_id))
        except FileNotFoundError:
            pass
        with contextlib.suppress(OSError):
            # fails with EBUSY while the cleaner still holds it; `clear_stale()` retries later
            fcntl.ioctl(self._fd, _QGROUP_CREATE, bytearray(struct.pack("=QQ", 0, subvol_id)))

    def clear_stale(self) -> int:
        """Remove qgroups of deleted subvolumes (gc). Returns how many were removed."""
        if not self.ensure() or self._fd is None:
            return 0
        r = run_sync(["btrfs", "qgroup", "show", "--raw", str(self.mountpoint)], timeout=60)
        n = 0
        for line in r.stdout.decode().splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[-1] == "<stale>" and parts[0].startswith("0/"):
                with contextlib.suppress(OSError, ValueError):
                    qid = int(parts[0].split("/")[1])
                    fcntl.ioctl(self._fd, _QGROUP_CREATE, bytearray(struct.pack("=QQ", 0, qid)))
                    n += 1
        return n

    def teardown(self) -> bool:
        """Unmount the pool when no sandbox uses it (tests, `shoal node teardown`). True if unmounted.
        The tmpfs of sandbox directories (shoal.backends.container.volatile) goes too when empty."""
        from shoal.backends.container.guestfs import GuestFiles
        from shoal.backends.container.volatile import VolatileDirs

        with contextlib.suppress(OSError):
            VolatileDirs(self.paths, enabled=False).teardown()
        with contextlib.suppress(OSError):
            GuestFiles(self.paths, Path()).teardown()
        self.close()
        with self._lock():
            if not syscalls.is_mountpoint(str(self.mountpoint)):
                return False
            if any(p.is_dir() for p in self.mountpoint.iterdir()):
                return False
            # busy: an fd another pool object in this process still holds; the empty pool detaches safely
            syscalls.umount_or_detach(str(self.mountpoint))
            return True
