"""What a VM boots: the guest kernel, the microVM initramfs, and full-VM root disks.

Everything here is built lazily on first use and cached under `$SHOAL_HOME/vm/` by a key that covers
every input (kernel version and file, agent binary, init script, busybox, module list, builder version),
so a change of any input builds a new artifact next to the old one and running VMs never see a file
change under them. Nothing is committed to the repository: the inputs are the host's Debian kernel
package (`linux-image-amd64`), `busybox-static`, the shoal agent (`make agent`) and `guest/`.

- microVM kernel: Debian's bzImage decompressed once into an uncompressed ELF `vmlinux`. QEMU boots it
  through the PVH entry point (Firecracker needs an ELF vmlinux too); under TCG this saves the ~5 s the
  kernel would spend decompressing itself with emulated instructions.
- microVM initramfs: an uncompressed newc cpio with busybox, `guest/init`, the agent, the vsock helper
  and the kernel modules of `GUEST_MODULES` plus their dependencies, copied from /lib/modules.
- full-VM disk: the image's own tree (its layers merged) plus the agent as a systemd service, packed by
  `mkfs.ext4 -d` into a sparse raw disk; each VM gets a qcow2 overlay on top of it. The image's own
  kernel and initrd (from its /boot) are copied next to the disk and booted directly.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import lzma
import os
import re
import shutil
import stat
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shoal.config import Paths, Settings
from shoal.errors import BackendUnavailable, ImageBuildError, InvalidRequest
from shoal.fsutil import flocked, sha256_file

BUILDER_VERSION = "1"
#: kernel modules the microVM initramfs loads, in this order (dependencies are added before each);
#: under TCG each insmod costs ~0.1 s, so the optional groups load only when the VM uses them
GUEST_MODULES = ["virtio_mmio", "virtio_blk", "virtio_console", "virtio_balloon", "crc32c_generic", "erofs",
                 "overlay", "ext4"]
GUEST_MODULE_GROUPS = {"net": ["virtio_net"], "vsock": ["vmw_vsock_virtio_transport"]}
_REPO = Path(__file__).resolve().parents[3]


def guest_src_dir(s: Settings) -> Path:
    """The guest build inputs: the guest_src setting or the repository's guest/ directory."""
    d = s.guest_src or (_REPO / "guest")
    if not (d / "init").is_file():
        raise BackendUnavailable(f"the VM guest sources are missing ({d}/init): run shoal from its repository "
                                 "or set SHOAL_GUEST_SRC to its guest/ directory")
    return d


def _hash(*parts: object) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(str(p).encode())
        h.update(b"\0")
    return h.hexdigest()


def _file_id(p: Path) -> str:
    st = p.stat()
    return f"{p}:{st.st_size}:{st.st_mtime_ns}"


# ---- the guest kernel ----------------------------------------------------------------------------
@dataclass
class HostKernel:
    """A Debian kernel installed on the host: its bzImage and its modules."""

    version: str
    vmlinuz: Path
    modules: Path


def _version_key(v: str) -> tuple:
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"[.-]", v))


def find_host_kernel(want: str | None = None) -> HostKernel:
    """Kernel `want` (the vm_kernel_version setting) or the newest /boot/vmlinuz-* that has
    /lib/modules/<version>/modules.dep."""
    found = []
    for p in Path("/boot").glob("vmlinuz-*"):
        ver = p.name[len("vmlinuz-"):]
        mods = Path("/lib/modules") / ver
        if (mods / "modules.dep").is_file() and (want is None or ver == want):
            found.append(HostKernel(ver, p, mods))
    if not found:
        what = f"kernel {want}" if want else "a guest kernel"
        raise BackendUnavailable(f"no {what} with modules in /boot and /lib/modules: "
                                 "apt-get install linux-image-amd64 (scripts/setup.sh does it)")
    return max(found, key=lambda k: _version_key(k.version))


_MAGICS = [(b"\xfd7zXZ\x00", "xz"), (b"\x1f\x8b\x08", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\x5d\x00\x00", "lzma")]


def extract_vmlinux(bzimage: Path, out: Path) -> None:
    """Decompress a bzImage's payload into an ELF vmlinux (what PVH boot and Firecracker load)."""
    data = bzimage.read_bytes()
    if data[:4] == b"\x7fELF":
        shutil.copyfile(bzimage, out)
        return
    for magic, kind in _MAGICS:
        start = 0
        while (off := data.find(magic, start)) >= 0:
            start = off + 1
            try:
                if kind == "xz":
                    elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[off:])
                elif kind == "lzma":
                    elf = lzma.LZMADecompressor(format=lzma.FORMAT_ALONE).decompress(data[off:])
                elif kind == "gzip":
                    elf = zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data[off:])
                else:
                    import zstandard

                    elf = zstandard.ZstdDecompressor().decompressobj().decompress(data[off:])
            except Exception:
                continue
            if elf[:4] == b"\x7fELF":
                tmp = out.with_name(out.name + ".tmp")
                tmp.write_bytes(elf)
                os.replace(tmp, out)
                return
    raise BackendUnavailable(f"cannot find a compressed ELF kernel inside {bzimage}")


