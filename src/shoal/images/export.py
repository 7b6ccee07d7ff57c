"""Images back out: a docker-archive `docker load` accepts, and a push to a registry.

    export_image(store, "task-17:step3", "x.tar")            # shoal image export task-17:step3 -o x.tar
    push_image(store, "task-17:step3", "localhost:5000/rl/task-17:step3")   # shoal image push NAME REF

Each EROFS layer is mounted read-only (through the node's LayerMounts, so a layer a sandbox already uses
is not mounted twice) and written as an OCI layer tar: overlayfs whiteouts (0/0 character devices) become
`.wh.<name>` files, opaque directories (`trusted.overlay.opaque=y`) a `.wh..wh..opq` entry, and owners,
modes (setuid too), mtimes, symlinks, hard links, device nodes, FIFOs and xattrs (but overlayfs'
bookkeeping ones) are kept. Entries are sorted, so a layer always becomes the same tar (the same diff id)
and, gzipped without a timestamp, the same blob: a second push of an image, or of another image sharing a
layer, uploads only what the registry lacks (`cache/export-layers/` remembers each layer's digests).

The image config carries Env, WorkingDir, User, Entrypoint, Cmd and what a Dockerfile keeps besides
(Labels, ExposedPorts, Volumes, Healthcheck, StopSignal, Shell, OnBuild).
"""

from __future__ import annotations

import contextlib
import datetime
import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import tarfile
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from shoal.errors import BackendUnavailable, InvalidRequest, RegistryUnavailable
from shoal.images.store import Image, ImageStore, Layer

#: cache kind: store layer hex -> {diff_id, size} of its tar and {blob, blob_size} of its gzip
EXPORT_CACHE = "export-layers"
MT_DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
MT_DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
MT_DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"
_OVERLAY_XATTRS = ("trusted.overlay.", "user.overlay.")
_CHUNK = 1 << 20


@dataclass
class ExportReport:
    """What an export or push did."""

    image: str
    layers: int
    bytes: int = 0                          # the archive's size, or bytes uploaded
    seconds: float = 0.0
    layers_uploaded: int = 0
    layers_present: int = 0                 # already in the registry: not uploaded
    manifest_digest: str = ""
    target: str = ""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {k: getattr(self, k) for k in ("image", "layers", "bytes", "seconds", "layers_uploaded",
                                              "layers_present", "manifest_digest", "target", "notes")}


# ---- layer -> tar ---------------------------------------------------------------------------------
def write_layer_tar(root: Path, out: IO[bytes]) -> None:
    """Write the tree of a mounted EROFS layer at `root` to `out` as an OCI layer tar (see the module doc)."""
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tf:
        links: dict[tuple[int, int], str] = {}
        if _opaque(str(root)):
            tf.addfile(_marker(".wh..wh..opq", os.lstat(root)))
        _walk(tf, str(root), "", links)


def _opaque(path: str) -> bool:
    for attr in ("trusted.overlay.opaque", "user.overlay.opaque"):
        with contextlib.suppress(OSError):
            if os.getxattr(path, attr, follow_symlinks=False) == b"y":
                return True
    return False


def _marker(name: str, st: os.stat_result) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = 0
    ti.mode = 0o644
    ti.mtime = int(st.st_mtime)
    return ti


def _xattrs(path: str) -> dict[str, str]:
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for name in sorted(os.listxattr(path, follow_symlinks=False)):
            if name.startswith(_OVERLAY_XATTRS):
                continue
            with contextlib.suppress(OSError):
                out["SCHILY.xattr." + name] = os.getxattr(path, name, follow_symlinks=False).decode(
                    "utf-8", "surrogateescape")
    return out


