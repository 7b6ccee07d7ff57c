"""Write docker-archive and OCI image-layout tarballs from layer tars (for tests, benchmarks, fixtures).

The import side lives in oci.py; these writers produce exactly the shapes `docker save` and
`skopeo copy … oci-archive:` produce, so tests can exercise the importer without Docker.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
import time
from pathlib import Path
from typing import Any

_OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
_OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
_OCI_LAYER = {None: "application/vnd.oci.image.layer.v1.tar", "gzip": "application/vnd.oci.image.layer.v1.tar+gzip",
              "zstd": "application/vnd.oci.image.layer.v1.tar+zstd"}


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def image_config(layer_tars: list[bytes], env: list[str] | None = None, workdir: str = "", user: str = "",
                 entrypoint: list[str] | None = None, cmd: list[str] | None = None,
                 architecture: str | None = None) -> dict[str, Any]:
    """An OCI image config whose rootfs.diff_ids match `layer_tars`."""
    from shoal.images.oci import host_arch

    return {
        "architecture": architecture or host_arch(), "os": "linux",
        "config": {"Env": env if env is not None else ["PATH=/usr/local/bin:/usr/bin:/bin"],
                   "WorkingDir": workdir, "User": user, "Entrypoint": entrypoint, "Cmd": cmd},
        "rootfs": {"type": "layers", "diff_ids": [_sha(t) for t in layer_tars]},
        "history": [{"created_by": f"layer {i}"} for i in range(len(layer_tars))],
    }


def _add(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    ti.mtime = 0
    ti.mode = 0o644
    tf.addfile(ti, io.BytesIO(data))


def _compress(data: bytes, how: str | None) -> bytes:
    if how is None:
        return data
    if how == "gzip":
        return gzip.compress(data, mtime=0)
    if how == "zstd":
        import zstandard

        return zstandard.ZstdCompressor().compress(data)
    raise ValueError(f"unknown compression {how!r}")


def write_docker_archive(path: Path, layer_tars: list[bytes], config: dict[str, Any] | None = None,
                         repo_tags: list[str] | None = None) -> Path:
    """Write a `docker save`-style archive: manifest.json, <config>.json, <n>/layer.tar."""
    config = config or image_config(layer_tars)
    cfg_bytes = json.dumps(config).encode()
    cfg_name = hashlib.sha256(cfg_bytes).hexdigest() + ".json"
    names = []
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for t in layer_tars:
            d = hashlib.sha256(t).hexdigest()
            name = f"{d}/layer.tar"
            if name not in names:
                _add(tf, name, t)
            names.append(name)
        _add(tf, cfg_name, cfg_bytes)
        manifest = [{"Config": cfg_name, "RepoTags": repo_tags or ["test:latest"], "Layers": names}]
        _add(tf, "manifest.json", json.dumps(manifest).encode())
    return Path(path)


def write_oci_layout(path: Path, layer_tars: list[bytes], config: dict[str, Any] | None = None,
                     compression: str | None = "gzip", ref_name: str = "latest") -> Path:
    """Write an OCI image-layout tarball (oci-layout, index.json, blobs/sha256/…), layers compressed."""
    config = config or image_config(layer_tars)
    cfg_bytes = json.dumps(config).encode()
    blobs: dict[str, bytes] = {_sha(cfg_bytes): cfg_bytes}
    layers = []
    for t in layer_tars:
        blob = _compress(t, compression)
        blobs[_sha(blob)] = blob
        layers.append({"mediaType": _OCI_LAYER[compression], "digest": _sha(blob), "size": len(blob)})
    manifest = {"schemaVersion": 2, "mediaType": _OCI_MANIFEST,
                "config": {"mediaType": _OCI_CONFIG, "digest": _sha(cfg_bytes), "size": len(cfg_bytes)},
                "layers": layers}
    m_bytes = json.dumps(manifest).encode()
    blobs[_sha(m_bytes)] = m_bytes
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": _OCI_MANIFEST, "digest": _sha(m_bytes), "size": len(m_bytes),
        "annotations": {"org.opencontainers.image.ref.name": ref_name}}]}
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        _add(tf, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        _add(tf, "index.json", json.dumps(index).encode())
        for d, b in blobs.items():
            _add(tf, "blobs/sha256/" + d[7:], b)
    return Path(path)


def layer_tar(entries: list[tuple], mtime: float | None = None) -> bytes:
    """Build a layer tar from simple entries (for fixtures):
    ("file", path, data, mode), ("dir", path, mode), ("symlink", path, target), ("hardlink", path, target),
    ("whiteout", path), ("opaque", dirpath). Owners are 0:0 unless an entry ends with (uid, gid)."""
    buf = io.BytesIO()
    t = time.time() if mtime is None else mtime
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for e in entries:
            kind, path = e[0], e[1]
            owner = e[-1] if isinstance(e[-1], tuple) else (0, 0)
            if kind == "whiteout":
                d, _, b = path.rpartition("/")
                path, kind, e = (f"{d}/.wh.{b}" if d else f".wh.{b}"), "file", ("file", path, b"", 0o644)
            elif kind == "opaque":
                path, kind, e = f"{path}/.wh..wh..opq", "file", ("file", path, b"", 0o644)
            ti = tarfile.TarInfo(path)
            ti.mtime = t
            ti.uid, ti.gid = owner
            if kind == "file":
                data = e[2]
                ti.size = len(data)
                ti.mode = e[3] if len(e) > 3 and isinstance(e[3], int) else 0o644
                tf.addfile(ti, io.BytesIO(data))
                continue
            if kind == "dir":
                ti.type = tarfile.DIRTYPE
                ti.mode = e[2] if len(e) > 2 and isinstance(e[2], int) else 0o755
            elif kind == "symlink":
                ti.type = tarfile.SYMTYPE
                ti.linkname = e[2]
                ti.mode = 0o777
            elif kind == "hardlink":
                ti.type = tarfile.LNKTYPE
                ti.linkname = e[2]
            else:
                raise ValueError(f"unknown entry kind {kind!r}")
            tf.addfile(ti)
    return buf.getvalue()
