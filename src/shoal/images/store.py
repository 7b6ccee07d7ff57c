"""The content-addressed layer store and the image index.

Layout under SHOAL_STORE (safe to share between hosts: no host paths inside, every write is a
temp file + link/rename, and no lock is needed because every object is immutable and named by its hash):

    chunks/sha256/<aa>/<hex>.zst  one chunk of layer data: a zstd frame of the bytes hashing to <hex>
    chunked/sha256/<hex>.table    a layer's chunk table (its digest is the layer digest: shoal.images.chunking)
    chunked/sha256/<hex>.json     {digest, size, created, source, format: "chunked", table, legacy}
    layers/sha256/<hex>.erofs     a layer in the earlier whole-file format (read-only, 0444); converted to
    layers/sha256/<hex>.json      chunks on first use or by `shoal store migrate` (shoal.images.migrate)
    manifests/sha256/<hex>.json   an image version: {layers: [bottom..top], config, created, lineage}
    tags/<name>/<tag>             text: the manifest digest this tag points at (tags move)
    cache/<kind>/<key>.json       build caches (recipe steps, OCI diff_id -> layer); never pin a layer
    leases/<hex>/<host>           "this node has the layer mounted"; mtime = last heartbeat (leases.py; gc)
    corrupt/<hex>/<chunk hex>     "a node read this chunk of layer <hex> and it was bad" (corruption.py)
    prefetch/<hex>.json           which chunks a layer's first sandbox read at start (prefetch.py)
    tmp/                          temp files of writes in progress

A layer is visible (complete) only once its `.json` exists, and the `.json` is written after its data
(chunks, table; or the whole file) is in place, so a reader never sees a half-written layer. What a shared
filesystem must provide for this (rename, link with EEXIST, close-to-open) is in docs/images.md, "Shared
stores". A layer's digest is the sha256 of its chunk table (which names every chunk by its sha256), so a
manifest digest pins every byte; a converted whole-file layer keeps its old digest (docs/images.md,
"Chunked layers").
"""

from __future__ import annotations

