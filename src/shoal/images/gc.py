"""Garbage collection of the store: layers no image and no live sandbox references, then chunks no layer names.

A layer is kept when any of these holds:
- a tagged image lists it (or an untagged image version younger than the grace period: a build or
  import may be about to tag it);
- a sandbox record under this host's $SHOAL_HOME/sandboxes lists it, or LayerMounts has users for it;
- it is mounted on this host (any SHOAL_HOME: found in /proc/self/mountinfo and loop backing files);
- another node holds a live lease on it (`leases/<hex>/<host key>`, written by LayerMounts while mounted
  and renewed by the node agent's heartbeat; a lease older than the lease TTL belongs to a dead node);
- it was created or last used (metadata mtime, touched by every build/import/compose that reuses it)
  less than `grace_s` ago — a layer another host is writing or about to reference is never collected.

gc takes no lock (the store may be shared by many hosts); the grace period is what makes it safe.
Untagged manifests, cache entries pointing at missing layers, orphan data files and stale temp files
(older than the grace period) go too.

Chunks: after the layers, every chunk object that no remaining layer's table names and that was not
written or re-used within the grace period is removed (a writer re-using a chunk renews its mtime before
it publishes the table naming it, so a layer being written never loses a chunk). A lease protects a
layer, and so its table, and so its chunks. Start records and corrupt marks of removed layers go too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shoal.config import Paths
from shoal.host import syscalls
from shoal.images import leases
from shoal.images.chunkd import erofs_sources
from shoal.images.store import ImageStore

DEFAULT_GRACE_S = 3600.0
_CACHE_KINDS = ("steps", "oci-diffids")


@dataclass
class GcReport:
    """What a gc pass removed and why it kept the rest."""

    removed_layers: list[str] = field(default_factory=list)
    removed_manifests: list[str] = field(default_factory=list)
    removed_cache_entries: int = 0
    removed_tmp: int = 0
    removed_orphans: int = 0
    removed_chunks: int = 0
    freed_bytes: int = 0
    kept_referenced: int = 0
    kept_in_use: list[str] = field(default_factory=list)
    kept_young: list[str] = field(default_factory=list)
    stale_leases_removed: int = 0
    #: other nodes' leases older than the TTL (their nodes died): ignored, and removed unless dry_run
    expired_leases: int = 0
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


def _host_prefix() -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname())[:64] or "host"


def _mounted_layer_files(store: ImageStore) -> set[str]:
    """Hexes of store layers mounted on this host (file-backed or through a loop device): whole files of
    the store, or any node's layer reader files (<home>/chunkfs/<S>/<hex>.erofs; counted whatever store the
    reader serves: keeping a layer too long is safe, removing one in use is not)."""
    layers_dir = os.path.realpath(store.layers_dir)
    out: set[str] = set()

    def note(path: str) -> None:
        p = path.removesuffix(" (deleted)")
        name = os.path.basename(p)
        if not name.endswith(".erofs") or len(name) != 70:
            return
        if os.path.basename(os.path.dirname(os.path.dirname(p))) == "chunkfs" or \
                os.path.dirname(os.path.realpath(p)) == layers_dir:
            out.add(name[: -len(".erofs")])

    for src in erofs_sources():
        note(src)
    return out


def _leased(store: ImageStore, mounted_here: set[str], dry_run: bool, lease_max_age_s: float | None,
            now: float, report: GcReport) -> set[str]:
    out: set[str] = set()
    me = _host_prefix()
    if not store.leases_dir.is_dir():
        return out
    for hdir in store.leases_dir.iterdir():
        if not hdir.is_dir():
            continue
        for lease in list(hdir.iterdir()):
            if lease.name.startswith(".tmp-"):
                continue
            host = lease.name.rsplit("-", 1)[0]
            if host == me:
                # our own lease: trust the kernel's mount table, not the file
                if hdir.name in mounted_here:
                    out.add(hdir.name)
                    continue
                try:
                    info = json.loads(lease.read_text())
                    mp, users = info.get("mountpoint", ""), info.get("users", "")
                except (OSError, ValueError, AttributeError):
                    mp = users = ""
                if mp and syscalls.is_mountpoint(mp):
                    out.add(hdir.name)
                    continue
                if users and _nonempty_dir(users):  # a VM drive reads the layer without a mount
                    out.add(hdir.name)
                    continue
                if not dry_run:
                    with contextlib.suppress(OSError):
                        lease.unlink()
                report.stale_leases_removed += 1
                continue
            age = leases.age_s(lease, now)
            if age is None:
                continue
            if lease_max_age_s is None or age < lease_max_age_s:
                out.add(hdir.name)
                continue
            report.expired_leases += 1
            if not dry_run:
                with contextlib.suppress(OSError):
                    lease.unlink()
        if not dry_run:
            with contextlib.suppress(OSError):
                hdir.rmdir()
    return out


def _nonempty_dir(path: str) -> bool:
    try:
        with os.scandir(path) as it:
            return any(True for _ in it)
    except OSError:
        return False


def _local_users(paths: Paths | None) -> tuple[set[str], set[str]]:
    """(layer hexes, manifest digests) that sandboxes of this SHOAL_HOME use."""
    hexes: set[str] = set()
    manifests: set[str] = set()
    if paths is None:
        return hexes, manifests
    from shoal.records import list_records

    for rec in list_records(paths.sandboxes):
        hexes.update(rec.layers or [])
        if rec.image_digest:
            manifests.add(rec.image_digest)
    root = paths.layer_mounts
    if root.is_dir():
        for p in root.glob("*.users"):
            with contextlib.suppress(OSError):
                if any(os.scandir(p)):
                    hexes.add(p.name[: -len(".users")])
    return hexes, manifests


def _tagged(store: ImageStore) -> tuple[set[str], set[str]]:
    manifests = {d for _, _, d in store.tags()}
    layers: set[str] = set()
    for d in manifests:
        with contextlib.suppress(Exception):
            layers.update(x[7:] for x in store.manifest(d).get("layers", []))
    return manifests, layers


def collect_garbage(store: ImageStore, paths: Paths | None = None, *, grace_s: float = DEFAULT_GRACE_S,
                    dry_run: bool = False, lease_max_age_s: float | None = -1.0,
                    now: float | None = None) -> GcReport:
    """Remove what nothing references (see module docs); `dry_run` only reports. Other nodes' leases
    count while younger than `lease_max_age_s` (default: the lease TTL setting; None: forever)."""
    if lease_max_age_s is not None and lease_max_age_s < 0:
        lease_max_age_s = leases.ttl_s()
    if paths is not None and not dry_run:
        from shoal.images.mounts import LayerMounts

        # this node's own leases are fresh before anyone (this gc included) judges ages
        with contextlib.suppress(Exception):
            LayerMounts(paths).renew_leases()
    # lease ages in the store's clock; everything else (grace periods) in this host's
    lease_now = leases.store_now(store.root) if now is None else now
    now = time.time() if now is None else now
    report = GcReport(dry_run=dry_run)
    cutoff = now - grace_s
    tagged_m, tagged_l = _tagged(store)
    local_l, local_m = _local_users(paths)
    mounted = _mounted_layer_files(store)
    leased = _leased(store, mounted, dry_run, lease_max_age_s, lease_now, report)

    # manifests: keep tagged, young, or used by a local sandbox; the rest go
    keep_m = set(tagged_m) | local_m
    for d in store.list_manifests():
        mp = store.manifests_dir / f"{d[7:]}.json"
        if d in keep_m:
            continue
        try:
            young = mp.stat().st_mtime >= cutoff
        except FileNotFoundError:
            continue
        if young:
            keep_m.add(d)
            continue
        report.removed_manifests.append(d)
    for d in keep_m - tagged_m:
        with contextlib.suppress(Exception):
            # an image version a local sandbox runs on: its layers are in use; a young one: referenced
            (local_l if d in local_m else tagged_l).update(x[7:] for x in store.manifest(d).get("layers", []))

    in_use = local_l | mounted | leased
    candidates = []
    all_hexes = {p.stem for p in store.layers_dir.glob("*.json") if len(p.stem) == 64}
    all_hexes.update(store.chunks.list_hexes())
    for h in sorted(all_hexes):
        if h in tagged_l:
            report.kept_referenced += 1
        elif h in in_use:
            report.kept_in_use.append("sha256:" + h)
        elif store.layer_last_used("sha256:" + h) >= cutoff:
            report.kept_young.append("sha256:" + h)
        else:
            candidates.append(h)

    if not dry_run:
        for d in report.removed_manifests:
            store.remove_manifest(d)
    # a build may have tagged one of them meanwhile: look again right before deleting
    _, tagged_again = _tagged(store)
    for h in candidates:
        if h in tagged_again or h in _mounted_layer_files(store) or \
                store.layer_last_used("sha256:" + h) >= cutoff:
            continue
        with contextlib.suppress(OSError):
            report.freed_bytes += (store.layers_dir / f"{h}.erofs").stat().st_size
        report.removed_layers.append("sha256:" + h)
        if not dry_run:
            store.remove_layer("sha256:" + h)

    _sweep_chunks(store, cutoff, set(report.removed_layers) if dry_run else set(), dry_run, report)

    removed = set(report.removed_layers)
    for kind in _CACHE_KINDS:
        for key, entry in store.cache_entries(kind):
            lay = (entry or {}).get("layer")
            gone = entry is None or (isinstance(lay, str) and (lay in removed or not store.has_layer(lay)))
            if gone:
                report.removed_cache_entries += 1
                if not dry_run:
                    store.cache_remove(kind, key)

    # build claims (shoal.images.claims) left by builders that died long ago
    steps_dir = store.cache_dir / "steps"
    if steps_dir.is_dir():
        for p in steps_dir.glob("*.claim"):
            if _older_than(p, cutoff):
                report.removed_tmp += 1
                if not dry_run:
                    with contextlib.suppress(OSError):
                        p.unlink()

    # orphans of chunked layers: a table without its record (a writer died between the two), a conversion
    # claim of a converter that died, start records and corrupt marks of layers that are gone
    for p in (store.chunks.layers_dir.iterdir() if store.chunks.layers_dir.is_dir() else []):
        if p.name.endswith((".table", ".converting")) or p.name.startswith(".tmp-"):
            h = p.name.split(".", 1)[0]
            if p.name.endswith(".table") and store.chunks.has(h):
                continue
            if _older_than(p, cutoff):
                report.removed_orphans += 1
                if not dry_run:
                    with contextlib.suppress(OSError):
                        p.unlink()
    present = None if dry_run else {lay.hex for lay in store.list_layers()}
    for sub in ("prefetch", "corrupt"):
        sub_dir = store.root / sub
        if present is None or not sub_dir.is_dir():
            continue
        for p in sub_dir.iterdir():
            h = p.name.split(".", 1)[0]
            if len(h) == 64 and h not in present and _older_than(p, cutoff):
                report.removed_orphans += 1
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        p.unlink()

    # orphans: data without metadata (a writer crashed between the two) and metadata without data
    for p in store.layers_dir.iterdir():
        name = p.name
        if name.endswith(".erofs"):
            other = p.with_suffix(".json")
        elif name.endswith(".json"):
            other = p.with_suffix(".erofs")
        elif name.startswith(".tmp-"):
            other = None
        else:
            continue
        try:
            old = p.stat().st_mtime < cutoff
        except FileNotFoundError:
            continue
        if old and (other is None or not other.exists()):
            report.removed_orphans += 1
            if not dry_run:
                with contextlib.suppress(OSError):
                    p.unlink()

    for p in store.tmp_dir.iterdir():
        if not _older_than(p, cutoff):
            continue
        report.removed_tmp += 1
        if not dry_run:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    p.unlink()
    return report


def _sweep_chunks(store: ImageStore, cutoff: float, also_gone: set[str], dry_run: bool, report: GcReport) -> None:
    """Remove chunk objects no remaining layer's table names, unless written or re-used after `cutoff`.
    `also_gone`: layers a dry run would have removed (their tables do not count)."""
    named: set[str] = set()
    for h in store.chunks.list_hexes():
        if f"sha256:{h}" in also_gone:
            continue
        try:
            t = store.chunks.table(h)
        except Exception:
            # a table that cannot be read names chunks we cannot know: keep every chunk this round
            with contextlib.suppress(OSError):
                if store.chunks.table_path(h).exists():
                    return
            continue
        named.update(x for x, _ in t.chunks)
    for hexd, path in store.chunks.iter_chunk_files():
        if hexd in named:
            continue
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        if st.st_mtime >= cutoff:
            continue
        report.removed_chunks += 1
        report.freed_bytes += st.st_size
        if not dry_run:
            with contextlib.suppress(OSError):
                path.unlink()


def _older_than(p: Path, cutoff: float) -> bool:
    """True when nothing in `p` (a file or a whole tree: an import in progress) changed since `cutoff`."""
    try:
        if p.lstat().st_mtime >= cutoff:
            return False
    except FileNotFoundError:
        return False
    if p.is_dir() and not p.is_symlink():
        for dirpath, dirnames, filenames in os.walk(p):
            for n in dirnames + filenames:
                with contextlib.suppress(OSError):
                    if os.lstat(os.path.join(dirpath, n)).st_mtime >= cutoff:
                        return False
    return True
