"""The content-addressed layer store and the image index.

Layout under SHOAL_STORE (safe to share between hosts: no host paths inside, every write is a
temp file + rename, and no lock is needed because every object is immutable and named by its hash):

    layers/sha256/<hex>.erofs     an EROFS filesystem image
    layers/sha256/<hex>.json      {digest, size, created, source}
    manifests/sha256/<hex>.json   an image version: {layers: [bottom..top], config, created, lineage}
    tags/<name>/<tag>             text: the manifest digest this tag points at (tags move)
    tmp/                          temp files of writes in progress
"""

from __future__ import annotations

import contextlib
import os
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import ImageNotFound, InvalidRequest
from shoal.fsutil import (
    atomic_write,
    atomic_write_json,
    canonical_json,
    read_json,
    sha256_bytes,
    sha256_file,
    tmp_name,
)
from shoal.images.erofs import build_erofs
from shoal.images.refs import ImageRef, parse_ref


@dataclass
class ImageConfig:
    """How to run an image: environment, working directory, user, entrypoint."""

    env: dict[str, str] = field(default_factory=lambda: {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "HOME": "/root",
    })
    workdir: str = "/"
    user: str = "root"
    entrypoint: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ImageConfig:
        """Build from JSON, ignoring unknown keys."""
        d = d or {}
        c = cls()
        if isinstance(d.get("env"), dict):
            c.env = {str(k): str(v) for k, v in d["env"].items()}
        if d.get("workdir"):
            c.workdir = str(d["workdir"])
        if d.get("user"):
            c.user = str(d["user"])
        if isinstance(d.get("entrypoint"), list):
            c.entrypoint = [str(x) for x in d["entrypoint"]]
        return c


@dataclass
class Layer:
    """One immutable EROFS layer in the store."""

    digest: str  # "sha256:<hex>"
    path: Path
    size: int
    created: float = 0.0
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def hex(self) -> str:
        """The bare hex part of the digest."""
        return self.digest.split(":", 1)[1]


