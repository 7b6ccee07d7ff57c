"""`shoal shell` (PTY and piped), `shoal pause/resume/snapshot/fork`, run as a user would (issue 4, item 6)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import secrets
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.config import Paths
from shoal.images.store import ImageStore
from tests.waiting import wait_for

pytestmark = [pytest.mark.root, pytest.mark.slow]
SHOAL = str(Path(sys.executable).with_name("shoal"))


def _shoal(*args: str, stdin: bytes | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([SHOAL, *args], input=stdin, capture_output=True, timeout=timeout, env=os.environ)


@pytest.fixture
def sandbox_id(shoal_home: Path, base_image: str) -> Iterator[str]:
    """A sandbox made by the CLI (another process), removed by the CLI afterwards."""
    r = _shoal("create", "base", "--memory-mb", "256")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.decode().strip()
    yield sid
    _shoal("rm", sid)


def test_shell_piped(sandbox_id: str) -> None:
    r = _shoal("shell", sandbox_id, stdin=b"cd /tmp\nexport A=1\necho $A $(pwd)\necho oops >&2\nexit 3\n")
    assert r.returncode == 3
    assert r.stdout == b"1 /tmp\n"
    assert r.stderr.endswith(b"oops\n")
    r = _shoal("shell", sandbox_id, "--", "python3", "-c", "import sys; print(sys.stdin.read().upper())",
               stdin=b"shout")
    assert (r.returncode, r.stdout) == (0, b"SHOUT\n")


def _read_until(fd: int, token: bytes, timeout: float) -> bytes:
    """What the terminal printed until `token` appeared (or `timeout` passed, or it closed)."""
    buf = b""
    end = time.monotonic() + timeout
    while token not in buf and time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
    return buf


def _expect(fd: int, token: bytes, timeout: float = 20) -> bytes:
    buf = _read_until(fd, token, timeout)
    assert token in buf, (token, buf[-400:])
    return buf


def test_shell_interactive_pty(sandbox_id: str) -> None:
    pid, fd = pty.fork()
    if pid == 0:  # the child: `shoal shell ID` on a terminal
        os.execv(SHOAL, [SHOAL, "shell", sandbox_id])
    try:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        _expect(fd, b"# ")
        os.write(fd, b"stty size; echo $((6*7))\r")
        assert b"40 120" in _expect(fd, b"42")
        # the window grows: SIGWINCH reaches `shoal shell`, which resizes the sandbox's PTY (asynchronously:
        # ask until the shell inside sees the new size)
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 99, 0, 0))
        os.kill(pid, signal.SIGWINCH)

        def resized() -> bool:
            os.write(fd, b"stty size\r")
            return b"33 99" in _read_until(fd, b"# ", 5)

        wait_for(resized, what="the sandbox's terminal to take the new size (33 99)")
        # an interactive REPL inside the interactive shell
        os.write(fd, b"python3 -q\r")
        _expect(fd, b">>> ")
        os.write(fd, b"print(6*7)\r")
        _expect(fd, b"42\r\n>>> ")
        os.write(fd, b"\x04")  # ^D ends python (raw mode passes it through)
        _expect(fd, b"# ")
        os.write(fd, b"exit 4\r")
        _, status = os.waitpid(pid, 0)
        pid = 0
        assert os.WEXITSTATUS(status) == 4
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


def test_pause_resume_snapshot_fork_commands(sandbox_id: str) -> None:
    r = _shoal("pause", sandbox_id)
    assert r.returncode == 0, r.stderr
    assert b"paused" in r.stdout
    r = _shoal("ls", "--json")
    assert b'"state": "paused"' in r.stdout
    r = _shoal("exec", sandbox_id, "--", "sh", "-c", "echo forked > /root/f")  # auto-resume
    assert r.returncode == 0, r.stderr
    r = _shoal("pause", sandbox_id)
    r = _shoal("resume", sandbox_id)
    assert r.returncode == 0 and b"resumed" in r.stdout
    name = f"test-stateful/cli-{secrets.token_hex(4)}:v1"
    kids: list[str] = []
    try:
        r = _shoal("snapshot", sandbox_id, name)
        assert r.returncode == 0, r.stderr
        assert name.encode() in r.stdout
        r = _shoal("fork", sandbox_id, "-n", "2", "--name", name + "-fork")
        assert r.returncode == 0, r.stderr
        kids = r.stdout.decode().split()
        assert len(kids) == 2
        for k in kids:
            assert _shoal("exec", k, "--", "cat", "/root/f").stdout == b"forked\n"
        r = _shoal("fork", sandbox_id, "-n", "1", "--memory")
        assert r.returncode == 1 and b"files only" in b" ".join(r.stderr.split())  # rich wraps lines
        r = _shoal("pause", "n0-" + "a" * 26)
        assert r.returncode == 1 and b"no sandbox" in b" ".join(r.stderr.split())
    finally:
        if kids:
            _shoal("rm", *kids)
        store = ImageStore(Paths.from_env().store)
        for ref in (name, name + "-fork"):
            with contextlib.suppress(Exception):
                store.remove_image(ref)


def test_node_swap_status() -> None:
    r = _shoal("node", "swap", "--json")
    assert r.returncode == 0
    assert b'"swap"' in r.stdout and b'"zram"' in r.stdout
    r = _shoal("node", "swap", "--zram", "1X")
    assert r.returncode == 1 and b"bad size" in b" ".join(r.stderr.split())


def test_node_swap_on_and_off() -> None:
    from shoal.backends.container import reclaim

    if reclaim.swap_active():
        pytest.skip("the host already has swap; not turning it off")
    try:
        r = _shoal("node", "swap", "--zram", "256M")
        assert r.returncode == 0, r.stderr
        assert b"zram swap on" in r.stderr and b"/dev/zram" in r.stdout
        assert reclaim.swap_active()
    finally:
        r = _shoal("node", "swap", "--off")
    assert r.returncode == 0 and b"zram swap off" in r.stderr
    assert not reclaim.swap_active()
