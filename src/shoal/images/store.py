"""The content-addressed layer store and the image index.

Layout under SHOAL_STORE (safe to share between hosts: no host paths inside, every write is a
temp file + link/rename, and no lock is needed because every object is immutable and named by its hash):

    layers/sha256/<hex>.erofs     an EROFS filesystem image (read-only, 0444)
    layers/sha256/<hex>.json      {digest, size, created, source, format}; its mtime = last time used
    manifests/sha256/<hex>.json   an image version: {layers: [bottom..top], config, created, lineage}
    tags/<name>/<tag>             text: the manifest digest this tag points at (tags move)
    cache/<kind>/<key>.json       build caches (recipe steps, OCI diff_id -> layer); never pin a layer
    leases/<hex>/<host>           "this node has the layer mounted"; mtime = last heartbeat (leases.py; gc)
    tmp/                          temp files of writes in progress

A layer is visible (complete) only once its `.json` exists, and the `.json` is written after the data
file is in place, so a reader never sees a half-written layer. What a shared filesystem must provide
for this (rename, link with EEXIST, close-to-open) is in docs/images.md, "Shared stores".
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import ImageCorrupt, ImageNotFound, InvalidRequest
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

#: overlayfs takes all lower dirs in one mount option string of at most one page (4 KiB); with
#: mountpoints like /var/lib/shoal/layers/<64 hex> that is ~46 layers. Keep a margin.
MAX_LAYERS = 40
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_CACHE_KIND = re.compile(r"^[a-z0-9-]{1,32}$")


@dataclass
class ImageConfig:
    """How to run an image: environment, working directory, user, entrypoint and default command."""

    env: dict[str, str] = field(default_factory=lambda: {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": "C.UTF-8",
        "HOME": "/root",
    })
    workdir: str = "/"
    user: str = "root"
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    # what a Dockerfile says about running the image (kept as Docker keeps it; `shoal image inspect`)
    labels: dict[str, str] = field(default_factory=dict)
    exposed_ports: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)
    healthcheck: dict[str, Any] | None = None
    stop_signal: str = ""
    shell: list[str] = field(default_factory=list)
    onbuild: list[str] = field(default_factory=list)

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
        if isinstance(d.get("cmd"), list):
            c.cmd = [str(x) for x in d["cmd"]]
        if isinstance(d.get("labels"), dict):
            c.labels = {str(k): str(v) for k, v in d["labels"].items()}
        for key in ("exposed_ports", "volumes", "shell", "onbuild"):
            if isinstance(d.get(key), list):
                setattr(c, key, [str(x) for x in d[key]])
        if isinstance(d.get("healthcheck"), dict):
            c.healthcheck = dict(d["healthcheck"])
        if d.get("stop_signal"):
            c.stop_signal = str(d["stop_signal"])
        return c

    def to_dict(self) -> dict[str, Any]:
        """JSON form; the Dockerfile-only fields appear only when set (so images without them keep the
        manifest bytes, and digests, they always had)."""
        d = asdict(self)
        for key in ("labels", "exposed_ports", "volumes", "healthcheck", "stop_signal", "shell", "onbuild"):
            if not d.get(key):
                d.pop(key, None)
        return d

    def copy(self) -> ImageConfig:
        """An independent copy (lists and dicts are not shared)."""
        return ImageConfig.from_dict(self.to_dict())


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

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (no host paths)."""
        return {"digest": self.digest, "size": self.size, "created": self.created, "source": self.source}


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
            "config": self.config.to_dict(), "lineage": self.lineage,
        }


def check_digest(digest: str) -> str:
    """Return `digest` if it is `sha256:<64 lowercase hex>`, else raise InvalidRequest."""
    if not (isinstance(digest, str) and digest.startswith("sha256:") and _HEX64.match(digest[7:])):
        raise InvalidRequest(f"bad digest {digest!r}: expected sha256:<64 lowercase hex chars>")
    return digest


_check_digest = check_digest  # older name, kept for callers


