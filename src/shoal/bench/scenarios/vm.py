"""`vm`: VM sandboxes (issue 5): boot-to-first-exec and host memory per idle microVM, pause reclaim, fork with
memory, and a full q35 VM when the `debian-vm` image exists; every figure says whether the VMs ran under KVM
or TCG. Docker runs no VMs: there is no comparison.

Memory of a VM is read from QEMU's /proc/<pid>/smaps and split into: guest RAM the guest has touched
(the memfd backing its RAM), the TCG translation cache (TCG only), the shared kernel image QEMU keeps
mapped (page cache, one copy for all VMs), and the rest: QEMU's own overhead.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import shoal
from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult
from shoal.bench.scenario import Scenario, param


@dataclass(frozen=True)
class VmParams:
    """How much work the vm scenario does."""

    n: int = param(3, help="microVMs booted")
    memory_mb: int = param(512, help="guest memory of each microVM")
    full_vm: bool = param(True, quick=False, help="also boot one full VM (q35) when the debian-vm image exists")
    fork_children: int = param(2, quick=1, help="children of the microVM fork with memory")


def qemu_memory(pid: int) -> dict[str, float]:
    """RSS and PSS of one QEMU, split by what the memory is (MiB)."""
    guest = tcg = kernel = other = 0
    pss = 0
    cur = ""
    rss_cur = 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
                cur = line
                continue
            if line.startswith("Rss:"):
                rss_cur = int(line.split()[1])
                fields = cur.split()
                name = fields[5] if len(fields) > 5 else ""
                if "memory-backend" in name or "microvm.ram" in name or "pc.ram" in name:
                    guest += rss_cur
                elif name.endswith("vmlinux") or "/vm/guest/" in name or "/vm/disks/" in name:
                    kernel += rss_cur
                elif not name and "x" in fields[1]:
                    tcg += rss_cur
                else:
                    other += rss_cur
            elif line.startswith("Pss:"):
                pss += int(line.split()[1])
    mib = 1024.0
    return {"rss_mib": (guest + tcg + kernel + other) / mib, "pss_mib": pss / mib, "guest_ram_mib": guest / mib,
            "tcg_cache_mib": tcg / mib, "kernel_image_mib": kernel / mib, "vmm_mib": other / mib}


def qemu_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) QEMU has used so far."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


async def _boot_many(client: shoal.Client, backend: str, image: str, n: int, memory_mb: int,
                     say: Callable[[str], None]) -> tuple[list[Any], list[float], list[dict]]:
    sbs, boot, phases = [], [], []
    for i in range(n):
        t0 = time.monotonic()
        sb = await client.create(image, backend=backend, memory_mb=memory_mb)
        r = await sb.exec(["true"])
        dt = time.monotonic() - t0
        if r.exit_code != 0:
            raise RuntimeError(f"`true` exited {r.exit_code} in a fresh {backend}: {r.stderr[-300:]!r}")
        sbs.append(sb)
        boot.append(dt)
        phases.append((await sb.refresh()).extra.get("boot_phases_s") or {})
        say(f"{backend} {i + 1}/{n}: boot to first exec {dt:.2f}s")
    return sbs, boot, phases


async def vm_bench(client: shoal.Client, node: Any, n: int = 3, memory_mb: int = 512, full_vm: bool = True,
                   fork_children: int = 2, say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Boot `n` microVMs (and one full VM), measure boot-to-first-exec, idle memory, pause, fork."""
    from shoal.host.kvm import kvm_status

    st = kvm_status()
    accel = "kvm" if st.usable else "tcg"
    out: dict[str, Any] = {"accel": accel, "accel_detail": st.detail, "n": n, "memory_mb": memory_mb}
    # (the sandboxes are the client's: the bench closes them with it even when a step fails)
    sbs, boot, phases = await _boot_many(client, "microvm", "base", n, memory_mb, say)
    out["microvm_boot_to_first_exec_s"] = {"median": _median(boot), "min": round(min(boot), 3),
                                           "max": round(max(boot), 3), "all": [round(x, 3) for x in boot]}
    out["microvm_boot_phases_s"] = {k: _median([p.get(k, 0) for p in phases]) for k in phases[0]}
    execs = []
    for _ in range(20):
        t0 = time.monotonic()
        await sbs[0].exec(["true"])
        execs.append(time.monotonic() - t0)
    out["microvm_exec_ms"] = round(1000 * statistics.median(execs), 2)
    say("idle 5 s, then reading QEMU's memory")
    await asyncio.sleep(5)
    pids = [node.record(sb.id).init_pid for sb in sbs]
    mems = [qemu_memory(p) for p in pids]
    out["microvm_idle_memory_mib"] = {k: round(statistics.median(m[k] for m in mems), 1) for k in mems[0]}
    c0 = [qemu_cpu_s(p) for p in pids]
    await asyncio.sleep(5)
    cpu = [100 * (qemu_cpu_s(p) - c) / 5 for p, c in zip(pids, c0, strict=True)]
    out["microvm_idle_cpu_pct"] = round(statistics.median(cpu), 2)
    # pause: balloon + stop, then what the host got back
    sb = sbs[0]
    pid = node.record(sb.id).init_pid
    before = qemu_memory(pid)
    t0 = time.monotonic()
    await sb.pause()
    pause_s = time.monotonic() - t0
    await asyncio.sleep(1)
    after = qemu_memory(pid)
    t0 = time.monotonic()
    await sb.resume()
    await sb.exec(["true"])
    out["microvm_pause"] = {"pause_s": round(pause_s, 3), "resume_to_exec_s": round(time.monotonic() - t0, 3),
                            "guest_ram_before_mib": round(before["guest_ram_mib"], 1),
                            "guest_ram_paused_mib": round(after["guest_ram_mib"], 1),
                            "rss_before_mib": round(before["rss_mib"], 1),
                            "rss_paused_mib": round(after["rss_mib"], 1)}
    say(f"pause {pause_s:.2f}s: guest RAM {before['guest_ram_mib']:.0f} -> {after['guest_ram_mib']:.0f} MiB")
    # fork with memory: a process keeps running in the children
    await sb.exec("sh -c 'sleep 1000 >/dev/null 2>&1 &'")
    kids_n = fork_children
    t0 = time.monotonic()
    kids = await sb.fork(kids_n)
    fork_s = time.monotonic() - t0
    t0 = time.monotonic()
    await kids[0].exec(["true"])
    out["microvm_fork"] = {"children": kids_n, "fork_s": round(fork_s, 3),
                           "first_exec_after_s": round(time.monotonic() - t0, 3)}
    say(f"fork {kids_n}: {fork_s:.2f}s")
    for k in kids:
        await k.close()
    for s in sbs:
        await s.close()
    if full_vm and node.store.exists("debian-vm:latest"):
        [vm], vboot, vph = await _boot_many(client, "vm", "debian-vm", 1, 768, say)
        await asyncio.sleep(5)
        out["vm_boot_to_first_exec_s"] = round(vboot[0], 3)
        out["vm_boot_phases_s"] = vph[0]
        out["vm_idle_memory_mib"] = {k: round(v, 1) for k, v in
                                     qemu_memory(node.record(vm.id).init_pid).items()}
        await vm.close()
    elif full_vm:
        out["vm"] = "skipped: no debian-vm image (shoal vm build-image)"
    return out


