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
from shoal.images.store import Image, ImageConfig, ImageStore
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
    drop_file_cache(layer.path)  # as on another node: nothing of the layer in this host's page cache
    return store.put_image(ref, [layer.digest], cfg)


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
