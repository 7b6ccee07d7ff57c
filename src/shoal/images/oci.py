"""Import OCI images: docker-archive (`docker save`) and OCI image-layout tarballs, or a registry via skopeo.

Each OCI layer tar is unpacked (strictly, see unpack.py) into a temp dir, whiteouts converted, and
packed into one reproducible EROFS layer. A cache `cache/oci-diffids/<diff_id>.json -> layer digest`
makes identical OCI layers (same uncompressed digest) map to the same EROFS layer without unpacking
them again. Every blob digest and diff_id is verified; an import that fails leaves no tag and no
partial layer behind (complete layers it already stored stay, unreferenced, until `gc`).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import platform
import posixpath
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from shoal.errors import BackendUnavailable, ImageBuildError, InvalidRequest
from shoal.images.refs import parse_ref
from shoal.images.store import Image, ImageConfig, ImageStore
from shoal.images.unpack import LayerTarError, unpack_layer

DIFFID_CACHE = "oci-diffids"
_GZIP = b"\x1f\x8b"
_ZSTD = b"\x28\xb5\x2f\xfd"
_XZ = b"\xfd7zXZ"
_BZ2 = b"BZh"
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json")


class ImageImportError(InvalidRequest):
    """The file is not an importable image (or is corrupt); the message says what is wrong."""


@dataclass
class ImportReport:
    """What an import did, layer by layer."""

    image: Image
    format: str
    layers_unpacked: int = 0
    layers_cached: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


class _HashReader(io.RawIOBase):
    """A read-through wrapper that hashes and counts every byte."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.h = hashlib.sha256()
        self.n = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self.f.read(len(b))
        n = len(data)
        b[:n] = data
        self.h.update(data)
        self.n += n
        return n

    def drain(self) -> None:
        """Read (and hash) whatever is left."""
        while self.f is not None:
            data = self.f.read(1 << 20)
            if not data:
                break
            self.h.update(data)
            self.n += len(data)

    def digest(self) -> str:
        return "sha256:" + self.h.hexdigest()


def host_arch() -> str:
    """The OCI architecture name of this host."""
    m = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386"}.get(m, m)


def _decompressed(raw: IO[bytes]) -> IO[bytes]:
    """Wrap a (maybe gzip/zstd-compressed) stream so that reading it yields the plain tar."""
    buf = io.BufferedReader(raw, 1 << 20)  # type: ignore[arg-type]
    magic = buf.peek(6)[:6]
    if magic.startswith(_GZIP):
        return gzip.GzipFile(fileobj=buf, mode="rb")  # type: ignore[return-value]
    if magic.startswith(_ZSTD):
        try:
            import zstandard
        except ImportError:
            raise BackendUnavailable("zstd-compressed layers need the zstandard package: pip install zstandard") \
                from None
        return zstandard.ZstdDecompressor().stream_reader(buf, read_across_frames=True)  # type: ignore[return-value]
    return buf  # type: ignore[return-value]


