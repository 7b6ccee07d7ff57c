"""The built-in `base` image: Debian bookworm made by mmdebstrap from the Debian mirror."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from shoal.config import settings
from shoal.errors import BackendUnavailable, ImageBuildError
from shoal.host.spawn import run_sync
from shoal.images.store import Image, ImageConfig, ImageStore

BASE_SUITE = "bookworm"
BASE_PACKAGES = ["bash", "coreutils", "procps", "python3", "git", "ca-certificates", "patch"]
# Documentation and translations are never read by agents; leaving them out shrinks the layer a lot.
_DPKG_EXCLUDES = [
    "path-exclude=/usr/share/man/*", "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright", "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*", "path-include=/usr/share/locale/locale.alias",
]


def default_mirror() -> str:
    """SHOAL_DEBIAN_MIRROR or the Debian mirror apt on this host uses."""
    return settings().debian_mirror


def build_base(store: ImageStore, ref: str = "base:latest", packages: list[str] | None = None,
               mirror: str | None = None, log: Callable[[str], None] | None = None,
               work_dir: Path | None = None) -> Image:
    """Run mmdebstrap (minbase + BASE_PACKAGES), pack the tree as one layer, tag it `ref`.
    `work_dir` holds the unpacked tree (default: the store's tmp/; use local disk for a shared store)."""
    if not shutil.which("mmdebstrap"):
        raise BackendUnavailable("mmdebstrap is not installed: apt-get install mmdebstrap")
    if os.geteuid() != 0:
        raise BackendUnavailable("building the base image needs root (mmdebstrap creates device nodes)")
    pkgs = packages or BASE_PACKAGES
    mirror = mirror or default_mirror()
    log = log or (lambda s: None)
    t0 = time.monotonic()
    base_dir = Path(work_dir) if work_dir else store.tmp_dir
    base_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".tmp-base-", dir=base_dir) as tmp:
        rootfs = Path(tmp) / "rootfs"
        argv = ["mmdebstrap", "--variant=minbase", "--include=" + ",".join(pkgs), "--quiet"]
        argv += [f"--dpkgopt={x}" for x in _DPKG_EXCLUDES]
        # apt lists are stale the moment the image is used; `apt-get update` fetches fresh ones
        argv += ["--customize-hook=rm -rf $1/var/lib/apt/lists/* $1/var/cache/apt/*.bin",
                 # mmdebstrap copies the build host's names; a sandbox has its own
                 "--customize-hook=echo sandbox > $1/etc/hostname && "
                 "printf '127.0.0.1 localhost sandbox\\n::1 localhost\\n' > $1/etc/hosts",
                 BASE_SUITE, str(rootfs), mirror]
        log(f"mmdebstrap {BASE_SUITE} ({', '.join(pkgs)}) from {mirror}")
        r = run_sync(argv, timeout=1800)
        if r.returncode != 0:
            raise ImageBuildError("mmdebstrap failed: " + r.stderr.decode(errors="replace")[-3000:])
        log(f"packing EROFS layer ({time.monotonic() - t0:.0f}s so far)")
        layer = store.add_layer_from_dir(rootfs, source={
            "type": "mmdebstrap", "suite": BASE_SUITE, "variant": "minbase", "packages": pkgs,
            "mirror": mirror})
    cfg = ImageConfig(workdir="/root")
    img = store.put_image(ref, [layer.digest], cfg,
                          lineage={"built_by": "shoal image build base", "source": "mmdebstrap"})
    log(f"built {img.ref} = {layer.digest[:19]} ({layer.size / 2**20:.0f} MiB) in {time.monotonic() - t0:.0f}s")
    return img


def ensure_base(store: ImageStore, log: Callable[[str], None] | None = None) -> Image:
    """Return the `base` image, building it first if the store lacks it."""
    if store.exists("base:latest"):
        return store.resolve("base:latest")
    return build_base(store, log=log)
