"""Loop devices at admission (issue 24, item 1): a create whose image layers would be mounted through loop
devices the host cannot give is refused with CapacityExceeded(resource="loop devices") before anything is
made; a create whose layers are already mounted needs none and goes through. The count is the kernel's
real state (/sys/block, a device this test adds through /dev/loop-control and binds to a file), seen
through a /dev that holds only that device, so the test never starves other users of the host's loops."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.errors import CapacityExceeded
from shoal.images.store import ImageStore
from shoal.models import SandboxSpec
from shoal.node import capacity
from tests.integration.storeutil import busybox_image, loops_backed_by, private_node

pytestmark = [pytest.mark.root, pytest.mark.timeout(240)]
SPEC = {"memory_mb": 64}
LOOP_CTL_ADD, LOOP_CTL_REMOVE = 0x4C80, 0x4C81


@contextlib.contextmanager
def own_loop_device() -> Iterator[str]:
    """A loop device this test adds (a high index nobody's `losetup --find` reaches first) and removes."""
    if not capacity._is_loop_control(Path("/dev/loop-control")):
        pytest.skip("no /dev/loop-control on this host")
    fd = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    try:
        for idx in range(500_000 + os.getpid() % 1000, 600_000, 1009):
            try:
                fcntl.ioctl(fd, LOOP_CTL_ADD, idx)
                break
            except OSError:
                continue
        else:
            pytest.skip("could not add a loop device")
        try:
            yield f"loop{idx}"
        finally:
            subprocess.run(["losetup", "-d", f"/dev/loop{idx}"], capture_output=True)
            with contextlib.suppress(OSError):
                fcntl.ioctl(fd, LOOP_CTL_REMOVE, idx)
    finally:
        os.close(fd)


def _view_with(dev: Path, name: str) -> None:
    """Make `dev` a /dev holding only the block node of loop device `name` (no loop-control)."""
    major, minor = (int(x) for x in Path(f"/sys/block/{name}/dev").read_text().split(":"))
    os.mknod(dev / name, stat.S_IFBLK | 0o600, os.makedev(major, minor))


async def test_a_create_needing_loop_devices_the_host_lacks_is_refused_at_admission(tmp_path: Path) -> None:
    store_root = tmp_path / "store"
    store = ImageStore(store_root)
    busybox_image(store, "bb:mounted", tmp_path, filler_mib=1)
    busybox_image(store, "bb:new", tmp_path, filler_mib=1)
    dev = tmp_path / "dev"
    dev.mkdir()
    backing = tmp_path / "taken.img"
    backing.write_bytes(b"\0" * (1 << 20))
    with own_loop_device() as name:
        _view_with(dev, name)
        # the real count through that view: the device is free (nothing backs it), none can be added
        lo = capacity.loop_devices(dev)
        assert (lo.free, lo.creatable, lo.available) == (1, 0, 1)
        async with private_node(store_root) as node:
            home = str(node.paths.home)
            node.layer_mounts.mode = "loop"  # every new layer mount takes a loop device
            node.capacity.dev = dev
            first = await node.create(SandboxSpec(image="bb:mounted", **SPEC))  # 1 needed, 1 free: admitted
            assert any(src.startswith("/dev/loop") for src in _sources(node))
            # another process takes the last free device
            subprocess.run(["losetup", "--read-only", f"/dev/{name}", str(backing)], check=True)
            lo = capacity.loop_devices(dev)
            assert (lo.free, lo.creatable) == (0, 0) and (Path("/sys/block") / name / "loop").is_dir()
            # the image whose layer is mounted already needs no loop device: admitted, and it runs
            again = await node.create(SandboxSpec(image="bb:mounted", **SPEC))
            assert (await node.exec(again.id, ["cat", "/data/tag"])).exit_code == 0
            # the other image's layer would need one: refused up front, by name, nothing made
            sandboxes = {e.name for e in os.scandir(node.paths.sandboxes)}
            mounted = node.layer_mounts.mounted()
            loops = loops_backed_by(home)
            with pytest.raises(CapacityExceeded) as ei:
                await node.create(SandboxSpec(image="bb:new", **SPEC))
            e = ei.value
            assert e.details["reason"] == "resource" and e.details["resource"] == "loop devices", e.details
            assert e.details["used"] == e.details["limit"] and "losetup -D" in e.message and e.retry_after_s > 0
            assert {e.name for e in os.scandir(node.paths.sandboxes)} == sandboxes
            assert node.layer_mounts.mounted() == mounted and loops_backed_by(home) == loops
            assert node.admission.snapshot().pending == 0 and node.capacity.in_flight == 0
            # a burst of them: every item refused by name
            items = await node.create_many(SandboxSpec(image="bb:new", **SPEC), 3)
            assert all(isinstance(i, CapacityExceeded) and i.details["resource"] == "loop devices" for i in items)
            # the host's own /dev (loop-control adds devices on demand): the same create goes through
            node.capacity.dev = Path("/dev")
            new = await node.create(SandboxSpec(image="bb:new", **SPEC))
            assert (await node.exec(new.id, ["cat", "/data/tag"])).exit_code == 0
            for sb in (first, again, new):
                await node.close(sb.id)
            assert not node.layer_mounts.mounted()
        assert not loops_backed_by(str(store_root)) and not loops_backed_by(home)


def _sources(node) -> list[str]:  # type: ignore[no-untyped-def]
    from shoal.images.mounts import mount_source

    return [mount_source(node.layer_mounts.mountpoint(h)) or "" for h in node.layer_mounts.mounted()]
