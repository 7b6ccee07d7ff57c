"""Disk and page-cache accounting for the benchmarks: bytes of a file in the page cache (mincore), dropping
caches, a block device's read/write counters, space allocated under a tree, write accounting with the
machine's idle rate subtracted, and a private ext4 scratch filesystem whose counters see only the benchmark.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from shoal.errors import BackendUnavailable

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_PAGE = os.sysconf("SC_PAGE_SIZE")

def resident_bytes(path: Path) -> int:
    """Bytes of `path` in the page cache (mincore over a read-only mapping; maps nothing in)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            pages = (size + _PAGE - 1) // _PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(v & 1 for v in vec) * _PAGE
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def drop_caches() -> None:
    """Write back dirty pages, then drop the clean page cache (root only)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def block_stat_path(path: Path) -> Path:
    """/sys/dev/block/M:m/stat of the device holding `path` (a partition's own counters if it is one)."""
    st = os.stat(path)
    p = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
    if not p.exists():
        raise BackendUnavailable(f"{path} is not on a block device with I/O counters (overlay/tmpfs root?)")
    return p


def bytes_written(stat_file: Path) -> int:
    """Sectors written (field 7) * 512."""
    return int(stat_file.read_text().split()[6]) * 512


def allocated_bytes(root: Path) -> int:
    """Disk space allocated by every file under `root` on root's own filesystem (mounts below it are
    skipped; hard links counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return 0
    if not os.path.isdir(root) or os.path.islink(root):
        return st.st_blocks * 512
    dev = st.st_dev
    for dirpath, dirnames, filenames in os.walk(root):
        keep = []
        for d in dirnames:
            with contextlib.suppress(OSError):
                if os.lstat(os.path.join(dirpath, d)).st_dev == dev:
                    keep.append(d)
        dirnames[:] = keep
        for n in [dirpath, *(os.path.join(dirpath, x) for x in filenames)]:
            with contextlib.suppress(OSError):
                s = os.lstat(n)
                if s.st_dev == dev and (s.st_dev, s.st_ino) not in seen:
                    seen.add((s.st_dev, s.st_ino))
                    total += s.st_blocks * 512
    return total


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


class Writes:
    """Disk-write accounting: whole-device counters with the machine's idle write rate (measured right
    before each round) subtracted, and the growth of allocated space under given roots (noise-free)."""

    def __init__(self, stat_file: Path, roots: list[Path], parts: dict[str, Path] | None = None) -> None:
        self.stat = stat_file
        self.roots = roots
        self.parts = parts or {}  # named sub-trees whose allocation growth is reported on its own
        self.rounds: list[dict[str, float]] = []

    def idle_rate(self, seconds: float = 2.0) -> float:
        os.sync()
        w0, t0 = bytes_written(self.stat), time.monotonic()
        time.sleep(seconds)
        os.sync()
        return (bytes_written(self.stat) - w0) / (time.monotonic() - t0)

    def begin(self) -> None:
        self._rate = self.idle_rate()
        os.sync()
        self._alloc = sum(allocated_bytes(r) for r in self.roots)
        self._parts = {k: allocated_bytes(p) for k, p in self.parts.items()}
        self._w, self._t = bytes_written(self.stat), time.monotonic()

    def end(self, n: int) -> None:
        os.sync()
        written, secs = bytes_written(self.stat) - self._w, time.monotonic() - self._t
        alloc = sum(allocated_bytes(r) for r in self.roots) - self._alloc
        row = {"raw": written / n, "corrected": max(0.0, written - self._rate * secs) / n,
               "allocated": alloc / n, "idle_Bps": self._rate, "seconds": secs}
        for k, p in self.parts.items():
            row[f"allocated:{k}"] = (allocated_bytes(p) - self._parts[k]) / n
        self.rounds.append(row)

    def summary(self) -> dict[str, Any]:
        def med(k: str) -> float:
            return median([r[k] for r in self.rounds])

        return {"bytes_written": med("corrected"), "bytes_written_raw": med("raw"),
                "allocated_bytes": med("allocated"), "idle_write_rate_Bps": med("idle_Bps"),
                "allocated_bytes_by_part": {k: med(f"allocated:{k}") for k in self.parts},
                "rounds": self.rounds, "device": str(self.stat)}


class ScratchFs:
    """A private ext4 filesystem on a loop device for SHOAL_HOME and Docker's data root: its I/O counters
    see only what the benchmark does (other work on the host's disk cannot blur them)."""

    def __init__(self, root: Path, size_gb: int = 32) -> None:
        self.img = root / "scratch.ext4"
        self.mnt = root / "fs"
        self.dev = ""
        with open(self.img, "wb") as f:
            f.truncate(size_gb * 2**30)  # sparse
        subprocess.run(["mkfs.ext4", "-q", "-F", str(self.img)], check=True, capture_output=True, timeout=300)
        self.dev = subprocess.run(["losetup", "--find", "--show", str(self.img)], check=True, capture_output=True,
                                  text=True, timeout=60).stdout.strip()
        self.mnt.mkdir()
        from shoal.host import syscalls

        syscalls.mount(self.dev, str(self.mnt), "ext4", 0, None)

    @property
    def stat(self) -> Path:
        return Path(f"/sys/block/{os.path.basename(self.dev)}/stat")

    def close(self) -> None:
        from shoal.host import syscalls

        for mp in syscalls.mounts_under(str(self.mnt)):
            with contextlib.suppress(OSError):
                syscalls.umount(mp, detach=True)
        if self.dev:
            subprocess.run(["losetup", "--detach", self.dev], capture_output=True, timeout=60)
        with contextlib.suppress(FileNotFoundError):
            self.img.unlink()


def erofs_cached_bytes(mountpoint: Path) -> int:
    """Bytes of file data in the page cache of the files of a mounted EROFS layer (its own page cache,
    which directio mounts fill without going through the layer file's)."""
    total = 0
    for dirpath, _dirnames, filenames in os.walk(mountpoint):
        for name in filenames:
            p = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                if os.path.isfile(p) and not os.path.islink(p):
                    total += resident_bytes(Path(p))
    return total


def disk_read_bytes(stat_file: Path) -> int:
    """Sectors read (field 3) * 512."""
    return int(stat_file.read_text().split()[2]) * 512