# ---- kernel modules ------------------------------------------------------------------------------
def _modules_index(moddir: Path) -> tuple[dict[str, str], dict[str, list[str]], dict[str, list[str]], set[str]]:
    """(name -> relative path, relative path -> deps, name -> softdep pre names, builtin names)."""
    paths: dict[str, str] = {}
    deps: dict[str, list[str]] = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        if ":" not in line:
            continue
        mod, rest = line.split(":", 1)
        deps[mod] = rest.split()
        name = Path(mod).name.split(".ko")[0].replace("-", "_")
        paths[name] = mod
    soft: dict[str, list[str]] = {}
    with contextlib.suppress(FileNotFoundError):
        for line in (moddir / "modules.softdep").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "softdep":
                pre = []
                if "pre:" in parts:
                    for w in parts[parts.index("pre:") + 1:]:
                        if w.endswith(":"):
                            break
                        pre.append(w)
                soft[parts[1].replace("-", "_")] = pre
    builtin = set()
    with contextlib.suppress(FileNotFoundError):
        for line in (moddir / "modules.builtin").read_text().splitlines():
            builtin.add(Path(line.strip()).name.split(".ko")[0].replace("-", "_"))
    return paths, deps, soft, builtin


def resolve_modules(moddir: Path, wanted: list[str]) -> list[tuple[str, Path]]:
    """Modules to load for `wanted`, dependencies first: [(name, file)]. Built-in ones are skipped."""
    paths, deps, soft, builtin = _modules_index(moddir)
    order: list[tuple[str, Path]] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        name = name.replace("-", "_")
        if name in seen:
            return
        seen.add(name)
        if name in builtin:
            return
        rel = paths.get(name)
        if rel is None:
            raise BackendUnavailable(f"kernel module {name} is missing from {moddir}: the guest kernel lacks it")
        for s in soft.get(name, []):
            with contextlib.suppress(BackendUnavailable):
                visit(s)
        for d in deps.get(rel, []):
            visit(Path(d).name.split(".ko")[0])
        order.append((name, moddir / rel))

    for w in wanted:
        visit(w)
    return order


# ---- cpio (newc) ---------------------------------------------------------------------------------
class _Cpio:
    """A minimal newc writer (what the kernel's initramfs unpacker reads)."""

    def __init__(self, f) -> None:
        self.f = f
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", nlink: int = 1) -> None:
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (
            self.ino, mode, 0, 0, nlink, 0, len(data), 0, 0, 0, 0, len(nb), 0))
        self.ino += 1
        self.f.write(hdr.encode() + nb)
        self.f.write(b"\0" * ((4 - (110 + len(nb)) % 4) % 4))
        self.f.write(data)
        self.f.write(b"\0" * ((4 - len(data) % 4) % 4))

    def dir(self, name: str, mode: int = 0o755) -> None:
        self._entry(name, stat.S_IFDIR | mode, nlink=2)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, stat.S_IFREG | mode, data)

    def symlink(self, name: str, target: str) -> None:
        self._entry(name, stat.S_IFLNK | 0o777, target.encode())

    def node(self, name: str, mode: int, major: int, minor: int) -> None:
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (
            self.ino, mode, 0, 0, 1, 0, 0, 0, 0, major, minor, len(nb), 0))
        self.ino += 1
        self.f.write(hdr.encode() + nb)
        self.f.write(b"\0" * ((4 - (110 + len(nb)) % 4) % 4))

    def trailer(self) -> None:
        self._entry("TRAILER!!!", 0)


# ---- the microVM guest ---------------------------------------------------------------------------
@dataclass
class GuestArtifacts:
    """A built microVM guest: kernel (ELF vmlinux), initramfs and what they were made from."""

    kernel: Path
    initrd: Path
    kernel_version: str
    key: str
    modules: list[str]


def _busybox(s: Settings) -> Path:
    for p in (s.busybox, "/bin/busybox", "/usr/bin/busybox"):
        if p and Path(p).is_file():
            return Path(p)
    raise BackendUnavailable("busybox is missing: apt-get install busybox-static")


