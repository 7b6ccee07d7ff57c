"""The one host-wide file lock helper (shoal.fsutil.flocked / aflocked): exclusive across processes, made
with its directory, released when the block ends, and waited for off the event loop by the async form."""

from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
import sys
from pathlib import Path

from shoal.fsutil import aflocked, flocked


def _held_elsewhere(path: Path) -> bool:
    # another process tries the same lock without waiting
    code = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\n"
            "try:\n    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept BlockingIOError:\n    sys.exit(3)\n")
    return subprocess.run([sys.executable, "-c", code, str(path)]).returncode == 3


def test_flocked_makes_the_file_and_excludes_other_processes(tmp_path: Path) -> None:
    lock = tmp_path / "deep" / "dir" / "x.lock"
    with flocked(lock) as fd:
        assert lock.exists() and (lock.stat().st_mode & 0o777) == 0o600
        assert fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC  # never inherited by a sandbox's processes
        assert _held_elsewhere(lock)
    assert not _held_elsewhere(lock)
    try:
        with flocked(lock):
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert not _held_elsewhere(lock)  # released on an error too


def test_aflocked_waits_without_blocking_the_loop(tmp_path: Path) -> None:
    lock = tmp_path / "build.lock"

    async def main() -> list[str]:
        order: list[str] = []
        holder = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(holder, fcntl.LOCK_EX)  # "another process" (another open file) holds it

        async def waiter() -> None:
            async with aflocked(lock):
                order.append("got")

        task = asyncio.create_task(waiter())
        for _ in range(5):
            await asyncio.sleep(0.01)
            order.append("tick")  # the loop keeps running while the waiter waits
        assert not task.done()
        os.close(holder)
        await asyncio.wait_for(task, 30)
        return order

    order = asyncio.run(main())
    assert order[:5] == ["tick"] * 5 and order[-1] == "got"
    assert not _held_elsewhere(lock)


def test_shared_holders_coexist_and_keep_an_exclusive_one_out(tmp_path: Path) -> None:
    lock = tmp_path / "use.lock"
    with flocked(lock, shared=True), flocked(lock, shared=True):  # two readers at once (two open files)
        assert _held_elsewhere(lock)  # a writer waits
    assert not _held_elsewhere(lock)
