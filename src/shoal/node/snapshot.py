"""Snapshots and forks of sandboxes.

`snapshot(name)` freezes the sandbox, packs its writable layer (the overlayfs upper dir) into one new
EROFS layer in the store, thaws it, and records a new image = the parent image's layers + that layer,
with its lineage (parent image, sandbox, node, time) in the manifest. Nothing is copied: the parent's
layers are shared by reference, and the new layer holds only what the sandbox changed (deleted files
are whiteouts). The image lives in the store, so any host that sees the store can create from it.

`fork(n)` is a snapshot (`fork_snapshot`, which returns the children's spec) followed by the node's
`create_many(spec, n)`: the children start from the parent's
*files*; processes and memory are not carried over (see docs/stateful.md for which backend forks what).
The parent keeps running. Both work on every backend with `Capability.SNAPSHOT_FILES` (a writable layer
on the host, `backend.upper_dir`); memory snapshots and forks are the backend's own
(`Backend.snapshot_memory` / `fork_memory`). `Node.snapshot` / `Node.fork` choose by capability.

An overlayfs mount takes at most ~40 lower layers (one page of mount options), so a snapshot whose
image would be deeper than the store allows is *squashed*: the sandbox's whole merged tree (every
layer plus the upper) becomes one layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.backends.base import Capability
from shoal.errors import ImageNotFound, InvalidRequest, SandboxError, ShoalError
from shoal.fsutil import tmp_name
from shoal.host import syscalls
from shoal.images.erofs import build_erofs
from shoal.images.pack import check_layer_budget, footprint, pack_upper, upper_is_empty
from shoal.images.refs import parse_ref
from shoal.images.store import ImageConfig, ImageStore, Layer
from shoal.spec import SandboxSpec

if TYPE_CHECKING:
    from shoal.node.ports import SnapshotHost
    from shoal.records import SandboxRecord

log = logging.getLogger(__name__)

MAX_FORK = 10_000


def max_layers() -> int:
    """Deepest image the store accepts (overlayfs' mount-option limit)."""
    from shoal.images.store import MAX_LAYERS

    return MAX_LAYERS


def _parent_config(node: SnapshotHost, rec: SandboxRecord) -> ImageConfig:
    try:
        return ImageConfig.from_dict(node.store.manifest(rec.image_digest).get("config"))
    except (ImageNotFound, InvalidRequest, OSError, ValueError):
        # the parent's manifest was removed since: keep what the record knows
        cfg = ImageConfig()
        if rec.extra.get("workdir"):
            cfg.workdir = str(rec.extra["workdir"])
        if rec.extra.get("user"):
            cfg.user = str(rec.extra["user"])
        return cfg


def _budget(node: SnapshotHost, rec: SandboxRecord, squash: bool, store_budget: int | None) -> tuple[int, str]:
    """The most bytes the snapshot's layer may take, and which limit that is (for the message).

    A layer holds what the sandbox wrote, and the sandbox could not store more than its disk_mb: the same
    bound holds in the store, whatever sparse files claim (a squash also holds the image's own layers)."""
    disk_mb = int(rec.spec.disk_mb or 4096)
    limit, why = disk_mb << 20, f"the sandbox's disk_mb={disk_mb}"
    if squash:
        parents = 0
        for h in rec.layers:
            with contextlib.suppress(ImageNotFound, OSError, ValueError):
                parents += node.store.layer(f"sha256:{h}").size
        limit += parents
        why += f" plus its image's {parents / 2**20:.0f} MiB (a squashed snapshot)"
    if store_budget is not None and store_budget < limit:
        limit, why = max(0, store_budget), "what is left of the project's store quota (max_store_mb)"
    return limit, why


def _squash(node: SnapshotHost, rec: SandboxRecord, upper: Path, source: dict[str, Any],
            budget: tuple[int, str] | None = None) -> Layer:
    """One layer holding the sandbox's whole merged tree (all lowers + the upper). Blocking."""
    lowers = [str(node.layer_mounts.mountpoint(h)) for h in reversed(rec.layers)]
    for p in lowers:
        if not syscalls.is_mountpoint(p):
            raise SandboxError(f"cannot squash sandbox {rec.id}: its layer {p} is not mounted")
    mnt = node.paths.run / f"squash-{rec.id}-{secrets.token_hex(4)}"
    mnt.mkdir(parents=True)
    try:
        # no upperdir: a read-only overlay whose top lower is the sandbox's upper (whiteouts honoured)
        syscalls.mount("overlay", str(mnt), "overlay", syscalls.MS_RDONLY,
                       "lowerdir=" + ":".join([str(upper), *lowers]) + ",redirect_dir=off,index=off,metacopy=off")
        try:
            if budget is not None:
                check_layer_budget(footprint(mnt), budget[0], f"the snapshot of sandbox {rec.id}", budget[1])
            tmp = node.store.tmp_dir / (tmp_name("squash-") + ".erofs")
            try:
                build_erofs(mnt, tmp, sparse=True)
                return node.store.add_layer_file(tmp, source)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
        finally:
            syscalls.umount(str(mnt), detach=True)
    finally:
        with contextlib.suppress(OSError):
            mnt.rmdir()


async def snapshot_sandbox(node: SnapshotHost, sandbox_id: str, name: str, *, squash: bool | None = None,
                           compress: str | None = None, store_budget: int | None = None) -> dict[str, Any]:
    """Freeze, pack the writable layer, thaw; tag a new image `name` = parent layers + the diff.

    The new layer may hold no more than the sandbox's disk_mb of files, counting the holes of sparse
    files (they are stored as holes, but packing reads them), nor more than `store_budget` bytes (what
    the caller's project may still store): QuotaExceeded before anything is read or written.

    Returns the image's summary (`ref`, `digest`, `layers`, `lineage`, ...) plus `layer` (the new
    layer's digest, or None when nothing changed), `diff_bytes`, `seconds` and `frozen_s`.
    `squash=None` squashes only when the image would exceed the overlayfs layer limit.
    """
    t0 = time.monotonic()
    rec = node.record(sandbox_id)
    ref = parse_ref(name)
    if ref.digest:
        raise InvalidRequest(f"snapshot name {name!r} must be name[:tag], not a digest")
    backend = node.backend(rec.backend)
    backend.require(Capability.SNAPSHOT_FILES)
    upper = backend.upper_dir(rec)
    if upper is None:
        raise SandboxError(f"sandbox {sandbox_id} has no writable layer on the host")
    async with node.locks.state(sandbox_id):
        rec = node.record(sandbox_id)
        if rec.state not in ("running", "paused"):
            raise SandboxError(f"cannot snapshot sandbox {sandbox_id}: it is {rec.state}")
        if not Path(upper).is_dir():
            raise SandboxError(f"sandbox {sandbox_id} has no writable layer at {upper}")
        parent_layers = [f"sha256:{h}" for h in rec.layers]
        config = _parent_config(node, rec)
        source = {"type": "snapshot", "sandbox": rec.id, "node": node.config.node_id,
                  "parent": rec.image_digest}
        was_running = rec.state == "running"
        if was_running:
            await backend.pause(rec)
            # crash-only: if this process dies mid-snapshot, the next request sees "paused" and thaws it
            rec.state = "paused"
            rec.extra["paused_by"] = "snapshot"
            rec.save()
        t_freeze = time.monotonic()
        layer: Layer | None = None
        squashed = False
        try:
            empty = await asyncio.to_thread(upper_is_empty, Path(upper), bool(rec.spec.network))
            depth = len(parent_layers) + (0 if empty else 1)
            squashed = bool(squash) or (squash is None and depth > max_layers())
            budget = _budget(node, rec, squashed, store_budget)
            if squashed:
                layer = await asyncio.to_thread(_squash, node, rec, Path(upper), dict(source, squashed=True), budget)
            elif not empty:
                kw: dict[str, Any] = {"network": True} if rec.spec.network else {}
                layer = await asyncio.to_thread(lambda: pack_upper(
                    node.store, Path(upper), source, compress, max_bytes=budget[0],
                    what=f"the snapshot of sandbox {rec.id}", why=budget[1], **kw))
        finally:
            frozen_s = time.monotonic() - t_freeze
            if was_running:
                await _thaw_after_snapshot(node, rec)
        layers = [layer.digest] if squashed and layer else parent_layers + ([layer.digest] if layer else [])
        lineage = {
            "kind": "snapshot", "parent": rec.image_digest, "parent_ref": rec.image, "sandbox": rec.id,
            "node": node.config.node_id, "backend": rec.backend, "created": time.time(),
            "layer": layer.digest if layer else None, "squashed": squashed,
        }
        img = await asyncio.to_thread(node.store.put_image, str(ref), layers, config, lineage)
    out = img.to_dict()
    out.update(ref=img.ref, layer=layer.digest if layer else None, diff_bytes=layer.size if layer else 0,
               seconds=round(time.monotonic() - t0, 4), frozen_s=round(frozen_s, 4))
    return out


async def _thaw_after_snapshot(node: SnapshotHost, rec: SandboxRecord) -> None:
    try:
        await node.backend(rec.backend).resume(rec)
    except ShoalError:
        # left frozen with state "paused": the next request resumes it (Node.client)
        return
    rec.state = "running"
    rec.extra.pop("paused_by", None)
    rec.save()


def _child_spec(rec: SandboxRecord, image_ref: str, overrides: dict[str, Any]) -> SandboxSpec:
    known = set(SandboxSpec.model_fields)
    unknown = set(overrides) - known - {"image"}
    if unknown:
        raise InvalidRequest(f"unknown sandbox option(s) for fork: {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(sorted(known - {'image'}))}")
    base = rec.spec.to_dict()
    base.update(overrides)
    base["image"] = image_ref
    labels = dict(base.get("labels") or {})
    labels.setdefault("shoal.fork_of", rec.id)
    base["labels"] = labels
    return SandboxSpec(**base)


def fork_image_prefix(sandbox_id: str) -> str:
    """The image name under which fork(n) tags its automatic snapshots of a sandbox."""
    return f"forks/{sandbox_id}"


def fork_image_name(sandbox_id: str) -> str:
    """A fresh image ref for a fork's snapshot: `forks/<sandbox id>:<UTC time>-<random>`."""
    return f"{fork_image_prefix(sandbox_id)}:{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"


async def fork_snapshot(node: SnapshotHost, sandbox_id: str, *, name: str | None = None,
                        store_budget: int | None = None, **overrides: Any) -> SandboxSpec:
    """The first half of a fork from files: snapshot the sandbox and return its children's spec (the
    node then creates them with create_many, per-item errors and all).

    `name` tags the intermediate snapshot (default `forks/<id>:<time>-<rand>`); `overrides` change the
    children's spec (cpus, memory_mb, ttl_s, labels, ...); `store_budget` bounds the snapshot's layer.
    """
    rec = node.record(sandbox_id)
    node.backend(rec.backend).require(Capability.SNAPSHOT_FILES)
    _child_spec(rec, "x", overrides)  # reject bad options before the snapshot is made
    if not rec.extra.get("forked"):
        # closing this sandbox untags its automatic fork snapshots (drop_fork_snapshots)
        rec.extra["forked"] = True
        rec.save()
    snap = await snapshot_sandbox(node, sandbox_id, name or fork_image_name(sandbox_id), store_budget=store_budget)
    return _child_spec(rec, snap["ref"], overrides)


def drop_fork_snapshots(store: ImageStore, rec: SandboxRecord) -> None:
    """Untag the snapshots that fork(n) made of a closed sandbox under their automatic names
    (`forks/<id>:…`, or a project's `projects/<p>/forks/<id>:…`): an RL loop forking every step would
    otherwise grow the store without end. Live children keep their layers (gc never removes a layer a
    sandbox uses); snapshots forked under a name of the caller's choosing stay. Blocking."""
    for name in (fork_image_prefix(rec.id), f"projects/{rec.project}/{fork_image_prefix(rec.id)}"):
        try:
            store.remove_name(name)
        except OSError as e:  # a shared store that is briefly unavailable: gc can still do it later
            log.warning("could not untag the fork snapshots of %s: %s", rec.id, e)