def rows(out: dict[str, Any]) -> list[Metric]:
    """Table rows of vm_bench's result."""
    accel = out["accel"]
    mem = out["microvm_idle_memory_mib"]
    boot_med = out["microvm_boot_to_first_exec_s"]["median"]
    kvm = accel == "kvm"
    rows = [
        Metric(f"microVM boot to first exec ({accel})", boot_med, None, "s", target="≤ 0.15 s (with KVM)",
               met=(boot_med <= 0.15) if kvm else None),
        Metric(f"microVM exec round trip ({accel})", out["microvm_exec_ms"], None, "ms"),
        Metric(f"idle microVM CPU ({accel})", out["microvm_idle_cpu_pct"], None, "% of a core"),
        Metric(f"idle microVM host RSS ({accel}, {out['memory_mb']} MiB guest)", mem["rss_mib"], None, "MiB"),
        Metric(f"idle microVM PSS ({accel})", mem["pss_mib"], None, "MiB"),
        Metric("  of which guest RAM touched", mem["guest_ram_mib"], None, "MiB"),
        Metric("  of which QEMU itself (VMM overhead)", mem["vmm_mib"], None, "MiB", target="≤ 10 MiB (with KVM)",
               met=(mem["vmm_mib"] <= 10.0) if kvm else None),
        Metric("  of which TCG translation cache", mem["tcg_cache_mib"], None, "MiB"),
        Metric("guest RAM paused (balloon)", out["microvm_pause"]["guest_ram_paused_mib"], None, "MiB"),
        Metric(f"fork {out['microvm_fork']['children']} children with memory", out["microvm_fork"]["fork_s"], None,
               "s"),
    ]
    if "vm_boot_to_first_exec_s" in out:
        rows += [Metric(f"full VM (q35, systemd) boot to first exec ({accel})", out["vm_boot_to_first_exec_s"], None,
                        "s"),
                 Metric("idle full VM host RSS", out["vm_idle_memory_mib"]["rss_mib"], None, "MiB")]
    return rows


async def run(ctx: BenchContext, p: VmParams) -> ScenarioResult:
    """The vm scenario (see the module docstring)."""
    res = ScenarioResult("vm", docker="not applicable")
    out = await vm_bench(ctx.client, ctx.node, p.n, p.memory_mb, p.full_vm, p.fork_children, ctx.log)
    res.data.update(out)
    res.add(*rows(out))
    res.notes.append(f"accelerator: {out['accel']} ({out['accel_detail']})")
    if isinstance(out.get("vm"), str):
        res.notes.append(f"full VM {out['vm']}")
    return res


SCENARIO = Scenario("vm", "microVM/VM boot-to-first-exec and host memory per idle VM", run, VmParams,
                    uses_docker=False)