def _vsock_helper(src: Path, out_dir: Path) -> Path | None:
    """Compile guest/vsock-listen.c statically (Firecracker's agent channel); None without a compiler."""
    cc = shutil.which("gcc") or shutil.which("cc")
    if not cc:
        return None
    out = out_dir / "shoal-vsock-listen"
    from shoal.host.spawn import run_sync

    r = run_sync([cc, "-static", "-Os", "-s", "-Wall", "-o", str(out), str(src)], timeout=120)
    return out if r.returncode == 0 and out.exists() else None


def ensure_guest(paths: Paths, agent: Path, s: Settings, log: Callable[[str], None] | None = None) -> GuestArtifacts:
    """Build (once, cached by the hash of every input) the microVM kernel and initramfs (the guest_src,
    vm_kernel_version and busybox settings of `s` say from what)."""
    src = guest_src_dir(s)
    kern = find_host_kernel(s.vm_kernel_version)
    bb = _busybox(s)
    key = _hash(BUILDER_VERSION, kern.version, _file_id(kern.vmlinuz), sha256_file(agent),
                sha256_file(src / "init"), sha256_file(src / "vsock-listen.c") if (src / "vsock-listen.c").exists()
                else "", _file_id(bb), ",".join(GUEST_MODULES), json.dumps(GUEST_MODULE_GROUPS))[:16]
    root = paths.home / "vm" / "guest"
    out = root / key
    meta = out / "guest.json"
    if meta.exists():
        m = json.loads(meta.read_text())
        return GuestArtifacts(out / "vmlinux", out / "initramfs.cpio", m["kernel_version"], key, m["modules"])
    with flocked(paths.locks / "vm-guest.lock"):
        if meta.exists():
            return ensure_guest(paths, agent, s, log)
        t0 = time.monotonic()
        (log or (lambda s: None))(f"building the microVM guest (kernel {kern.version}) in {out}")
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
        os.chmod(tmp, 0o755)
        try:
            # the kernel's uncompressed image is the same for every guest build of this kernel: share it
            vml = root / f"vmlinux-{kern.version}-{_hash(_file_id(kern.vmlinuz))[:8]}"
            if not vml.exists():
                extract_vmlinux(kern.vmlinuz, vml)
            os.link(vml, tmp / "vmlinux")
            mods = resolve_modules(kern.modules, GUEST_MODULES)
            core = {n for n, _ in mods}
            groups = {g: [(n, p) for n, p in resolve_modules(kern.modules, want) if n not in core]
                      for g, want in GUEST_MODULE_GROUPS.items()}
            helper = _vsock_helper(src / "vsock-listen.c", tmp) if (src / "vsock-listen.c").exists() else None
            with open(tmp / "initramfs.cpio", "wb") as f:
                c = _Cpio(f)
                for d in ("bin", "sbin", "dev", "proc", "sys", "etc", "etc/shoal", "lib", "lib/modules",
                          "newroot", "layers", "rw", "tmp"):
                    c.dir(d)
                c.node("dev/console", stat.S_IFCHR | 0o600, 5, 1)
                c.node("dev/null", stat.S_IFCHR | 0o666, 1, 3)
                c.file("bin/busybox", bb.read_bytes(), 0o755)
                c.symlink("bin/sh", "busybox")
                c.file("init", (src / "init").read_bytes(), 0o755)
                c.file("shoal-agent", agent.read_bytes(), 0o755)
                if helper:
                    c.file("shoal-vsock-listen", helper.read_bytes(), 0o755)
                for name, p in [*mods, *(m for g in groups.values() for m in g)]:
                    c.file(f"lib/modules/{name}.ko", p.read_bytes())
                c.file("etc/shoal/modules", ("\n".join(n for n, _ in mods) + "\n").encode())
                for g, gm in groups.items():
                    c.file(f"etc/shoal/modules.{g}", ("\n".join(n for n, _ in gm) + "\n").encode())
                c.trailer()
            with contextlib.suppress(FileNotFoundError):
                (tmp / "shoal-vsock-listen").unlink()
            (tmp / "guest.json").write_text(json.dumps({
                "kernel_version": kern.version, "kernel_source": str(kern.vmlinuz), "modules": [n for n, _ in mods],
                "module_groups": {g: [n for n, _ in gm] for g, gm in groups.items()},
                "agent_sha256": sha256_file(agent), "vsock_helper": helper is not None, "built": time.time(),
                "builder_version": BUILDER_VERSION}))
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        (log or (lambda s: None))(f"guest built in {time.monotonic() - t0:.1f}s")
    return ensure_guest(paths, agent, s, log)


