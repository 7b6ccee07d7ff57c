"""Small filesystem helpers: atomic writes that are safe on shared filesystems, hashing, unique temp names,
host-wide file locks."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

_HOST = socket.gethostname().replace("/", "_")[:32]


def tmp_name(prefix: str = "") -> str:
    """A temp file name unique across hosts sharing a filesystem (host + pid + random)."""
    return f".tmp-{prefix}{_HOST}-{os.getpid()}-{secrets.token_hex(6)}"


def atomic_write(path: Path, data: bytes, mode: int = 0o644, fsync: bool = True) -> None:
    """Write `data` to `path` atomically: temp file in the same directory, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / tmp_name()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: Path, obj: Any, fsync: bool = True) -> None:
    """Atomically write `obj` as pretty JSON."""
    atomic_write(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(), fsync=fsync)


def read_json(path: Path) -> Any:
    """Read a JSON file."""
    with open(path, "rb") as f:
        return json.loads(f.read())


def canonical_json(obj: Any) -> bytes:
    """Deterministic JSON bytes (sorted keys, no spaces): what digests are computed over."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def sha256_file(path: Path, bufsize: int = 1 << 20) -> str:
    """Hex sha256 of a file's content."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(bufsize):
            h.update(chunk)
    return h.hexdigest()


def install_copy(src: Path, dst: Path, mode: int = 0o755) -> bool:
    """Make `dst` a copy of `src` (mode `mode`) unless it already has the same bytes; the new copy replaces
    the old one by rename, so a process running the old file never sees a half-written one. True when copied."""
    if dst.exists() and dst.stat().st_size == src.stat().st_size and sha256_file(dst) == sha256_file(src):
        return False
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}")
    shutil.copy2(src, tmp)
    os.chmod(tmp, mode)
    os.rename(tmp, dst)
    return True


def remove_tree(path: Path) -> None:
    """Remove a directory, or a symlink and the directory it points to (a sandbox directory kept on the
    node's tmpfs, shoal.backends.container.volatile); what is already gone is no error."""
    if os.path.islink(path):
        shutil.rmtree(os.path.realpath(path), ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def sha256_bytes(data: bytes) -> str:
    """Hex sha256 of bytes."""
    return hashlib.sha256(data).hexdigest()


def _lock_fd(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)


@contextlib.contextmanager
def flocked(path: Path, *, shared: bool = False) -> Iterator[int]:
    """Hold an exclusive (or `shared`) flock on the lock file `path` (made, with its directory, when
    missing) for the `with` block; yields its descriptor. What serializes host-wide setup between node
    processes (a bridge, a tmpfs, a layer mount, a build): the kernel drops the lock when the holder dies,
    so a crash never leaves it held."""
    fd = _lock_fd(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


@contextlib.asynccontextmanager
async def aflocked(path: Path) -> AsyncIterator[int]:
    """`flocked` for coroutines: the wait for another process's lock runs in a thread, so the event loop
    keeps serving while a long holder (an image build) finishes."""
    fd = _lock_fd(path)
    try:
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)
