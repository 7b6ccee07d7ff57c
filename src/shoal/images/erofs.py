"""Build EROFS images with mkfs.erofs, reproducibly: the same tree always gives the same bytes.

Reproducible output is what makes layers content-addressed for real: two hosts (or two imports of
the same OCI layer) that pack the same tree get the same sha256 and share one file in the store.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from shoal.errors import BackendUnavailable, ImageBuildError
from shoal.host.spawn import run_sync

# Fixed UUID and build time: mkfs.erofs would otherwise stamp random/now values into the superblock.
FIXED_UUID = "00000000-0000-0000-0000-000000000000"
# SOURCE_DATE_EPOCH clamps newer mtimes; 2100-01-01 keeps every real mtime (python's .pyc checks them).
EPOCH = "4102444800"
# older names
_FIXED_UUID, _EPOCH = FIXED_UUID, EPOCH


def mkfs_binary() -> str:
    """Path of mkfs.erofs, or BackendUnavailable telling how to install it."""
    exe = shutil.which("mkfs.erofs")
    if not exe:
        raise BackendUnavailable("mkfs.erofs is not installed: apt-get install erofs-utils")
    return exe


#: chunk size of sparse-aware layers: a 4 KiB chunk that is all hole is stored as nothing (4-8 bytes of
#: index), so a file's holes cost ~1/512 of their size instead of being written out as zeros
SPARSE_CHUNK = 4096


def build_erofs(src_dir: Path, out_file: Path, compress: str | None = None, timeout: float = 3600,
                exclude: list[str] | None = None, sparse: bool = False) -> None:
    """Pack `src_dir` into the EROFS image `out_file` (overwritten). Keeps owners, modes, xattrs,
    whiteouts (0/0 char devices) and overlayfs opaque markers. `exclude`: paths relative to src_dir.
    `sparse`: chunk-based files that keep holes as holes (uncompressed layers only)."""
    argv = [mkfs_binary(), "-U", FIXED_UUID, "--quiet"]
    argv += [f"--exclude-path={rel}" for rel in exclude or []]
    if compress:
        argv.append(f"-z{compress}")
    elif sparse:
        argv.append(f"--chunksize={SPARSE_CHUNK}")
    argv += [str(out_file), str(src_dir)]
    env = dict(os.environ, SOURCE_DATE_EPOCH=EPOCH)
    r = run_sync(argv, timeout=timeout, env=env)
    if r.returncode != 0:
        raise ImageBuildError(
            f"mkfs.erofs failed on {src_dir}: {r.stderr.decode(errors='replace').strip()[-2000:]}")
