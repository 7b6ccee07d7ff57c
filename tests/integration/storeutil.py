"""Helpers of the store tests: a tiny runnable image (busybox) with data files far apart in the layer,
private node homes, and leak checks."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from shoal.config import NodeConfig, Paths
from shoal.host import syscalls
from shoal.images.store import Image, ImageConfig, ImageStore, Layer
from shoal.node.node import Node
from shoal.node.teardown import mounts_under, purge_home, teardown_home

BUSYBOX = Path("/bin/busybox")
APPLETS = ["sh", "cat", "ls", "echo", "head", "dd", "true", "sleep", "wc", "md5sum"]


def busybox_tree(root: Path, tag: str, filler_mib: int = 16) -> Path:
    """A minimal root filesystem: busybox + /etc/passwd, and /data/a, /data/m-filler, /data/z
    (a and z 64 KiB of random bytes each, `filler_mib` MiB between them so reading one never
    prefetches the other). `tag` makes the layer unique."""
    (root / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    for a in APPLETS:
        os.symlink("busybox", root / "bin" / a)
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    for d in ("root", "tmp", "data", "proc", "sys", "dev"):
        (root / d).mkdir(exist_ok=True)
    (root / "data" / "tag").write_text(tag)
    (root / "data" / "a").write_bytes(os.urandom(64 << 10))
    (root / "data" / "m-filler").write_bytes(os.urandom(filler_mib << 20))
    (root / "data" / "z").write_bytes(os.urandom(64 << 10))
    return root


def busybox_image(store: ImageStore, ref: str, tmp: Path, filler_mib: int = 16) -> Image:
    """Build and tag a one-layer busybox image in `store` (unique bytes per call)."""
    tree = busybox_tree(Path(tempfile.mkdtemp(prefix="bbtree-", dir=tmp)), f"{ref}-{os.urandom(8).hex()}",
                        filler_mib)
    layer = store.add_layer_from_dir(tree, {"type": "test", "desc": ref})
    shutil.rmtree(tree, ignore_errors=True)
    cfg = ImageConfig(env={"PATH": "/bin"}, workdir="/", user="root")
    drop_layer_cache(store, layer)  # as on another node: nothing of the layer in this host's page cache
    return store.put_image(ref, [layer.digest], cfg)


def chunk_files(store: ImageStore, layer: Layer) -> list[Path]:
    """The chunk objects of a layer in the store, in table order (each once)."""
    t = store.layer_table(layer.digest)
    return [store.chunks.chunk_path(h) for h in dict.fromkeys(h for h, _ in t.chunks)]


def chunk_at(store: ImageStore, layer: Layer, offset: int) -> tuple[str, int, Path]:
    """(chunk hex, offset of the chunk in the layer, object path) of the chunk holding layer byte `offset`."""
    t = store.layer_table(layer.digest)
    for (h, n), at in zip(t.chunks, t.offsets(), strict=True):
        if at <= offset < at + n:
            return h, at, store.chunks.chunk_path(h)
    raise ValueError(f"offset {offset} is past the layer's end")


def corrupt_chunk(path: Path) -> None:
    """Replace a chunk object by a valid zstd frame of other bytes of the same length (what a bit flip in the
    data would decode to: the frame is fine, the bytes do not hash to the chunk's name)."""
    import zstandard

    data = bytearray(zstandard.ZstdDecompressor().decompress(path.read_bytes()))
    data[len(data) // 2] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(zstandard.ZstdCompressor(level=3).compress(bytes(data)))
    os.chmod(path, 0o444)


def drop_layer_cache(store: ImageStore, layer: Layer) -> None:
    """Evict a layer's chunk objects from this host's page cache."""
    for p in chunk_files(store, layer) if layer.chunked else [layer.path]:
        drop_file_cache(p)


def drop_file_cache(path: Path) -> None:
    """Evict a file's clean pages from this host's page cache (they were cached when it was written)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@asynccontextmanager
async def private_node(store_root: Path, **kw: object) -> AsyncIterator[Node]:
    """A started Node with its own short SHOAL_HOME (Unix socket paths) on `store_root`; at the end its
    sandboxes are closed, its mounts undone, and nothing may remain mounted under the home."""
    home = Path(tempfile.mkdtemp(prefix="shs-", dir="/tmp"))
    paths = Paths(home=home, store=Path(store_root))
    node = Node(NodeConfig(paths=paths, memory_overcommit=1000.0, min_free_memory_mb=0, **kw))  # type: ignore[arg-type]
    try:
        await node.start()
        yield node
    finally:
        await node.stop()
        await teardown_home(paths, close_sandboxes=True)
        leaks = mounts_under(paths)
        for mp in leaks:
            syscalls.umount(mp, detach=True)
        purge_home(paths)
        assert not leaks, f"mounts leaked under {home}: {leaks}"


def loops_backed_by(prefix: str) -> list[str]:
    """Loop devices whose backing file is under `prefix` (a leak check)."""
    out = []
    for d in Path("/sys/block").glob("loop*"):
        try:
            bf = (d / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue
        if bf.startswith(prefix):
            out.append(f"/dev/{d.name}: {bf}")
    return out
