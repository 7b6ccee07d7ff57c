"""Memory of paused sandboxes: give it back to the host after the freeze, bring it back before the thaw.

A frozen sandbox runs no code, so every page it holds is idle. After the freeze the node asks the
kernel to reclaim the sandbox's whole memory cgroup:

* cgroup v2: `memory.reclaim` (the kernel's proactive reclaim interface);
* cgroup v1 (this project's hybrid hosts): `memory.force_empty`, which reclaims the cgroup page by
  page while its tasks stay in it (the frozen tasks are not woken; the writer does the work).

Page cache and reclaimable slab (dentries, inodes) always go. Anonymous memory (heaps, stacks, tmpfs)
can only go to swap: without swap it stays. The node can set up compressed swap in RAM (zram) with
`shoal node swap --zram 8G` or `SHOAL_ZRAM_SWAP=8G` — and by default, on a host with no swap, the node
makes one itself (shoal.backends.container.swap); then anonymous pages are compressed (typically
3-5x for program memory, near 100x for zero-filled buffers) and the paused sandbox keeps only kernel
memory that cannot be reclaimed (page tables, unreclaimable slab).

Before reclaiming, the node records the sandbox's *working set* (which pages of each process were
resident, from /proc/PID/pagemap) in the sandbox directory. On resume it reads exactly those pages back
through /proc/PID/mem while the sandbox is still frozen (swap-in from zram, or page-cache reads) and
only then thaws it, so the first request after a resume does not pay hundreds of page faults (REAP's
record-and-prefetch idea, applied to a paused container).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import BackendUnavailable, InvalidRequest, SandboxError
from shoal.host.cgroups import SandboxCgroup
from shoal.host.spawn import run_sync

PAGE = os.sysconf("SC_PAGE_SIZE")
_PRESENT = 1 << 63
_SWAPPED = 1 << 62
#: mappings larger than this are not scanned for the working set (huge reservations, not real memory)
MAX_SCAN_MAPPING = 4 << 30
#: stop prefetching after this long; the rest faults in on demand after the thaw
PREFETCH_BUDGET_S = 2.0
_SKIP_MAPPINGS = ("[vvar]", "[vvar_vclock]", "[vsyscall]", "[vdso]")
WORKING_SET_FILE = "workingset.json"


# ---- swap devices ------------------------------------------------------------------------------
@dataclass
class SwapDevice:
    """One line of /proc/swaps."""

    path: str
    type: str
    size_kb: int
    used_kb: int
    priority: int


def swap_devices(proc_swaps: str = "/proc/swaps") -> list[SwapDevice]:
    """Active swap areas of the host."""
    try:
        lines = Path(proc_swaps).read_text().splitlines()[1:]
    except OSError:
        return []
    return parse_swaps(lines)


def parse_swaps(lines: list[str]) -> list[SwapDevice]:
    """Parse the body lines of /proc/swaps (the header already removed)."""
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 5:
            with contextlib.suppress(ValueError):
                out.append(SwapDevice(parts[0].replace("\\040", " "), parts[1], int(parts[2]), int(parts[3]),
                                      int(parts[4])))
    return out


def swap_active() -> bool:
    """True when the host has any swap area on."""
    return bool(swap_devices())


@dataclass
class ZramDevice:
    """A zram block device and its compression statistics (bytes)."""

    name: str
    disksize: int
    algorithm: str
    orig_data_size: int = 0
    compr_data_size: int = 0
    mem_used_total: int = 0
    same_pages: int = 0
    swap: bool = False


def zram_devices() -> list[ZramDevice]:
    """Every zram device the kernel has (configured or not)."""
    out = []
    for d in sorted(Path("/sys/block").glob("zram*")):
        try:
            disksize = int((d / "disksize").read_text())
            alg = _selected((d / "comp_algorithm").read_text())
            mm = [int(x) for x in (d / "mm_stat").read_text().split()]
        except (OSError, ValueError):
            continue
        active = {s.path for s in swap_devices()}
        out.append(ZramDevice(d.name, disksize, alg, *(mm[i] if len(mm) > i else 0 for i in (0, 1, 2, 5)),
                              swap=f"/dev/{d.name}" in active))
    return out


def _selected(comp_algorithm: str) -> str:
    m = re.search(r"\[([^\]]+)\]", comp_algorithm)
    return m.group(1) if m else comp_algorithm.strip()


def parse_size(text: str | int) -> int:
    """'8G', '512M', '1.5g', '4096' (bytes) -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(text))
    if not m:
        raise InvalidRequest(f"bad size {text!r}: use a number with an optional K, M, G or T suffix (e.g. 8G)")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    n = int(float(m.group(1)) * mult)
    if n <= 0:
        raise InvalidRequest(f"size {text!r} must be positive")
    return n


