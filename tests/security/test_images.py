"""Item 9 of issue 19: OCI images without /etc/passwd (scratch, distroless) run as uid 0, as under Docker."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from shoal.errors import InvalidRequest, SandboxError
from shoal.images.archive import image_config, layer_tar, write_oci_layout
from shoal.images.oci import import_archive
from shoal.images.store import ImageStore

pytestmark = [pytest.mark.root]


def test_image_without_passwd_runs_as_root(tmp_path: Path, shoal_home: Path) -> None:
    """No /etc/passwd at all, no User in the config: exec works as uid 0 (also user="root" and "0"); an
    unknown name is still refused with a typed error."""
    busybox = Path("/bin/busybox")
    if not busybox.exists():
        pytest.skip("busybox-static is not installed (make setup installs it)")
    layer = layer_tar([("dir", "bin", 0o755), ("file", "bin/busybox", busybox.read_bytes(), 0o755),
                       ("symlink", "bin/sh", "busybox"), ("symlink", "bin/id", "busybox"), ("dir", "tmp", 0o1777)])
    store = ImageStore(tmp_path / "store")
    cfg = image_config([layer], env=["PATH=/bin"])
    import_archive(store, write_oci_layout(tmp_path / "scratch.tar", [layer], cfg), "scratch:1")
    from shoal.config import NodeConfig, Paths
    from shoal.models import SandboxSpec
    from shoal.node.node import Node

    async def go() -> None:
        async with Node(NodeConfig(paths=Paths(home=shoal_home, store=tmp_path / "store"))) as node:
            info = await node.create(SandboxSpec(image="scratch:1"))
            try:
                for user in (None, "root", "0", "0:0"):
                    r = await node.exec(info.id, ["/bin/id", "-u"], user=user)
                    assert (r.exit_code, r.stdout) == (0, b"0\n"), (user, r)
                assert (await node.exec(info.id, ["/bin/id", "-u"], user="1234")).stdout == b"1234\n"
                with pytest.raises((InvalidRequest, SandboxError), match="no such user"):
                    await node.exec(info.id, ["/bin/id"], user="nobody")
            finally:
                await node.close(info.id)

    asyncio.run(go())
