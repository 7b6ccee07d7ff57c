"""Item 8 of issue 19: kernel interfaces a sandbox must not reach, and host facts it must not read.

Each test runs a real container sandbox and tries the attack from inside it, as the attack run did."""

from __future__ import annotations

import os

import pytest

import shoal

pytestmark = [pytest.mark.root]

# syscall numbers on x86-64 (the sandbox's python calls them through libc's syscall())
_IO_URING_SETUP = 425
_PROBE = """
import ctypes, errno, socket
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)
fd = libc.syscall(425, 4, params)
print("io_uring", fd, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))
try:
    socket.socket(40, socket.SOCK_STREAM)   # AF_VSOCK
    print("vsock open")
except OSError as e:
    print("vsock", errno.errorcode[e.errno])
"""


async def test_io_uring_and_vsock_are_refused(client: shoal.Client) -> None:
    """io_uring_setup answers ENOSYS (callers fall back to plain syscalls) and AF_VSOCK sockets
    EAFNOSUPPORT, with the network off and on."""
    for network in (False, True):
        sb = await client.create("base", network=network)
        r = await sb.exec(["python3", "-c", _PROBE])
        assert r.exit_code == 0, r.stderr
        assert r.stdout.decode().split("\n")[:2] == ["io_uring -1 ENOSYS", "vsock EAFNOSUPPORT"], r.stdout
        await sb.close()


async def test_mountinfo_names_no_host_path(client: shoal.Client) -> None:
    """/proc/self/mountinfo (and /proc/mounts) show neither the node's directories nor the host's disk."""
    sb = await client.create("base")
    home = os.environ["SHOAL_HOME"]
    for f in ("/proc/self/mountinfo", "/proc/mounts"):
        text = (await sb.exec(["cat", f])).stdout.decode()
        assert "lowerdir=" in text  # the overlay is there, named by relative links
        for leak in (home, "/dev/vda", "/var/lib/shoal", "/tmp/", "devtmpfs", "/layers/", "/uppers/"):
            assert leak not in text, f"{f} shows {leak!r}:\n{text}"
    await sb.close()


async def test_host_kernel_facts_are_hidden(client: shoal.Client) -> None:
    """/proc/cmdline is empty, /proc/meminfo reports the sandbox's own limit, the host's block devices
    are not listed."""
    sb = await client.create("base", memory_mb=300)
    r = await sb.exec("cat /proc/cmdline | wc -c; grep MemTotal /proc/meminfo; "
                      "find /sys/block /sys/class/block /sys/dev/block -mindepth 1 | wc -l; "
                      "cat /proc/partitions /proc/diskstats /proc/swaps | wc -c; free -m | grep Mem:")
    lines = r.stdout.decode().split("\n")
    assert lines[0] == "0"
    assert lines[1].split() == ["MemTotal:", str(300 * 1024), "kB"]
    assert lines[2] == "0" and lines[3] == "0"
    assert lines[4].split()[1] == "300", lines  # `free` works and agrees
    await sb.close()


async def test_raw_sockets_only_with_network(client: shoal.Client) -> None:
    """CAP_NET_RAW is granted only to networked sandboxes (the only ones where packet tools make sense)."""
    probe = ["python3", "-c", "import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW); print('raw')"]
    off = await client.create("base")
    r = await off.exec(probe)
    assert r.exit_code != 0 and b"PermissionError" in r.stderr
    on = await client.create("base", network=True)
    assert (await on.exec(probe)).stdout == b"raw\n"