def _zram_available() -> bool:
    return Path("/sys/class/zram-control").is_dir() or any(Path("/sys/block").glob("zram*"))


def setup_zram_swap(size: int | str, algorithm: str | None = None, priority: int = 100, *,
                    new: bool = False) -> ZramDevice:
    """Make a zram device of `size` bytes and swap on it (idempotent: an existing zram swap is kept, unless
    `new`: then another device is made beside it).

    `algorithm` defaults to the best ratio the kernel offers (zstd, then lzo-rle, then lz4).
    """
    if os.geteuid() != 0:
        raise BackendUnavailable("setting up swap needs root")
    size_b = parse_size(size)
    for z in zram_devices():
        if z.swap and not new:
            return z
    if not _zram_available():
        run_sync(["modprobe", "zram"], timeout=30)
        if not _zram_available():
            raise BackendUnavailable("this kernel has no zram (CONFIG_ZRAM); use a swap file or partition "
                                     "instead (then pause reclaims to it the same way)")
    dev = _free_zram()
    sysd = Path("/sys/block") / dev
    offered = (sysd / "comp_algorithm").read_text().replace("[", " ").replace("]", " ").split()
    if algorithm is None:
        # ratio first: a paused sandbox's pages are compressed once and rarely read (lzo-rle beat lz4 by
        # ~7% on program memory in `shoal bench pause`; zstd is better still where offered)
        algorithm = next((a for a in ("zstd", "lzo-rle", "lz4", "lzo") if a in offered),
                         offered[0] if offered else "")
    elif algorithm not in offered:
        raise InvalidRequest(f"zram compression {algorithm!r} is not offered by this kernel: {', '.join(offered)}")
    try:
        if algorithm:
            (sysd / "comp_algorithm").write_text(algorithm)
        (sysd / "disksize").write_text(str(size_b))
        r = run_sync(["mkswap", f"/dev/{dev}"], timeout=60)
        if r.returncode != 0:
            raise SandboxError(f"mkswap /dev/{dev} failed: {r.stderr.decode(errors='replace').strip()}")
        r = run_sync(["swapon", "-p", str(int(priority)), f"/dev/{dev}"], timeout=60)
        if r.returncode != 0:
            raise SandboxError(f"swapon /dev/{dev} failed: {r.stderr.decode(errors='replace').strip()}")
    except BaseException:
        with contextlib.suppress(OSError):
            (sysd / "reset").write_text("1")
        raise
    return next(z for z in zram_devices() if z.name == dev)


def _free_zram() -> str:
    for z in zram_devices():
        if z.disksize == 0:
            return z.name
    ctl = Path("/sys/class/zram-control/hot_add")
    if ctl.exists():
        return f"zram{int(ctl.read_text().strip())}"
    raise BackendUnavailable("every zram device is in use and this kernel cannot add one (no zram-control)")


def teardown_zram_swap(devices: list[str] | None = None) -> list[str]:
    """Turn off swap on every zram device (or only those named, e.g. ["zram1"]) and free its memory;
    returns the devices turned off.

    swapoff reads every swapped page back into RAM first: it needs that much free memory.
    """
    done = []
    for z in zram_devices():
        if devices is not None and z.name not in devices:
            continue
        if z.swap:
            r = run_sync(["swapoff", f"/dev/{z.name}"], timeout=3600)
            if r.returncode != 0:
                raise SandboxError(f"swapoff /dev/{z.name} failed: {r.stderr.decode(errors='replace').strip()}")
            done.append(z.name)
        if z.disksize:
            with contextlib.suppress(OSError):
                (Path("/sys/block") / z.name / "reset").write_text("1")
    return done


def swap_status() -> dict[str, Any]:
    """What the node has for swap: areas, zram devices with their compression, zswap."""
    zswap = {}
    for p in Path("/sys/module/zswap/parameters").glob("*"):
        with contextlib.suppress(OSError):
            zswap[p.name] = p.read_text().strip()
    return {"swap": [asdict(s) for s in swap_devices()], "zram": [asdict(z) for z in zram_devices() if z.disksize],
            "zswap": zswap}


