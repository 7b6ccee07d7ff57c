"""The `image` benchmark scenario: lazy reads, mount times, disk writes per sandbox (vs Docker).

- read fraction: with a cold page cache, how much of an image's EROFS file the kernel reads to start a
  sandbox and run `python3 -c 'import json'`. File-backed EROFS reads go through the layer file's page
  cache, so mincore(2) over the file after the run counts exactly the bytes read (readahead included).
  The layer is a private *copy* (its own inode, its own page cache) so nobody else's reads count.
- mount time: mounting a layer (LayerMounts.acquire) with a cold and a warm page cache, file-backed and
  through a loop device.
- disk writes: bytes written per new sandbox, from the block-device counters of a private ext4
  filesystem (on a loop device) that holds SHOAL_HOME — so nothing else on the host blurs them — with
  a sync before and after; plus the growth of allocated space. The same for `docker run` of the same
  image tree (`docker import`) with Docker's data root on that filesystem, when Docker is available
  or allowed to be installed.

Use `await run_image_bench()` (for `shoal bench image`) or `python benchmarks/bench_image.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.config import NodeConfig, Paths
from shoal.errors import BackendUnavailable
from shoal.images.mounts import LayerMounts, erofs_mode
from shoal.images.store import ImageStore

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_PAGE = os.sysconf("SC_PAGE_SIZE")
JSON_CMD = "python3 -c 'import json'"


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


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


class _Writes:
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
            return _median([r[k] for r in self.rounds])

        return {"bytes_written": med("corrected"), "bytes_written_raw": med("raw"),
                "allocated_bytes": med("allocated"), "idle_write_rate_Bps": med("idle_Bps"),
                "allocated_bytes_by_part": {k: med(f"allocated:{k}") for k in self.parts},
                "rounds": self.rounds, "device": str(self.stat)}


class _ScratchFs:
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


async def run_image_bench(*, image: str = "base:latest", n: int = 20, trials: int = 3, rounds: int = 3,
                          docker: bool = True,
                          install_docker: bool = True, log: Callable[[str], None] | None = None,
                          work_root: Path | None = None) -> dict[str, Any]:
    """Run the image scenario; returns a JSON-friendly dict of results (see module docs)."""
    if os.geteuid() != 0:
        raise BackendUnavailable("the image benchmark needs root (mounts, drop_caches, sandboxes)")
    from shoal.models import SandboxSpec
    from shoal.node.node import Node

    log = log or (lambda s: None)
    shared = ImageStore(Paths.from_env().store)
    src_img = shared.resolve(image)
    root = Path(tempfile.mkdtemp(prefix="sbi-", dir=str(work_root or "/var/tmp")))
    scratch = await asyncio.to_thread(_ScratchFs, root)
    paths = Paths(home=scratch.mnt / "h", store=root / "store")
    store = ImageStore(paths.store)
    results: dict[str, Any] = {"image": image, "image_bytes": src_img.size, "layers": len(src_img.layers),
                               "n_sandboxes": n, "trials": trials, "write_rounds": rounds, "host": os.uname().nodename,
                               "kernel": os.uname().release, "time": time.time()}
    log(f"copying {image} ({src_img.size / 2**20:.0f} MiB) into a private store {store.root}")
    img = await asyncio.to_thread(store.copy_image_from, shared, image, "bench:latest", link=False)
    node = Node(NodeConfig(paths=paths))
    await node.start(reap=False, reconcile=False)
    spec = SandboxSpec(image="bench:latest", network=False, ttl_s=3600)
    try:
        # warm-up: runtime probes, upper pool, guest agent (then caches are dropped before measuring)
        info = await node.create(spec)
        await node.close(info.id)
        results["erofs_mount_mode"] = erofs_mode()
        results["read_modes"] = {}
        for directio in (True, False):
            r = await _read_fraction(node, spec, img, trials, log, directio)
            results["read_modes"][r["mount_mode"]] = r
        results["read"] = results["read_modes"].get(results["erofs_mount_mode"]) or r
        results["mount"] = await asyncio.to_thread(_mount_times, paths, img, trials, log)
        results["writes"] = {"shoal": await _shoal_writes(node, spec, paths, scratch, n, rounds, log)}
        # where shoal's own writes come from: the same without per-sandbox disk limits (no btrfs pool)
        results["writes"]["shoal_no_disk_limits"] = await _variant_writes(
            {"SHOAL_DISK_LIMITS": "0"}, spec, Paths(home=scratch.mnt / "h2", store=paths.store), scratch, n,
            rounds, log)
        if docker:
            try:
                results["writes"]["docker"] = await asyncio.to_thread(
                    _docker_writes, node, img, root, scratch, n, rounds, install_docker, log)
            except (BackendUnavailable, subprocess.SubprocessError, OSError) as e:
                results["writes"]["docker"] = {"error": str(e)[:500]}
                log(f"docker comparison skipped: {e}")
        _ratios(results)
    finally:
        with contextlib.suppress(Exception):
            await node.close_all()
        await node.stop()
        with contextlib.suppress(Exception):
            pool = getattr(node.backend("container"), "upper_pool", None)
            if pool is not None:
                await asyncio.to_thread(pool.teardown)
        await asyncio.to_thread(_cleanup_home, paths)
        await asyncio.to_thread(scratch.close)
        shutil.rmtree(root, ignore_errors=True)
    return results


def _cleanup_home(paths: Paths) -> None:
    from shoal.host import syscalls

    for mp in syscalls.mounts_under(str(paths.home)):
        with contextlib.suppress(OSError):
            syscalls.umount(mp, detach=True)


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


def _disk_read(stat_file: Path) -> int:
    return int(stat_file.read_text().split()[2]) * 512


def _read_now(img: Any, mps: list[Path], before: int, mode: str) -> int:
    # the layer files' page cache holds metadata (and, without directio, all data read); with
    # directio the data read sits only in the EROFS files' own page cache
    meta = sum(resident_bytes(lay.path) for lay in img.layers) - before
    return meta + (sum(erofs_cached_bytes(mp) for mp in mps) if mode.endswith("directio") else 0)


async def _read_fraction(node: Any, spec: Any, img: Any, trials: int, log: Callable[[str], None],
                         directio: bool) -> dict:
    """Cold-cache bytes read from the image to start a sandbox and to run JSON_CMD in it."""
    total = img.size
    node.layer_mounts.directio = directio
    disk = block_stat_path(img.layers[0].path)
    start, after, create_s, disk_reads = [], [], [], []
    mode = "?"
    for t in range(trials):
        # two cold runs per trial: measuring walks every file of the layer (reading all its metadata),
        # so the start and the command are measured from separate cold starts
        for phase in ("start", "json"):
            drop_caches()
            before = sum(resident_bytes(lay.path) for lay in img.layers)
            d0 = _disk_read(disk)
            t0 = time.perf_counter()
            info = await node.create(spec)
            if phase == "start":
                create_s.append(time.perf_counter() - t0)
            mode = erofs_mode()
            try:
                if phase == "json":
                    r = await node.exec(info.id, JSON_CMD)
                    if r.exit_code != 0:
                        raise RuntimeError(f"{JSON_CMD} failed in the sandbox: {r.stderr[-500:]!r}")
                    disk_reads.append(_disk_read(disk) - d0)
                mps = [node.layer_mounts.mountpoint(lay.hex) for lay in img.layers]
                got = await asyncio.to_thread(_read_now, img, mps, before, mode)
            finally:
                await node.close(info.id)
            (start if phase == "start" else after).append(got)
        log(f"read trial {t + 1} ({mode}): start {start[-1] / 2**20:.2f} MiB, +import json "
            f"{after[-1] / 2**20:.2f} MiB of {total / 2**20:.0f} MiB ({after[-1] / total:.1%}); whole-disk reads "
            f"meanwhile {disk_reads[-1] / 2**20:.1f} MiB; cold create {create_s[-1] * 1000:.0f} ms")
    node.layer_mounts.directio = True
    return {"mount_mode": mode, "image_bytes": total, "start_bytes": _median(start),
            "start_and_json_bytes": _median(after), "start_fraction": _median(start) / total,
            "start_and_json_fraction": _median(after) / total, "cold_create_s": _median(create_s),
            "samples_bytes": after, "disk_read_bytes_whole_machine": _median(disk_reads), "command": JSON_CMD}


def _mount_times(paths: Paths, img: Any, trials: int, log: Callable[[str], None]) -> dict:
    out: dict[str, Any] = {}
    layer = max(img.layers, key=lambda x: x.size)
    for mode in ("file", "loop"):
        lm = LayerMounts(paths, mode=mode)
        cold, warm = [], []
        try:
            for _ in range(trials):
                drop_caches()
                t0 = time.perf_counter()
                lm.acquire([layer], "bench-mount")
                cold.append(time.perf_counter() - t0)
                lm.release([layer.hex], "bench-mount")
            for _ in range(max(10, trials)):
                t0 = time.perf_counter()
                lm.acquire([layer], "bench-mount")
                warm.append(time.perf_counter() - t0)
                lm.release([layer.hex], "bench-mount")
        except Exception as e:  # e.g. no loop devices in this container
            out[mode] = {"error": str(e)[:300]}
            continue
        out[mode] = {"cold_ms": _median(cold) * 1000, "warm_ms": _median(warm) * 1000,
                     "cold_samples_ms": [x * 1000 for x in cold]}
        log(f"mount ({mode}): cold {out[mode]['cold_ms']:.2f} ms, warm {out[mode]['warm_ms']:.2f} ms")
    return out


async def _shoal_writes(node: Any, spec: Any, paths: Paths, scratch: _ScratchFs, n: int, rounds: int,
                        log: Callable[[str], None]) -> dict:
    parts = {"sandbox dirs (records, bundles)": paths.sandboxes}
    pool = paths.home / "uppers.btrfs"  # the node's upper pool, when it uses one (shoal.node.disk)
    if pool.exists():
        parts["upper pool"] = pool
    w = _Writes(scratch.stat, [paths.home], parts)
    t_create = []
    for _ in range(rounds):
        await asyncio.to_thread(w.begin)
        ids = []
        for _ in range(n):
            t0 = time.perf_counter()
            ids.append((await node.create(spec)).id)
            t_create.append(time.perf_counter() - t0)
        await asyncio.to_thread(w.end, n)
        for sid in ids:
            await node.close(sid)
    res = w.summary()
    res["create_s_median"] = _median(t_create)
    log(f"shoal: {res['bytes_written'] / 1024:.1f} KiB written per sandbox (raw {res['bytes_written_raw'] / 1024:.1f} "
        f"KiB, idle {res['idle_write_rate_Bps'] / 1024:.0f} KiB/s); {res['allocated_bytes'] / 1024:.1f} KiB allocated "
        f"({', '.join(f'{k}: {v / 1024:.1f} KiB' for k, v in res['allocated_bytes_by_part'].items())})")
    return res


async def _variant_writes(env: dict[str, str], spec: Any, paths: Paths, scratch: _ScratchFs, n: int,
                          rounds: int, log: Callable[[str], None]) -> dict:
    """_shoal_writes with a node configured by extra environment variables (restored afterwards)."""
    from shoal.node.node import Node

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    node = Node(NodeConfig(paths=paths))
    try:
        await node.start(reap=False, reconcile=False)
        info = await node.create(spec)  # warm-up
        await node.close(info.id)
        log(f"variant {env}:")
        res = await _shoal_writes(node, spec, paths, scratch, n, rounds, log)
        res["env"] = env
        return res
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        with contextlib.suppress(Exception):
            await node.close_all()
        await node.stop()
        await asyncio.to_thread(_cleanup_home, paths)


# ---- docker, for the side-by-side comparison ------------------------------------------------------
class _Dockerd:
    """A private dockerd (own data root, socket, no iptables/bridge) started and stopped by the benchmark."""

    def __init__(self, root: Path) -> None:
        self.root = root  # data root on the same disk as SHOAL_HOME (like /var/lib/docker)
        # runtime state on tmpfs, like Docker's default /var/run/docker
        self.exec_root = Path(tempfile.mkdtemp(prefix="shoal-bench-docker-", dir="/run"))
        self.sock = f"unix://{self.exec_root}/docker.sock"
        self.proc: subprocess.Popen | None = None

    def docker(self, *args: str, stdin: Any = None, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", "-H", self.sock, *args], stdin=stdin, capture_output=True, text=True,
                              timeout=timeout)

    def start(self) -> None:
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        with open(self.root / "dockerd.log", "wb") as logf:
            self.proc = subprocess.Popen(
                ["dockerd", "--iptables=false", "--ip-masq=false", "--bridge=none", "-H", self.sock,
                 "--data-root", str(self.root / "data"), "--exec-root", str(self.exec_root / "exec"),
                 "--pidfile", str(self.exec_root / "dockerd.pid"), "--storage-driver", "overlay2"],
                stdout=logf, stderr=subprocess.STDOUT)
        for _ in range(300):
            if self.proc.poll() is not None:
                raise BackendUnavailable("dockerd exited: " + (self.root / "dockerd.log").read_text()[-800:])
            with contextlib.suppress(subprocess.SubprocessError):
                if self.docker("info", timeout=5).returncode == 0:
                    return
            time.sleep(0.2)
        raise BackendUnavailable("dockerd did not come up: " + (self.root / "dockerd.log").read_text()[-800:])

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(Exception):
            ids = self.docker("ps", "-aq").stdout.split()
            if ids:
                self.docker("rm", "-f", *ids)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        from shoal.host import syscalls

        for base in (self.root, self.exec_root):
            for mp in syscalls.mounts_under(str(base)):
                with contextlib.suppress(OSError):
                    syscalls.umount(mp, detach=True)
        shutil.rmtree(self.exec_root, ignore_errors=True)


def _ensure_docker(install: bool, log: Callable[[str], None]) -> None:
    if shutil.which("dockerd") and shutil.which("docker"):
        return
    if not install:
        raise BackendUnavailable("Docker is not installed (apt-get install docker.io)")
    log("installing docker.io for the side-by-side comparison (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    r = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "docker.io"],
                       capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0 or not shutil.which("dockerd"):
        raise BackendUnavailable(f"could not install docker.io: {r.stderr[-500:]}")


def _docker_writes(node: Any, img: Any, root: Path, scratch: _ScratchFs, n: int, rounds: int, install: bool,
                   log: Callable[[str], None]) -> dict:
    _ensure_docker(install, log)
    d = _Dockerd(scratch.mnt / "docker")
    lm = LayerMounts(node.paths)
    d.start()
    try:
        # the same tree: the image's layers stacked read-only, tarred into `docker import`
        mps = lm.acquire(img.layers, "bench-docker-import")
        merged = root / "merged"
        merged.mkdir()
        from shoal.host import syscalls

        empty = root / "empty"
        empty.mkdir()
        # an empty bottom lower: a read-only overlay of a one-layer image still hides its whiteouts
        lowers = [*(str(p) for p in reversed(mps)), str(empty)]
        syscalls.mount("overlay", str(merged), "overlay", syscalls.MS_RDONLY, "lowerdir=" + ":".join(lowers))
        try:
            tar = subprocess.Popen(["tar", "-C", str(merged), "--numeric-owner", "-cf", "-", "."],
                                   stdout=subprocess.PIPE)
            r = d.docker("import", "-", "shoal-bench:latest", stdin=tar.stdout, timeout=900)
            tar.wait()
            if r.returncode != 0:
                raise BackendUnavailable(f"docker import failed: {r.stderr[-500:]}")
        finally:
            syscalls.umount(str(merged), detach=True)
            lm.release([lay.hex for lay in img.layers], "bench-docker-import")
        log("docker: imported the same tree as shoal-bench:latest")
        # warm-up, as for shoal
        r = d.docker("run", "-d", "--network", "none", "shoal-bench:latest", "sleep", "infinity")
        if r.returncode != 0:
            raise BackendUnavailable(f"docker run failed: {r.stderr[-500:]}")
        d.docker("rm", "-f", r.stdout.strip())
        data = d.root / "data"
        w = _Writes(scratch.stat, [data], {"containers (config, hosts, logs)": data / "containers",
                                   "overlay2 (init + upper layers)": data / "overlay2",
                                   "containerd": data / "containerd"})
        t_run = []
        for _ in range(rounds):
            w.begin()
            ids = []
            for _ in range(n):
                t0 = time.perf_counter()
                r = d.docker("run", "-d", "--network", "none", "shoal-bench:latest", "sleep", "infinity")
                t_run.append(time.perf_counter() - t0)
                if r.returncode != 0:
                    raise BackendUnavailable(f"docker run failed: {r.stderr[-500:]}")
                ids.append(r.stdout.strip())
            w.end(n)
            d.docker("rm", "-f", *ids)
        res = w.summary()
        res["docker_run_s_median"] = _median(t_run)
        res["docker_version"] = d.docker("version", "-f", "{{.Server.Version}}").stdout.strip()
        log(f"docker: {res['bytes_written'] / 1024:.1f} KiB written per container (raw "
            f"{res['bytes_written_raw'] / 1024:.1f} KiB); {res['allocated_bytes'] / 1024:.1f} KiB allocated; "
            f"docker run {res['docker_run_s_median'] * 1000:.0f} ms")
        return res
    finally:
        d.stop()


def _ratios(results: dict[str, Any]) -> None:
    w = results.get("writes", {})
    s, dk = w.get("shoal", {}), w.get("docker", {})
    targets = results.setdefault("targets", {})
    if s and dk and "error" not in dk:
        def ratio(a: float, b: float) -> float | None:
            return a / b if b > 0 else None

        results["ratios"] = {
            "written_shoal_over_docker": ratio(s["bytes_written"], dk["bytes_written"]),
            "written_raw_shoal_over_docker": ratio(s["bytes_written_raw"], dk["bytes_written_raw"]),
            "allocated_shoal_over_docker": ratio(s["allocated_bytes"], dk["allocated_bytes"]),
        }
        if results["ratios"]["written_shoal_over_docker"] is not None:
            targets["written_le_1pct_of_docker"] = results["ratios"]["written_shoal_over_docker"] <= 0.01
    r = results.get("read", {})
    if r:
        targets["read_fraction_le_10pct"] = r["start_and_json_fraction"] <= 0.10


def plot(results: dict[str, Any], out: Path) -> Path:
    """A PNG with the three figures (read fraction, mount times, bytes written per sandbox)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
    modes = results.get("read_modes", {})
    if modes:
        labels, vals = [], []
        for mode, r in modes.items():
            short = {"file-backed+directio": "directio", "file-backed": "buffered"}.get(mode, mode)
            labels += [f"{short}\nstart", f"{short}\n+ import json"]
            vals += [r["start_fraction"] * 100, r["start_and_json_fraction"] * 100]
        ax[0].bar(labels, vals, color=["#7aa6c2", "#2e6f95"] * len(modes))
        ax[0].tick_params(axis="x", labelsize=8)
        ax[0].axhline(10, color="red", ls="--", lw=1, label="target 10%")
        ax[0].set_ylabel("% of image bytes read (cold cache)")
        ax[0].set_title(f"{results['image']} ({results['image_bytes'] / 2**20:.0f} MiB)")
        ax[0].legend()
    m = results.get("mount", {})
    labels, vals = [], []
    for mode in ("file", "loop"):
        if "cold_ms" in m.get(mode, {}):
            labels += [f"{mode}\ncold", f"{mode}\nwarm"]
            vals += [m[mode]["cold_ms"], m[mode]["warm_ms"]]
    ax[1].bar(labels, vals, color="#5b8c5a")
    ax[1].set_ylabel("ms to mount one layer")
    ax[1].set_title("layer mount time")
    w = results.get("writes", {})
    names, kib = [], []
    if "shoal" in w:
        names.append("shoal")
        kib.append(max(w["shoal"]["bytes_written"], 1) / 1024)
    if "bytes_written" in w.get("docker", {}):
        names.append("docker run")
        kib.append(max(w["docker"]["bytes_written"], 1) / 1024)
    ax[2].bar(names, kib, color=["#2e6f95", "#c2553a"][: len(names)])
    ax[2].set_yscale("log")
    ax[2].set_ylabel("KiB written to disk per new sandbox")
    ax[2].set_title("disk bytes written per new sandbox")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