def _walk(tf: tarfile.TarFile, root: str, rel: str, links: dict[tuple[int, int], str]) -> None:
    base = os.path.join(root, rel) if rel else root
    with os.scandir(base) as it:
        names = sorted(e.name for e in it)
    for name in names:
        path = os.path.join(base, name)
        arc = f"{rel}/{name}" if rel else name
        st = os.lstat(path)
        mode = st.st_mode
        if stat.S_ISCHR(mode) and st.st_rdev == 0:
            parent = f"{rel}/" if rel else ""
            tf.addfile(_marker(f"{parent}.wh.{name}", st))  # an overlayfs whiteout: deleted below
            continue
        ti = tarfile.TarInfo(arc)
        ti.uid, ti.gid = st.st_uid, st.st_gid
        ti.uname = ti.gname = ""
        ti.mode = stat.S_IMODE(mode)
        ti.mtime = st.st_mtime if st.st_mtime != int(st.st_mtime) else int(st.st_mtime)
        xattrs = _xattrs(path)
        if xattrs:
            ti.pax_headers = xattrs
        if stat.S_ISDIR(mode):
            ti.type = tarfile.DIRTYPE
            tf.addfile(ti)
            if _opaque(path):
                tf.addfile(_marker(f"{arc}/.wh..wh..opq", st))
            _walk(tf, root, arc, links)
        elif stat.S_ISREG(mode):
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and key in links:
                ti.type = tarfile.LNKTYPE
                ti.linkname = links[key]
                tf.addfile(ti)
                continue
            if st.st_nlink > 1:
                links[key] = arc
            ti.size = st.st_size
            with open(path, "rb") as f:
                tf.addfile(ti, f)
        elif stat.S_ISLNK(mode):
            ti.type = tarfile.SYMTYPE
            ti.linkname = os.readlink(path)
            tf.addfile(ti)
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            ti.type = tarfile.CHRTYPE if stat.S_ISCHR(mode) else tarfile.BLKTYPE
            ti.devmajor, ti.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
            tf.addfile(ti)
        elif stat.S_ISFIFO(mode):
            ti.type = tarfile.FIFOTYPE
            tf.addfile(ti)
        # sockets cannot be in a tar (Docker drops them too)


class _Tee(io.RawIOBase):
    """A write-only file that hashes and counts what passes to `out` (which may be None)."""

    def __init__(self, out: IO[bytes] | None) -> None:
        self.out = out
        self.h = hashlib.sha256()
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        self.h.update(data)
        self.n += len(data)
        if self.out is not None:
            self.out.write(data)
        return len(data)

    def digest(self) -> str:
        return "sha256:" + self.h.hexdigest()


# ---- mounting ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def mounted(store: ImageStore, layers: list[Layer], paths: Any = None) -> Iterator[list[Path]]:
    """Mount the layers of `store` read-only for the duration of the block, through the layer reader of this
    SHOAL_HOME for that store (shared with sandboxes that use them)."""
    if os.geteuid() != 0:
        raise BackendUnavailable("exporting images needs root (the layers are mounted to be read)")
    from shoal.config import Paths
    from shoal.images.mounts import LayerMounts

    lm = LayerMounts(paths or Paths.from_env(store=store.root))
    user = f"export-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    mps = lm.acquire(layers, user)
    try:
        yield mps
    finally:
        lm.release([lay.hex for lay in layers], user)


