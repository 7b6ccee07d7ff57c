"""The VM backends' pure parts: QEMU command lines, the cpio writer, module resolution, kernel extraction,
console parsing, the KVM probe firmware. No root, no QEMU run (the integration tests boot real VMs)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from shoal.backends import qemu as q
from shoal.backends import vm_images as vi
from shoal.errors import InvalidRequest


def _cfg(machine: str = "microvm", accel: str = "tcg", **kw: object) -> q.MachineConfig:
    drives = [q.Drive("layer0", "/s/l0.erofs", "raw", True, "shoal-layer0"),
              q.Drive("upper", "/d/upper.img", "raw", False, "shoal-upper")]
    base = dict(machine=machine, accel=accel, cpus=2, memory_mb=512, kernel="/k/vmlinux", initrd="/k/initrd",
                cmdline="console=ttyS0 shoal.layers=1", drives=drives, tb_mb=64)
    base.update(kw)
    return q.MachineConfig(**base)  # type: ignore[arg-type]


def test_microvm_argv_has_devices_sockets_and_sandbox(tmp_path: Path) -> None:
    argv = q.qemu_argv("/usr/bin/qemu-system-x86_64", _cfg(), tmp_path)
    s = " ".join(argv)
    assert "-M microvm,x-option-roms=off" in s and "acpi=on" in s
    assert "-accel tcg,tb-size=64" in s and "-cpu max" in s and "-m 512M" in s and "-smp 2" in s
    assert f"socket,id=agent,path={tmp_path}/agent.sock,server=on,wait=off" in s
    assert "virtserialport,chardev=agent,name=shoal.agent" in s and "virtio-serial-device" in s
    assert f"unix:{tmp_path}/qmp.sock,server=on,wait=off" in s
    assert f"file,id=console,path={tmp_path}/console.log" in s
    # layers read-only with their serials, the upper writable
    assert "file=/s/l0.erofs,format=raw,cache=writeback,aio=threads,readonly=on" in s
    assert "virtio-blk-device,drive=layer0,serial=shoal-layer0" in s
    assert "file=/d/upper.img,format=raw,cache=writeback,aio=threads,discard=unmap" in s
    assert "free-page-reporting=on" in s and "deflate-on-oom=on" in s
    assert "memory-backend-memfd,id=ram0,size=512M" in s
    assert "-daemonize" not in argv and "-incoming" not in argv
    assert "-no-reboot" in argv


def test_seccomp_and_incoming_and_kvm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = q.qemu_argv("qemu", _cfg(accel="kvm"), tmp_path, incoming=True)
    assert argv[argv.index("-accel") + 1] == "kvm" and argv[argv.index("-cpu") + 1] == "host"
    assert argv[-3:] == ["-incoming", "defer", "-S"]
    assert "spawn=deny" in argv[argv.index("-sandbox") + 1]
    from shoal.config import Settings

    off = Settings.load(env={"SHOAL_VM_SECCOMP": "0"}).vm_seccomp  # the node passes its setting's value
    assert "-sandbox" not in q.qemu_argv("qemu", _cfg(), tmp_path, seccomp=off)


def test_q35_uses_pci_devices_and_network(tmp_path: Path) -> None:
    s = " ".join(q.qemu_argv("qemu", _cfg("q35", network=True), tmp_path))
    assert "-M q35" in s and "virtio-blk-pci" in s and "virtio-serial-pci" in s and "virtio-balloon-pci" in s
    assert "-netdev user,id=net0" in s and "virtio-net-pci,netdev=net0" in s


def test_machine_config_round_trip() -> None:
    c = _cfg()
    d = c.to_dict()
    d["unknown_future_field"] = 1  # records written by a newer shoal still load
    assert q.MachineConfig.from_dict(d) == c


def test_console_tail_and_fatal(tmp_path: Path) -> None:
    (tmp_path / "console.log").write_bytes(b"\x1b[0mboot\r\nline 2\r\nshoal-init: FATAL: no disk\r\n")
    assert q.console_tail(tmp_path) == "boot\nline 2\nshoal-init: FATAL: no disk"
    assert q.console_fatal(tmp_path) == "shoal-init: FATAL: no disk"
    (tmp_path / "console.log").write_text("[ 1.0] Kernel panic - not syncing: Attempted to kill init!\n")
    assert q.console_fatal(tmp_path).startswith("Kernel panic - not syncing")
    assert q.console_tail(tmp_path / "nope") == "(no console output)"


def test_socket_path_limit(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="too long"):
        q.check_socket_paths(tmp_path / ("x" * 120))


def test_cpio_is_read_back_by_cpio(tmp_path: Path) -> None:
    if not shutil.which("cpio"):
        pytest.skip("cpio is not installed")
    buf = io.BytesIO()
    c = vi._Cpio(buf)
    c.dir("etc")
    c.file("etc/a.txt", b"hello", 0o640)
    c.file("odd", b"x" * 1001, 0o755)
    c.symlink("link", "etc/a.txt")
    c.trailer()
    r = subprocess.run(["cpio", "-idm", "--quiet"], input=buf.getvalue(), cwd=tmp_path, capture_output=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "etc/a.txt").read_bytes() == b"hello"
    assert (tmp_path / "etc/a.txt").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "odd").read_bytes() == b"x" * 1001
    assert os.readlink(tmp_path / "link") == "etc/a.txt"


def _fake_modules(root: Path) -> Path:
    d = root / "lib/modules/6.0.0-test"
    (d / "kernel").mkdir(parents=True)
    for m in ("a", "b", "c", "crc", "crc-gen"):
        (d / "kernel" / f"{m}.ko").write_bytes(m.encode())
    (d / "modules.dep").write_text("kernel/a.ko: kernel/b.ko kernel/c.ko\nkernel/b.ko: kernel/c.ko\n"
                                   "kernel/c.ko:\nkernel/crc.ko:\nkernel/crc-gen.ko:\n")
    (d / "modules.softdep").write_text("# comment\nsoftdep c pre: crc_gen\n")
    (d / "modules.builtin").write_text("kernel/fs/builtin_fs.ko\n")
    return d


def test_resolve_modules_orders_dependencies_softdeps_builtins(tmp_path: Path) -> None:
    d = _fake_modules(tmp_path)
    got = [n for n, _ in vi.resolve_modules(d, ["a", "builtin_fs"])]
    assert got == ["crc_gen", "c", "b", "a"]
    with pytest.raises(Exception, match="missing"):
        vi.resolve_modules(d, ["nope"])


def test_real_kernel_modules_resolve() -> None:
    try:
        k = vi.find_host_kernel()
    except Exception as e:
        pytest.skip(f"no host kernel package: {e}")
    names = [n for n, _ in vi.resolve_modules(k.modules, vi.GUEST_MODULES)]
    for need in ("virtio_mmio", "virtio_blk", "virtio_console", "erofs", "overlay", "ext4"):
        assert need in names
    assert names.index("virtio") < names.index("virtio_blk")
    assert names.index("crc32c_generic") < names.index("libcrc32c")  # softdep: libcrc32c needs crc32c at init


def test_extract_vmlinux_from_a_bzimage(tmp_path: Path) -> None:
    import lzma

    elf = b"\x7fELF" + os.urandom(5000)
    fake = b"MZ" + b"\0" * 600 + b"junk\xfd7zXZ\x00not-xz" + lzma.compress(elf, format=lzma.FORMAT_XZ) + b"\0" * 64
    (tmp_path / "vmlinuz").write_bytes(fake)
    vi.extract_vmlinux(tmp_path / "vmlinuz", tmp_path / "vmlinux")
    assert (tmp_path / "vmlinux").read_bytes() == elf
    (tmp_path / "bad").write_bytes(b"MZ" + b"\0" * 100)
    with pytest.raises(Exception, match="cannot find"):
        vi.extract_vmlinux(tmp_path / "bad", tmp_path / "out")


def test_copy_sparse_keeps_holes(tmp_path: Path) -> None:
    src = tmp_path / "disk"
    with open(src, "wb") as f:
        f.truncate(64 << 20)
        f.seek(10 << 20)
        f.write(b"a" * 4096)
        f.seek(50 << 20)
        f.write(b"b" * 8192)
    vi.copy_sparse(src, tmp_path / "copy")
    dst = tmp_path / "copy"
    assert dst.stat().st_size == 64 << 20
    assert dst.read_bytes() == src.read_bytes()
    assert dst.stat().st_blocks * 512 < 1 << 20  # holes stayed holes


def test_image_without_kernel_is_refused(tmp_path: Path) -> None:
    (tmp_path / "boot").mkdir()
    with pytest.raises(InvalidRequest, match="has no kernel"):
        vi.find_image_kernel(tmp_path)
    (tmp_path / "boot/vmlinuz-6.1.0-1-amd64").write_bytes(b"k")
    (tmp_path / "boot/initrd.img-6.1.0-1-amd64").write_bytes(b"i")
    (tmp_path / "lib/modules/6.1.0-1-amd64").mkdir(parents=True)
    ver, vmlinuz, initrd = vi.find_image_kernel(tmp_path)
    assert ver == "6.1.0-1-amd64" and vmlinuz.name == "vmlinuz-6.1.0-1-amd64" and initrd is not None


def test_kvm_probe_firmware_layout() -> None:
    from shoal.host import kvm

    rom = kvm.probe_rom()
    assert len(rom) == 0x10000
    assert rom[0xFFF0:0xFFF5] == bytes.fromhex("ea000000f0")  # reset vector: ljmp f000:0000
    assert rom[: len(kvm._PROBE_CODE)] == kvm._PROBE_CODE
    # the code ends by writing the probe value to the probe port, then halts
    assert bytes([0xB0, kvm._PROBE_VALUE, 0xE6, kvm._PROBE_PORT, 0xF4]) in kvm._PROBE_CODE


def test_kvm_status_forced_tcg(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.host.kvm import kvm_status

    monkeypatch.setenv("SHOAL_VM_ACCEL", "tcg")
    st = kvm_status()
    assert not st.usable and "SHOAL_VM_ACCEL=tcg" in st.detail


def test_firecracker_is_chosen_only_when_usable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.backends import firecracker as fc
    from shoal.config import Settings

    monkeypatch.delenv("SHOAL_FIRECRACKER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    ok, why = fc.firecracker_usable(Settings.load())
    assert not ok and "no firecracker binary" in why
    fake = tmp_path / "firecracker"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    monkeypatch.setenv("SHOAL_VM_ACCEL", "tcg")  # KVM not usable
    ok, why = fc.firecracker_usable(Settings.load())
    assert not ok and "needs KVM" in why
    # the VMM registry: "auto" passes over a monitor that cannot run; one asked for by name must run
    from shoal.backends.registry import VMMS, pick_vmm, vmm_names
    from shoal.errors import BackendUnavailable

    assert vmm_names() == ["firecracker", "qemu"] and set(VMMS) == set(vmm_names())
    entry, why = pick_vmm("auto", Settings.load())
    assert entry.name == "qemu" and "needs KVM" in why
    with pytest.raises(BackendUnavailable, match="SHOAL_VMM=qemu, but it cannot run here: QEMU is not installed"):
        pick_vmm("qemu", Settings.load())
    monkeypatch.setenv("SHOAL_QEMU", str(fake))  # any executable will do: nothing is started
    assert pick_vmm("qemu", Settings.load())[0].name == "qemu"
    with pytest.raises(BackendUnavailable, match=r"SHOAL_VMM=firecracker, but it cannot run here: .*needs KVM"):
        pick_vmm("firecracker", Settings.load())
