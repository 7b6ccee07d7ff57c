"""Compose images: stack the layers of several images into a new one without rebuilding anything.

An environment is typically base OS + workspace + toolkit, each versioned on its own; composing
`base:v1 workspace:v3 toolkit:v2` writes one small manifest that points at layers already in the
store. A layer that appears in more than one input (e.g. the base under a workspace built FROM it)
is kept once, at its lowest position, so the base stays at the bottom.
"""

from __future__ import annotations

from typing import Any

from shoal.errors import InvalidRequest
from shoal.images.refs import parse_ref
from shoal.images.store import Image, ImageConfig, ImageStore


def compose_images(store: ImageStore, ref: str, sources: list[str], *, env: dict[str, str] | None = None,
                   workdir: str | None = None, user: str | None = None, entrypoint: list[str] | None = None,
                   cmd: list[str] | None = None) -> Image:
    """Tag `ref` as the layers of `sources` stacked bottom (first) to top (last).

    The config is the last source's, with `env` merged over it and the other fields replaced when given."""
    target = parse_ref(ref)
    if target.digest:
        raise InvalidRequest(f"compose into name:tag, not a digest ({ref})")
    if not sources:
        raise InvalidRequest("compose needs at least one source image")
    images = [store.resolve(s) for s in sources]  # ImageNotFound names the missing one
    layers: list[str] = []
    seen: set[str] = set()
    for img in images:
        for lay in img.layers:
            if lay.digest not in seen:
                seen.add(lay.digest)
                layers.append(lay.digest)
    cfg: ImageConfig = images[-1].config.copy()
    if env:
        cfg.env.update(env)
    if workdir is not None:
        if not workdir.startswith("/"):
            raise InvalidRequest(f"workdir {workdir!r} must be an absolute path")
        cfg.workdir = workdir
    if user is not None:
        cfg.user = user
    if entrypoint is not None:
        cfg.entrypoint = list(entrypoint)
    if cmd is not None:
        cfg.cmd = list(cmd)
    lineage: dict[str, Any] = {"composed_from": [{"ref": i.ref, "digest": i.digest} for i in images]}
    return store.put_image(target, layers, cfg, lineage=lineage)


def tag_image(store: ImageStore, source: str, ref: str) -> Image:
    """Point `ref` (name:tag) at the same image version as `source`."""
    target = parse_ref(ref)
    if target.digest:
        raise InvalidRequest(f"tag as name:tag, not a digest ({ref})")
    img = store.resolve(source)
    store.set_tag(target, img.digest)
    return store.resolve(str(target))
