"""The private homes of `shoal bench` runs: where they live, who owns one, what a run left mounted, and the
teardown of the homes (and loop-device disks) of runs that died without cleaning up.

A run's home is /tmp/shoal-bench-<pid>; it holds an owner file naming the pid and that process's start time,
so a recycled pid is never mistaken for the run. A run killed with SIGKILL (a CI timeout, the OOM killer)
cannot undo its mounts; the next `shoal bench` does it for every home whose owner is gone. Homes of live
runs are never touched: several benchmarks may run side by side on one machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path("/tmp")
PREFIX = "shoal-bench-"
OWNER_FILE = ".bench-owner"
#: where host.LoopFs keeps its sparse disk images: shoal-bench-<pid>-<name>.ext4
LOOP_IMAGE_DIR = Path("/var/tmp")
_LOOP_IMAGE = re.compile(rf"^{PREFIX}(\d+)-.+\.ext4$")
#: how long a teardown waits for the loop devices of unmounted filesystems to be released
LOOP_RELEASE_S = 15.0


def home_for(pid: int | None = None) -> Path:
    """The private home of the run `pid` (this process by default)."""
    return ROOT / f"{PREFIX}{pid or os.getpid()}"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat); None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: count fields after its last ')'
    return stat.rsplit(")", 1)[1].split()[19]


def claim(home: Path) -> None:
    """Mark `home` as this process's (before anything is mounted in it)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / OWNER_FILE).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")


def owner_alive(home: Path) -> bool:
    """Whether the run that made `home` is still running. Homes without an owner file (older versions) are
    judged by the pid in their name alone."""
    try:
        pid_s, _, started = (home / OWNER_FILE).read_text().strip().partition(" ")
        pid = int(pid_s)
    except (OSError, ValueError):
        suffix = home.name[len(PREFIX):]
        if not suffix.isdigit():
            return True  # not a name this module gives: not ours to judge
        pid, started = int(suffix), ""
    now = _start_time(pid)
    if now is None:
        return False
    return not started or started == "None" or now == started


def loop_devices_under(prefix: Path | str) -> list[str]:
    """Loop devices (/dev/loopN) whose backing file lies below the directory `prefix` (or, when `prefix` does
    not end in a directory name, starts with it: LoopFs images are named /var/tmp/shoal-bench-PID-*)."""
    p = os.path.realpath(prefix)
    out = []
    for dev in sorted(Path("/sys/block").glob("loop*")):
        with contextlib.suppress(OSError):
            backing = (dev / "loop" / "backing_file").read_text().strip()
            if backing.startswith(p.rstrip("/") + "/") or (str(prefix).endswith("-") and backing.startswith(p)):
                out.append(f"/dev/{dev.name}")
    return out


@dataclass
class LeftOver:
    """What is still there after a home's teardown: mount points and loop devices (empty when clean)."""

    mounts: list[str] = field(default_factory=list)
    loops: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.mounts or self.loops)

    def to_dict(self) -> dict[str, list[str]]:
        """The non-empty parts, for the results document."""
        return {k: v for k, v in (("home_mounts", self.mounts), ("loop_devices", self.loops)) if v}


def left_in(home: Path) -> LeftOver:
    """Mounts below `home` and loop devices backed by files in it."""
    from shoal.host import syscalls

    loops = loop_devices_under(home)
    suffix = home.name[len(PREFIX):]
    if home.name.startswith(PREFIX) and suffix.isdigit():  # the run's LoopFs disks (Docker's, the disk scenario's)
        loops += loop_devices_under(f"{LOOP_IMAGE_DIR}/{PREFIX}{suffix}-")
    return LeftOver(mounts=syscalls.mounts_under(str(home)), loops=loops)


async def teardown(home: Path, store: Path | str, *, remove: bool = True) -> LeftOver:
    """Close every sandbox of `home`, unmount its layers, upper pool and tmpfs dirs (shoal.node.teardown),
    then force off whatever is still mounted below it; delete the directory when nothing is left."""
    from shoal.config import Paths
    from shoal.host import syscalls
    from shoal.node.teardown import teardown_home

    with contextlib.suppress(Exception):  # what it could not do is reported below, not raised
        await teardown_home(Paths.from_env(home, str(store)), close_sandboxes=True)
    for mp in syscalls.mounts_under(str(home)):  # deepest first
        try:
            syscalls.umount(mp)
        except OSError:
            with contextlib.suppress(OSError):
                syscalls.umount(mp, detach=True)
    # `mount -o loop` devices detach themselves, but after umount returns (the kernel's autoclear runs
    # asynchronously); one attached by hand never does: detach what stays, until none is left or time is up
    deadline = time.monotonic() + LOOP_RELEASE_S
    while (devs := loop_devices_under(home)) and time.monotonic() < deadline:
        for dev in devs:
            _detach(dev)
        await asyncio.sleep(0.2)
    left = left_in(home)
    if remove and not left:
        shutil.rmtree(home, ignore_errors=True)
    return left


def _detach(dev: str) -> None:
    from shoal.host.spawn import run_sync

    with contextlib.suppress(Exception):
        run_sync(["losetup", "-d", dev], timeout=60)


def _stale_loop_images() -> list[Path]:
    out = []
    with contextlib.suppress(OSError):
        for e in os.scandir(LOOP_IMAGE_DIR):
            m = _LOOP_IMAGE.match(e.name)
            if m and _start_time(int(m.group(1))) is None:
                out.append(Path(e.path))
    return out


def _drop_loop_image(image: Path) -> None:
    """Unmount and detach every loop device backed by `image` (a dead run's LoopFs), then delete it."""
    from shoal.host import syscalls

    for dev in Path("/sys/block").glob("loop*"):
        try:
            backing = (dev / "loop" / "backing_file").read_text().strip()
        except OSError:
            continue
        if backing != str(image):
            continue
        node = f"/dev/{dev.name}"
        with open("/proc/self/mountinfo") as f:
            mps = [line.split(" - ", 1)[0].split()[4] for line in f if f" {node} " in line.split(" - ", 1)[-1]]
        for mp in sorted(mps, key=len, reverse=True):
            with contextlib.suppress(OSError):
                syscalls.umount(mp, detach=True)
            with contextlib.suppress(OSError):
                os.rmdir(mp)  # the empty mount point (/tmp/sbd-PID, /tmp/sbdisk-PID)
        _detach(node)
    with contextlib.suppress(OSError):
        image.unlink()


def stale_homes() -> list[Path]:
    """Homes of bench runs that are no longer running."""
    out = []
    with contextlib.suppress(OSError):
        for e in os.scandir(ROOT):
            if e.name.startswith(PREFIX) and e.is_dir(follow_symlinks=False) and not owner_alive(Path(e.path)):
                out.append(Path(e.path))
    return sorted(out)


async def reap_stale(store: Path | str) -> dict[str, list[str]]:
    """Tear down what dead bench runs left: their homes (sandboxes, mounts, loop devices) and their LoopFs
    disk images. Returns {home or image: what could not be removed} (empty lists when all went)."""
    out: dict[str, list[str]] = {}
    for image in _stale_loop_images():  # first: a home counts its run's loop disks as left over
        _drop_loop_image(image)
        out[str(image)] = [str(image)] if image.exists() else []
    for home in stale_homes():
        left = await teardown(home, store)
        out[str(home)] = left.mounts + left.loops
    return out