# ---- reclaim -----------------------------------------------------------------------------------
@dataclass
class ReclaimResult:
    """What one reclaim did to a sandbox's memory cgroup (bytes)."""

    method: str
    before: int = 0
    after: int = 0
    swap_before: int = 0
    swap_after: int = 0
    stat_before: dict[str, int] = field(default_factory=dict)
    stat_after: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    error: str = ""

    @property
    def reclaimed(self) -> int:
        """Bytes no longer charged as memory (some may now be in swap)."""
        return max(0, self.before - self.after)


_STAT_KEYS_V1 = ("cache", "rss", "shmem", "mapped_file", "swap")
_STAT_KEYS_V2 = ("anon", "file", "shmem", "kernel", "slab")


def _stat_summary(cg: SandboxCgroup) -> dict[str, int]:
    st = cg.memory_stat()
    keys = _STAT_KEYS_V2 if cg.mode == "v2" else _STAT_KEYS_V1
    out = {k: st[k] for k in keys if k in st}
    if cg.mode != "v2":
        kmem = cg.read("memory", "memory.kmem.usage_in_bytes")
        if kmem and kmem.strip().isdigit():
            out["kmem"] = int(kmem)
    return out


def _swap_bytes(cg: SandboxCgroup) -> int:
    if cg.mode == "v2":
        v = cg.read("memory", "memory.swap.current")
        return int(v) if v and v.strip().isdigit() else 0
    return cg.memory_stat().get("swap", 0)


def reclaim_cgroup(cg: SandboxCgroup) -> ReclaimResult:
    """Reclaim as much of the cgroup's memory as the kernel can (blocking: run it in a thread)."""
    t0 = time.monotonic()
    res = ReclaimResult(method="memory.reclaim" if cg.mode == "v2" else "memory.force_empty")
    res.before = cg.memory_bytes() or 0
    res.swap_before = _swap_bytes(cg)
    res.stat_before = _stat_summary(cg)
    path = cg.dir("memory") / ("memory.reclaim" if cg.mode == "v2" else "memory.force_empty")
    try:
        with open(path, "w") as f:
            # v2: ask for everything; the kernel answers EAGAIN when it got less, which is expected
            f.write(str(max(res.before, PAGE)) if cg.mode == "v2" else "0")
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EBUSY):
            res.error = f"{path.name}: {e.strerror or e}"
    res.after = cg.memory_bytes() or 0
    res.swap_after = _swap_bytes(cg)
    res.stat_after = _stat_summary(cg)
    res.seconds = time.monotonic() - t0
    return res


# ---- working set: record before reclaim, prefetch before thaw ------------------------------------
def _starttime(pid: int) -> int | None:
    from shoal.records import proc_starttime

    return proc_starttime(pid)


def _runs(entries: memoryview, base_page: int, mask: int = _PRESENT | _SWAPPED) -> list[list[int]]:
    """[start_page, n_pages] runs of pagemap entries with any bit of `mask` (default: present or swapped)."""
    out: list[list[int]] = []
    run_start = -1
    for i, e in enumerate(entries):
        if e & mask:
            if run_start < 0:
                run_start = i
        elif run_start >= 0:
            out.append([base_page + run_start, i - run_start])
            run_start = -1
    if run_start >= 0:
        out.append([base_page + run_start, len(entries) - run_start])
    return out


def _device_mapping(name: str) -> bool:
    # device memory must never be read through /proc/PID/mem (MMIO reads can have side effects);
    # shared anonymous memory shows up as "/dev/zero (deleted)" and POSIX shm under /dev/shm: keep those
    return name.startswith("/dev/") and not name.startswith(("/dev/zero", "/dev/shm/"))


def process_working_set(pid: int) -> list[list[int]]:
    """[first_page, n_pages] runs of every resident or swapped page in `pid`'s address space."""
    runs: list[list[int]] = []
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pm:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 5:
                continue
            perms = parts[1]
            name = parts[5].strip() if len(parts) > 5 else ""
            if perms.startswith("---") or name in _SKIP_MAPPINGS or _device_mapping(name):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if hi - lo > MAX_SCAN_MAPPING:
                continue
            first, n = lo // PAGE, (hi - lo) // PAGE
            pm.seek(first * 8)
            raw = pm.read(n * 8)
            if len(raw) % 8:
                raw = raw[: len(raw) - len(raw) % 8]
            runs.extend(_runs(memoryview(raw).cast("Q"), first))
    return runs