# ---- the writable disk of a microVM --------------------------------------------------------------
def make_upper_disk(path: Path, size_mb: int) -> None:
    """A sparse ext4 file of `size_mb` for the overlay's upper layer (only written blocks use space)."""
    from shoal.host.spawn import run_sync

    mkfs = shutil.which("mkfs.ext4")
    if not mkfs:
        raise BackendUnavailable("mkfs.ext4 is missing: apt-get install e2fsprogs")
    with open(path, "wb") as f:
        f.truncate(int(size_mb) << 20)
    # no journal: the disk never outlives the VM that writes it, and a journal doubles small writes;
    # lazy_itable_init + the guest's noinit_itable keep the inode tables unwritten (the file stays sparse)
    r = run_sync([mkfs, "-q", "-F", "-O", "^has_journal", "-m", "0", "-E", "lazy_itable_init=1,nodiscard",
                  "-L", "shoal-upper", str(path)], timeout=120)
    if r.returncode != 0:
        raise BackendUnavailable(f"mkfs.ext4 failed: {r.stderr.decode(errors='replace').strip()[-500:]}")


def copy_sparse(src: Path, dst: Path) -> None:
    """Copy a disk file keeping its holes (SEEK_DATA/SEEK_HOLE): a 4 GiB disk with 10 MiB written costs 10 MiB."""
    size = src.stat().st_size
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        fo.truncate(size)
        fdi, fdo = fi.fileno(), fo.fileno()
        off = 0
        while off < size:
            try:
                data = os.lseek(fdi, off, os.SEEK_DATA)
            except OSError:
                break  # ENXIO: no data past off
            hole = os.lseek(fdi, data, os.SEEK_HOLE)
            pos = data
            while pos < hole:
                n = os.copy_file_range(fdi, fdo, hole - pos, pos, pos)
                if n <= 0:
                    raise OSError(f"copy_file_range stopped at {pos} copying {src}")
                pos += n
            off = hole


# ---- full-VM disks -------------------------------------------------------------------------------
@dataclass
class VmDisk:
    """A full-VM base disk built from an image, with the image's own kernel and initrd next to it."""

    disk: Path
    kernel: Path
    initrd: Path | None
    kernel_version: str
    size: int
    key: str


_UNIT = """[Unit]
Description=shoal in-sandbox agent (virtio-serial port shoal.agent)
DefaultDependencies=no
After=systemd-remount-fs.service

[Service]
ExecStart=/usr/local/lib/shoal/start-agent
Restart=always
RestartSec=100ms
KillMode=process
StandardError=journal

[Install]
WantedBy=sysinit.target
"""

_STARTER = """#!/bin/sh
# Start the shoal agent on the virtio-serial port named shoal.agent (found through sysfs, so udev's
# /dev/virtio-ports symlinks are not needed).
i=0
while [ $i -lt 600 ]; do
	for p in /sys/class/virtio-ports/*; do
		if [ -e "$p/name" ] && [ "$(cat "$p/name")" = shoal.agent ]; then
			exec /usr/local/lib/shoal/shoal-agent --serial "/dev/${p##*/}"
		fi
	done
	sleep 0.1
	i=$((i + 1))
done
echo "start-agent: no virtio-serial port named shoal.agent" >&2
exit 1
"""


def find_image_kernel(root: Path) -> tuple[str, Path, Path | None]:
    """(version, vmlinuz, initrd) of the newest kernel in an image tree; InvalidRequest when it has none."""
    found = []
    for p in (root / "boot").glob("vmlinuz-*"):
        ver = p.name[len("vmlinuz-"):]
        if (root / "lib" / "modules" / ver).is_dir() or (root / "usr" / "lib" / "modules" / ver).is_dir():
            found.append((ver, p))
    if not found:
        raise InvalidRequest(
            "this image has no kernel (no /boot/vmlinuz-* with matching /lib/modules), so backend='vm' cannot "
            "boot it: use an image built with a kernel (`shoal vm build-image` makes debian-vm:latest) or "
            "backend='microvm', which boots shoal's own kernel")
    ver, vmlinuz = max(found, key=lambda t: _version_key(t[0]))
    initrd = root / "boot" / f"initrd.img-{ver}"
    return ver, vmlinuz, initrd if initrd.exists() else None