# ---- the image config -------------------------------------------------------------------------------
def docker_config(img: Image, diff_ids: list[str]) -> dict[str, Any]:
    """The Docker/OCI image config of a shoal image whose layers have these diff ids."""
    from shoal.images.oci import host_arch

    c = img.config
    cfg: dict[str, Any] = {
        "Env": [f"{k}={v}" for k, v in c.env.items()],
        "WorkingDir": "" if c.workdir in ("", "/") else c.workdir,
        "User": "" if c.user in ("", "root", "0", "0:0") else c.user,
        "Entrypoint": list(c.entrypoint) or None,
        "Cmd": list(c.cmd) or None,
    }
    if c.labels:
        cfg["Labels"] = dict(c.labels)
    if c.exposed_ports:
        cfg["ExposedPorts"] = {p: {} for p in c.exposed_ports}
    if c.volumes:
        cfg["Volumes"] = {v: {} for v in c.volumes}
    if c.healthcheck:
        cfg["Healthcheck"] = dict(c.healthcheck)
    if c.stop_signal:
        cfg["StopSignal"] = c.stop_signal
    if c.shell:
        cfg["Shell"] = list(c.shell)
    if c.onbuild:
        cfg["OnBuild"] = list(c.onbuild)
    created = datetime.datetime.fromtimestamp(img.created or time.time(), datetime.UTC)
    stamp = created.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    history = [{"created": stamp, "created_by": f"shoal layer {lay.digest[:19]} "
                                                f"({(lay.source or {}).get('type', 'layer')})"} for lay in img.layers]
    return {"architecture": img.lineage.get("architecture") or host_arch(), "os": "linux", "created": stamp,
            "config": cfg, "rootfs": {"type": "layers", "diff_ids": diff_ids}, "history": history}


# ---- export ------------------------------------------------------------------------------------------
def export_image(store: ImageStore, ref: str, out: Path | str | IO[bytes], *, repo_tags: list[str] | None = None,
                 work_dir: Path | None = None, log: Callable[[str], None] | None = None,
                 paths: Any = None) -> ExportReport:
    """Write image `ref` as a docker-archive (`docker save`'s format; `docker load -i` reads it) to `out`, a
    path or a binary file object (stdout). `repo_tags` default to the image's `name:tag`."""
    from shoal.images.pull import resolve_local
    from shoal.images.reference import parse_reference

    log = log or (lambda s: None)
    t0 = time.monotonic()
    img = resolve_local(store, ref)
    if img is None:
        raise _missing(store, ref)
    r = parse_reference(ref)
    tags = repo_tags if repo_tags is not None else ([f"{img.name}:{img.tag}"] if img.tag else
                                                    [f"{r.name}:{r.tag or 'latest'}"])
    base = Path(work_dir) if work_dir else store.tmp_dir
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-export-", dir=base))
    own = not hasattr(out, "write")
    part = Path(str(out) + f".part-{uuid.uuid4().hex[:8]}") if own else None
    try:
        f: IO[bytes] = open(part, "wb") if part is not None else out  # type: ignore[assignment]  # noqa: SIM115
        try:
            counted = _Tee(f)
            with tarfile.open(fileobj=counted, mode="w|", format=tarfile.PAX_FORMAT) as outer, \
                    mounted(store, img.layers, paths) as mps:
                diff_ids = []
                names = []
                for i, (lay, mp) in enumerate(zip(img.layers, mps, strict=True)):
                    log(f"layer {i + 1}/{len(img.layers)} {lay.digest[:19]}")
                    lt = tmp / "layer.tar"
                    with open(lt, "wb") as lf:
                        tee = _Tee(lf)
                        write_layer_tar(mp, tee)  # type: ignore[arg-type]
                    diff = tee.digest()
                    diff_ids.append(diff)
                    name = f"{diff[7:]}/layer.tar"
                    if name not in names:
                        _add_file(outer, name, lt)
                    names.append(name)
                    _remember(store, lay, diff_id=diff, size=tee.n)
                    lt.unlink()
                config = json.dumps(docker_config(img, diff_ids), sort_keys=True).encode()
                cfg_name = hashlib.sha256(config).hexdigest() + ".json"
                _add_bytes(outer, cfg_name, config)
                manifest = [{"Config": cfg_name, "RepoTags": tags, "Layers": names}]
                _add_bytes(outer, "manifest.json", json.dumps(manifest).encode())
            if part is not None:
                f.flush()
                os.fsync(f.fileno())
        finally:
            if part is not None:
                f.close()
        if part is not None:
            os.replace(part, Path(out))  # type: ignore[arg-type]
        return ExportReport(image=img.ref, layers=len(img.layers), bytes=counted.n, seconds=time.monotonic() - t0,
                            target=str(out) if own else "<stream>")
    finally:
        if part is not None:
            with contextlib.suppress(FileNotFoundError):
                part.unlink()
        shutil.rmtree(tmp, ignore_errors=True)