def record_working_set(pids: list[int]) -> dict[str, Any]:
    """The working set of every process in `pids` (blocking; run it in a thread)."""
    procs = {}
    for pid in pids:
        st = _starttime(pid)
        if st is None:
            continue
        try:
            runs = process_working_set(pid)
        except OSError:
            continue  # exited, or a kernel thread: nothing to prefetch
        if runs:
            procs[str(pid)] = {"start": st, "runs": runs}
    return {"page": PAGE, "recorded_at": time.time(), "procs": procs}


def working_set_pages(ws: dict[str, Any]) -> int:
    """How many pages a recorded working set holds."""
    return sum(n for p in ws.get("procs", {}).values() for _, n in p["runs"])


def _missing(pm_fd: int, first: int, n: int) -> list[list[int]]:
    """Sub-runs of [first, first+n) whose pages are in swap now.

    Only swapped pages are worth reading ahead: a dropped page-cache page comes back from the (host)
    page cache on demand for the price of a minor fault, and reading all of them eagerly costs more
    than it saves (measured: `shoal bench pause`).
    """
    raw = os.pread(pm_fd, n * 8, first * 8)
    raw = raw[: len(raw) - len(raw) % 8]
    return _runs(memoryview(raw).cast("Q"), first, _SWAPPED)


_MADV_WILLNEED = 3
_SYS_PROCESS_MADVISE = {"x86_64": 440, "aarch64": 440}.get(os.uname().machine)
_libc: Any = None


def _process_madvise_willneed(pidfd: int, ranges: list[tuple[int, int]]) -> bool:
    """Ask the kernel to read `ranges` (addr, length) of another process back from swap (no copy).

    process_madvise(2), Linux >= 5.10, needs CAP_SYS_NICE. False when unavailable here.
    """
    global _libc
    if _SYS_PROCESS_MADVISE is None:
        return False
    import ctypes

    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    for i in range(0, len(ranges), 512):
        chunk = ranges[i : i + 512]
        iov = (ctypes.c_size_t * (2 * len(chunk)))(*[x for a, n in chunk for x in (a, n)])
        r = _libc.syscall(_SYS_PROCESS_MADVISE, pidfd, iov, len(chunk), _MADV_WILLNEED, 0)
        if r < 0:
            return False
    return True


def prefetch_working_set(ws: dict[str, Any], budget_s: float = PREFETCH_BUDGET_S) -> int:
    """Bring the recorded pages that are now in swap back into memory; returns how many pages.

    Uses process_madvise(MADV_WILLNEED) (the kernel swaps the pages in without mapping or copying
    them; the first touch is then a minor fault), else reads them through /proc/PID/mem. Pages still
    resident, and dropped file pages (cheap to fault back from the page cache), are left alone.
    Blocking: run it in a thread, with the sandbox still frozen.
    """
    page = int(ws.get("page", PAGE))
    deadline = time.monotonic() + budget_s
    done = 0
    for pid_s, p in ws.get("procs", {}).items():
        pid = int(pid_s)
        if _starttime(pid) != p.get("start"):
            continue  # gone (or the pid was reused): nothing of ours to prefetch
        try:
            pm = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            todo: list[list[int]] = []
            for run_first, run_n in p["runs"]:
                with contextlib.suppress(OSError):
                    todo.extend(_missing(pm, run_first, run_n))
        finally:
            os.close(pm)
        if not todo:
            continue
        ranges = [(first * page, n * page) for first, n in todo]
        pidfd = -1
        with contextlib.suppress(OSError, AttributeError):
            pidfd = os.pidfd_open(pid)
        try:
            if pidfd >= 0 and _starttime(pid) == p.get("start") and _process_madvise_willneed(pidfd, ranges):
                done += sum(n for _, n in todo)
                continue
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        done += _read_back(pid, ranges, page, deadline)
        if time.monotonic() > deadline:
            return done
    return done


def _read_back(pid: int, ranges: list[tuple[int, int]], page: int, deadline: float) -> int:
    """Fallback prefetch: read the ranges through /proc/PID/mem (faults them in; slower, copies)."""
    done = 0
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        for addr, left in ranges:
            while left > 0:
                try:
                    got = len(os.pread(fd, min(left, 1 << 20), addr))
                except OSError:
                    got = 0  # an unreadable range (unmapped since): skip it
                if got <= 0:
                    break
                done += got // page
                addr += got
                left -= got
            if time.monotonic() > deadline:
                break
    finally:
        os.close(fd)
    return done


