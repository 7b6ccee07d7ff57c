"""Container sandbox directories in memory: `$SHOAL_HOME/sandboxes/<id>` is a symlink into a tmpfs.

Everything in a container sandbox's directory (its record, bundle and agent socket) is runtime state
that cannot outlive the host, like crun's own state in /run/crun. On a tmpfs mounted at
`$SHOAL_HOME/volatile`, a create or close writes nothing to the host's disk except one symlink (a
directory on ext4 costs ~9 KiB of writes after sync, a short symlink ~1 KiB), and allocates no inodes there
(on ext4 without a journal, as on this project's hosts, each new inode scans the recently deleted
ones: ~20% of all CPU samples under create/close churn). Records are still found by scanning
`$SHOAL_HOME/sandboxes` (the symlinks), so nothing else changes; VM sandboxes keep real directories
there (their disks must not live in memory).

A node agent that crashes loses nothing (the tmpfs stays mounted). After a reboot the tmpfs is empty:
the dangling symlinks are removed by `Node.reconcile`, the writable layers by `UpperPool.sweep_orphans`.
The tmpfs is unmounted by `teardown()` once no sandbox is left (`UpperPool.teardown` calls it).
SHOAL_SANDBOX_TMPFS=0 keeps sandbox directories on disk.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from shoal.config import Paths
from shoal.fsutil import flocked
from shoal.host import syscalls

log = logging.getLogger(__name__)

#: only small files live here (a record and a socket per sandbox; a working-set list while paused)
_TMPFS_OPTS = "mode=0755,size=25%"


class VolatileDirs:
    """The tmpfs under `$SHOAL_HOME/volatile` holding container sandbox directories."""

    def __init__(self, paths: Paths, enabled: bool = True) -> None:
        self.paths = paths
        self.root = paths.home / "volatile"
        #: where sandbox directories go (the name keeps "/sandboxes/" in every path, as before)
        self.sandboxes = self.root / "sandboxes"
        #: the sandbox_tmpfs setting (a node passes its own; teardown only needs the paths)
        self.enabled = enabled
        self._ready = False

    def ensure(self) -> bool:
        """Mount the tmpfs if needed. True when sandbox directories can go there (cheap after the first call)."""
        if self._ready and syscalls.mount_root(str(self.root)) is not False:
            return True
        self._ready = False
        if not self.enabled:
            return False
        with flocked(self.paths.locks / "volatile.lock"):
            self.root.mkdir(parents=True, exist_ok=True)
            if not syscalls.is_mountpoint(str(self.root)):
                with os.scandir(self.root) as it:
                    if any(True for _ in it):
                        log.warning("%s is not empty; sandbox directories stay on disk", self.root)
                        return False
                try:
                    syscalls.mount("tmpfs", str(self.root), "tmpfs", syscalls.MS_NOSUID | syscalls.MS_NODEV,
                                   _TMPFS_OPTS)
                except OSError as e:
                    log.warning("sandbox directories stay on disk: %s", e)
                    self.enabled = False
                    return False
            self.sandboxes.mkdir(exist_ok=True)
            self._ready = True
            return True

    def make_dir(self, link: Path) -> bool:
        """Create the sandbox directory `link` (in `$SHOAL_HOME/sandboxes`) as a symlink to a directory on
        the tmpfs. False (nothing done) when the tmpfs cannot be used."""
        if not self.ensure():
            return False
        real = self.sandboxes / link.name
        real.mkdir()
        try:
            # relative and short: ext4 keeps a target of up to 60 bytes in the inode itself; a longer one
            # costs a data block (measured: 9 KiB of writes per sandbox instead of ~1 KiB)
            os.symlink(os.path.relpath(real, link.parent), link)
        except BaseException:
            with contextlib.suppress(OSError):
                real.rmdir()
            raise
        return True

    def teardown(self) -> bool:
        """Unmount the tmpfs if no sandbox directory is left in it. True if unmounted."""
        self._ready = False
        with flocked(self.paths.locks / "volatile.lock"):
            if not self.root.is_dir() or not syscalls.is_mountpoint(str(self.root)):
                return False
            if self.sandboxes.is_dir():
                with os.scandir(self.sandboxes) as it:
                    if any(True for _ in it):
                        return False
            syscalls.umount_or_detach(str(self.root))
            with contextlib.suppress(OSError):
                self.root.rmdir()
            return True

