"""What the benchmark reads from the host: machine description, memory, disk writes, load."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any

from shoal.host.spawn import run_sync


def meminfo_kib() -> dict[str, int]:
    """/proc/meminfo in KiB."""
    out: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            parts = v.split()
            if parts and parts[0].isdigit():
                out[k] = int(parts[0])
    return out


def memory_snapshot() -> dict[str, int]:
    """Host memory in bytes: available, used (not free, not cache, not reclaimable slab), slab, page tables."""
    m = meminfo_kib()
    used = m["MemTotal"] - m["MemFree"] - m.get("Buffers", 0) - m.get("Cached", 0) - m.get("SReclaimable", 0)
    return {k: v * 1024 for k, v in {
        "available": m["MemAvailable"], "used": used, "slab": m.get("Slab", 0),
        "slab_unreclaimable": m.get("SUnreclaim", 0), "kernel_stack": m.get("KernelStack", 0),
        "page_tables": m.get("PageTables", 0), "percpu": m.get("Percpu", 0), "shmem": m.get("Shmem", 0),
        "anon": m.get("AnonPages", 0), "total": m["MemTotal"]}.items()}


def cgroup_memory_bytes(rel: str) -> int | None:
    """Memory charged to a cgroup subtree (v1 memory.usage_in_bytes or v2 memory.current)."""
    for p in (Path("/sys/fs/cgroup/memory") / rel / "memory.usage_in_bytes", Path("/sys/fs/cgroup") / rel /
              "memory.current"):
        with contextlib.suppress(OSError, ValueError):
            return int(p.read_text())
    return None


def block_device_of(path: str | Path) -> str | None:
    """The whole-disk block device name (e.g. 'vda') holding `path`, from /sys/dev/block."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    sysdir = Path(f"/sys/dev/block/{major}:{minor}")
    if not sysdir.exists():
        return None
    real = sysdir.resolve()
    # a partition's parent directory is the disk
    if (real / "partition").exists():
        real = real.parent
    return real.name


def disk_written_bytes(dev: str) -> int:
    """Bytes written to block device `dev` since boot (/sys/block/<dev>/stat, field 7 = sectors written)."""
    fields = Path(f"/sys/block/{dev}/stat").read_text().split()
    return int(fields[6]) * 512


def sync_disks() -> None:
    """Flush dirty pages and filesystem journals so that written bytes show up in the disk counters."""
    os.sync()


def load_average() -> tuple[float, float, float]:
    """1, 5 and 15-minute load averages."""
    return os.getloadavg()


def cpu_times() -> tuple[int, int]:
    """(all, idle) jiffies of the whole machine since boot."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    return sum(vals), vals[3] + (vals[4] if len(vals) > 4 else 0)


def own_cpu_seconds() -> float:
    """CPU seconds used by this process and its waited-for children (crun, helpers) so far."""
    import resource

    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def cpu_busy_fraction(interval_s: float = 1.0) -> float:
    """Fraction of all CPUs busy over `interval_s` (from /proc/stat): how quiet the machine is."""
    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return sum(vals), idle

    t0, i0 = snap()
    time.sleep(interval_s)
    t1, i1 = snap()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def _first_line(argv: list[str]) -> str:
    if not shutil.which(argv[0]):
        return ""
    with contextlib.suppress(Exception):
        r = run_sync(argv, timeout=10)
        return (r.stdout or r.stderr).decode(errors="replace").strip().splitlines()[0]
    return ""


def machine_info() -> dict[str, Any]:
    """A description of the machine the benchmark ran on."""
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    from shoal.host.cgroups import cgroup_mode

    m = meminfo_kib()
    return {
        "cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(m["MemTotal"] / 2**20, 1),
        "kernel": platform.release(), "os": _os_release(), "python": platform.python_version(),
        "cgroups": cgroup_mode(), "crun": _first_line(["crun", "--version"]),
        "runc": _first_line(["runc", "--version"]), "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "rlimit_nofile": _nofile(),
    }


def _nofile() -> list[int]:
    import resource

    return list(resource.getrlimit(resource.RLIMIT_NOFILE))


def _os_release() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    return platform.platform()


def kernel_limits() -> dict[str, Any]:
    """Host limits that bound how many sandboxes can live at once."""
    def rd(p: str) -> str | None:
        with contextlib.suppress(OSError):
            return Path(p).read_text().strip()
        return None

    return {"pid_max": rd("/proc/sys/kernel/pid_max"), "threads_max": rd("/proc/sys/kernel/threads-max"),
            "mount_max_per_ns": rd("/proc/sys/fs/mount-max"),
            "max_net_namespaces": rd("/proc/sys/user/max_net_namespaces"),
            "max_mnt_namespaces": rd("/proc/sys/user/max_mnt_namespaces"), "file_max": rd("/proc/sys/fs/file-max"),
            "inotify_max_user_instances": rd("/proc/sys/fs/inotify/max_user_instances"),
            "rlimit_nofile": _nofile()}


class LoopFs:
    """A fresh ext4 filesystem on its own loop device: a private disk whose write counter
    (/sys/block/loopN/stat) sees only what is done on it. The backing file is sparse and deleted after."""

    def __init__(self, mountpoint: Path, size_gb: int = 32, backing_dir: Path = Path("/var/tmp")) -> None:
        self.mountpoint = Path(mountpoint)
        self.size_gb = size_gb
        self.image = Path(backing_dir) / f"shoal-bench-{os.getpid()}-{self.mountpoint.name}.ext4"
        self.device: str | None = None

    def __enter__(self) -> LoopFs:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def create(self) -> LoopFs:
        """Make the sparse image, mkfs.ext4 it, attach a loop device, mount it."""
        self.image.parent.mkdir(parents=True, exist_ok=True)
        with open(self.image, "wb") as f:
            f.truncate(self.size_gb * 2**30)
        try:
            # lazy init + noinit_itable: no background zeroing thread writing while we count writes
            run_sync(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=1,lazy_journal_init=1", str(self.image)],
                     timeout=300, check=True)
            dev = run_sync(["losetup", "--find", "--show", str(self.image)], timeout=60, check=True)
            self.device = dev.stdout.decode().strip()
            self.mountpoint.mkdir(parents=True, exist_ok=True)
            run_sync(["mount", "-o", "noinit_itable", self.device, str(self.mountpoint)], timeout=60, check=True)
        except BaseException:
            self.destroy()
            raise
        return self

    @property
    def block_name(self) -> str:
        """'loopN' (the name under /sys/block)."""
        return Path(self.device or "").name

    def written_bytes(self) -> int:
        """Bytes written to this filesystem's device so far (call sync_disks() first)."""
        return disk_written_bytes(self.block_name)

    def destroy(self) -> None:
        """Unmount everything under the mountpoint, detach the loop device, delete the image."""
        from shoal.host import syscalls

        with contextlib.suppress(OSError):
            for mp in syscalls.mounts_under(str(self.mountpoint)):
                try:
                    syscalls.umount(mp)
                except OSError:
                    syscalls.umount(mp, detach=True)
        if self.device:
            run_sync(["losetup", "-d", self.device], timeout=60)
            self.device = None
        with contextlib.suppress(OSError):
            self.image.unlink()
        with contextlib.suppress(OSError):
            self.mountpoint.rmdir()
