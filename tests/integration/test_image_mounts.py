"""Layer mounts: once per host, reference-counted, file-backed or loop; sandbox start copies nothing."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.config import NodeConfig, Paths
from shoal.host import syscalls
from shoal.images.mounts import LayerMounts, mount_source
from shoal.images.store import ImageStore, Layer

pytestmark = pytest.mark.root


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[Paths, ImageStore, Layer]]:
    home = Path(tempfile.mkdtemp(prefix="shm-", dir="/tmp"))
    store = ImageStore(tmp_path / "store")
    src = tmp_path / "tree"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "hello").write_text("hello\n")
    layer = store.add_layer_from_dir(src, {"type": "test"})
    paths = Paths(home=home, store=store.root)
    yield paths, store, layer
    leaks = syscalls.mounts_under(str(home))
    for mp in leaks:
        syscalls.umount(mp, detach=True)
    shutil.rmtree(home, ignore_errors=True)
    assert not leaks, f"mounts leaked: {leaks}"


def _mount_count(mp: Path) -> int:
    p = os.path.realpath(mp)
    with open("/proc/self/mountinfo") as f:
        return sum(1 for line in f if line.split()[4] == p)


def _leases(store: ImageStore, layer: Layer) -> list[str]:
    d = store.leases_dir / layer.hex
    return sorted(os.listdir(d)) if d.is_dir() else []


def test_a_layer_is_mounted_once_and_unmounted_after_its_last_user(env: tuple[Paths, ImageStore, Layer]) -> None:
    paths, store, layer = env
    lm = LayerMounts(paths)
    (mp,) = lm.acquire([layer], "sb-1")
    (mp2,) = lm.acquire([layer], "sb-2")
    assert mp == mp2 and _mount_count(mp) == 1
    assert (mp / "etc" / "hello").read_text() == "hello\n"
    assert lm.users(layer.hex) == ["sb-1", "sb-2"]
    assert _leases(store, layer) == [lm.lease_key], "other hosts sharing the store must see the layer in use"
    lm.release([layer.hex], "sb-1")
    assert syscalls.is_mountpoint(str(mp)) and lm.users(layer.hex) == ["sb-2"]
    lm.release([layer.hex], "sb-2")
    assert not syscalls.is_mountpoint(str(mp)) and not mp.exists()
    assert _leases(store, layer) == []
    # a crash left a user behind: reconcile forgets users that no longer exist, then unmounts
    lm.acquire([layer], "ghost")
    lm.reconcile(live_users=set())
    assert not syscalls.is_mountpoint(str(mp))


@pytest.mark.parametrize("mode", ["file", "loop"])
def test_forced_mount_modes(env: tuple[Paths, ImageStore, Layer], mode: str) -> None:
    paths, _, layer = env
    lm = LayerMounts(paths, mode=mode)
    (mp,) = lm.acquire([layer], "sb")
    try:
        src = mount_source(mp)
        assert src is not None
        served = lm.daemon.file(layer.hex)
        if mode == "file":
            assert Path(src) == served, "file-backed: the node reader's file of the layer, nothing copied"
        else:
            assert src.startswith("/dev/loop")
            backing = Path(f"/sys/block/{os.path.basename(src)}/loop/backing_file").read_text().strip()
            assert Path(backing) == served
        assert (mp / "etc" / "hello").read_text() == "hello\n"
    finally:
        lm.release([layer.hex], "sb")
    assert not syscalls.is_mountpoint(str(mp))
    if mode == "loop":
        # autoclear: the loop device went away with the last unmount
        r = subprocess.run(["losetup", "-j", str(served)], capture_output=True, text=True)
        assert r.stdout.strip() == ""


def test_bad_mode_is_refused(env: tuple[Paths, ImageStore, Layer]) -> None:
    from shoal.errors import InvalidRequest

    with pytest.raises(InvalidRequest):
        LayerMounts(env[0], mode="nfs")


def _store_state(store: ImageStore) -> dict[str, tuple[int, int]]:
    out = {}
    for p in store.root.rglob("*"):
        rel = str(p.relative_to(store.root))
        if rel.startswith(("leases", "prefetch")):
            continue  # mount leases and the start record (which chunks the start read) are tiny, not image data
        st = p.lstat()
        out[rel] = (st.st_size, st.st_mtime_ns)
    return out


def _tree_bytes(root: Path) -> tuple[int, list[str]]:
    total, names = 0, []
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            names.append(os.path.relpath(p, root))
            st = os.lstat(p)
            if not os.path.isdir(p):
                total += st.st_size
    return total, names


def test_sandbox_start_copies_and_unpacks_nothing(shoal_home: Path, base_image: str, tmp_path: Path) -> None:
    from shoal.models import SandboxSpec
    from shoal.node.node import Node

    store = ImageStore(tmp_path / "store")
    store.copy_image_from(ImageStore(Path(os.environ["SHOAL_STORE"])), "base:latest")
    before = _store_state(store)
    layer = store.resolve("base").layers[0]

    async def go() -> None:
        async with Node(NodeConfig(paths=Paths(home=shoal_home, store=store.root))) as node:
            info = await node.create(SandboxSpec(image="base"))
            try:
                rec = node.record(info.id)
                upper = node.backend("container").upper_dir(rec)
                size, names = _tree_bytes(Path(upper))
                assert size == 0 and set(names) <= {".shoal"}, f"the upper got {names}"
                mp = node.layer_mounts.mountpoint(layer.hex)
                src = mount_source(mp)
                # The reader's file of the layer is mounted (or its loop device), never an unpacked copy.
                # Another node of this session (the API server) may have mounted the same digest from the
                # session's store first: layer mounts are host-wide and keyed by content digest.
                assert (src or "").startswith("/dev/loop") or (src or "").endswith(f"/{layer.hex}.erofs"), src
                assert "/chunkfs/" in (src or "") or (src or "").startswith("/dev/loop"), src
                r = await node.exec(info.id, "python3 -c 'import json; print(1)'")
                assert r.exit_code == 0
                # reading files inside the sandbox changed nothing on disk either
                size, names = _tree_bytes(Path(upper))
                assert size == 0 and set(names) <= {".shoal"}, f"the upper got {names}"
            finally:
                await node.close(info.id)

    asyncio.run(go())
    assert _store_state(store) == before, "starting a sandbox must not write to the image store"
