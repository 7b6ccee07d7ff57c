"""`sharing`: memory that identical sandboxes hold once — EROFS page cache across containers, KSM across VMs.

* **EROFS page cache** — every layer is mounted once per host and stacked under each container's overlay,
  so a file of the image has one inode, and one page cache, however many sandboxes read it. Measured:
  the file's pages resident in the host page cache (`fincore` on the layer mount) after one sandbox read it
  and after all `sandboxes` read it, against what N private copies would take.
* **KSM** — `vms` identical microVMs (the same kernel, initramfs and image, each running the same short
  program) are booted twice: with guest RAM in a memfd (as with `SHOAL_VM_KSM=0`: never merged) and as
  private mergeable memory with ksmd on (`SHOAL_VM_KSM=1`, the default). Measured: the QEMU processes' memory (PSS,
  which divides a merged page among the processes mapping it), and ksmd's own count of pages no longer
  stored (pages_sharing + merged zero pages), once it has scanned everything twice after the boots.
Under TCG (no KVM here) a microVM boot takes seconds of CPU; on a KVM host the same runs much faster.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.bench import host
from shoal.bench.context import BenchContext
from shoal.bench.docker import process_tree_rss
from shoal.bench.results import Metric, ScenarioResult
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios.common import close_all, spec
from shoal.bench.stats import percentile
from shoal.errors import ShoalError
from shoal.host import ksm
from shoal.host.spawn import run

MIB = 2**20
#: what each VM runs once booted (reads a good part of the image: the same pages in every guest)
VM_WORK = "python3 -c 'import json, email.parser, http.client, decimal, sqlite3, xml.dom.minidom' && echo ok"


@dataclass(frozen=True)
class SharingParams:
    """How much the sharing scenario creates."""

    sandboxes: int = param(20, quick=5, help="containers reading the same file of their image")
    vms: int = param(20, quick=3, help="identical microVMs, booted once without KSM and once with it")
    vm_memory_mb: int = param(256, quick=192, help="memory_mb of each microVM")
    boot_concurrency: int = param(4, help="microVMs booted at once")
    ksm_wait_s: float = param(180.0, quick=60.0, help="longest wait for ksmd to finish two full scans")


def _largest_file(root: Path, under: tuple[str, ...] = ("usr/lib", "usr/bin")) -> Path | None:
    best: tuple[int, Path | None] = (0, None)
    for sub in under:
        for dirpath, _dirs, files in os.walk(root / sub):
            for f in files:
                p = Path(dirpath) / f
                with contextlib.suppress(OSError):
                    st = p.lstat()
                    if p.is_file() and not p.is_symlink() and st.st_size > best[0] and st.st_size < 256 * MIB:
                        best = (st.st_size, p)
    return best[1]


async def _resident(path: Path) -> int:
    r = await run(["fincore", "-b", "-n", "-o", "RES", str(path)], timeout=30)
    with contextlib.suppress(ValueError):
        return int(r.stdout.split()[0])
    return -1


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def page_cache(ctx: BenchContext, n: int) -> dict[str, Any]:
    """N containers read the same image file: how much page cache it takes."""
    node = ctx.node
    made = await node.create_many(spec(ctx, memory_mb=256), n)
    ids = [i.id for i in made if not isinstance(i, ShoalError)]
    try:
        rec = node.record(ids[0])
        # the image's file on the host, as the overlay under every sandbox reaches it: the layer's mount
        mounts = [node.layer_mounts.mountpoint(h) for h in rec.layers]
        found = [(m, f) for m in reversed(mounts) if (f := _largest_file(m)) is not None]
        if not found:
            return {"error": "no file to read in the image"}
        mount, path = found[0]
        inside = "/" + str(path.relative_to(mount))
        size = path.stat().st_size
        await asyncio.to_thread(_evict, path)
        cached0 = host.meminfo_kib()["Cached"]
        res0 = await _resident(path)
        r = await node.exec(ids[0], ["cat", inside], timeout=120)
        one = await _resident(path)
        await asyncio.gather(*(node.exec(s, ["sh", "-c", f"cat '{inside}' > /dev/null"], timeout=120) for s in ids[1:]))
        cached1 = host.meminfo_kib()["Cached"]
        all_ = await _resident(path)
        sums = await asyncio.gather(*(node.exec(s, ["md5sum", inside], timeout=120) for s in ids))
        same = len({x.stdout.split()[0] for x in sums if x.exit_code == 0}) == 1
    finally:
        await close_all(ctx, ids, "closing the readers")
    return {"readers": len(ids), "file": inside, "size_bytes": size, "read_ok": r.exit_code == 0,
            "resident_before": res0, "resident_after_one": one, "resident_after_all": all_,
            "page_cache_growth_mb": round((cached1 - cached0) / 1024, 1), "same_content": same,
            "private_copies_would_take_mb": round(len(ids) * size / MIB, 1)}


async def _boot(ctx: BenchContext, n: int, memory_mb: int, conc: int) -> tuple[list[str], list[str], float]:
    node = ctx.node
    sem = asyncio.Semaphore(conc)
    ids: list[str] = []
    errors: list[str] = []

    async def one() -> None:
        async with sem:
            try:
                info = await node.create(spec(ctx, backend="microvm", memory_mb=memory_mb))
            except ShoalError as e:
                errors.append(str(e)[:300])
                return
            ids.append(info.id)
            r = await node.exec(info.id, VM_WORK, timeout=600)
            if r.stdout.strip() != b"ok":
                errors.append(f"work failed in {info.id}: {r.stderr[-200:]!r}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return ids, errors, time.perf_counter() - t0


def _qemu_pids(node: Any, ids: list[str]) -> list[int]:
    return [p for p in (node.record(i).init_pid for i in ids) if p]


async def _ksm_settle(wait_s: float) -> dict[str, int]:
    """Wait until ksmd has scanned everything twice since now (or `wait_s`), then its counters."""
    start = ksm.stats().get("full_scans", 0)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and ksm.stats().get("full_scans", 0) < start + 2:
        await asyncio.sleep(2.0)
    return ksm.stats()


async def vms(ctx: BenchContext, sz: SharingParams, with_ksm: bool) -> dict[str, Any]:
    """Boot `sz.vms` microVMs with or without KSM; their memory once booted and used."""
    backend = ctx.node.backend("microvm")
    backend.ksm = with_ksm  # type: ignore[attr-defined]  # (the VM backend's override of SHOAL_VM_KSM)
    ids: list[str] = []
    try:
        before = host.memory_snapshot()
        ids, errors, boot_s = await _boot(ctx, sz.vms, sz.vm_memory_mb, sz.boot_concurrency)
        node = ctx.node
        rams = {node.record(i).extra.get("vm", {}).get("ram") for i in ids}
        st = await _ksm_settle(sz.ksm_wait_s) if with_ksm else ksm.stats()
        await asyncio.sleep(2.0)
        pids = _qemu_pids(node, ids)
        pss = process_tree_rss(pids)
        per = [process_tree_rss([p]) for p in pids]
        after = host.memory_snapshot()
    finally:
        backend.ksm = None  # type: ignore[attr-defined]
        await close_all(ctx, ids, "closing the microVMs")
    return {"with_ksm": with_ksm, "booted": len(ids), "errors": errors[:3], "boot_all_s": round(boot_s, 1),
            "guest_ram": sorted(r or "?" for r in rams), "qemu_pss_total_mb": round(pss / MIB, 1),
            "qemu_pss_per_vm_mb": round(pss / MIB / max(1, len(pids)), 1),
            "qemu_pss_per_vm_p50_mb": round(percentile(per, 50) / MIB, 1) if per else None,
            "host_used_delta_mb": round((after["used"] - before["used"]) / MIB, 1),
            "ksm_stats": st, "ksm_saved_mb": round(ksm.saved_bytes(st) / MIB, 1) if with_ksm else 0.0}


async def run_scenario(ctx: BenchContext, sz: SharingParams) -> ScenarioResult:
    """The sharing scenario (see the module docstring)."""
    res = ScenarioResult("sharing")
    pc = await page_cache(ctx, sz.sandboxes)
    res.data["erofs_page_cache"] = pc
    if "error" not in pc:
        res.add(Metric(f"page cache for one image file read by {pc['readers']} containers", round(
            pc["resident_after_all"] / MIB, 1), None, "MiB",
            note=f"{pc['file']} ({pc['size_bytes'] / MIB:.1f} MiB): {pc['resident_after_one'] / MIB:.1f} MiB after one "
                 f"reader, {pc['resident_after_all'] / MIB:.1f} after all; {pc['private_copies_would_take_mb']} MiB as "
                 "private copies"))
    run_was = ksm.stats().get("run")
    try:
        if sz.vms:
            off = await vms(ctx, sz, with_ksm=False)
            on = await vms(ctx, sz, with_ksm=True)
            res.data["vms_without_ksm"], res.data["vms_with_ksm"] = off, on
            saved = (1 - on["qemu_pss_total_mb"] / off["qemu_pss_total_mb"]) * 100 if off["qemu_pss_total_mb"] else None
            res.add(Metric(f"memory of {sz.vms} identical microVMs, no KSM (QEMU PSS)", off["qemu_pss_total_mb"], None,
                           "MiB", note=f"{off['qemu_pss_per_vm_mb']} MiB per VM of {sz.vm_memory_mb}; guest RAM "
                                       f"{off['guest_ram']}"),
                    Metric(f"memory of {sz.vms} identical microVMs with KSM (QEMU PSS)", on["qemu_pss_total_mb"], None,
                           "MiB", note=f"{on['qemu_pss_per_vm_mb']} MiB per VM; ksmd: {on['ksm_saved_mb']} MiB not "
                                       f"stored ({on['ksm_stats'].get('pages_sharing', 0)} sharing pages, "
                                       f"{on['ksm_stats'].get('ksm_zero_pages', 0)} zero pages)"),
                    Metric("KSM saving on identical microVMs", round(saved, 1) if saved is not None else None, None,
                           "%", better="higher"))
    finally:
        if run_was == 0:
            with contextlib.suppress(OSError):
                (ksm.KSM / "run").write_text("0")  # leave the host's KSM as this run found it
    return res


SCENARIO = Scenario("sharing", "memory held once: EROFS page cache across containers, KSM across microVMs",
                    run_scenario, SharingParams, uses_docker=False, default_run=False)
