"""Benchmarks of VM sandboxes (issue 5): boot-to-first-exec and host memory per idle VM, pause reclaim,
fork with memory; every figure says whether the VMs ran under KVM or TCG.

    sudo .venv/bin/python benchmarks/bench_vm.py                 # microVMs (+ a full VM if debian-vm exists)
    sudo .venv/bin/python benchmarks/bench_vm.py --n 5 --json /tmp/vm.json --no-full-vm

`run_vm_bench` is also what `shoal bench vm` runs. Nothing here asserts timings.

Memory of a VM is read from QEMU's /proc/<pid>/smaps and split into: guest RAM the guest has touched
(the memfd backing its RAM), the TCG translation cache (TCG only), the shared kernel image QEMU keeps
mapped (page cache, one copy for all VMs), and the rest: QEMU's own overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import shoal


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


def _sayer(progress: Any) -> Callable[[str], None]:
    """A function printing one line: `progress` itself, or the console of a rich Progress (shoal bench)."""
    if progress is None:
        return lambda s: None
    if callable(progress):
        return progress
    con = getattr(progress, "console", None)
    return (lambda s: con.log(s)) if con is not None else (lambda s: None)


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
        assert r.exit_code == 0
        sbs.append(sb)
        boot.append(dt)
        phases.append((await sb.refresh()).extra.get("boot_phases_s") or {})
        say(f"{backend} {i + 1}/{n}: boot to first exec {dt:.2f}s")
    return sbs, boot, phases


async def run_vm_bench(client: shoal.Client | None = None, node: Any = None, n: int = 3, memory_mb: int = 512,
                       full_vm: bool = True, quick: bool = False,
                       progress: Any = None) -> dict[str, Any]:
    """Boot `n` microVMs (and one full VM), measure boot-to-first-exec, idle memory, pause, fork."""
    from shoal.host.kvm import kvm_status

    say = _sayer(progress)
    own = client is None
    if own:
        client = shoal.Client()
        await client.__aenter__()
    assert client is not None
    node = node or client.transport.node  # type: ignore[attr-defined]
    st = kvm_status()
    accel = "kvm" if st.usable else "tcg"
    out: dict[str, Any] = {"accel": accel, "accel_detail": st.detail, "n": n, "memory_mb": memory_mb}
    try:
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
        kids_n = 1 if quick else 2
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
        if full_vm and not quick and node.store.exists("debian-vm:latest"):
            [vm], vboot, vph = await _boot_many(client, "vm", "debian-vm", 1, 768, say)
            await asyncio.sleep(5)
            out["vm_boot_to_first_exec_s"] = round(vboot[0], 3)
            out["vm_boot_phases_s"] = vph[0]
            out["vm_idle_memory_mib"] = {k: round(v, 1) for k, v in
                                         qemu_memory(node.record(vm.id).init_pid).items()}
            await vm.close()
        elif full_vm:
            out["vm"] = "skipped: no debian-vm image (shoal vm build-image) or --quick"
    finally:
        if own:
            await client.__aexit__(None, None, None)
    mem = out["microvm_idle_memory_mib"]
    boot_med = out["microvm_boot_to_first_exec_s"]["median"]
    out["metrics"] = [
        {"name": f"microVM boot to first exec ({accel})", "shoal": boot_med, "unit": "s", "better": "lower",
         "target": "≤ 0.15 s (with KVM)", "met": (boot_med <= 0.15) if accel == "kvm" else None},
        {"name": f"microVM exec round trip ({accel})", "shoal": out["microvm_exec_ms"], "unit": "ms",
         "better": "lower"},
        {"name": f"idle microVM CPU ({accel})", "shoal": out["microvm_idle_cpu_pct"], "unit": "% of a core",
         "better": "lower"},
        {"name": f"idle microVM host RSS ({accel}, {memory_mb} MiB guest)", "shoal": mem["rss_mib"], "unit": "MiB",
         "better": "lower"},
        {"name": f"idle microVM PSS ({accel})", "shoal": mem["pss_mib"], "unit": "MiB", "better": "lower"},
        {"name": "  of which guest RAM touched", "shoal": mem["guest_ram_mib"], "unit": "MiB", "better": "lower"},
        {"name": "  of which QEMU itself (VMM overhead)", "shoal": mem["vmm_mib"], "unit": "MiB", "better": "lower",
         "target": "≤ 10 MiB (with KVM)", "met": (mem["vmm_mib"] <= 10.0) if accel == "kvm" else None},
        {"name": "  of which TCG translation cache", "shoal": mem["tcg_cache_mib"], "unit": "MiB", "better": "lower"},
        {"name": "guest RAM paused (balloon)", "shoal": out["microvm_pause"]["guest_ram_paused_mib"], "unit": "MiB",
         "better": "lower"},
        {"name": f"fork {out['microvm_fork']['children']} children with memory", "shoal": out["microvm_fork"]["fork_s"],
         "unit": "s", "better": "lower"},
    ]
    if "vm_boot_to_first_exec_s" in out:
        out["metrics"].append({"name": f"full VM (q35, systemd) boot to first exec ({accel})",
                               "shoal": out["vm_boot_to_first_exec_s"], "unit": "s", "better": "lower"})
        out["metrics"].append({"name": "idle full VM host RSS", "shoal": out["vm_idle_memory_mib"]["rss_mib"],
                               "unit": "MiB", "better": "lower"})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=3, help="microVMs to boot")
    ap.add_argument("--memory-mb", type=int, default=512)
    ap.add_argument("--no-full-vm", action="store_true", help="skip the q35 full VM")
    ap.add_argument("--json", type=Path, help="write the results here")
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_vm: run as root", file=sys.stderr)
        return 1
    res = asyncio.run(run_vm_bench(n=a.n, memory_mb=a.memory_mb, full_vm=not a.no_full_vm,
                                   progress=lambda s: print(s, flush=True)))
    print(f"\naccelerator: {res['accel']} ({res['accel_detail']})")
    for m in res["metrics"]:
        met = {True: "met", False: "not met", None: "n/a here"}[m.get("met")]
        tgt = f"  (target {m['target']}: {met})" if m.get("target") else ""
        print(f"{m['name']:<58} {m['shoal']!s:>8} {m['unit']}{tgt}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
