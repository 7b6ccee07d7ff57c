"""Turn a sandbox's writable layer (an overlayfs upper dir) into an immutable store layer.

An upper dir already speaks the layer format: deleted files are 0/0 character devices (whiteouts) and
replaced directories carry the `trusted.overlay.opaque` xattr. mkfs.erofs keeps both, so the packed
layer stacks under a new upper exactly as the files looked in the sandbox.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from shoal.errors import ImageBuildError
from shoal.fsutil import tmp_name
from shoal.host.spawn import run_sync
from shoal.images.erofs import mkfs_binary
from shoal.images.store import ImageStore, Layer

# Created by the OCI runtime as the agent's mountpoint; not part of the sandbox's own files.
RUNTIME_ARTIFACTS = [".shoal"]
_FIXED_UUID = "00000000-0000-0000-0000-000000000000"
_EPOCH = "4102444800"


def pack_upper(store: ImageStore, upper: Path, source: dict[str, Any], compress: str | None = None) -> Layer:
    """Pack `upper` (excluding runtime artifacts) into a layer in `store`; returns it (deduplicated)."""
    upper = Path(upper)
    if not upper.is_dir():
        raise ImageBuildError(f"no writable layer at {upper}")
    tmp = store.tmp_dir / (tmp_name("upper-") + ".erofs")
    argv = [mkfs_binary(), "-U", _FIXED_UUID, "--quiet"]
    for rel in RUNTIME_ARTIFACTS:
        # only skip the artifact when it is the runtime's empty mountpoint, never user data of that name
        p = upper / rel
        if p.is_dir() and not p.is_symlink() and not any(os.scandir(p)):
            argv.append(f"--exclude-path={rel}")
    if compress:
        argv.append(f"-z{compress}")
    argv += [str(tmp), str(upper)]
    try:
        r = run_sync(argv, timeout=3600, env=dict(os.environ, SOURCE_DATE_EPOCH=_EPOCH))
        if r.returncode != 0:
            raise ImageBuildError(f"mkfs.erofs failed on {upper}: {r.stderr.decode(errors='replace')[-2000:]}")
        return store.add_layer_file(tmp, source)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
