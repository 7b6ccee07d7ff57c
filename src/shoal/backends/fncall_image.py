"""The images fncall languages run in, beyond `base`: built once per store, on first use, and reused.

- `fncall:latest` = `base` + gcc, g++ (c, cpp);
- `fncall-langs:<version>` = `fncall:latest` + Go, a JDK, Node.js with esbuild, rustc and pytest (go, java,
  nodejs, typescript, rust, pytest): about 1 GB of Debian packages, so it is built only when one of those
  languages is first asked for (or by `shoal fncall setup --all`). Its tag changes with its package list, so a
  store never serves an image older than what the languages expect.

Built like any image a user would make by hand: a sandbox of the parent image with network access runs
apt-get, then `snapshot` packs its writable layer into a new layer on top of the parent's. Concurrent builders
(two processes, two tasks) serialize on a host lock and the second one finds the image made.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shoal.errors import ImageBuildError, ImageNotFound
from shoal.fsutil import aflocked
from shoal.spec import SandboxSpec

if TYPE_CHECKING:
    from shoal.backends.context import SandboxHost

FNCALL_PACKAGES = ["gcc", "g++", "libc6-dev"]
_LOCKS: dict[str, asyncio.Lock] = {}


@dataclass(frozen=True)
class Recipe:
    """How one fncall image is made: its parent, the Debian packages added, a check that they work."""

    name: str
    parent: str
    packages: tuple[str, ...]
    check: str
    #: shell run before apt-get (what a package's scripts assume of a full Debian that `base` leaves out)
    prepare: str = ""

    @property
    def ref(self) -> str:
        """`name:tag`; the tag of a versioned recipe is a digest of what it installs."""
        if self.name == "fncall":
            return "fncall:latest"  # the first one, named before tags were versioned; its packages never change
        digest = hashlib.sha256(repr((self.parent, self.packages, self.check, self.prepare)).encode()).hexdigest()[:10]
        return f"{self.name}:{digest}"


FNCALL_RECIPE = Recipe("fncall", "base:latest", tuple(FNCALL_PACKAGES),
                       "gcc --version | head -1; g++ --version | head -1")
#: golang-go, default-jdk-headless, nodejs + esbuild, rustc (links with gcc: hence the parent), pytest
LANGS_RECIPE = Recipe(
    "fncall-langs", FNCALL_RECIPE.ref,
    ("golang-go", "default-jdk-headless", "nodejs", "esbuild", "rustc", "python3-pytest"),
    "go version; javac -version; java -version 2>&1 | head -1; echo node $(node --version); "
    "echo esbuild $(esbuild --version); rustc --version; python3 -m pytest --version",
    # `base` has no manual pages; the JRE's postinst links java.1.gz there and fails without the directory
    prepare="mkdir -p /usr/share/man/man1")
RECIPES = {r.ref: r for r in (FNCALL_RECIPE, LANGS_RECIPE)}


def _install_script(packages: list[str] | tuple[str, ...], check: str = FNCALL_RECIPE.check,
                    prepare: str = "") -> str:
    pkgs = " ".join(packages)
    return (
        "set -e; export DEBIAN_FRONTEND=noninteractive; "
        + (f"{prepare}; " if prepare else "") +
        "apt-get update -q; "
        f"apt-get install -y -q --no-install-recommends {pkgs}; "
        # nothing of the download belongs in the layer: lists and caches are stale the moment it is packed
        "apt-get clean; rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log "
        "/tmp/* /var/tmp/* /root/.cache; "
        + check
    )


async def build_fncall_image(node: SandboxHost, ref: str = "fncall:latest", *, base: str | None = None,
                             packages: list[str] | None = None,
                             log: Callable[[str], None] | None = None) -> dict:
    """Build `ref` and return the image summary: a known fncall image (`RECIPES`) from its recipe, or any
    `ref` = `base` (default base:latest) + `packages` (default gcc, g++, libc6-dev)."""
    log = log or (lambda s: None)
    recipe = RECIPES.get(ref)
    check = recipe.check if recipe and packages is None else ""
    prepare = recipe.prepare if recipe and packages is None else ""
    base = base or (recipe.parent if recipe else "base:latest")
    packages = packages or list(recipe.packages if recipe else FNCALL_PACKAGES)
    if not node.store.exists(base):
        parent = RECIPES.get(base)
        if parent is None:
            raise ImageNotFound(f"cannot build {ref}: image {base} is missing; run `shoal image build base` first")
        await ensure_fncall_image(node, base, log=log)
    t0 = time.monotonic()
    log(f"creating a {base} sandbox with network access to install {', '.join(packages)}")
    info = await node.create(SandboxSpec(image=base, network=True, cpus=2.0, memory_mb=2048, ttl_s=3600,
                                         disk_mb=8192, labels={"shoal.fncall.build": ref}))
    try:
        handle = await node.stream(info.id, _install_script(packages, check, prepare), timeout=1800)
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


async def ensure_fncall_image(node: SandboxHost, ref: str = "fncall:latest",
                              log: Callable[[str], None] | None = None) -> str:
    """Return `ref`, building it first (once per store, host-wide lock) when the store lacks it."""
    if node.store.exists(ref):
        return ref
    lock = _LOCKS.setdefault(ref, asyncio.Lock())
    async with lock:
        if node.store.exists(ref):
            return ref
        path = node.paths.locks / f"fncall-image-{ref.replace('/', '_').replace(':', '_')}.lock"
        # another process may be building it: wait for its lock, then look again
        async with aflocked(path):
            if not node.store.exists(ref):
                await build_fncall_image(node, ref, log=log)
    return ref