def _missing(store: ImageStore, ref: str) -> Exception:
    from shoal.errors import ImageNotFound

    return ImageNotFound(f"image {ref} not found in the store at {store.root}: see `shoal image ls`")


def _add_file(tf: tarfile.TarFile, name: str, path: Path) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = path.stat().st_size
    ti.mode = 0o644
    ti.mtime = 0
    with open(path, "rb") as f:
        tf.addfile(ti, f)


def _add_bytes(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    ti.mode = 0o644
    ti.mtime = 0
    tf.addfile(ti, io.BytesIO(data))


def _remember(store: ImageStore, lay: Layer, **kw: Any) -> None:
    with contextlib.suppress(OSError, InvalidRequest):
        entry = store.cache_get(EXPORT_CACHE, lay.hex) or {}
        entry.update(kw)
        store.cache_put(EXPORT_CACHE, lay.hex, entry)


# ---- push ----------------------------------------------------------------------------------------------
def push_image(store: ImageStore, ref: str, target: str, *, settings: Any = None, work_dir: Path | None = None,
               progress: Callable[[str], None] | None = None, paths: Any = None, client: Any = None) -> ExportReport:
    """Push image `ref` of the store to `target` (a reference like `localhost:5000/team/env:1` or
    `docker.io/user/env:1`) as a Docker v2 image with gzip layers. Blobs the registry already has are not
    uploaded (HEAD first); the registry itself is written to, never a mirror. Credentials and typed errors
    as for pulls (shoal.images.registry)."""
    from shoal.images.pull import resolve_local
    from shoal.images.reference import parse_reference
    from shoal.images.registry import RegistryClient

    log = progress or (lambda s: None)
    t0 = time.monotonic()
    tr = parse_reference(target)
    if tr.local_only:
        raise InvalidRequest(f"cannot push to {target!r}: not a registry reference (Docker's grammar)")
    if tr.digest:
        raise InvalidRequest(f"push to name:tag, not a digest ({target})")
    img = resolve_local(store, ref)
    if img is None:
        raise _missing(store, ref)
    if settings is None:
        from shoal.config import settings as _s

        settings = _s()
    own = client is None
    rc = client or RegistryClient.from_settings(settings)
    ep = rc.registry_endpoint(tr)
    rep = ExportReport(image=img.ref, layers=len(img.layers), target=tr.canonical)
    base = Path(work_dir) if work_dir else store.tmp_dir
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-push-", dir=base))
    scope = f"repository:{tr.repository}:pull,push"
    try:
        descs, diff_ids = [], []
        with mounted(store, img.layers, paths) as mps:
            for i, (lay, mp) in enumerate(zip(img.layers, mps, strict=True)):
                label = f"layer {i + 1}/{len(img.layers)} {lay.digest[:19]}"
                known = store.cache_get(EXPORT_CACHE, lay.hex) or {}
                if known.get("blob") and known.get("diff_id") and _blob_exists(rc, ep, tr, str(known["blob"]), scope):
                    rep.layers_present += 1
                    log(f"{label}: already in the registry")
                    descs.append({"mediaType": MT_DOCKER_LAYER, "digest": known["blob"],
                                  "size": int(known["blob_size"])})
                    diff_ids.append(str(known["diff_id"]))
                    continue
                blob = tmp / "layer.tar.gz"
                with open(blob, "wb") as bf:
                    ztee = _Tee(bf)
                    with gzip.GzipFile(fileobj=ztee, mode="wb", mtime=0, compresslevel=6) as gz:  # type: ignore[arg-type]
                        tee = _Tee(gz)  # type: ignore[arg-type]
                        write_layer_tar(mp, tee)  # type: ignore[arg-type]
                bdigest, bsize = ztee.digest(), ztee.n
                _remember(store, lay, diff_id=tee.digest(), size=tee.n, blob=bdigest, blob_size=bsize)
                diff_ids.append(tee.digest())
                descs.append({"mediaType": MT_DOCKER_LAYER, "digest": bdigest, "size": bsize})
                if _blob_exists(rc, ep, tr, bdigest, scope):
                    rep.layers_present += 1
                    log(f"{label}: already in the registry")
                else:
                    log(f"{label}: uploading {bsize} bytes")
                    _upload(rc, ep, tr, bdigest, blob, scope)
                    rep.layers_uploaded += 1
                    rep.bytes += bsize
                blob.unlink()
        config = json.dumps(docker_config(img, diff_ids), sort_keys=True).encode()
        cdigest = "sha256:" + hashlib.sha256(config).hexdigest()
        if not _blob_exists(rc, ep, tr, cdigest, scope):
            cpath = tmp / "config.json"
            cpath.write_bytes(config)
            _upload(rc, ep, tr, cdigest, cpath, scope)
            rep.bytes += len(config)
        manifest = json.dumps({"schemaVersion": 2, "mediaType": MT_DOCKER_MANIFEST,
                               "config": {"mediaType": MT_DOCKER_CONFIG, "digest": cdigest, "size": len(config)},
                               "layers": descs}).encode()
        r = rc.request(ep, "PUT", ep.url(tr.repository, "manifests", tr.tag or "latest"), scope=scope,
                       what=f"the manifest of {tr.canonical}", content=manifest,
                       headers={"Content-Type": MT_DOCKER_MANIFEST})
        try:
            if r.status_code not in (200, 201):
                from shoal.images.registry import _judge

                _judge(r, ep, f"writing the manifest of {tr.canonical}")
        finally:
            r.close()
        rep.manifest_digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        rep.seconds = time.monotonic() - t0
        log(f"pushed {tr.familiar} {rep.manifest_digest[:19]}")
        return rep
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if own:
            rc.close()


def _blob_exists(rc: Any, ep: Any, tr: Any, digest: str, scope: str) -> bool:
    r = rc.request(ep, "HEAD", ep.url(tr.repository, "blobs", digest), scope=scope, what=f"blob {digest[:19]}")
    try:
        if r.status_code == 200:
            return True
        if r.status_code == 404:
            return False
        from shoal.images.registry import _judge

        _judge(r, ep, f"blob {digest[:19]} of {tr.canonical}")
        return False
    finally:
        r.close()


def _upload(rc: Any, ep: Any, tr: Any, digest: str, path: Path, scope: str) -> None:
    """A monolithic upload: POST for an upload URL, PUT the bytes with their digest."""
    import urllib.parse

    what = f"an upload to {tr.canonical}"
    r = rc.request(ep, "POST", f"{ep.base}/v2/{tr.repository}/blobs/uploads/", scope=scope, what=what)
    try:
        if r.status_code != 202:
            from shoal.images.registry import _judge

            _judge(r, ep, what)
        loc = r.headers.get("location", "")
    finally:
        r.close()
    if not loc:
        raise RegistryUnavailable(f"{ep.describe()} started an upload without a Location")
    url = urllib.parse.urljoin(f"{ep.base}/", loc)
    url += ("&" if "?" in url else "?") + "digest=" + urllib.parse.quote(digest)
    content: Any = path.read_bytes() if path.stat().st_size <= (64 << 20) else _FileChunks(path)
    r = rc.request(ep, "PUT", url, scope=scope, what=what, content=content,
                   headers={"Content-Type": "application/octet-stream",
                            "Content-Length": str(path.stat().st_size)})
    try:
        if r.status_code not in (201, 204):
            from shoal.images.registry import _judge

            _judge(r, ep, what)
    finally:
        r.close()


class _FileChunks:
    """A file as an iterable of chunks that can be iterated again (a retried upload sends it anew)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __iter__(self) -> Iterator[bytes]:
        with open(self.path, "rb") as f:
            while chunk := f.read(_CHUNK):
                yield chunk
