"""Layer integrity (issues 14 and 19.4): a layer is checked against its digest before its first mount on a
node; a corrupt or truncated layer raises ImageCorrupt and is never mounted — embedded and over HTTP,
where the error is typed and shows no host path."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest

import shoal
from shoal.config import Paths
from shoal.errors import ImageCorrupt
from shoal.images import mounts as mounts_mod
from shoal.images.mounts import LayerMounts
from shoal.images.store import Image, ImageStore
from shoal.models import SandboxSpec
from shoal.node.records import list_records
from shoal.server.proc import ServerProcess
from tests.integration.storeutil import busybox_image, busybox_tree, loops_backed_by, private_node

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]
SPEC = {"memory_mb": 64}


def _flip(path: Path, offset: int, n: int = 16) -> None:
    """Overwrite n bytes at `offset` with their complement (through the filesystem, as a bad write would)."""
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))
    os.chmod(path, 0o444)


def _assert_nothing_mounted(node: object, img: Image) -> None:
    lm: LayerMounts = node.layer_mounts  # type: ignore[attr-defined]
    assert img.layers[0].hex not in lm.mounted(), "a corrupt layer must never be mounted"
    assert not (lm.root / f"{img.layers[0].hex}.users").exists(), "a failed mount leaves no trace"
    lm.reconcile(set())  # (an empty users dir left behind made this raise IsADirectoryError)
    assert not loops_backed_by(str(img.layers[0].path))
    assert not list_records(node.paths.sandboxes)  # type: ignore[attr-defined]


async def test_flipped_data_bytes_raise_image_corrupt_and_nothing_is_mounted(store_root: Path,
                                                                              tmp_path: Path) -> None:
    """Bytes flipped inside a data block (the attack of issue 19.4 served corrupted files silently)."""
    store = ImageStore(store_root)
    img = busybox_image(store, "bb:flipped", tmp_path, filler_mib=4)
    _flip(img.layers[0].path, img.layers[0].size // 2)
    async with private_node(store_root) as node:
        with pytest.raises(ImageCorrupt) as ei:
            await node.create(SandboxSpec(image="bb:flipped", **SPEC))
        assert img.layers[0].digest in ei.value.message
        assert str(store_root) not in ei.value.message, "errors reach API clients: no host paths"
        _assert_nothing_mounted(node, img)
        # and again: a corrupt layer is never remembered as good
        with pytest.raises(ImageCorrupt):
            await node.create(SandboxSpec(image="bb:flipped", **SPEC))


async def test_a_truncated_layer_raises_image_corrupt(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    img = busybox_image(store, "bb:short", tmp_path, filler_mib=1)
    path = img.layers[0].path
    os.chmod(path, 0o644)
    os.truncate(path, img.layers[0].size // 2)
    async with private_node(store.root) as node:
        with pytest.raises(ImageCorrupt, match="truncated"):
            await node.create(SandboxSpec(image="bb:short", **SPEC))
        _assert_nothing_mounted(node, img)


async def test_a_bad_superblock_is_image_corrupt_even_with_verification_off(tmp_path: Path) -> None:
    """With SHOAL_VERIFY_LAYERS=0 the kernel's refusal is still a typed error (it was a raw OSError), and it
    does not make this process give up file-backed mounts for good layers."""
    store = ImageStore(tmp_path / "store")
    bad = busybox_image(store, "bb:badsb", tmp_path, filler_mib=1)
    busybox_image(store, "bb:good", tmp_path, filler_mib=1)
    os.chmod(bad.layers[0].path, 0o644)
    with open(bad.layers[0].path, "r+b") as f:
        f.seek(1024)  # the EROFS superblock
        f.write(b"\0" * 128)
    async with private_node(store.root) as node:
        node.layer_mounts.verifier.enabled = False
        with pytest.raises(ImageCorrupt, match="does not mount"):
            await node.create(SandboxSpec(image="bb:badsb", **SPEC))
        _assert_nothing_mounted(node, bad)
        info = await node.create(SandboxSpec(image="bb:good", **SPEC))
        assert mounts_mod.erofs_mode().startswith("file-backed"), mounts_mod.erofs_mode()
        await node.close(info.id)


def test_verification_is_remembered_per_node_by_file_identity(tmp_path: Path) -> None:
    """Hashed once per node (not per create, not per restart of the node agent); hashed again when the
    file changed (new ctime) — then a corruption made meanwhile is caught."""
    store = ImageStore(tmp_path / "store")
    home = Path(tempfile.mkdtemp(prefix="shv-", dir="/tmp"))
    try:
        paths = Paths(home=home, store=store.root)
        img = busybox_image(store, "bb:cached", tmp_path, filler_mib=1)
        layer = img.layers[0]
        lm = LayerMounts(paths)
        for i in range(3):
            lm.acquire([layer], f"sb{i}")
            lm.release([layer.hex], f"sb{i}")
        assert lm.verifier.hashed_bytes == layer.size, "one hash for three first-mounts on this node"
        lm2 = LayerMounts(paths)  # a restarted node agent
        lm2.acquire([layer], "sb")
        lm2.release([layer.hex], "sb")
        assert lm2.verifier.hashed_bytes == 0
        _flip(layer.path, layer.size // 2)
        with pytest.raises(ImageCorrupt):
            lm2.acquire([layer], "sb")
        assert not lm2.mounted()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_republishing_a_layer_heals_a_corrupt_copy(tmp_path: Path) -> None:
    """A same-size but corrupt file under a digest is replaced when the layer is published again
    (a build or import of the same content), instead of being kept because it already exists."""
    store = ImageStore(tmp_path / "store")
    tree = busybox_tree(tmp_path / "tree", "heal", filler_mib=1)
    layer = store.add_layer_from_dir(tree, {"type": "test"})
    _flip(layer.path, layer.size // 2)
    assert not store.verify_layer(layer.digest)
    again = store.add_layer_from_dir(tree, {"type": "test"})
    assert again.digest == layer.digest and store.verify_layer(layer.digest)


def test_http_create_of_a_corrupt_image_is_typed_and_shows_no_host_paths(tmp_path: Path) -> None:
    """Over HTTP: 500 with code image_corrupt (an operator problem, not bad input), no store path in the
    body, the keep-alive connection stays usable; the SDK raises shoal.ImageCorrupt."""
    store_root = Path(tempfile.mkdtemp(prefix="sts-", dir="/var/tmp"))
    home = Path(tempfile.mkdtemp(prefix="shh-", dir="/tmp"))
    store = ImageStore(store_root)
    img = busybox_image(store, "bb:http", tmp_path, filler_mib=1)
    _flip(img.layers[0].path, img.layers[0].size // 2)
    try:
        env = dict(os.environ, SHOAL_HOME=str(home), SHOAL_STORE=str(store_root))
        with ServerProcess(env=env, log_path=home / "server.log") as srv:
            with httpx.Client(base_url=srv.url, timeout=60) as h:
                r = h.post("/v1/sandboxes", json={"image": "bb:http", **SPEC})
                assert r.status_code == 500, r.text
                err = r.json()["error"]
                assert err["code"] == "image_corrupt" and img.layers[0].digest in err["message"]
                assert str(store_root) not in r.text and "/var/" not in r.text and "/tmp/" not in r.text
                assert h.get("/v1/sandboxes").status_code == 200

            async def sdk() -> None:
                async with shoal.Client(srv.url, timeout=60) as c:
                    with pytest.raises(shoal.ImageCorrupt):
                        await c.create("bb:http", **SPEC)

            asyncio.run(sdk())
    finally:
        from shoal.node.teardown import teardown_home

        with contextlib.suppress(Exception):
            asyncio.run(teardown_home(Paths(home=home, store=store_root), close_sandboxes=True))
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(store_root, ignore_errors=True)


async def test_a_microvm_never_boots_on_a_corrupt_layer(tmp_path: Path) -> None:
    """microVMs read layer files as disks (no host mount): the same check runs before QEMU starts."""
    from shoal.backends.qemu import find_qemu
    from shoal.errors import BackendUnavailable

    try:
        find_qemu()
    except BackendUnavailable as e:
        pytest.skip(e.message)
    store = ImageStore(tmp_path / "store")
    img = busybox_image(store, "bb:vm", tmp_path, filler_mib=1)
    _flip(img.layers[0].path, img.layers[0].size // 2)
    async with private_node(store.root) as node:
        with pytest.raises(ImageCorrupt):
            await node.create(SandboxSpec(image="bb:vm", backend="microvm", memory_mb=256))
        assert not list_records(node.paths.sandboxes)