@dataclass
class Image:
    """A resolved image version: ordered layers (bottom first) plus config."""

    name: str
    tag: str | None
    digest: str  # manifest digest
    layers: list[Layer]
    config: ImageConfig
    created: float
    lineage: dict[str, Any] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        """`name:tag` (or `name@digest` when resolved by digest)."""
        return f"{self.name}:{self.tag}" if self.tag else f"{self.name}@{self.digest}"

    @property
    def size(self) -> int:
        """Total bytes of all layers."""
        return sum(layer.size for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly summary (no host paths)."""
        return {
            "name": self.name, "tag": self.tag, "digest": self.digest, "created": self.created,
            "size": self.size, "layers": [lay.digest for lay in self.layers],
            "config": asdict(self.config), "lineage": self.lineage,
        }


def _check_digest(digest: str) -> str:
    if not (isinstance(digest, str) and digest.startswith("sha256:") and len(digest) == 71
            and all(c in "0123456789abcdef" for c in digest[7:])):
        raise InvalidRequest(f"bad digest {digest!r}: expected sha256:<64 lowercase hex chars>")
    return digest


class ImageStore:
    """Content-addressed layers and named, versioned images in one directory (maybe shared)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.layers_dir = self.root / "layers" / "sha256"
        self.manifests_dir = self.root / "manifests" / "sha256"
        self.tags_dir = self.root / "tags"
        self.tmp_dir = self.root / "tmp"
        for d in (self.layers_dir, self.manifests_dir, self.tags_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)

    # ---- layers -------------------------------------------------------------------------------
    def layer_path(self, digest: str) -> Path:
        """Where the EROFS file of `digest` lives (it may not exist)."""
        return self.layers_dir / f"{_check_digest(digest)[7:]}.erofs"

    def has_layer(self, digest: str) -> bool:
        """True when the layer file and its metadata are both present."""
        hexd = _check_digest(digest)[7:]
        return (self.layers_dir / f"{hexd}.erofs").exists() and (self.layers_dir / f"{hexd}.json").exists()

    def layer(self, digest: str) -> Layer:
        """Look up one layer; ImageNotFound when absent."""
        hexd = _check_digest(digest)[7:]
        meta_path = self.layers_dir / f"{hexd}.json"
        path = self.layers_dir / f"{hexd}.erofs"
        try:
            meta = read_json(meta_path)
        except FileNotFoundError:
            raise ImageNotFound(f"layer {digest} is not in the store at {self.root}") from None
        if not path.exists():
            raise ImageNotFound(f"layer {digest} has metadata but no data file in {self.root}")
        return Layer(digest=digest, path=path, size=int(meta.get("size", 0)),
                     created=float(meta.get("created", 0)), source=meta.get("source") or {})

    def list_layers(self) -> list[Layer]:
        """Every complete layer in the store."""
        out = []
        for p in sorted(self.layers_dir.glob("*.json")):
            with contextlib.suppress(ImageNotFound, ValueError, OSError):
                out.append(self.layer("sha256:" + p.stem))
        return out

    def add_layer_file(self, erofs_file: Path, source: dict[str, Any]) -> Layer:
        """Move a finished EROFS file (inside this store's tmp/) into place under its digest."""
        hexd = sha256_file(erofs_file)
        digest = f"sha256:{hexd}"
        final = self.layers_dir / f"{hexd}.erofs"
        size = erofs_file.stat().st_size
        if final.exists() and final.stat().st_size == size:
            # someone (maybe another host) already stored these exact bytes
            erofs_file.unlink()
        else:
            os.chmod(erofs_file, 0o444)
            os.rename(erofs_file, final)
        meta_path = self.layers_dir / f"{hexd}.json"
        if not meta_path.exists():
            atomic_write_json(meta_path, {"digest": digest, "size": size, "created": time.time(),
                                          "source": source, "format": "erofs"})
        return self.layer(digest)

    def add_layer_from_dir(self, src_dir: Path, source: dict[str, Any], compress: str | None = None) -> Layer:
        """Pack a directory tree into an EROFS layer and store it (deduplicated by content)."""
        tmp = self.tmp_dir / (tmp_name("layer-") + ".erofs")
        try:
            build_erofs(Path(src_dir), tmp, compress=compress)
            return self.add_layer_file(tmp, source)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()

    def remove_layer(self, digest: str) -> None:
        """Delete a layer's metadata then its data (metadata first, so it never looks complete)."""
        hexd = _check_digest(digest)[7:]
        for suffix in (".json", ".erofs"):
            with contextlib.suppress(FileNotFoundError):
                (self.layers_dir / f"{hexd}{suffix}").unlink()

    # ---- manifests and tags -------------------------------------------------------------------
    def _tag_path(self, name: str, tag: str) -> Path:
        return self.tags_dir / urllib.parse.quote(name, safe="") / tag

    def put_image(self, ref: str | ImageRef, layers: list[str], config: ImageConfig | None = None,
                  lineage: dict[str, Any] | None = None) -> Image:
        """Record an image version made of `layers` (bottom first) and point `ref`'s tag at it."""
        r = parse_ref(ref) if isinstance(ref, str) else ref
        if r.digest:
            raise InvalidRequest(f"cannot tag by digest: {r}; give name:tag")
        for d in layers:
            if not self.has_layer(d):
                raise ImageNotFound(f"cannot make image {r}: layer {d} is not in the store")
        if not layers:
            raise InvalidRequest(f"image {r} needs at least one layer")
        manifest = {
            "schema": 1,
            "layers": list(layers),
            "config": asdict(config or ImageConfig()),
            "created": time.time(),
            "lineage": lineage or {},
        }
        data = canonical_json(manifest)
        mdigest = "sha256:" + sha256_bytes(data)
        mpath = self.manifests_dir / f"{mdigest[7:]}.json"
        if not mpath.exists():
            atomic_write(mpath, data)
        atomic_write(self._tag_path(r.name, r.tag or "latest"), (mdigest + "\n").encode())
        return self.resolve(f"{r.name}@{mdigest}", tag=r.tag)

    def manifest(self, digest: str) -> dict[str, Any]:
        """The raw manifest of an image version."""
        try:
            return read_json(self.manifests_dir / f"{_check_digest(digest)[7:]}.json")
        except FileNotFoundError:
            raise ImageNotFound(f"image version {digest} is not in the store") from None

    def resolve(self, ref: str | ImageRef, tag: str | None = None) -> Image:
        """Resolve `name[:tag]` or `name@digest` to an Image; ImageNotFound says how to get it."""
        r = parse_ref(ref) if isinstance(ref, str) else ref
        if r.digest:
            mdigest = r.digest
        else:
            try:
                mdigest = self._tag_path(r.name, r.tag or "latest").read_text().strip()
            except FileNotFoundError:
                hint = ("run `shoal image build base`" if r.name == "base"
                        else "see `shoal image ls`, or build/import it")
                raise ImageNotFound(f"image {r} not found in {self.root}: {hint}") from None
            tag = r.tag
        m = self.manifest(mdigest)
        layers = [self.layer(d) for d in m["layers"]]
        return Image(name=r.name, tag=tag, digest=mdigest, layers=layers,
                     config=ImageConfig.from_dict(m.get("config")), created=float(m.get("created", 0)),
                     lineage=m.get("lineage") or {})

    def exists(self, ref: str) -> bool:
        """True when `ref` resolves."""
        try:
            self.resolve(ref)
            return True
        except ImageNotFound:
            return False

    def list_images(self) -> list[Image]:
        """Every tagged image, sorted by name then tag."""
        out = []
        for name_dir in sorted(self.tags_dir.iterdir()):
            if not name_dir.is_dir():
                continue
            name = urllib.parse.unquote(name_dir.name)
            for tag_file in sorted(name_dir.iterdir()):
                if tag_file.name.startswith(".tmp-"):
                    continue
                with contextlib.suppress(ImageNotFound, InvalidRequest, OSError, ValueError, KeyError):
                    out.append(self.resolve(f"{name}:{tag_file.name}"))
        return out

    def remove_image(self, ref: str) -> None:
        """Remove a tag (its layers stay until `gc`)."""
        r = parse_ref(ref)
        if r.digest:
            raise InvalidRequest("remove images by name:tag, not by digest")
        p = self._tag_path(r.name, r.tag or "latest")
        try:
            p.unlink()
        except FileNotFoundError:
            raise ImageNotFound(f"image {r} not found") from None
        with contextlib.suppress(OSError):
            p.parent.rmdir()
