"""Is KVM usable here? Not "does /dev/kvm exist" but "does a real guest run under it".

Two stages, each in a child process killed after a timeout (under broken nested virtualization guests
hang rather than fail, so a hang is an answer too):

1. the KVM ioctl API: create a VM and a vCPU, load `_PROBE_CODE` (below) at 0xF0000 and run it from
   real mode. It loads a GDT, enters protected mode, turns paging on (one 4 MiB identity page) and writes
   0x21 to port 0xf4. KVM works when KVM_RUN comes back with that I/O exit. (Real mode alone is not
   enough: on this project's CI hosts real-mode code runs under KVM while paging hangs the guest.)
2. QEMU itself, when installed: the same code as a 64 KiB firmware image on the microvm machine with
   `-cpu host` and an isa-debug-exit device, so a QEMU that cannot start a vCPU (it aborts on MSRs some
   nested hypervisors refuse) is caught too. The answer is cached per boot
(keyed by /proc/sys/kernel/random/boot_id) because it cannot change without a reboot.

`python -m shoal.host.kvm` prints the verdict (and `--probe` is the child's entry point).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from shoal.config import settings

# ioctl numbers from <linux/kvm.h> (x86-64)
KVM_GET_API_VERSION = 0xAE00
KVM_CREATE_VM = 0xAE01
KVM_GET_VCPU_MMAP_SIZE = 0xAE04
KVM_CREATE_VCPU = 0xAE41
KVM_RUN = 0xAE80
KVM_SET_USER_MEMORY_REGION = 0x4020AE46
KVM_GET_SREGS = 0x8138AE83
KVM_SET_SREGS = 0x4138AE84
KVM_SET_REGS = 0x4090AE82
KVM_EXIT_IO = 2
KVM_EXIT_HLT = 5
KVM_EXIT_SHUTDOWN = 8

PROBE_TIMEOUT_S = 5.0
# GNU as (--32), linked at 0, placed at 0xF0000:
#   .code16: cli; xor ax,ax; mov ds,ax; lgdtl cs:gdtr; cr0 |= PE; ljmpl 0x08:0xF0000+start32
#   .code32 start32: ds=es=ss=0x10; [0x1000] = 0x83 (4 MiB page, P|RW|PS); cr4 |= PSE; cr3 = 0x1000;
#                    cr0 |= PG; mov al,0x21; out 0xf4,al; 1: hlt; jmp 1b
#   gdt: null, code32 flat (0x00cf9a000000ffff), data32 flat (0x00cf92000000ffff); gdtr: limit 23, base 0xF0000+gdt
_PROBE_CODE = bytes.fromhex(
    "fa31c08ed82e660f011678000f20c06683c8010f22c066ea1e000f00080066b810008ed88ec08ed0bf00100000b8830000"
    "008907c74704000000000f20e083c8100f22e00f22df0f20c00d000000800f22c0b021e6f4f4ebfd8db400008d74000000"
    "000000000000ffff0000009acf00ffff00000092cf00170060000f00")
_RESET_JUMP = bytes.fromhex("ea0000" "00f0")  # at 0xFFFF0: ljmp 0xf000:0x0000
_PROBE_PORT = 0xF4
_PROBE_VALUE = 0x21
_MEM = 1 << 20


@dataclass
class KvmStatus:
    """The verdict: `usable` plus a one-line `detail` and, when not usable, a `fix`."""

    usable: bool
    detail: str
    fix: str = ""
    boot_id: str = ""


class _Region(ctypes.Structure):
    _fields_ = [("slot", ctypes.c_uint32), ("flags", ctypes.c_uint32), ("guest_phys_addr", ctypes.c_uint64),
                ("memory_size", ctypes.c_uint64), ("userspace_addr", ctypes.c_uint64)]


class _Regs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in (
        "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rsp", "rbp", "r8", "r9", "r10", "r11", "r12", "r13",
        "r14", "r15", "rip", "rflags")]


def _probe_in_this_process() -> tuple[bool, str]:
    """Run the tiny guest. Returns (ok, detail). May hang forever on broken nested virtualization."""
    kvm = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    try:
        api = fcntl.ioctl(kvm, KVM_GET_API_VERSION)
        if api != 12:
            return False, f"/dev/kvm speaks API version {api}, expected 12"
        vm = fcntl.ioctl(kvm, KVM_CREATE_VM, 0)
        mem = mmap.mmap(-1, _MEM, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mem[0xF0000:0xF0000 + len(_PROBE_CODE)] = _PROBE_CODE
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
        region = _Region(0, 0, 0, _MEM, addr)
        fcntl.ioctl(vm, KVM_SET_USER_MEMORY_REGION, region)
        vcpu = fcntl.ioctl(vm, KVM_CREATE_VCPU, 0)
        size = fcntl.ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE)
        run = mmap.mmap(vcpu, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        # kvm_sregs is 312 bytes; cs is its first kvm_segment (base u64, limit u32, selector u16, ...)
        sregs = bytearray(312)
        fcntl.ioctl(vcpu, KVM_GET_SREGS, sregs)
        sregs[0:8] = (0xF0000).to_bytes(8, "little")  # cs.base
        sregs[12:14] = (0xF000).to_bytes(2, "little")  # cs.selector
        fcntl.ioctl(vcpu, KVM_SET_SREGS, sregs)
        regs = _Regs()
        regs.rip = 0
        regs.rflags = 2
        fcntl.ioctl(vcpu, KVM_SET_REGS, regs)
        for _ in range(4):
            fcntl.ioctl(vcpu, KVM_RUN, 0)
            # struct kvm_run: u8 request_interrupt_window, immediate_exit, padding[6]; u32 exit_reason
            reason = int.from_bytes(run[8:12], "little")
            if reason == KVM_EXIT_IO:
                # io: u8 direction, u8 size, u16 port, u32 count, u64 data_offset (at offset 32)
                port = int.from_bytes(run[34:36], "little")
                off = int.from_bytes(run[40:48], "little")
                val = run[off]
                if port == _PROBE_PORT and val == _PROBE_VALUE:
                    return True, "a test guest entered protected mode with paging under KVM"
                return False, f"unexpected I/O exit (port {port:#x}, value {val:#x})"
            if reason == KVM_EXIT_SHUTDOWN:
                return False, "the test guest triple-faulted (protected mode or paging is broken under this KVM)"
            if reason == KVM_EXIT_HLT:
                return False, "the test guest halted without doing its I/O"
        return False, f"KVM_RUN kept exiting with reason {reason}"
    finally:
        os.close(kvm)


def probe_rom() -> bytes:
    """The probe code as a 64 KiB x86 firmware image (reset vector at 0xFFFF0 jumps to it)."""
    rom = bytearray(0x10000)
    rom[0:len(_PROBE_CODE)] = _PROBE_CODE
    rom[0xFFF0:0xFFF0 + len(_RESET_JUMP)] = _RESET_JUMP
    return bytes(rom)


def _qemu_probe(qemu: str, timeout: float) -> tuple[bool | None, str]:
    """Stage 2: does QEMU run the probe firmware with -accel kvm -cpu host? (None: undecided)"""
    with tempfile.TemporaryDirectory(prefix="shoal-kvm-") as tmp:
        rom = Path(tmp) / "probe.rom"
        rom.write_bytes(probe_rom())
        argv = [qemu, "-M", "microvm,x-option-roms=off,isa-serial=off,acpi=off", "-accel", "kvm", "-cpu", "host",
                "-m", "16", "-nodefaults", "-no-user-config", "-display", "none", "-bios", str(rom),
                "-device", f"isa-debug-exit,iobase={_PROBE_PORT:#x},iosize=1"]
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return False, f"QEMU's test guest under KVM did not finish within {timeout:.0f}s"
        except OSError as e:
            return None, f"could not run {qemu}: {e}"
    # isa-debug-exit makes QEMU exit with (value << 1) | 1
    if r.returncode == (_PROBE_VALUE << 1) | 1:
        return True, "QEMU ran a test guest under KVM"
    err = (r.stderr or "").strip().splitlines()
    return False, f"QEMU could not run a guest under KVM ({err[0] if err else f'exit {r.returncode}'})"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _cache_path() -> Path:
    # /run is a tmpfs: it is empty after a reboot, and the boot id guards against stale files anyway
    return settings().kvm_cache


def probe(timeout: float = PROBE_TIMEOUT_S) -> KvmStatus:
    """Run the probe now in a child process (killed after `timeout` seconds)."""
    boot = _boot_id()
    if not os.path.exists("/dev/kvm"):
        return KvmStatus(False, "/dev/kvm is missing: VMs run under TCG (software emulation, much slower)",
                         "load kvm_intel or kvm_amd, or enable virtualization (VT-x/AMD-V) for this host", boot)
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return KvmStatus(False, "/dev/kvm is not accessible to this user: VMs run under TCG",
                         "run shoal as root or add the user to the kvm group", boot)
    try:
        r = subprocess.run([sys.executable, "-m", "shoal.host.kvm", "--probe"], capture_output=True, text=True,
                           timeout=timeout, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    except subprocess.TimeoutExpired:
        return KvmStatus(False, f"/dev/kvm exists but a test guest did not finish within {timeout:.0f}s "
                         "(nested virtualization that hangs guests): VMs run under TCG",
                         "run on bare metal, or enable working nested virtualization on the hypervisor", boot)
    out = (r.stdout or "").strip().splitlines()
    try:
        verdict = json.loads(out[-1]) if out else {}
    except ValueError:
        verdict = {}
    fix = "run on bare metal, or enable working nested virtualization on the hypervisor; check `dmesg`"
    if not (r.returncode == 0 and verdict.get("ok")):
        why = verdict.get("detail") or (r.stderr or "").strip()[-300:] or f"probe exited {r.returncode}"
        return KvmStatus(False, f"/dev/kvm exists but KVM does not work ({why}): VMs run under TCG", fix, boot)
    qemu = shutil.which("qemu-system-x86_64")
    if qemu:
        ok, why = _qemu_probe(qemu, timeout)
        if ok is False:
            return KvmStatus(False, f"/dev/kvm runs a bare test guest but {why}: VMs run under TCG", fix, boot)
    return KvmStatus(True, "KVM works (a test guest ran with paging on): VMs use hardware virtualization",
                     "", boot)


def kvm_status(refresh: bool = False) -> KvmStatus:
    """The cached verdict for this boot (probing once when there is none). SHOAL_VM_ACCEL=tcg forces TCG."""
    if settings().vm_accel == "tcg":
        return KvmStatus(False, "SHOAL_VM_ACCEL=tcg: KVM not used (software emulation)", "unset SHOAL_VM_ACCEL")
    boot = _boot_id()
    path = _cache_path()
    if not refresh:
        with contextlib.suppress(OSError, ValueError, TypeError):
            data = json.loads(path.read_text())
            if data.get("boot_id") == boot and boot:
                return KvmStatus(**data)
    st = probe()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, prefix=".kvm-") as f:
            json.dump(asdict(st), f)
        os.replace(f.name, path)
    return st


def _main(argv: list[str]) -> int:
    if "--probe" in argv:
        try:
            ok, detail = _probe_in_this_process()
        except OSError as e:
            ok, detail = False, f"{e.strerror or e} in the KVM ioctl sequence"
        print(json.dumps({"ok": ok, "detail": detail}), flush=True)
        return 0 if ok else 1
    st = kvm_status(refresh="--refresh" in argv)
    print(("usable: " if st.usable else "not usable: ") + st.detail + (f"\nfix: {st.fix}" if st.fix else ""))
    return 0 if st.usable else 1


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