class _Archive:
    """Random access to the members of the outer tarball (decompressed to a temp file if needed)."""

    def __init__(self, path: Path, tmp: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                magic = f.read(6)
        except FileNotFoundError:
            raise ImageImportError(f"cannot import {path}: no such file") from None
        except IsADirectoryError:
            raise ImageImportError(f"cannot import {path}: it is a directory; give the tarball") from None
        src = path
        if magic.startswith((_GZIP, _ZSTD, _XZ, _BZ2)):
            # random access into a compressed stream means re-decompressing: unpack the outer tar once
            src = tmp / "outer.tar"
            try:
                with open(path, "rb") as f, open(src, "wb") as out:
                    if magic.startswith(_XZ):
                        import lzma
                        with lzma.LZMAFile(f) as z:
                            shutil.copyfileobj(z, out, 1 << 20)
                    elif magic.startswith(_BZ2):
                        import bz2
                        with bz2.BZ2File(f) as z:
                            shutil.copyfileobj(z, out, 1 << 20)
                    else:
                        shutil.copyfileobj(_decompressed(f), out, 1 << 20)  # type: ignore[arg-type]
            except (OSError, EOFError, ValueError) as e:
                raise ImageImportError(f"cannot import {path}: corrupt or truncated compressed file ({e})") from None
            except Exception as e:  # zstandard.ZstdError and friends
                raise ImageImportError(f"cannot import {path}: corrupt compressed file ({e})") from None
        try:
            self.tf = tarfile.open(src, "r:")  # noqa: SIM115 - closed by close()
            self.members = {_norm(m.name): m for m in self.tf.getmembers()}
        except (tarfile.TarError, EOFError, OSError) as e:
            raise ImageImportError(f"cannot import {path}: not a valid tar archive ({e})") from None
        if not self.members:
            raise ImageImportError(f"cannot import {path}: the archive is empty")

    def close(self) -> None:
        self.tf.close()

    def has(self, name: str) -> bool:
        return _norm(name) in self.members

    def _member(self, name: str) -> tarfile.TarInfo:
        n = _norm(name)
        for _ in range(16):  # docker save links duplicate layers to one copy
            m = self.members.get(n)
            if m is None:
                raise ImageImportError(f"cannot import {self.path}: the archive lacks {name!r}")
            if m.issym():
                n = _norm(posixpath.join(posixpath.dirname(n), m.linkname))
            elif m.islnk():
                n = _norm(m.linkname)
            else:
                if not m.isreg():
                    raise ImageImportError(f"cannot import {self.path}: {name!r} is not a file in the archive")
                return m
        raise ImageImportError(f"cannot import {self.path}: link loop at {name!r}")

    def open(self, name: str) -> IO[bytes]:
        f = self.tf.extractfile(self._member(name))
        assert f is not None
        return f

    def read_json(self, name: str, max_bytes: int = 16 << 20) -> Any:
        m = self._member(name)
        if m.size > max_bytes:
            raise ImageImportError(f"cannot import {self.path}: {name!r} is too large for JSON metadata")
        try:
            data = self.open(name).read()
        except (tarfile.TarError, OSError, EOFError) as e:
            raise ImageImportError(f"cannot import {self.path}: {name!r} is truncated ({e})") from None
        if len(data) != m.size:
            raise ImageImportError(f"cannot import {self.path}: {name!r} is truncated")
        try:
            return json.loads(data)
        except ValueError as e:
            raise ImageImportError(f"cannot import {self.path}: {name!r} is not valid JSON ({e})") from None

    def blob_name(self, digest: str) -> str:
        alg, _, hexd = str(digest).partition(":")
        if alg != "sha256" or len(hexd) != 64 or any(c not in "0123456789abcdef" for c in hexd):
            raise ImageImportError(f"cannot import {self.path}: unsupported or malformed digest {digest!r}")
        return f"blobs/sha256/{hexd}"

    def read_blob_json(self, digest: str) -> Any:
        name = self.blob_name(digest)
        data = self.open(name).read()
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise ImageImportError(f"cannot import {self.path}: blob {digest} is corrupt (digest mismatch)")
        try:
            return json.loads(data)
        except ValueError as e:
            raise ImageImportError(f"cannot import {self.path}: blob {digest} is not valid JSON ({e})") from None


def _norm(name: str) -> str:
    # members of the outer archive are only looked up, never extracted: normalizing is enough
    return posixpath.normpath("/" + name).lstrip("/")


@dataclass
class _LayerSpec:
    name: str                 # member name in the archive
    blob_digest: str | None   # OCI: descriptor digest (verified); docker-archive: None
    diff_id: str | None       # from the image config (verified after unpack)
    media_type: str = ""


def _docker_archive(ar: _Archive, select: str | None) -> tuple[dict[str, Any], list[_LayerSpec], dict[str, Any]]:
    manifest = ar.read_json("manifest.json")
    if not isinstance(manifest, list) or not manifest:
        raise ImageImportError(f"cannot import {ar.path}: manifest.json is not a non-empty list")
    entries = [e for e in manifest if isinstance(e, dict)]
    if select:
        entries = [e for e in entries if select in (e.get("RepoTags") or [])]
        if not entries:
            tags = [t for e in manifest if isinstance(e, dict) for t in (e.get("RepoTags") or [])]
            raise ImageImportError(f"cannot import {ar.path}: no image tagged {select!r} in it (it has {tags})")
    if len(entries) != 1:
        tags = [t for e in entries for t in (e.get("RepoTags") or [])]
        raise ImageImportError(f"cannot import {ar.path}: it holds {len(entries)} images; choose one with "
                           f"--select (tags: {tags})")
    e = entries[0]
    if not isinstance(e.get("Config"), str) or not isinstance(e.get("Layers"), list):
        raise ImageImportError(f"cannot import {ar.path}: manifest.json entry lacks Config or Layers")
    config = ar.read_json(e["Config"])
    diff_ids = _diff_ids(ar, config, len(e["Layers"]))
    layers = [_LayerSpec(name=str(n), blob_digest=None, diff_id=d) for n, d in zip(e["Layers"], diff_ids,
                                                                                   strict=True)]
    return config, layers, {"format": "docker-archive", "repo_tags": list(e.get("RepoTags") or [])}


def _diff_ids(ar: _Archive, config: Any, n: int) -> list[str | None]:
    if not isinstance(config, dict):
        raise ImageImportError(f"cannot import {ar.path}: the image config is not a JSON object")
    ids = (config.get("rootfs") or {}).get("diff_ids")
    if ids is None:
        return [None] * n
    if not isinstance(ids, list) or len(ids) != n:
        raise ImageImportError(f"cannot import {ar.path}: the config lists {len(ids) if isinstance(ids, list) else '?'}"
                           f" diff_ids for {n} layers")
    return [str(x) for x in ids]


def _pick_manifest(ar: _Archive, descs: list[Any], select: str | None, depth: int = 0) -> dict[str, Any]:
    if depth > 4:
        raise ImageImportError(f"cannot import {ar.path}: image indexes nested too deep")
    descs = [d for d in descs if isinstance(d, dict) and d.get("digest")]
    if select:
        named = [d for d in descs if (d.get("annotations") or {}).get("org.opencontainers.image.ref.name") == select
                 or select in ((d.get("annotations") or {}).get("io.containerd.image.name") or "")]
        if named:
            descs = named
    plat = [d for d in descs if (d.get("platform") or {}).get("os", "linux") == "linux"
            and (d.get("platform") or {}).get("architecture", host_arch()) == host_arch()]
    if plat:
        descs = plat
    if not descs:
        raise ImageImportError(f"cannot import {ar.path}: no image for linux/{host_arch()} in its index")
    if len(descs) > 1:
        names = [(d.get("annotations") or {}).get("org.opencontainers.image.ref.name") for d in descs]
        raise ImageImportError(f"cannot import {ar.path}: it holds {len(descs)} images; choose one with --select "
                           f"(names: {names})")
    d = descs[0]
    doc = ar.read_blob_json(d["digest"])
    if not isinstance(doc, dict):
        raise ImageImportError(f"cannot import {ar.path}: manifest {d['digest']} is not a JSON object")
    if d.get("mediaType") in _INDEX_TYPES or doc.get("mediaType") in _INDEX_TYPES or "manifests" in doc:
        return _pick_manifest(ar, doc.get("manifests") or [], select, depth + 1)
    return doc


def _oci_layout(ar: _Archive, select: str | None) -> tuple[dict[str, Any], list[_LayerSpec], dict[str, Any]]:
    index = ar.read_json("index.json")
    if not isinstance(index, dict) or not isinstance(index.get("manifests"), list):
        raise ImageImportError(f"cannot import {ar.path}: index.json has no manifests list")
    manifest = _pick_manifest(ar, index["manifests"], select)
    cfg_desc = manifest.get("config") or {}
    if not isinstance(cfg_desc, dict) or not cfg_desc.get("digest") or not isinstance(manifest.get("layers"), list):
        raise ImageImportError(f"cannot import {ar.path}: the image manifest lacks config or layers")
    config = ar.read_blob_json(cfg_desc["digest"])
    descs = manifest["layers"]
    diff_ids = _diff_ids(ar, config, len(descs))
    layers = []
    for d, diff in zip(descs, diff_ids, strict=True):
        if not isinstance(d, dict) or not d.get("digest"):
            raise ImageImportError(f"cannot import {ar.path}: a layer descriptor lacks its digest")
        mt = str(d.get("mediaType", ""))
        if ("nondistributable" in mt or "foreign" in mt) and not ar.has(ar.blob_name(d["digest"])):
            raise ImageImportError(f"cannot import {ar.path}: layer {d['digest']} is non-distributable and not "
                               "in the archive")
        layers.append(_LayerSpec(name=ar.blob_name(d["digest"]), blob_digest=str(d["digest"]), diff_id=diff,
                                 media_type=mt))
    return config, layers, {"format": "oci-layout", "config_digest": cfg_desc["digest"]}


def image_config_from_oci(config: dict[str, Any]) -> ImageConfig:
    """Map an OCI/Docker image config (Env, WorkingDir, User, Entrypoint, Cmd, Labels, ExposedPorts, Volumes,
    Healthcheck, StopSignal, Shell, OnBuild) to an ImageConfig."""
    c = config.get("config") or config.get("container_config") or {}
    if not isinstance(c, dict):
        c = {}
    env: dict[str, str] = {}
    for item in c.get("Env") or []:
        if isinstance(item, str) and "=" in item:
            k, v = item.split("=", 1)
            if k:
                env[k] = v
    env.setdefault("PATH", _DEFAULT_PATH)
    cfg = ImageConfig(env=env)
    cfg.workdir = str(c.get("WorkingDir") or "/")
    if not cfg.workdir.startswith("/"):
        cfg.workdir = "/" + cfg.workdir
    cfg.user = str(c.get("User") or "root")
    cfg.entrypoint = [str(x) for x in (c.get("Entrypoint") or []) if isinstance(x, str | int | float)]
    cfg.cmd = [str(x) for x in (c.get("Cmd") or []) if isinstance(x, str | int | float)]
    # what Docker keeps for running the image (and a Dockerfile FROM it inherits)
    if isinstance(c.get("Labels"), dict):
        cfg.labels = {str(k): str(v) for k, v in c["Labels"].items()}
    if isinstance(c.get("ExposedPorts"), dict):
        cfg.exposed_ports = [str(k) for k in c["ExposedPorts"]]
    if isinstance(c.get("Volumes"), dict):
        cfg.volumes = [str(k) for k in c["Volumes"]]
    if isinstance(c.get("Healthcheck"), dict):
        cfg.healthcheck = dict(c["Healthcheck"])
    if c.get("StopSignal"):
        cfg.stop_signal = str(c["StopSignal"])
    for key, attr in (("Shell", "shell"), ("OnBuild", "onbuild")):
        if isinstance(c.get(key), list):
            setattr(cfg, attr, [str(x) for x in c[key]])
    return cfg


def _require_root() -> None:
    if os.geteuid() != 0:
        raise BackendUnavailable("importing images needs root (owners, device nodes and overlayfs whiteouts "
                                 "must be kept)")


def import_archive(store: ImageStore, path: Path | str, ref: str, *, select: str | None = None,
                   log: Callable[[str], None] | None = None, work_dir: Path | None = None,
                   source_label: str | None = None) -> ImportReport:
    """Import a docker-archive or OCI image-layout tarball (maybe gzip/zstd/xz-compressed) as `ref`."""
    r = parse_ref(ref)  # a bad name fails before any work
    if r.digest:
        raise InvalidRequest(f"import into name:tag, not a digest ({ref})")
    _require_root()
    log = log or (lambda s: None)
    t0 = time.monotonic()
    path = Path(path)
    base = Path(work_dir) if work_dir else store.tmp_dir
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-import-", dir=base))
    try:
        ar = _Archive(path, tmp)
        try:
            if ar.has("manifest.json"):
                config, specs, lineage = _docker_archive(ar, select)
            elif ar.has("index.json"):
                config, specs, lineage = _oci_layout(ar, select)
            else:
                raise ImageImportError(f"cannot import {path}: neither a docker-archive (manifest.json) nor an OCI "
                                   "image layout (index.json)")
            if not specs:
                raise ImageImportError(f"cannot import {path}: the image has no layers")
            arch = config.get("architecture")
            notes = []
            if arch and arch != host_arch():
                notes.append(f"image architecture {arch} differs from this host's ({host_arch()})")
            report = ImportReport(image=None, format=lineage["format"], notes=notes)  # type: ignore[arg-type]
            digests = []
            for i, spec in enumerate(specs):
                digests.append(_import_layer(store, ar, spec, i, len(specs), tmp, report, log))
        finally:
            ar.close()
        lineage.update({"imported": source_label or "archive", "architecture": arch or "",
                        "os": config.get("os", "")})
        img = store.put_image(r, digests, image_config_from_oci(config), lineage=lineage)
        report.image = img
        report.seconds = time.monotonic() - t0
        log(f"imported {img.ref} ({len(digests)} layers: {report.layers_unpacked} unpacked, "
            f"{report.layers_cached} cached) in {report.seconds:.1f}s")
        return report
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _import_layer(store: ImageStore, ar: _Archive, spec: _LayerSpec, i: int, n: int, tmp: Path,
                  report: ImportReport, log: Callable[[str], None]) -> str:
    label = spec.diff_id or spec.blob_digest or spec.name
    if spec.diff_id and spec.diff_id.startswith("sha256:") and len(spec.diff_id) == 71:
        hit = store.cache_get(DIFFID_CACHE, spec.diff_id[7:])
        if hit and isinstance(hit.get("layer"), str):
            with contextlib.suppress(InvalidRequest):
                if store.has_layer(hit["layer"]):
                    store.touch_layer(hit["layer"])
                    report.layers_cached += 1
                    log(f"layer {i + 1}/{n} {label[:19]}: cached")
                    return hit["layer"]
    log(f"layer {i + 1}/{n} {label[:19]}: unpacking")
    tree = tmp / f"layer{i}"
    tree.mkdir()
    try:
        try:
            raw = _HashReader(ar.open(spec.name))
            plain = _HashReader(_decompressed(raw))  # type: ignore[arg-type]
            stats = unpack_layer(plain, tree)  # type: ignore[arg-type]
            plain.drain()
            raw.drain()
        except LayerTarError as e:
            raise ImageImportError(f"cannot import {ar.path}: layer {i + 1} ({label}): {e.message}") from None
        except (InvalidRequest, BackendUnavailable):
            raise
        except OSError as e:
            if not isinstance(e, gzip.BadGzipFile):
                # the host's side failed (disk full, permissions): not the archive's fault
                raise ImageBuildError(f"importing layer {i + 1} of {ar.path} failed: {e}") from None
            raise ImageImportError(f"cannot import {ar.path}: layer {i + 1} ({label}) is corrupt: {e}") from None
        except Exception as e:  # tarfile.TarError, EOFError, zlib.error, zstandard.ZstdError
            raise ImageImportError(f"cannot import {ar.path}: layer {i + 1} ({label}) is corrupt or truncated: "
                                   f"{type(e).__name__}: {e}") from None
        if spec.blob_digest and raw.digest() != spec.blob_digest:
            raise ImageImportError(f"cannot import {ar.path}: layer {i + 1} is corrupt: its blob hashes to "
                               f"{raw.digest()}, the manifest says {spec.blob_digest}")
        diff_id = plain.digest()
        if spec.diff_id and diff_id != spec.diff_id:
            raise ImageImportError(f"cannot import {ar.path}: layer {i + 1} is corrupt: its content hashes to "
                               f"{diff_id}, the image config says {spec.diff_id}")
        layer = store.add_layer_from_dir(tree, source={"type": "oci-layer", "diff_id": diff_id,
                                                       "files": stats.files, "bytes": stats.bytes})
        store.cache_put(DIFFID_CACHE, diff_id[7:], {"layer": layer.digest, "diff_id": diff_id,
                                                     "created": time.time()})
        report.layers_unpacked += 1
        log(f"layer {i + 1}/{n} {label[:19]}: {stats.entries} entries, {stats.whiteouts} whiteouts "
            f"-> {layer.digest[:19]} ({layer.size / 2**20:.1f} MiB)")
        return layer.digest
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def skopeo_binary() -> str:
    """Path of skopeo, or BackendUnavailable telling how to install it."""
    exe = shutil.which("skopeo")
    if not exe:
        raise BackendUnavailable("pulling from a registry needs skopeo: apt-get install skopeo")
    return exe


def pull_image(store: ImageStore, source: str, ref: str, *, tls_verify: bool = True,
               log: Callable[[str], None] | None = None, work_dir: Path | None = None,
               timeout: float = 3600) -> ImportReport:
    """Copy `docker://registry/name:tag` with skopeo into a temp docker-archive, then import it as `ref`."""
    from shoal.host.spawn import run_sync

    parse_ref(ref)
    if not source.startswith("docker://") or len(source) <= len("docker://"):
        raise InvalidRequest(f"registry source {source!r} must look like docker://registry/name:tag")
    _require_root()
    log = log or (lambda s: None)
    base = Path(work_dir) if work_dir else store.tmp_dir
    base.mkdir(parents=True, exist_ok=True)
    if ":" in str(base):
        raise InvalidRequest(f"cannot pull into {base}: skopeo cannot write archives to paths containing ':'")
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-pull-", dir=base))
    try:
        archive = tmp / "image.tar"
        argv = [skopeo_binary()]
        if not Path("/etc/containers/policy.json").exists():
            argv.append("--insecure-policy")
        argv += ["copy", "--quiet", f"--src-tls-verify={'true' if tls_verify else 'false'}",
                 "--override-os", "linux", "--override-arch", host_arch(), source, f"docker-archive:{archive}"]
        log(f"skopeo copy {source}")
        res = run_sync(argv, timeout=timeout)
        if res.returncode != 0:
            msg = res.stderr.decode(errors="replace").strip()[-1500:]
            raise ImageBuildError(f"could not pull {source}: {msg}")
        return import_archive(store, archive, ref, log=log, work_dir=tmp, source_label=source)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
