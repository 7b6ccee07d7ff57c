"""Get an Image for any reference: from the store, or pulled from its registry — the one entry point.

    from shoal.images.pull import ensure_image
    img = await ensure_image(store, "python:3.12-slim")              # pull_policy from the settings
    img = await ensure_image(store, "ghcr.io/org/env:1", policy="never")   # store only: ImageNotFound
    rep = pull_image(store, "python:3.12-slim", progress=print)      # an explicit pull (blocking)

Every place that turns a user's image reference into an Image (a create, a Dockerfile FROM, a recipe's
base, E2B templates, Harbor's docker_image) calls `ensure_image`; `resolve_local` is the store-only
lookup that also knows registry digests (`python@sha256:<the registry's digest>`).

**pull_policy** (setting, or per call): `missing` (default) pulls a reference not in the store; `never`
only looks in the store; `always` asks the registry every time whether an image that came from a
registry changed (a digest check: no layer moves when it did not). Images made in shoal — built,
imported, snapshotted, composed — are never replaced by a pull, and a digest reference never needs a
check (its content cannot change). A name that is not a registry reference (`Reference.local_only`)
is never pulled.

**Once per image**: concurrent calls for one reference in a process share one pull (a burst of 1,000
creates pulls once), and node agents sharing a store take the pull claim `cache/pulls/<key>.claim`
(shoal.images.claims): one node pulls, the others wait for it and then use its result.

**A pull** fetches the manifest (a manifest list or OCI index picks this host's platform), the config,
then the layers the store does not have by diff id — in parallel (`pull_concurrency`), each streamed from
the registry through its blob digest check and decompression (gzip, zstd or none) into the strict
unpacker (shoal.images.unpack), packed as an EROFS layer; a broken download resumes (HTTP Range). The
image is tagged `name:tag`, or `name:sha256-<hex>` when pulled by digest (the registry digests are kept
so `name@sha256:<hex>` resolves later without the registry).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import (
    BackendUnavailable,
    ImageBuildError,
    ImageNotFound,
    InvalidRequest,
    RegistryAuthFailed,
    RegistryUnavailable,
    Timeout,
)
from shoal.images.claims import CLAIM_TTL_S, Claim, break_stale
from shoal.images.claims import age_s as claim_age_s
from shoal.images.reference import Reference, parse_reference
from shoal.images.store import MAX_LAYERS, Image, ImageStore

#: cache kind: a registry manifest (or index) digest -> the store manifest it became
REGISTRY_DIGESTS = "registry-digests"
#: where pull claims live under the store's cache directory
PULL_CLAIMS = "pulls"
POLICIES = ("missing", "always", "never")


@dataclass
class PullEvent:
    """Progress of a pull, for a progress bar or a log. `kind`: resolved, waiting, layer-cached,
    layer-start, layer-bytes, layer-done, done."""

    kind: str
    reference: str
    layer: int | None = None       # 0-based index, bottom first
    layers: int | None = None
    digest: str | None = None      # the layer's blob digest
    size: int | None = None        # the blob's size (compressed)
    bytes: int = 0                 # layer-bytes: how many arrived since the last event
    message: str = ""


ProgressFn = Callable[[PullEvent], None]


@dataclass
class PullReport:
    """What a pull did."""

    image: Image
    reference: str                       # canonical, as asked
    manifest_digest: str = ""            # the registry's digest of the platform manifest
    index_digest: str | None = None
    layers_fetched: int = 0
    layers_cached: int = 0               # already in the store (same diff id): not fetched
    bytes_fetched: int = 0               # bytes received from the registry (compressed)
    resumes: int = 0                     # broken downloads resumed
    seconds: float = 0.0
    up_to_date: bool = False             # policy always: the registry still serves what the store has
    waited: bool = False                 # another node (or call) pulled it; this one waited
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        d = {k: getattr(self, k) for k in ("reference", "manifest_digest", "index_digest", "layers_fetched",
                                          "layers_cached", "bytes_fetched", "resumes", "seconds", "up_to_date",
                                          "waited", "notes")}
        d["image"] = self.image.to_dict()
        return d


def check_policy(policy: str) -> str:
    """`policy` if it is one of missing/always/never, else InvalidRequest."""
    if policy not in POLICIES:
        raise InvalidRequest(f"pull_policy {policy!r} must be one of {', '.join(POLICIES)}")
    return policy


def _settings(s: Any) -> Any:
    if s is not None:
        return s
    from shoal.config import settings

    return settings()


def _ref(ref: str | Reference) -> Reference:
    return ref if isinstance(ref, Reference) else parse_reference(ref)


# ---- the store side ---------------------------------------------------------------------------------
def resolve_local(store: ImageStore, ref: str | Reference) -> Image | None:
    """The image `ref` names if the store has it (no registry is asked), else None.
    `name@sha256:<hex>` is a store manifest digest, or a registry digest of an image pulled before."""
    r = _ref(ref)
    if not r.digest:
        try:
            return store.resolve(r.store_ref)
        except ImageNotFound:
            return None
    with contextlib.suppress(ImageNotFound):
        return store.resolve(f"{r.name}@{r.digest}")
    hit = store.cache_get(REGISTRY_DIGESTS, r.digest[7:])
    if hit and isinstance(hit.get("manifest"), str):
        with contextlib.suppress(ImageNotFound, InvalidRequest):
            return store.resolve(f"{r.name}@{hit['manifest']}")
    with contextlib.suppress(ImageNotFound):
        return store.resolve(f"{r.name}:{r.digest_tag}")
    return None


def from_registry(img: Image) -> bool:
    """True when the image came from a registry pull (`always` re-checks only those)."""
    return bool(img.lineage.get("pulled"))


def _not_found(r: Reference, store: ImageStore, why: str) -> ImageNotFound:
    hint = ("run `shoal image build base`" if r.name == "base" and not r.digest else
            f"`shoal image pull {r.familiar}`, or see `shoal image ls`")
    return ImageNotFound(f"image {r.familiar} not found in the store at {store.root} ({why}): {hint}",
                         reference=r.familiar)


# ---- ensure: the entry point ----------------------------------------------------------------------
_inflight: dict[tuple[int, str, str], asyncio.Future[Image]] = {}
_tasks: set[asyncio.Task[None]] = set()
_sync_locks: dict[tuple[str, str], threading.Lock] = {}
_sync_locks_guard = threading.Lock()


def _decide(store: ImageStore, r: Reference, policy: str) -> tuple[Image | None, bool]:
    """(the local image, whether to ask the registry)."""
    img = resolve_local(store, r)
    if img is not None:
        return img, policy == "always" and from_registry(img) and not r.digest
    if policy == "never":
        raise _not_found(r, store, "pull_policy is never")
    if r.local_only:
        raise _not_found(r, store, "it is a shoal name outside Docker's grammar, so it is never pulled")
    return None, True


def check_available(store: ImageStore, ref: str | Reference, *, policy: str | None = None,
                    settings: Any = None) -> None:
    """Raise ImageNotFound (or InvalidRequest) unless `ref` is in the store or would be pulled — what a
    gateway checks before spreading a burst over nodes that will pull it themselves."""
    _decide(store, _ref(ref), check_policy(policy or _settings(settings).pull_policy))


async def ensure_image(store: ImageStore, ref: str | Reference, *, policy: str | None = None, settings: Any = None,
                       progress: ProgressFn | None = None, work_dir: Path | None = None) -> Image:
    """The Image `ref` names: from the store, or pulled per `policy` (default: the `pull_policy` setting).
    Concurrent calls for one reference share one pull. Raises ImageNotFound, RegistryAuthFailed,
    RegistryUnavailable or InvalidRequest (a bad reference) — never anything untyped."""
    s = _settings(settings)
    r = _ref(ref)
    pol = check_policy(policy or s.pull_policy)
    img, ask = await asyncio.to_thread(_decide, store, r, pol)
    if not ask:
        assert img is not None
        return img
    loop = asyncio.get_running_loop()
    key = (id(loop), str(store.root), f"{r.canonical}|{pol}")
    fut = _inflight.get(key)
    if fut is None:
        fut = loop.create_future()
        _inflight[key] = fut

        async def run() -> None:
            try:
                rep = await asyncio.to_thread(pull_image, store, r, settings=s, progress=progress, work_dir=work_dir,
                                              previous=img, if_missing=img is None)
                fut.set_result(rep.image)
            except BaseException as e:
                fut.set_exception(e)
            finally:
                _inflight.pop(key, None)

        # nobody may be left to await it (every caller cancelled): mark its error as seen
        fut.add_done_callback(lambda f: None if f.cancelled() else f.exception())
        task = loop.create_task(run(), name=f"shoal-pull {r.familiar}")
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)
    # shield: a caller that is cancelled (its create timed out) does not cancel the others' pull
    return await asyncio.shield(fut)


def ensure_image_sync(store: ImageStore, ref: str | Reference, *, policy: str | None = None, settings: Any = None,
                      progress: ProgressFn | None = None, work_dir: Path | None = None) -> Image:
    """`ensure_image` for blocking code (CLI, threads): concurrent callers in this process pull once."""
    s = _settings(settings)
    r = _ref(ref)
    pol = check_policy(policy or s.pull_policy)
    img, ask = _decide(store, r, pol)
    if not ask:
        assert img is not None
        return img
    key = (str(store.root), f"{r.canonical}|{pol}")
    with _sync_locks_guard:
        lock = _sync_locks.setdefault(key, threading.Lock())
    if not lock.acquire(blocking=False):
        with lock:  # someone in this process is pulling it: wait, then use what they pulled
            pass
        got = resolve_local(store, r)
        if got is not None:
            return got
        lock.acquire()
    try:
        return pull_image(store, r, settings=s, progress=progress, work_dir=work_dir, previous=img,
                          if_missing=img is None).image
    finally:
        lock.release()


# ---- the pull, once per store ---------------------------------------------------------------------
def claim_path(store: ImageStore, r: Reference) -> Path:
    """The pull claim of a reference in a (shared) store."""
    return store.cache_dir / PULL_CLAIMS / (hashlib.sha256(r.canonical.encode()).hexdigest() + ".claim")


def pull_image(store: ImageStore, ref: str | Reference, *, settings: Any = None, progress: ProgressFn | None = None,
               work_dir: Path | None = None, previous: Image | None = None, timeout_s: float | None = None,
               client: Any = None, if_missing: bool = False) -> PullReport:
    """Pull `ref` into the store now (blocking), once across every node sharing the store: the node holding
    the pull claim pulls, the others wait for it (up to `pull_timeout_s`) and report `waited`.

    Like `docker pull`, an image of that reference pulled before is checked against the registry (one
    manifest request; nothing moves when it did not change). `previous`: the image a caller under policy
    `always` saw (another node's fresh pull of it counts). `if_missing`: only pull when the store still
    lacks the reference once the claim is held (what a create under policy `missing` wants)."""
    s = _settings(settings)
    r = _ref(ref)
    if r.local_only:
        raise InvalidRequest(f"{r.familiar} is a shoal name outside Docker's grammar: it cannot be pulled")
    _require_root()
    path = claim_path(store, r)
    deadline = time.monotonic() + (timeout_s or s.pull_timeout_s)
    waited = False
    poll = 0.05
    t0 = time.monotonic()
    while True:
        claim = Claim.try_take(path)
        if claim is not None:
            claim.start_heartbeat_thread()
            try:
                local = resolve_local(store, r)
                if local is not None and (waited or if_missing) and (
                        previous is None or local.digest != previous.digest or waited):
                    # someone pulled it while this call waited (or since it last looked): use theirs
                    return PullReport(image=local, reference=r.canonical, waited=True,
                                      seconds=time.monotonic() - t0)
                if previous is None and local is not None and from_registry(local):
                    previous = local
                return _pull(store, r, s, progress, work_dir, previous, client)
            finally:
                claim.release_sync()
        if not waited and progress is not None:
            progress(PullEvent("waiting", r.familiar, message="another node is pulling it"))
        waited = True
        age = claim_age_s(path)
        # only a claim that looks dead is broken: breaking moves it aside for a moment, and a waiter that
        # looked then would take the claim of a live puller
        if age is not None and age > CLAIM_TTL_S and break_stale(path, CLAIM_TTL_S):
            continue
        if age is None:
            got = resolve_local(store, r)
            if got is not None:
                return PullReport(image=got, reference=r.canonical, waited=True, seconds=time.monotonic() - t0)
            continue  # the puller failed: try ourselves (and meet its error)
        if time.monotonic() > deadline:
            raise Timeout(f"waited {timeout_s or s.pull_timeout_s:.0f}s for another node to pull {r.familiar} "
                          f"(its claim {path} is still renewed)")
        time.sleep(poll)
        poll = min(poll * 1.5, 1.0)


def _require_root() -> None:
    import os

    if os.geteuid() != 0:
        raise BackendUnavailable("pulling images needs root (owners, device nodes and overlayfs whiteouts "
                                 "must be kept)")


def _pull(store: ImageStore, r: Reference, s: Any, progress: ProgressFn | None, work_dir: Path | None,
          previous: Image | None, client: Any) -> PullReport:
    from shoal.images.oci import host_arch, image_config_from_oci
    from shoal.images.registry import RegistryClient

    t0 = time.monotonic()
    emit = progress or (lambda ev: None)
    own = client is None
    rc = client or RegistryClient.from_settings(s)
    try:
        m = rc.manifest(r)
        if previous is not None and previous.lineage.get("manifest_digest") == m.digest:
            return PullReport(image=previous, reference=r.canonical, manifest_digest=m.digest,
                              index_digest=m.index_digest, up_to_date=True, bytes_fetched=rc.bytes_received,
                              seconds=time.monotonic() - t0)
        if not m.config_digest:
            raise RegistryUnavailable(f"the manifest of {r.canonical} names no config blob")
        config = json.loads(rc.blob_bytes(m, m.config_digest, "the image config"))
        if not isinstance(config, dict):
            raise RegistryUnavailable(f"the image config of {r.canonical} is not a JSON object")
        descs = m.layers
        diff_ids = (config.get("rootfs") or {}).get("diff_ids")
        if not isinstance(diff_ids, list) or len(diff_ids) != len(descs) or not all(
                isinstance(d, str) for d in diff_ids):
            raise RegistryUnavailable(f"the image config of {r.canonical} lists "
                                      f"{len(diff_ids) if isinstance(diff_ids, list) else 'no'} diff_ids for "
                                      f"{len(descs)} layers")
        if not descs:
            raise ImageNotFound(f"{r.canonical} has no layers")
        if len(descs) > MAX_LAYERS:
            raise InvalidRequest(f"{r.canonical} has {len(descs)} layers; shoal stacks at most {MAX_LAYERS} "
                                 "(overlayfs' limit): squash it (e.g. `docker build --squash`, or a multi-stage "
                                 "build copying into one layer) and push it again")
        notes = []
        arch = config.get("architecture")
        if arch and arch != host_arch():
            notes.append(f"image architecture {arch} differs from this host's ({host_arch()})")
        rep = PullReport(image=None, reference=r.canonical, manifest_digest=m.digest,  # type: ignore[arg-type]
                         index_digest=m.index_digest, notes=notes)
        emit(PullEvent("resolved", r.familiar, layers=len(descs), digest=m.digest,
                       size=sum(int(d.get("size") or 0) for d in descs)))
        base = Path(work_dir) if work_dir else store.tmp_dir
        base.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-pull-", dir=base))
        try:
            digests: list[str | None] = [None] * len(descs)
            todo = []
            for i, (desc, diff) in enumerate(zip(descs, diff_ids, strict=True)):
                hit = _cached_layer(store, diff)
                if hit is not None:
                    digests[i] = hit
                    rep.layers_cached += 1
                    emit(PullEvent("layer-cached", r.familiar, layer=i, layers=len(descs),
                                   digest=str(desc.get("digest")), size=int(desc.get("size") or 0)))
                else:
                    todo.append(i)
            lock = threading.Lock()

            def one(i: int) -> str:
                d, fetched, resumes = _fetch_layer(store, rc, m, i, len(descs), descs[i], diff_ids[i], tmp, emit)
                with lock:
                    rep.resumes += resumes
                    if fetched:
                        rep.layers_fetched += 1
                    else:
                        rep.layers_cached += 1
                return d

            if todo:
                with ThreadPoolExecutor(max_workers=min(s.pull_concurrency, len(todo)),
                                        thread_name_prefix="shoal-pull") as pool:
                    futs = {i: pool.submit(one, i) for i in todo}
                    errors: list[BaseException] = []
                    for i, f in futs.items():
                        try:
                            digests[i] = f.result()
                        except BaseException as e:
                            errors.append(e)
                            for other in futs.values():  # layers not started yet: no point any more
                                other.cancel()
                    errors = [e for e in errors if not isinstance(e, CancelledError)] or errors
                    if errors:
                        raise _first(errors)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        lineage = {"pulled": r.canonical, "registry": r.registry, "repository": r.repository,
                   "manifest_digest": m.digest, "index_digest": m.index_digest, "media_type": m.media_type,
                   "architecture": arch or "", "os": config.get("os", ""), "format": "registry",
                   "oci_config": config.get("config") if isinstance(config.get("config"), dict) else {}}
        tag_ref = f"{r.name}:{r.digest_tag}" if r.digest else f"{r.name}:{r.tag}"
        img = store.put_image(tag_ref, [d for d in digests if d], image_config_from_oci(config), lineage=lineage)
        for d in (m.digest, m.index_digest):
            if d:
                store.cache_put(REGISTRY_DIGESTS, d[7:], {"manifest": img.digest, "reference": r.canonical_name,
                                                          "created": time.time()})
        rep.image = img
        rep.bytes_fetched = rc.bytes_received
        rep.seconds = time.monotonic() - t0
        emit(PullEvent("done", r.familiar, layers=len(descs), digest=img.digest,
                       message=f"{rep.layers_fetched} fetched, {rep.layers_cached} already in the store"))
        return rep
    finally:
        if own:
            rc.close()


def _first(errors: list[BaseException]) -> BaseException:
    """The most telling of the layers' errors (a typed one before anything else)."""
    typed = (ImageNotFound, RegistryAuthFailed, RegistryUnavailable, InvalidRequest, ImageBuildError)
    return next((e for e in errors if isinstance(e, typed)), errors[0])


_diff_locks: dict[str, threading.Lock] = {}
_diff_locks_guard = threading.Lock()


def _cached_layer(store: ImageStore, diff_id: str) -> str | None:
    """The store layer made from an OCI layer with this diff id, if it is still there."""
    from shoal.images.oci import DIFFID_CACHE

    if not (diff_id.startswith("sha256:") and len(diff_id) == 71):
        return None
    hit = store.cache_get(DIFFID_CACHE, diff_id[7:])
    if hit and isinstance(hit.get("layer"), str):
        with contextlib.suppress(InvalidRequest):
            if store.has_layer(hit["layer"]):
                store.touch_layer(hit["layer"])
                return str(hit["layer"])
    return None


def _check_blob(raw: Any, digest: str, label: str, m: Any) -> None:
    """After a layer failed to unpack: read the rest of its blob and, when the bytes do not hash to the
    manifest's digest, say so (the registry or the network corrupted it) rather than blame the image."""
    with contextlib.suppress(Exception):
        raw.drain()
    if raw.digest() != digest:
        raise RegistryUnavailable(f"{label} of {m.reference.canonical} is corrupt: the blob hashes to "
                                  f"{raw.digest()}, the manifest says {digest}")


def _fetch_layer(store: ImageStore, rc: Any, m: Any, i: int, n: int, desc: dict[str, Any], diff_id: str, tmp: Path,
                 emit: ProgressFn) -> tuple[str, bool, int]:
    """Fetch, check, unpack and store one layer; (layer digest, fetched?, resumes). Layers with one diff id
    are fetched once per process even by concurrent pulls of different images."""
    from shoal.images.oci import DIFFID_CACHE, ImageImportError, _decompressed, _HashReader
    from shoal.images.unpack import LayerTarError, unpack_layer

    with _diff_locks_guard:
        lock = _diff_locks.setdefault(diff_id, threading.Lock())
    with lock:
        hit = _cached_layer(store, diff_id)
        if hit is not None:
            return hit, False, 0
        digest = str(desc.get("digest") or "")
        size = int(desc.get("size") or 0) or None
        mt = str(desc.get("mediaType") or "")
        label = f"layer {i + 1}/{n} ({digest[:19]})"
        if not digest.startswith("sha256:") or len(digest) != 71:
            raise RegistryUnavailable(f"{label} of {m.reference.canonical} has an unsupported digest {digest!r}")
        if "encrypted" in mt:
            raise InvalidRequest(f"{label} of {m.reference.canonical} is encrypted ({mt}): not supported")
        emit(PullEvent("layer-start", m.reference.familiar, layer=i, layers=n, digest=digest, size=size))
        tree = tmp / f"layer{i}"
        tree.mkdir()

        def on_bytes(k: int) -> None:
            emit(PullEvent("layer-bytes", m.reference.familiar, layer=i, layers=n, digest=digest, size=size, bytes=k))

        try:
            reader = rc.blob(m, digest, label, size=size, on_bytes=on_bytes)
            raw = _HashReader(reader)
            try:
                plain = _HashReader(_decompressed(raw))  # type: ignore[arg-type]
                stats = unpack_layer(plain, tree)  # type: ignore[arg-type]
                plain.drain()
                raw.drain()
            except (ImageNotFound, RegistryAuthFailed, RegistryUnavailable, InvalidRequest, BackendUnavailable) as e:
                if isinstance(e, LayerTarError):
                    _check_blob(raw, digest, label, m)  # corrupt in transit, or a malformed image?
                    raise ImageImportError(f"cannot pull {m.reference.familiar}: {label}: {e.message}") from None
                raise
            except OSError as e:
                if not isinstance(e, gzip.BadGzipFile):
                    raise ImageBuildError(f"pulling {label} of {m.reference.familiar} failed on this host: {e}") \
                        from None
                _check_blob(raw, digest, label, m)
                raise ImageImportError(f"{label} of {m.reference.canonical} is not valid gzip: {e}") from None
            except Exception as e:  # tarfile.TarError, EOFError, zlib.error, zstandard.ZstdError
                _check_blob(raw, digest, label, m)
                raise ImageImportError(f"{label} of {m.reference.canonical} does not decompress: "
                                       f"{type(e).__name__}: {e}") from None
            finally:
                reader.close()
            if raw.digest() != digest:
                raise RegistryUnavailable(f"{label} of {m.reference.canonical} is corrupt: the blob hashes to "
                                          f"{raw.digest()}, the manifest says {digest}")
            if plain.digest() != diff_id:
                raise RegistryUnavailable(f"{label} of {m.reference.canonical} is corrupt: its content hashes to "
                                          f"{plain.digest()}, the image config says {diff_id}")
            layer = store.add_layer_from_dir(tree, source={"type": "oci-layer", "diff_id": diff_id, "blob": digest,
                                                           "files": stats.files, "bytes": stats.bytes})
            store.cache_put(DIFFID_CACHE, diff_id[7:], {"layer": layer.digest, "diff_id": diff_id,
                                                         "created": time.time()})
            emit(PullEvent("layer-done", m.reference.familiar, layer=i, layers=n, digest=digest, size=size,
                           message=f"{stats.entries} entries -> {layer.digest[:19]}"))
            return layer.digest, True, reader.resumes
        finally:
            shutil.rmtree(tree, ignore_errors=True)
