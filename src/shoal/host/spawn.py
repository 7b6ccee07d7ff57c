"""Run host commands from asyncio without the cost of fork+exec of a big Python process.

posix_spawn (vfork under the hood) plus a pidfd watched by the event loop: spawning `crun` this way
takes a fraction of asyncio.create_subprocess_exec's time, and lets us place an fd at an exact number
(the agent's listening socket must be fd 3 in the container).
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass

from shoal.errors import Timeout


@dataclass
class Completed:
    """Exit status and captured output of a host command."""

    argv: list[str]
    returncode: int
    stdout: bytes
    stderr: bytes

    def check(self, what: str | None = None) -> Completed:
        """Raise RuntimeError carrying stderr when the command failed."""
        if self.returncode != 0:
            msg = self.stderr.decode(errors="replace").strip() or self.stdout.decode(errors="replace").strip()
            raise RuntimeError(f"{what or self.argv[0]} failed (exit {self.returncode}): {msg[-2000:]}")
        return self


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            b = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not b:
            break
        chunks.append(b)
    return b"".join(chunks)


async def run(argv: list[str], *, fds: dict[int, int] | None = None, timeout: float | None = 60.0,
              env: dict[str, str] | None = None, stdin: bytes | None = None,
              executable: str | None = None) -> Completed:
    """Run `argv`, capture stdout/stderr; `fds` maps child fd number -> parent fd to place there.
    `executable` (an absolute path) is run instead of looking `argv[0]` up on PATH."""
    loop = asyncio.get_running_loop()
    out_r, out_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    err_r, err_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    in_r = -1
    in_w = -1
    if stdin is not None:
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
    devnull = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    actions: list[tuple] = [
        (os.POSIX_SPAWN_DUP2, in_r if stdin is not None else devnull, 0),
        (os.POSIX_SPAWN_DUP2, out_w, 1),
        (os.POSIX_SPAWN_DUP2, err_w, 2),
    ]
    extra_dups: list[int] = []
    for child_fd, parent_fd in (fds or {}).items():
        if parent_fd == child_fd:
            # dup2 onto itself is a no-op that keeps O_CLOEXEC: go through a fresh number first
            parent_fd = os.dup(parent_fd)
            extra_dups.append(parent_fd)
        actions.append((os.POSIX_SPAWN_DUP2, parent_fd, child_fd))
    try:
        if executable is not None:
            pid = os.posix_spawn(executable, argv, env if env is not None else os.environ, file_actions=actions)
        else:
            pid = os.posix_spawnp(argv[0], argv, env if env is not None else os.environ, file_actions=actions)
    finally:
        os.close(out_w)
        os.close(err_w)
        os.close(devnull)
        for fd in extra_dups:
            os.close(fd)
        if stdin is not None:
            os.close(in_r)
    if stdin is not None:
        try:
            os.write(in_w, stdin)
        finally:
            os.close(in_w)
    pidfd = os.pidfd_open(pid)
    out: list[bytes] = []
    err: list[bytes] = []
    done = loop.create_future()

    def on_exit() -> None:
        if not done.done():
            done.set_result(None)

    def on_out() -> None:
        out.append(_read_all(out_r))

    def on_err() -> None:
        err.append(_read_all(err_r))

    loop.add_reader(pidfd, on_exit)
    loop.add_reader(out_r, on_out)
    loop.add_reader(err_r, on_err)
    try:
        try:
            await asyncio.wait_for(asyncio.shield(done), timeout)
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            await done
            raise Timeout(f"host command timed out after {timeout}s: {' '.join(argv)}") from None
        finally:
            loop.remove_reader(pidfd)
            _, status = os.waitpid(pid, 0)
        # the child exited; whatever is left in the pipes is readable now (unless a grandchild holds them)
        loop.remove_reader(out_r)
        loop.remove_reader(err_r)
        out.append(_read_all(out_r))
        err.append(_read_all(err_r))
    finally:
        loop.remove_reader(out_r)
        loop.remove_reader(err_r)
        os.close(pidfd)
        os.close(out_r)
        os.close(err_r)
    return Completed(list(argv), os.waitstatus_to_exitcode(status), b"".join(out), b"".join(err))


def run_sync(argv: list[str], *, timeout: float | None = 60.0, check: bool = False,
             stdin: bytes | None = None, env: dict[str, str] | None = None) -> Completed:
    """Blocking variant for CLI code paths and tests (plain subprocess)."""
    import subprocess

    try:
        p = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout, env=env,
                           stdin=None if stdin is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise Timeout(f"host command timed out after {timeout}s: {' '.join(argv)}") from None
    c = Completed(list(argv), p.returncode, p.stdout, p.stderr)
    return c.check() if check else c