import contextlib
import hashlib
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
from shoal.images.chunking import ChunkTable
from shoal.images.chunkstore import ChunkStats, ChunkStore
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
    """One immutable EROFS layer in the store.

    `format` is "chunked" (its bytes are chunks named by its table; `path` is where a whole file of the
    earlier format would be and usually does not exist: read the bytes with ImageStore.export_layer, or on
    a node through LayerMounts) or "erofs" (a whole file at `path`, not converted yet)."""

    digest: str  # "sha256:<hex>"
    path: Path
    size: int
    created: float = 0.0
    source: dict[str, Any] = field(default_factory=dict)
    format: str = "erofs"
    #: the digest of its chunk table (== digest, except for a converted whole-file layer)
    table: str | None = None

    @property
    def hex(self) -> str:
        """The bare hex part of the digest."""
        return self.digest.split(":", 1)[1]

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (no host paths)."""
        return {"digest": self.digest, "size": self.size, "created": self.created, "source": self.source,
                "format": self.format}

    @property
    def chunked(self) -> bool:
        """True when the layer's bytes are stored as chunks."""
        return self.format == "chunked"


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
        #: chunk objects and chunked-layer records (shoal.images.chunkstore)
        self.chunks = ChunkStore(self.root)
        #: what the last add_layer_file / copy did (chunks written, bytes re-used): benchmarks and migrate
        self.last_write = ChunkStats()
        from shoal.images.probe import ensure_marker

        ensure_marker(self.root)  # the small file `shoal store check` and the nodes' probes read

    # ---- layers -------------------------------------------------------------------------------
    def layer_path(self, digest: str) -> Path:
        """Where the whole EROFS file of `digest` would be in the earlier format (it exists only for layers
        not converted to chunks; read a layer's bytes with `export_layer` or `iter_layer_bytes`)."""
        return self.layers_dir / f"{check_digest(digest)[7:]}.erofs"

    def _meta_path(self, digest: str) -> Path:
        return self.layers_dir / f"{check_digest(digest)[7:]}.json"

    def has_layer(self, digest: str) -> bool:
        """True when the layer is complete here (chunked, or a whole file and its metadata)."""
        hexd = check_digest(digest)[7:]
        if self.chunks.has(hexd):
            return True
        return (self.layers_dir / f"{hexd}.erofs").exists() and (self.layers_dir / f"{hexd}.json").exists()

    def layer(self, digest: str) -> Layer:
        """Look up one layer; ImageNotFound when absent."""
        hexd = check_digest(digest)[7:]
        path = self.layers_dir / f"{hexd}.erofs"
        if self.chunks.has(hexd):
            meta = self.chunks.meta(hexd)
            return Layer(digest=digest, path=path, size=int(meta.get("size", 0)),
                         created=float(meta.get("created", 0)), source=meta.get("source") or {},
                         format="chunked", table=self.chunks.table_digest(hexd, meta))
        meta_path = self.layers_dir / f"{hexd}.json"
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
        hexes = set(self.chunks.list_hexes())
        hexes.update(p.stem for p in self.layers_dir.glob("*.json") if _HEX64.match(p.stem))
        out = []
        for h in sorted(hexes):
            with contextlib.suppress(ImageNotFound, ValueError, OSError):
                out.append(self.layer("sha256:" + h))
        return out

    def add_layer_file(self, erofs_file: Path, source: dict[str, Any]) -> Layer:
        """Store a finished EROFS file (inside this store's tmp/) as a chunked layer, and remove the file.

        The returned layer's digest is the sha256 of its chunk table (earlier versions named a layer by the
        sha256 of the whole file; docs/images.md, "Chunked layers"). Safe against concurrent writers of the
        same layer on this or another host: chunks are published with link(2) (a damaged existing chunk is
        replaced), the table and the record after them.
        """
        erofs_file = Path(erofs_file)
        stats = ChunkStats()
        digest, _ = self.chunks.add_file(erofs_file, source, stats=stats)
        self.last_write = stats
        with contextlib.suppress(FileNotFoundError):
            erofs_file.unlink()
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

    def layer_table(self, digest: str) -> ChunkTable:
        """The chunk table of a chunked layer, checked against its digest (ImageCorrupt when it does not
        match; ImageNotFound for a layer not chunked: see `convert_layer`)."""
        hexd = check_digest(digest)[7:]
        if not self.chunks.has(hexd):
            raise ImageNotFound(f"layer {digest} is not stored as chunks in {self.root}")
        return self.chunks.table(hexd)

    def convert_layer(self, digest: str) -> Layer:
        """Store a whole-file layer as chunks (keeping its digest and, for older readers, its file); the
        file's bytes must hash to the digest (ImageCorrupt otherwise). A no-op for a chunked layer."""
        from shoal.images.migrate import convert_layer

        return convert_layer(self, digest)

    def export_layer(self, digest: str, dest: Path) -> Path:
        """Write a layer's whole EROFS image to `dest` (every chunk checked); for tools that want a file."""
        lay = self.layer(digest)
        tmp = Path(dest).parent / tmp_name("export-")
        try:
            with open(tmp, "wb") as out:
                if lay.chunked:
                    self.chunks.export(lay.hex, out)
                else:
                    h = hashlib.sha256()
                    with open(lay.path, "rb") as f:
                        while b := f.read(1 << 20):
                            h.update(b)
                            out.write(b)
                    if h.hexdigest() != lay.hex:
                        raise ImageCorrupt(f"layer {digest} is corrupt (its file does not hash to its digest)")
            os.rename(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return Path(dest)

    def touch_layer(self, digest: str) -> None:
        """Mark a layer as just used (its metadata mtime): gc's grace period then protects it."""
        hexd = check_digest(digest)[7:]
        self.chunks.touch(hexd)
        with contextlib.suppress(OSError):
            os.utime(self._meta_path(digest))

    def layer_last_used(self, digest: str) -> float:
        """Newest of: created, metadata mtime, data mtime (0 when absent)."""
        hexd = check_digest(digest)[7:]
        t = 0.0
        paths = [self.layers_dir / f"{hexd}{suffix}" for suffix in (".json", ".erofs")]
        paths += [self.chunks.meta_path(hexd), self.chunks.table_path(hexd)]
        for p in paths:
            with contextlib.suppress(OSError):
                t = max(t, p.stat().st_mtime)
        for p in (self.layers_dir / f"{hexd}.json", self.chunks.meta_path(hexd)):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                t = max(t, float(read_json(p).get("created", 0)))
        return t

    def verify_layer(self, digest: str) -> bool:
        """True when every byte of the layer still hashes to what its digest pins."""
        hexd = check_digest(digest)[7:]
        if self.chunks.has(hexd):
            return not self.chunks.verify(hexd)
        try:
            return sha256_file(self.layer_path(digest)) == hexd
        except FileNotFoundError:
            return False

    def remove_layer(self, digest: str) -> None:
        """Delete a layer's records then its data (records first, so it never looks complete); its chunks
        stay until gc finds no table naming them."""
        hexd = check_digest(digest)[7:]
        self.chunks.remove(hexd)
        for suffix in (".json", ".erofs"):
            with contextlib.suppress(FileNotFoundError):
                (self.layers_dir / f"{hexd}{suffix}").unlink()
        from shoal.images import corruption, prefetch

        corruption.clear(self.root, hexd)
        prefetch.remove(self.root, hexd)

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
        Chunks are checked as they are read and stored once (those this store has are re-used); a whole-file
        layer is converted to chunks on the way. `link` is kept for callers (chunks are always copied)."""
        img = other.resolve(ref)
        stats = ChunkStats()
        for lay in img.layers:
            if self.has_layer(lay.digest):
                self.touch_layer(lay.digest)
                continue
            if lay.chunked:
                t = other.layer_table(lay.digest)
                for hexd, n in t.unique().items():
                    data = other.chunks.read_chunk(hexd, n)
                    new, stored = self.chunks.put_chunk(hexd, data)
                    stats.add(new, n, stored)
                meta = other.chunks.meta(lay.hex)
                self.chunks.publish(lay.hex, t, lay.source, legacy=bool(meta.get("legacy")),
                                    created=float(meta.get("created", 0)) or None)
            else:
                self.chunks.add_file(lay.path, lay.source, legacy_digest=lay.digest, stats=stats)
        self.last_write = stats
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
