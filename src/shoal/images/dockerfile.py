"""Dockerfiles of task sets (Harbor, RL tasks): build once per content, by name.

    img = await ensure_dockerfile_image(node, Path("task/environment"), "fizzbuzz", from_map={"python:3.12": "py"})
    img.ref, img.image.config.workdir

The build itself is shoal.images.dockerbuild's (BuildKit's Dockerfile semantics, every step cached). The
image is named `dockerfile/<name>:<16 hex>`, the hex a hash of the context, the Dockerfile, the options
(from_map, build args, target) *and the digests the FROM images resolve to*: a remapped or rebuilt base is a
new name, never a stale image. Trials of one task starting together build once; later calls with the same
inputs find the image without running anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.errors import ShoalError
from shoal.images.store import Image

if TYPE_CHECKING:
    from shoal.node.node import Node

_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass
class DockerfileImage:
    """A task's Dockerfile built into the store: its name, the image, and the build's warnings."""

    ref: str
    image: Image
    warnings: list[str] = field(default_factory=list)
    steps_run: int = 0


def substitute(s: str, env: dict[str, str]) -> str:
    """Docker's `$VAR`, `${VAR}`, `${VAR:-default}` and `${VAR:+alt}` expansion (unset = empty)."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(4)
        val = env.get(name)
        if m.group(2) == "-":
            return val if val else m.group(3)
        if m.group(2) == "+":
            return m.group(3) if val else ""
        return val or ""

    return _VAR.sub(one, s.replace("\\$", "\0")).replace("\0", "$")


def dockerfile_digest(context: Path, dockerfile: Path | None = None) -> str:
    """A short content hash of the Dockerfile and its build context (names an image built from it)."""
    import hashlib

    h = hashlib.sha256()
    context = Path(context)
    for root, dirs, files in os.walk(context):
        dirs.sort()
        for name in sorted(files):
            p = Path(root, name)
            rel = p.relative_to(context).as_posix()
            h.update(rel.encode() + b"\0")
            try:
                h.update(p.read_bytes() if not p.is_symlink() else os.readlink(p).encode())
            except OSError:
                pass
            h.update(b"\0")
    if dockerfile is not None:
        h.update(Path(dockerfile).read_bytes())
    return h.hexdigest()[:16]


def dockerfile_image_ref(name: str, digest: str) -> str:
    """A valid shoal image ref for the build of `name`'s Dockerfile (`name` may hold any characters)."""
    clean = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-._") or "task"
    return f"dockerfile/{clean[:80]}:{digest}"


_build_locks: dict[tuple[int, str], Any] = {}


async def _inputs_digest(node: Node, context: Path, dockerfile: Path | None, from_map: dict[str, str],
                         build_args: dict[str, str], target: str | None) -> str:
    """The context's digest plus everything else the result depends on, including the base images' digests."""
    import asyncio

    from shoal.images.dockerbuild import _KEY_VERSION, BuildOptions, read_dockerfile, split_stages

    ctx_digest = await asyncio.to_thread(dockerfile_digest, context, dockerfile)
    opts = BuildOptions(tag="x:1", context=context, dockerfile=dockerfile, build_args=build_args, target=target,
                        from_map=from_map)
    stages, _, _, _ = split_stages(read_dockerfile(opts), opts)
    names = {s.name for s in stages if s.name}
    bases = {}
    for s in stages:
        if s.base.lower() in names or s.base.lower() == "scratch" or s.base.isdigit():
            continue
        from shoal.images.pull import resolve_local

        mapped = from_map.get(s.base, s.base)
        try:
            img = await asyncio.to_thread(resolve_local, node.store, mapped)
        except ShoalError:
            img = None  # a bad reference: the build says so
        # (not in the store yet: it is pulled by the build, which names the image by what it got)
        bases[s.base] = img.digest if img is not None else mapped
    blob = json.dumps({"builder": _KEY_VERSION, "ctx": ctx_digest, "from_map": from_map, "args": build_args,
                       "target": target, "bases": bases}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


async def ensure_dockerfile_image(node: Node, context: Path, name: str, *, from_map: dict[str, str] | None = None,
                                  build_args: dict[str, str] | None = None, network: bool = True,
                                  force: bool = False, target: str | None = None, dockerfile: Path | None = None,
                                  log: Callable[[str], None] | None = None) -> DockerfileImage:
    """Build `context/Dockerfile` into `node`'s store unless an image of the same inputs exists; returns it.
    Concurrent callers in one process build once; the others wait and find the image (every step is cached
    in the store, so another process rebuilds nothing either)."""
    import asyncio

    from shoal.images.dockerbuild import BuildOptions, build_dockerfile

    context = Path(context)
    fmap = dict(from_map or {})
    args = dict(build_args or {})
    digest = await _inputs_digest(node, context, dockerfile, fmap, args, target)
    ref = dockerfile_image_ref(name, digest)
    lock = _build_locks.setdefault((id(asyncio.get_running_loop()), ref), asyncio.Lock())
    async with lock:
        if not force and node.store.exists(ref):
            return DockerfileImage(ref=ref, image=node.store.resolve(ref))
        res = await build_dockerfile(node, BuildOptions(tag=ref, context=context, dockerfile=dockerfile,
                                                        build_args=args, target=target, from_map=fmap,
                                                        network=network, no_cache=force), log=log)
    return DockerfileImage(ref=ref, image=res.image, warnings=res.warnings, steps_run=res.steps_run)
