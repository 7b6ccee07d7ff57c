"""A node on a used machine (issue 24, item 6): a dead FUSE mount elsewhere on the host — a layer reader or
any other FUSE server killed without unmounting — must not cost a new node its disk limits.

mkfs.btrfs checks every btrfs mount on the host and stats the file behind its loop device; when that path
runs through a FUSE mount whose server is gone, the stat answers ENOTCONN and mkfs.btrfs refuses to make
the node's upper pool ("cannot check mount status … Transport endpoint is not connected"). The test makes
exactly that host state with real mounts, shows mkfs.btrfs trips over it, and that a new node still
enforces `disk_mb`; then removes every mount, loop device and directory it made."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.backends.container.disk import mkfs_btrfs
from shoal.host import syscalls

pytestmark = [pytest.mark.root]

_libc = ctypes.CDLL(None, use_errno=True)


def _dead_fuse_mount(at: Path) -> None:
    """Mount a FUSE filesystem at `at` and close its connection without serving it: what a FUSE server that
    was killed leaves behind (every access answers ENOTCONN until someone unmounts it)."""
    fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
        if _libc.mount(b"shoal-test-dead", str(at).encode(), b"fuse.shoal-test-dead", 0, opts) != 0:
            e = ctypes.get_errno()
            pytest.skip(f"cannot mount FUSE here: {os.strerror(e)}")
    finally:
        os.close(fd)  # the connection is aborted with its last descriptor


def _run(*argv: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture
def dead_mount_under_a_btrfs() -> Iterator[Path]:
    """A btrfs on a loop device whose backing file's directory is now a dead FUSE mount."""
    if not (shutil.which("mkfs.btrfs") and os.path.exists("/dev/fuse")):
        pytest.skip("needs mkfs.btrfs and /dev/fuse")
    scratch = Path(tempfile.mkdtemp(prefix="shdm-", dir="/tmp"))
    served, other = scratch / "served", scratch / "other"
    served.mkdir()
    other.mkdir()
    img = served / "other.btrfs"
    with open(img, "wb") as f:
        f.truncate(256 << 20)
    mounted = dead = False
    try:
        # through the node's own mkfs: a dead mount a killed process left elsewhere on this host (not the one
        # this test makes) must not fail the setup
        mkfs_btrfs(["mkfs.btrfs", "-q", "--mixed", str(img)])
        r = _run("mount", "-o", "loop", str(img), str(other))
        assert r.returncode == 0, r.stderr
        mounted = True
        _dead_fuse_mount(served)
        dead = True
        yield scratch
    finally:
        if dead:
            syscalls.umount(str(served), detach=True)
        if mounted:
            _run("umount", str(other))

        def loops() -> list[str]:
            return [ln.split(":", 1)[0] for ln in _run("losetup", "-a").stdout.splitlines() if str(scratch) in ln]

        # autoclear lets go of the loop device once btrfs has released it, which can take a moment
        for dev in loops():
            _run("losetup", "-d", dev)
        leaks = syscalls.mounts_under(str(scratch))
        shutil.rmtree(scratch, ignore_errors=True)
        assert not leaks and not loops(), (leaks, loops())


_PROGRAM = """
import asyncio, json, shoal

async def main():
    async with shoal.Client() as c:
        sb = await c.create("base", disk_mb=32, memory_mb=64)
        r = await sb.exec("dd if=/dev/zero of=/root/big bs=1M count=64")
        size = (await sb.exec(["python3", "-c", "import os; print(os.path.getsize('/root/big'))"])).stdout
        print(json.dumps({"enforced": sb.info.extra.get("disk_limit_enforced"), "exit": r.exit_code,
                          "stderr": r.stderr.decode(errors="replace")[-300:], "size": int(size)}))
        await sb.close()

asyncio.run(main())
"""


def test_a_dead_fuse_mount_elsewhere_does_not_cost_a_new_node_its_disk_limits(
        dead_mount_under_a_btrfs: Path, base_image: str) -> None:
    scratch = dead_mount_under_a_btrfs
    with pytest.raises(OSError) as ei:
        os.stat(scratch / "served")
    assert ei.value.errno == errno.ENOTCONN
    assert str(scratch / "served") in syscalls.dead_mounts()
    # the host state trips mkfs.btrfs itself (so this test fails when the node does not work around it)
    probe = scratch / "probe.img"
    with open(probe, "wb") as f:
        f.truncate(256 << 20)
    r = _run("mkfs.btrfs", "-q", "-f", "--mixed", str(probe))
    assert r.returncode != 0 and "cannot check mount status" in r.stderr, r.stderr

    home = scratch / "home"  # a fresh node home: its upper pool is made now, on this host
    env = {**os.environ, "SHOAL_HOME": str(home)}
    try:
        r = _run(sys.executable, "-c", _PROGRAM, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["enforced"] is True, (out, r.stderr[-2000:])
        assert out["exit"] != 0 and ("quota" in out["stderr"].lower() or "space" in out["stderr"].lower()), out
        assert out["size"] <= 33 * 2**20, out
        # the host's mounts were not touched: the dead one is still there for its owner to clean up
        assert str(scratch / "served") in syscalls.dead_mounts()
    finally:
        t = _run(sys.executable, "-m", "shoal.cli.main", "node", "teardown", "--close-sandboxes", "--purge", env=env)
    assert t.returncode == 0, t.stderr
    assert not home.exists()