def _holds(path: Path, hexd: str, size: int) -> bool:
    """True when `path` exists with exactly the bytes of digest `hexd` (hashed: a same-size file may be corrupt)."""
    try:
        return path.stat().st_size == size and sha256_file(path) == hexd
    except FileNotFoundError:
        return False


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ImageStore:
    """Content-addressed layers and named, versioned images in one directory (maybe shared)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.layers_dir = self.root / "layers" / "sha256"
        self.manifests_dir = self.root / "manifests" / "sha256"
        self.tags_dir = self.root / "tags"
        self.tmp_dir = self.root / "tmp"
        self.cache_dir = self.root / "cache"
        self.leases_dir = self.root / "leases"
        for d in (self.layers_dir, self.manifests_dir, self.tags_dir, self.tmp_dir, self.cache_dir,
                  self.leases_dir):
            d.mkdir(parents=True, exist_ok=True)
        from shoal.images.probe import ensure_marker

        ensure_marker(self.root)  # the small file `shoal store check` and the nodes' probes read

    # ---- layers -------------------------------------------------------------------------------
    def layer_path(self, digest: str) -> Path:
        """Where the EROFS file of `digest` lives (it may not exist)."""
        return self.layers_dir / f"{check_digest(digest)[7:]}.erofs"

    def _meta_path(self, digest: str) -> Path:
        return self.layers_dir / f"{check_digest(digest)[7:]}.json"

    def has_layer(self, digest: str) -> bool:
        """True when the layer file and its metadata are both present."""
        hexd = check_digest(digest)[7:]
        return (self.layers_dir / f"{hexd}.erofs").exists() and (self.layers_dir / f"{hexd}.json").exists()

    def layer(self, digest: str) -> Layer:
        """Look up one layer; ImageNotFound when absent."""
        hexd = check_digest(digest)[7:]
        meta_path = self.layers_dir / f"{hexd}.json"
        path = self.layers_dir / f"{hexd}.erofs"
        try:
            meta = read_json(meta_path)
        except FileNotFoundError:
            raise ImageNotFound(f"layer {digest} is not in the store at {self.root}") from None
        except ValueError as e:
            raise ImageNotFound(f"layer {digest} has unreadable metadata ({e}); run `shoal image gc`") from None
        if not path.exists():
            raise ImageNotFound(f"layer {digest} has metadata but no data file in {self.root}")
        return Layer(digest=digest, path=path, size=int(meta.get("size", 0)),
                     created=float(meta.get("created", 0)), source=meta.get("source") or {})

    def list_layers(self) -> list[Layer]:
        """Every complete layer in the store."""
        out = []
        for p in sorted(self.layers_dir.glob("*.json")):
            if not _HEX64.match(p.stem):
                continue
            with contextlib.suppress(ImageNotFound, ValueError, OSError):
                out.append(self.layer("sha256:" + p.stem))
        return out

    def add_layer_file(self, erofs_file: Path, source: dict[str, Any]) -> Layer:
        """Move a finished EROFS file (inside this store's tmp/) into place under its digest.

        Safe against concurrent writers of the same layer on this or another host: the data file is
        published with link(2) (never replacing bytes someone may have mounted), metadata after it.
        """
        erofs_file = Path(erofs_file)
        _fsync_path(erofs_file)
        hexd = sha256_file(erofs_file)
        digest = f"sha256:{hexd}"
        final = self.layers_dir / f"{hexd}.erofs"
        size = erofs_file.stat().st_size
        os.chmod(erofs_file, 0o444)
        try:
            os.link(erofs_file, final)
        except FileExistsError:
            # someone (maybe another node) already stored these bytes; heal a damaged (torn, truncated or
            # bit-flipped) copy by renaming ours over it: nodes that mounted the old file keep its inode
            if not _holds(final, hexd, size):
                os.rename(erofs_file, final)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            # a shared filesystem without hard links: rename is still atomic
            if not _holds(final, hexd, size):
                os.rename(erofs_file, final)
        with contextlib.suppress(FileNotFoundError):
            erofs_file.unlink()
        meta_path = self.layers_dir / f"{hexd}.json"
        if meta_path.exists():
            self.touch_layer(digest)
        else:
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

    def touch_layer(self, digest: str) -> None:
        """Mark a layer as just used (its metadata mtime): gc's grace period then protects it."""
        with contextlib.suppress(OSError):
            os.utime(self._meta_path(digest))

    def layer_last_used(self, digest: str) -> float:
        """Newest of: created, metadata mtime, data mtime (0 when absent)."""
        hexd = check_digest(digest)[7:]
        t = 0.0
        for suffix in (".json", ".erofs"):
            with contextlib.suppress(OSError):
                t = max(t, (self.layers_dir / f"{hexd}{suffix}").stat().st_mtime)
        with contextlib.suppress(OSError, ValueError, AttributeError):
            t = max(t, float(read_json(self.layers_dir / f"{hexd}.json").get("created", 0)))
        return t

    def verify_layer(self, digest: str) -> bool:
        """True when the layer's bytes still hash to its digest."""
        try:
            return sha256_file(self.layer_path(digest)) == check_digest(digest)[7:]
        except FileNotFoundError:
            return False

    def remove_layer(self, digest: str) -> None:
        """Delete a layer's metadata then its data (metadata first, so it never looks complete)."""
        hexd = check_digest(digest)[7:]
        for suffix in (".json", ".erofs"):
            with contextlib.suppress(FileNotFoundError):
                (self.layers_dir / f"{hexd}{suffix}").unlink()

    # ---- manifests and tags -------------------------------------------------------------------
    def _tag_path(self, name: str, tag: str) -> Path:
        return self.tags_dir / urllib.parse.quote(name, safe="") / tag

    def put_manifest(self, layers: list[str], config: ImageConfig | None = None,
                     lineage: dict[str, Any] | None = None) -> str:
        """Record an (untagged) image version; returns its manifest digest. gc removes it unless tagged."""
        if not layers:
            raise InvalidRequest("an image needs at least one layer")
        if len(layers) > MAX_LAYERS:
            raise InvalidRequest(
                f"an image may have at most {MAX_LAYERS} layers (overlayfs limit), got {len(layers)}: "
                "merge recipe steps, or rebuild from a base that already contains the lower layers")
        for d in layers:
            if not self.has_layer(d):
                raise ImageNotFound(f"layer {d} is not in the store at {self.root}")
        manifest = {
            "schema": 1,
            "layers": list(layers),
            "config": (config or ImageConfig()).to_dict(),
            "created": time.time(),
            "lineage": lineage or {},
        }
        data = canonical_json(manifest)
        mdigest = "sha256:" + sha256_bytes(data)
        mpath = self.manifests_dir / f"{mdigest[7:]}.json"
        if not mpath.exists():
            atomic_write(mpath, data)
        for d in layers:
            self.touch_layer(d)
        return mdigest

    def set_tag(self, ref: str | ImageRef, manifest_digest: str) -> None:
        """Point `name:tag` at an existing manifest (tags move; manifests never change)."""
        r = parse_ref(ref) if isinstance(ref, str) else ref
        if r.digest:
            raise InvalidRequest(f"cannot tag by digest: {r}; give name:tag")
        self.manifest(manifest_digest)  # must exist
        path = self._tag_path(r.name, r.tag or "latest")
        for attempt in range(3):
            try:
                atomic_write(path, (manifest_digest + "\n").encode())
                return
            except FileNotFoundError:
                # a concurrent `image rm` removed the (then empty) name directory: retry
                if attempt == 2:
                    raise

    def put_image(self, ref: str | ImageRef, layers: list[str], config: ImageConfig | None = None,
                  lineage: dict[str, Any] | None = None) -> Image:
        """Record an image version made of `layers` (bottom first) and point `ref`'s tag at it."""
        r = parse_ref(ref) if isinstance(ref, str) else ref
        if r.digest:
            raise InvalidRequest(f"cannot tag by digest: {r}; give name:tag")
        try:
            mdigest = self.put_manifest(layers, config, lineage)
        except (ImageNotFound, InvalidRequest) as e:
            raise type(e)(f"cannot make image {r}: {e.message}") from None
        self.set_tag(r, mdigest)
        return self.resolve(f"{r.name}@{mdigest}", tag=r.tag)

    def manifest(self, digest: str) -> dict[str, Any]:
        """The raw manifest of an image version."""
        try:
            return read_json(self.manifests_dir / f"{check_digest(digest)[7:]}.json")
        except FileNotFoundError:
            raise ImageNotFound(f"image version {digest} is not in the store") from None
        except ValueError as e:
            raise ImageNotFound(f"image version {digest} has an unreadable manifest ({e})") from None

    def list_manifests(self) -> list[str]:
        """Digests of every manifest in the store (tagged or not)."""
        return sorted("sha256:" + p.stem for p in self.manifests_dir.glob("*.json") if _HEX64.match(p.stem))

    def remove_manifest(self, digest: str) -> None:
        """Delete one manifest file (gc uses this for untagged, unused versions)."""
        with contextlib.suppress(FileNotFoundError):
            (self.manifests_dir / f"{check_digest(digest)[7:]}.json").unlink()

    def tag_target(self, ref: str | ImageRef) -> str:
        """The manifest digest a `name:tag` points at; ImageNotFound says how to get it."""
        r = parse_ref(ref) if isinstance(ref, str) else ref
        if r.digest:
            return r.digest
        try:
            return self._tag_path(r.name, r.tag or "latest").read_text().strip()
        except (FileNotFoundError, NotADirectoryError):
            hint = ("run `shoal image build base`" if r.name == "base"
                    else "see `shoal image ls`, or build/import it")
            raise ImageNotFound(f"image {r} not found in {self.root}: {hint}") from None

    def resolve(self, ref: str | ImageRef, tag: str | None = None) -> Image:
        """Resolve `name[:tag]` or `name@digest` to an Image; ImageNotFound says how to get it."""
        r = parse_ref(ref) if isinstance(ref, str) else ref
        mdigest = self.tag_target(r)
        if not r.digest:
            tag = r.tag
        try:
            check_digest(mdigest)
        except InvalidRequest:
            raise ImageNotFound(f"image {r} has a damaged tag file (content {mdigest[:80]!r})") from None
        m = self.manifest(mdigest)
        try:
            layers = [self.layer(d) for d in m["layers"]]
        except ImageNotFound as e:
            raise ImageNotFound(f"image {r} is incomplete: {e.message}") from None
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

    def tags(self) -> list[tuple[str, str, str]]:
        """Every (name, tag, manifest digest) in the store, sorted; damaged tag files are skipped."""
        out = []
        for name_dir in sorted(self.tags_dir.iterdir()):
            if not name_dir.is_dir() or name_dir.name.startswith(".tmp-"):
                continue
            name = urllib.parse.unquote(name_dir.name)
            for tag_file in sorted(name_dir.iterdir()):
                if tag_file.name.startswith(".tmp-"):
                    continue
                with contextlib.suppress(OSError, UnicodeDecodeError):
                    d = tag_file.read_text().strip()
                    if d.startswith("sha256:") and _HEX64.match(d[7:]):
                        out.append((name, tag_file.name, d))
        return out

    def list_images(self) -> list[Image]:
        """Every tagged image, sorted by name then tag."""
        out = []
        for name, tag, _ in self.tags():
            with contextlib.suppress(ImageNotFound, InvalidRequest, OSError, ValueError, KeyError):
                out.append(self.resolve(f"{name}:{tag}"))
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

    def remove_name(self, name: str) -> int:
        """Remove every tag of image `name` (layers stay until `gc`); returns how many went. Missing: 0."""
        d = self.tags_dir / urllib.parse.quote(name, safe="")
        n = 0
        with contextlib.suppress(FileNotFoundError):
            for tag_file in d.iterdir():
                if not tag_file.name.startswith(".tmp-"):
                    with contextlib.suppress(FileNotFoundError):
                        tag_file.unlink()
                        n += 1
        with contextlib.suppress(OSError):
            d.rmdir()
        return n

    def copy_image_from(self, other: ImageStore, ref: str, as_ref: str | None = None, *, link: bool = True) -> Image:
        """Bring image `ref` of another store into this one as `as_ref` (default: the same name:tag).
        Layers are hard-linked when both stores share a filesystem (and `link`), else copied; re-verified."""
        import shutil

        img = other.resolve(ref)
        for lay in img.layers:
            if self.has_layer(lay.digest):
                continue
            tmp = self.tmp_dir / (tmp_name("copy-") + ".erofs")
            try:
                if not link:
                    raise OSError("copy requested")
                os.link(lay.path, tmp)
            except OSError:
                shutil.copyfile(lay.path, tmp)
            try:
                got = self.add_layer_file(tmp, lay.source)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
            if got.digest != lay.digest:
                self.remove_layer(got.digest)
                raise ImageCorrupt(f"layer {lay.digest} of {other.root} is corrupt (its bytes hash to {got.digest})")
        target = as_ref or (img.ref if img.tag else f"{img.name}:latest")
        return self.put_image(target, [lay.digest for lay in img.layers], img.config,
                              lineage=dict(img.lineage, copied_from=img.digest))

    # ---- caches -------------------------------------------------------------------------------
    def _cache_path(self, kind: str, key: str) -> Path:
        if not _CACHE_KIND.match(kind) or not _HEX64.match(key):
            raise InvalidRequest(f"bad cache key {kind}/{key}")
        return self.cache_dir / kind / f"{key}.json"

    def cache_get(self, kind: str, key: str) -> dict[str, Any] | None:
        """A cache entry, or None (missing or unreadable entries are misses)."""
        path = self._cache_path(kind, key)
        try:
            v = read_json(path)
        except (OSError, ValueError):
            return None
        return v if isinstance(v, dict) else None

    def cache_put(self, kind: str, key: str, value: dict[str, Any]) -> None:
        """Write a cache entry atomically (last writer wins; entries are pure functions of the key)."""
        atomic_write_json(self._cache_path(kind, key), value)

    def cache_entries(self, kind: str) -> list[tuple[str, dict[str, Any] | None]]:
        """Every (key, entry) of one cache; entry None when unreadable."""
        d = self.cache_dir / kind
        out = []
        if d.is_dir():
            for p in sorted(d.glob("*.json")):
                if _HEX64.match(p.stem):
                    out.append((p.stem, self.cache_get(kind, p.stem)))
        return out

    def cache_remove(self, kind: str, key: str) -> None:
        """Drop one cache entry."""
        with contextlib.suppress(FileNotFoundError):
            self._cache_path(kind, key).unlink()
