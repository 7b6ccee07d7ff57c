"""The upper pool is shared: keep one sandbox's writes from taking the others' disk (issue 19, item 7).

Each sandbox's writable layer has its own limit (disk_mb, a btrfs qgroup), but the limits are promises
on one pool of fixed size, and agent sandboxes rarely write much of theirs, so by default they add up to
more than the pool (like memory, disk is oversubscribed). Three rules keep that safe:

1. **A create must be able to get its disk.** It is refused (CapacityExceeded, with the numbers) when the
   pool's free space, minus a reserve, is smaller than the disk_mb it asks for.
2. **Optional hard promises.** With `disk_overcommit` > 0 the disk_mb of the pool's live sandboxes may
   add up to at most that multiple of the pool (1.0: every sandbox can always write its whole disk_mb,
   whatever the others do). The promises are kept in a small ledger under the pool's lock.
3. **Bystanders keep the reserve.** The node watches the pool's free space (every 50 ms; writes still in
   the page cache count).
   When it falls under the reserve (5% of the pool, at least 256 MiB; `disk_reserve_mb`), every sandbox
   is clamped at what it holds now plus a little slack (16 MiB, less when many share the reserve): the
   one filling the pool gets EDQUOT ("Disk quota exceeded") in that sandbox, a bystander's small write
   still succeeds, and nobody can take the reserve. Creates are refused meanwhile (rule 1). Clamps are
   lifted once twice the reserve is free again (the writer deleted files, or sandboxes were closed).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.errors import CapacityExceeded

if TYPE_CHECKING:
    from shoal.backends.container.disk import UpperPool

log = logging.getLogger(__name__)

MIN_RESERVE = 256 << 20
#: what a clamped sandbox may still add (less when many share the reserve)
SLACK = 16 << 20
RESERVE_FRACTION = 0.05
#: how often the guard looks at the pool's free space (seconds): a statvfs and two sysfs reads, ~20 µs;
#: often enough that a writer cannot get through the reserve between two looks
GUARD_INTERVAL_S = 0.05
_FS_INFO = 0x8400941F  # _IOR(0x94, 31, struct btrfs_ioctl_fs_info_args = 1024 B)


def _round_mib(n: int) -> int:
    return (n + (1 << 20) - 1) & ~((1 << 20) - 1)


class DiskGuard:
    """Admission and pressure relief for one upper pool (see the module docstring)."""

    def __init__(self, pool: UpperPool, overcommit: float = 0.0, reserve_mb: int = 0) -> None:
        self.pool = pool
        #: promised disk may reach this multiple of the pool (0: not checked)
        self.overcommit = overcommit
        #: free space kept for bystanders (0: 5% of the pool, at least 256 MiB)
        self.reserve_mb = reserve_mb
        self._ledger = pool.paths.locks / "upper-pool.promised"
        self._clamps = pool.paths.locks / "upper-pool.clamped"
        self._sysfs_for: int | None = None
        self._sysfs_dir: Path | None = None

    # ---- space ---------------------------------------------------------------------------------
    def space(self) -> tuple[int, int]:
        """(capacity, free) bytes of the pool. Free space counts writes still in the page cache: btrfs's
        statfs only sees data once written back (30 s later, or at a sync), but reserves its space at
        write() time, and that reservation (`bytes_may_use` in sysfs) is what runs the pool out."""
        st = os.statvfs(self.pool.mountpoint)
        free = st.f_bavail * st.f_frsize
        sysfs = self._sysfs()
        if sysfs is not None:
            for name in ("bytes_may_use", "bytes_reserved"):
                with contextlib.suppress(OSError, ValueError), open(sysfs / name, "rb") as f:
                    free -= int(f.read())
        return st.f_blocks * st.f_frsize, max(0, free)

    def _sysfs(self) -> Path | None:
        # /sys/fs/btrfs/<fsid>/allocation/data (or mixed), found once per mounted pool (BTRFS_IOC_FS_INFO)
        fd = self.pool._fd
        if fd is None:
            return None
        if self._sysfs_for != fd:
            self._sysfs_for, self._sysfs_dir = fd, None
            with contextlib.suppress(OSError):
                buf = bytearray(1024)
                fcntl.ioctl(fd, _FS_INFO, buf)
                fsid = uuid.UUID(bytes=bytes(buf[16:32]))
                # a pool with mixed block groups (small pools, shoal.backends.container.disk) has one space for both
                for kind in ("data", "mixed"):
                    d = Path(f"/sys/fs/btrfs/{fsid}/allocation/{kind}")
                    if d.is_dir():
                        self._sysfs_dir = d
                        break
        return self._sysfs_dir

    def under_pressure(self) -> bool:
        """True when the pool's free space is under the reserve, or clamps wait to be lifted (cheap)."""
        capacity, free = self.space()
        reserve = self.reserve(capacity)
        return free < reserve or (self._clamps.exists() and free >= 2 * reserve and bool(self.clamped()))

    def reserve(self, capacity: int) -> int:
        """Bytes of free space kept for bystanders."""
        if self.reserve_mb:
            return self.reserve_mb << 20
        return max(MIN_RESERVE, int(capacity * RESERVE_FRACTION))

    def _locked(self) -> contextlib.AbstractContextManager[int]:
        return self.pool._lock()

    @staticmethod
    def _read(path: Path) -> dict[str, int]:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return {str(k): int(v) for k, v in data.items()} if isinstance(data, dict) else {}

    @staticmethod
    def _write(path: Path, data: dict[str, int]) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    # ---- admission -----------------------------------------------------------------------------
    def admit(self, sandbox_id: str, disk_mb: int) -> None:
        """Refuse (CapacityExceeded) a sandbox whose disk the pool cannot give; record its promise."""
        capacity, free = self.space()
        reserve = self.reserve(capacity)
        want = int(disk_mb) << 20
        if free - reserve < want:
            raise CapacityExceeded(
                f"this node's disk pool has {max(0, free - reserve) >> 20} MiB free for new sandboxes (of "
                f"{capacity >> 20} MiB, {reserve >> 20} MiB kept in reserve) and this sandbox asks for "
                f"disk_mb={disk_mb}: ask for less disk_mb, close sandboxes, or retry on another node",
                retry_after_s=10.0, reason="disk_pool_full", free_mb=max(0, free - reserve) >> 20,
                disk_mb=int(disk_mb))
        if self.overcommit <= 0:
            return
        limit_mb = int((capacity >> 20) * self.overcommit)
        with self._locked():
            promised = self._read(self._ledger)
            total = sum(promised.values())
            if total + int(disk_mb) > limit_mb:
                raise CapacityExceeded(
                    f"this node's sandboxes are promised {total} MiB of disk; disk_mb={disk_mb} more would pass "
                    f"the pool's limit of {limit_mb} MiB ({self.overcommit:g}x its {capacity >> 20} MiB): ask "
                    "for less disk_mb, close sandboxes, or retry on another node",
                    retry_after_s=10.0, reason="disk_overcommit", promised_mb=total, limit_mb=limit_mb)
            promised[sandbox_id] = int(disk_mb)
            self._write(self._ledger, promised)

    def forget(self, sandbox_id: str) -> None:
        """A sandbox's writable layer is gone: drop its promise and any clamp."""
        if not self._ledger.exists() and not self._clamps.exists():
            return
        with self._locked():
            for path in (self._ledger, self._clamps):
                data = self._read(path)
                if data.pop(sandbox_id, None) is not None:
                    self._write(path, data)

    def prune(self) -> None:
        """Drop promises and clamps whose writable layer is gone (after a crash; from reconcile)."""
        with self._locked():
            for path in (self._ledger, self._clamps):
                data = self._read(path)
                keep = {k: v for k, v in data.items() if (self.pool.mountpoint / k).exists()}
                if keep != data:
                    self._write(path, keep)

    # ---- pressure ------------------------------------------------------------------------------
    def check(self, live: Callable[[], tuple[dict[str, int], dict[str, int]]]) -> list[str]:
        """One look at the pool: clamp the biggest writer when free space is under the reserve, lift the
        clamps when twice the reserve is free. `live()` (called only then) gives the live sandboxes'
        subvolume ids and disk_mb (two dicts keyed by sandbox id). Returns the sandboxes clamped or
        released now."""
        capacity, free = self.space()
        reserve = self.reserve(capacity)
        clamped = self._read(self._clamps) if self._clamps.exists() else {}
        if free >= reserve and not (clamped and free >= 2 * reserve):
            return []
        subvols, limits = live()
        with self._locked():
            clamped = self._read(self._clamps)
            changed: list[str] = []
            if free >= 2 * reserve:
                for sid in list(clamped):
                    if sid in subvols and sid in limits:
                        with contextlib.suppress(OSError):
                            self.pool.set_limit(subvols[sid], limits[sid] << 20)
                    del clamped[sid]
                    changed.append(sid)
            elif free < reserve:
                # every sandbox stops growing, except for a little slack: the one filling the pool gets
                # EDQUOT, a bystander's small write still fits, and the reserve cannot be taken by anyone
                # no sync first: it would wait for the writer's page cache to reach the disk (seconds) while
                # it keeps writing; committed usage lags, so a clamp is only ever tighter than "now"
                usage = self.pool.usage_all()
                slack = max(1 << 20, min(SLACK, reserve // (2 * max(1, len(subvols)))))
                for sid, subvol in subvols.items():
                    if sid in clamped:
                        continue
                    limit = _round_mib(usage.get(subvol, 0) + slack)
                    if limit >= limits.get(sid, 0) << 20:
                        continue  # its own limit is tighter already
                    try:
                        self.pool.set_limit(subvol, limit)
                    except OSError as e:
                        log.warning("could not clamp sandbox %s: %s", sid, e)
                        continue
                    clamped[sid] = limit >> 20
                    changed.append(sid)
                if changed:
                    log.warning("disk pool under its reserve (%d MiB free of %d): %d sandbox(es) clamped",
                                free >> 20, capacity >> 20, len(changed))
            if changed:
                self._write(self._clamps, clamped)
            return changed

    def clamped(self) -> dict[str, int]:
        """Sandboxes clamped now (id -> their limit in MiB)."""
        return self._read(self._clamps)


def pool_sandboxes(sandboxes_dir: Path) -> tuple[dict[str, int], dict[str, int]]:
    """The live sandboxes with a writable layer on the pool: (id -> subvolume id, id -> disk_mb)."""
    from shoal.records import list_records

    subvols, limits = {}, {}
    for rec in list_records(sandboxes_dir):
        projid = int(rec.extra.get("projid") or 0)
        if projid:
            subvols[rec.id] = projid
            limits[rec.id] = int(rec.spec.disk_mb or 0)
    return subvols, limits


async def watch(pool: UpperPool) -> None:
    """Run the guard for as long as the node process uses the pool (the container backend starts it
    with its first sandbox and stops it when the node stops)."""
    def live() -> tuple[dict[str, int], dict[str, int]]:
        return pool_sandboxes(pool.paths.sandboxes)

    while True:
        await asyncio.sleep(GUARD_INTERVAL_S)
        if not pool.enforced or pool._fd is None:
            continue
        try:
            if pool.guard.under_pressure():  # inline: cheap; the work (qgroup show, clamps) in a thread
                await asyncio.to_thread(pool.guard.check, live)
        except Exception as e:  # the guard must never stop; the next round tries again
            log.warning("disk guard: %s", e)