def ensure_vm_disk(paths: Paths, image: object, layer_mounts: object, agent: Path,
                   log: Callable[[str], None] | None = None) -> VmDisk:
    """Build (once per image digest and agent) the raw root disk a full VM boots; cached under $SHOAL_HOME/vm/disks."""
    from shoal.host import syscalls
    from shoal.host.spawn import run_sync

    key = _hash(BUILDER_VERSION, image.digest, sha256_file(agent), _UNIT, _STARTER)[:16]  # type: ignore[attr-defined]
    root = paths.home / "vm" / "disks"
    out = root / key
    meta = out / "disk.json"
    if meta.exists():
        m = json.loads(meta.read_text())
        return VmDisk(out / "root.raw", out / "vmlinux", (out / "initrd.img") if m.get("initrd") else None,
                      m["kernel_version"], m["size"], key)
    mkfs = shutil.which("mkfs.ext4")
    if not mkfs:
        raise BackendUnavailable("mkfs.ext4 is missing: apt-get install e2fsprogs")
    with flocked(paths.locks / f"vm-disk-{key}.lock"):
        if meta.exists():
            return ensure_vm_disk(paths, image, layer_mounts, agent, log)
        say = log or (lambda s: None)
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
        owner = f"vmdisk-{key}"
        lowers = layer_mounts.acquire(image.layers, owner)  # type: ignore[attr-defined]
        merged = tmp / "merged"
        extra = tmp / "extra"
        try:
            merged.mkdir()
            (extra / "usr/local/lib/shoal").mkdir(parents=True)
            (extra / "etc/systemd/system/sysinit.target.wants").mkdir(parents=True)
            shutil.copy2(agent, extra / "usr/local/lib/shoal/shoal-agent")
            (extra / "usr/local/lib/shoal/start-agent").write_text(_STARTER)
            os.chmod(extra / "usr/local/lib/shoal/start-agent", 0o755)
            (extra / "etc/systemd/system/shoal-agent.service").write_text(_UNIT)
            os.symlink("../shoal-agent.service", extra / "etc/systemd/system/sysinit.target.wants/shoal-agent.service")
            (extra / "etc/fstab").write_text("/dev/vda / ext4 rw,noatime 0 1\n")
            os.chmod(extra, 0o755)
            # read-only overlay: the extra files on top of the image's layers (topmost lower first)
            lowerdir = ":".join([str(extra), *[str(p) for p in reversed(lowers)]])
            syscalls.mount("overlay", str(merged), "overlay", syscalls.MS_RDONLY, f"lowerdir={lowerdir}")
            try:
                ver, vmlinuz, initrd = find_image_kernel(merged)
                say(f"packing {image.ref} (kernel {ver}) into a VM disk")  # type: ignore[attr-defined]
                extract_vmlinux(vmlinuz, tmp / "vmlinux")
                if initrd:
                    shutil.copyfile(initrd, tmp / "initrd.img")
                used = int(run_sync(["du", "-sxb", str(merged)], timeout=600).stdout.split()[0] or 0)
                # room to work: the tree plus 4 GiB free (sparse: free space costs nothing on the host)
                size = ((used * 5 // 4 + (4 << 30)) >> 20) << 20
                disk = tmp / "root.raw"
                with open(disk, "wb") as f:
                    f.truncate(size)
                r = run_sync([mkfs, "-q", "-F", "-L", "shoal-root", "-E", "lazy_itable_init=1,nodiscard",
                              "-d", str(merged), str(disk)], timeout=1800)
                if r.returncode != 0:
                    raise ImageBuildError("mkfs.ext4 -d failed: " + r.stderr.decode(errors="replace")[-1500:])
            finally:
                syscalls.umount(str(merged))
            os.chmod(disk, 0o444)
            shutil.rmtree(extra)
            merged.rmdir()
            (tmp / "disk.json").write_text(json.dumps({
                "image": image.ref, "image_digest": image.digest, "kernel_version": ver,  # type: ignore[attr-defined]
                "initrd": initrd is not None, "size": size, "built": time.time(), "builder_version": BUILDER_VERSION}))
            os.rename(tmp, out)
        except BaseException:
            with contextlib.suppress(OSError):
                if syscalls.is_mountpoint(str(merged)):
                    syscalls.umount(str(merged), detach=True)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            with contextlib.suppress(Exception):
                layer_mounts.release([lay.hex for lay in image.layers], owner)  # type: ignore[attr-defined]
    return ensure_vm_disk(paths, image, layer_mounts, agent, log)


VM_IMAGE_PACKAGES = ["linux-image-amd64", "initramfs-tools", "systemd-sysv", "udev", "kmod"]


def build_vm_image(store: object, ref: str = "debian-vm:latest", log: Callable[[str], None] | None = None) -> object:
    """Build a Debian image that carries its own kernel and systemd (for backend='vm') with mmdebstrap."""
    from shoal.images.base import BASE_PACKAGES, build_base

    return build_base(store, ref=ref, packages=[*BASE_PACKAGES, *VM_IMAGE_PACKAGES], log=log)  # type: ignore[arg-type]
