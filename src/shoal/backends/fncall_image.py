"""The `fncall` image: `base` plus the C/C++ toolchain, built once per store and reused.

Built like any image a user would make by hand: a `base` sandbox with network access runs apt-get,
then `snapshot` packs its writable layer into a new layer on top of `base`'s. Concurrent builders
(two processes, two tasks) serialize on a host lock and the second one finds the image made.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from shoal.errors import ImageBuildError, ImageNotFound
from shoal.spec import SandboxSpec

if TYPE_CHECKING:
    from shoal.node.node import Node

FNCALL_PACKAGES = ["gcc", "g++", "libc6-dev"]
_LOCKS: dict[str, asyncio.Lock] = {}


def _install_script(packages: list[str]) -> str:
    pkgs = " ".join(packages)
    return (
        "set -e; export DEBIAN_FRONTEND=noninteractive; "
        "apt-get update -q; "
        f"apt-get install -y -q --no-install-recommends {pkgs}; "
        # nothing of the download belongs in the layer: lists and caches are stale the moment it is packed
        "apt-get clean; rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log "
        "/tmp/* /var/tmp/* /root/.cache; "
        "gcc --version | head -1; g++ --version | head -1"
    )


async def build_fncall_image(node: Node, ref: str = "fncall:latest", *, base: str = "base:latest",
                             packages: list[str] | None = None,
                             log: Callable[[str], None] | None = None) -> dict:
    """Build `ref` = `base` + `packages` (default gcc, g++, libc6-dev) and return the image summary."""
    log = log or (lambda s: None)
    packages = packages or list(FNCALL_PACKAGES)
    if not node.store.exists(base):
        raise ImageNotFound(f"cannot build {ref}: image {base} is missing; run `shoal image build base` first")
    t0 = time.monotonic()
    log(f"creating a {base} sandbox with network access to install {', '.join(packages)}")
    info = await node.create(SandboxSpec(image=base, network=True, cpus=2.0, memory_mb=2048, ttl_s=3600,
                                         labels={"shoal.fncall.build": ref}))
    try:
        handle = await node.stream(info.id, _install_script(packages), timeout=1800)
        tail: list[str] = []
        partial = b""
        async for ev in handle:
            if ev.kind in ("stdout", "stderr"):
                partial += ev.data
                *lines, partial = partial.split(b"\n")
                for raw in lines:
                    line = raw.decode(errors="replace").rstrip()
                    if line:
                        tail = [*tail[-30:], line]
                        log(line)
            elif ev.kind == "exit" and ev.result is not None:
                r = ev.result
                if r.exit_code != 0 or r.timed_out:
                    why = "timed out" if r.timed_out else f"exit code {r.exit_code}"
                    raise ImageBuildError(f"installing {', '.join(packages)} into {ref} failed ({why}); "
                                          "is the Debian mirror reachable from sandboxes (network=True)?\n"
                                          + "\n".join(tail[-15:]))
        log(f"packing the new layer into {ref}")
        img = await node.snapshot(info.id, ref)
    finally:
        with contextlib.suppress(Exception):
            await node.close(info.id)
    log(f"built {ref} in {time.monotonic() - t0:.0f}s")
    return img


async def ensure_fncall_image(node: Node, ref: str = "fncall:latest",
                              log: Callable[[str], None] | None = None) -> str:
    """Return `ref`, building it first (once per store, host-wide lock) when the store lacks it."""
    if node.store.exists(ref):
        return ref
    lock = _LOCKS.setdefault(ref, asyncio.Lock())
    async with lock:
        if node.store.exists(ref):
            return ref
        path = node.paths.locks / f"fncall-image-{ref.replace('/', '_').replace(':', '_')}.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            # another process may be building it: wait for its lock, then look again
            await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
            if not node.store.exists(ref):
                await build_fncall_image(node, ref, log=log)
        finally:
            os.close(fd)
    return ref