def save_working_set(sandbox_dir: Path, ws: dict[str, Any]) -> Path:
    """Keep a working set next to the sandbox's record (survives a node-agent restart)."""
    p = Path(sandbox_dir) / WORKING_SET_FILE
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(ws, separators=(",", ":")))
    os.replace(tmp, p)
    return p


def load_working_set(sandbox_dir: Path) -> dict[str, Any] | None:
    """The working set saved at pause, or None."""
    try:
        return json.loads((Path(sandbox_dir) / WORKING_SET_FILE).read_text())
    except (OSError, ValueError):
        return None


def drop_working_set(sandbox_dir: Path) -> None:
    """Forget the saved working set (after a resume)."""
    with contextlib.suppress(FileNotFoundError):
        (Path(sandbox_dir) / WORKING_SET_FILE).unlink()


def cgroup_pids(cg: SandboxCgroup) -> list[int]:
    """Processes charged to the sandbox's memory cgroup (host PIDs)."""
    raw = cg.read("memory", "cgroup.procs") or ""
    return [int(x) for x in raw.split() if x.isdigit()]


# ---- the node's hooks --------------------------------------------------------------------------
def _pause_reclaim_sync(cgroup: str, sandbox_dir: Path, prefetch: bool) -> dict[str, Any]:
    cg = SandboxCgroup(cgroup)
    if not cg.exists():
        return {"error": f"no memory cgroup at {cg.dir('memory')}"}
    out: dict[str, Any] = {}
    if prefetch:
        t0 = time.monotonic()
        ws = record_working_set(cgroup_pids(cg))
        save_working_set(sandbox_dir, ws)
        out["working_set_pages"] = working_set_pages(ws)
        out["record_s"] = round(time.monotonic() - t0, 4)
    res = reclaim_cgroup(cg)
    out.update(method=res.method, before=res.before, after=res.after, reclaimed=res.reclaimed,
               swap_before=res.swap_before, swap_after=res.swap_after, stat_before=res.stat_before,
               stat_after=res.stat_after, reclaim_s=round(res.seconds, 4), swap_on=swap_active())
    if res.error:
        out["error"] = res.error
    return out


async def reclaim_paused(cgroup: str, sandbox_dir: Path, prefetch: bool = True) -> dict[str, Any]:
    """After a freeze: record the working set (when `prefetch`), then reclaim. Never raises."""
    import asyncio

    try:
        return await asyncio.to_thread(_pause_reclaim_sync, cgroup, sandbox_dir, prefetch)
    except Exception as e:  # reclaim is best effort: the sandbox is paused either way
        return {"error": f"reclaim failed: {e}"}


def _prefetch_sync(sandbox_dir: Path) -> dict[str, Any]:
    ws = load_working_set(sandbox_dir)
    if not ws:
        return {}
    t0 = time.monotonic()
    pages = prefetch_working_set(ws)
    drop_working_set(sandbox_dir)
    return {"prefetched_pages": pages, "prefetch_s": round(time.monotonic() - t0, 4)}


async def prefetch_before_thaw(sandbox_dir: Path) -> dict[str, Any]:
    """Before a thaw: read the recorded working set back in. Never raises."""
    import asyncio

    try:
        return await asyncio.to_thread(_prefetch_sync, sandbox_dir)
    except Exception as e:
        return {"error": f"prefetch failed: {e}"}


def _memsw_supported() -> bool:
    from shoal.host.cgroups import CGROUP_ROOT, cgroup_mode

    if cgroup_mode() == "v2":
        return True  # memory.swap.max: present whenever the kernel has swap accounting (the default)
    return (CGROUP_ROOT / "memory" / "memory.memsw.limit_in_bytes").exists()


def sandbox_swap_mb(memory_mb: int, policy: str = "auto") -> int | None:
    """Swap a *running* container sandbox may use (memsw limit = memory + this); None = leave the
    runtime's default (used when the host has no swap, or no swap accounting).

    `policy` (the node's `sandbox_swap` setting, SHOAL_SANDBOX_SWAP): `auto` (default) = as much swap as
    memory; `0` = none (an over-limit sandbox is OOM-killed at once instead of thrashing); a size (e.g.
    `512M`) = that much. Reclaim of a *paused* sandbox moves its pages to swap whatever this says: moving a
    page from RAM to swap does not change memory+swap.
    """
    if not swap_active() or not _memsw_supported():
        return None
    pol = policy  # "auto", "0" or a size (checked when the settings load)
    if pol == "auto":
        return int(memory_mb)
    if pol == "0":
        return 0
    return parse_size(pol) >> 20
