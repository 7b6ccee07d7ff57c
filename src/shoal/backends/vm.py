"""microVM and full-VM sandboxes: QEMU `microvm` and `q35` (Firecracker for microVMs when it is installed).

- `backend="microvm"`: shoal's guest — Debian's kernel (PVH-booted ELF), an initramfs with busybox, the
  virtio modules and the agent. Each image layer is one read-only virtio-blk disk (the store's EROFS
  file itself: nothing is copied), the writable layer an overlayfs upper on a per-VM sparse ext4 disk of
  `disk_mb`; the agent becomes PID 1 after switch_root and serves the virtio-serial port `shoal.agent`.
- `backend="vm"`: a full q35 VM booting the image's own kernel, initrd and init (systemd) from a qcow2
  overlay over a root disk built once from the image; the agent runs as a systemd service.

Exec, files, shells and streams then go through the same agent protocol as containers. Pause is QMP
`stop` (after the balloon took the guest's spare memory back); snapshot saves memory + disks
(`migrate` to a file) and fork restores that into new VMs whose processes keep running.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.agentproto.client import AgentClient
from shoal.backends.base import Backend, Capability
from shoal.backends.qemu import (
    Drive,
    MachineConfig,
    check_socket_paths,
    console_fatal,
    console_tail,
    find_qemu,
    host_tsc_khz,
    kill_and_wait,
    launch,
    migrate_fd,
    qemu_argv,
    qemu_pid_for,
    qmp,
    sandbox_files,
)
from shoal.config import Paths, Settings
from shoal.errors import (
    BackendUnavailable,
    InvalidRequest,
    SandboxError,
    SandboxNotFound,
    ShoalError,
    Timeout,
)
from shoal.images.store import Image
from shoal.limits import AGENT_READY_TIMEOUT_S, MAX_VM_BATCH
from shoal.models import SandboxInfo
from shoal.records import SandboxRecord, validate_labels
from shoal.spec import SandboxSpec

if TYPE_CHECKING:
    from shoal.backends.context import NodeContext

MIN_VM_MEMORY_MB = 128
#: microvm has 8 virtio-mmio slots: agent port, balloon, writable disk, optional network, and the layers
MICROVM_MMIO_SLOTS = 8
_SNAPSHOT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def _extra_cmdline(s: Settings) -> str:
    """SHOAL_VM_EXTRA_CMDLINE: arguments appended to the guest kernel's command line (debugging, tests)."""
    extra = s.vm_extra_cmdline.strip()
    return f" {extra}" if extra else ""


# ---- the agent connection ------------------------------------------------------------------------
class VmAgentClient(AgentClient):
    """An AgentClient that adds the sandbox's environment (image env + spec env) to every process.

    A container's agent inherits that environment from the OCI config; a VM's agent is started by the
    guest's init, so the host supplies it with each request instead (no size limit, nothing to plumb
    through the kernel command line)."""

    base_env: dict[str, str] = {}

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        merged = dict(self.base_env)
        if env:
            merged.update(env)
        return merged

    async def exec_stream(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                          **kw: Any) -> Any:
        """exec_stream with the sandbox's environment underneath `env`."""
        return await super().exec_stream(argv, env=self._env(env), **kw)

    async def exec_detached(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                            **kw: Any) -> int:
        """exec_detached with the sandbox's environment underneath `env`."""
        return await super().exec_detached(argv, env=self._env(env), **kw)

    async def shell_open(self, *, env: Mapping[str, str] | None = None, **kw: Any) -> str:
        """shell_open with the sandbox's environment underneath `env`."""
        return await super().shell_open(env=self._env(env), **kw)


async def connect_agent(d: Path, base_env: dict[str, str], *, timeout: float, alive: Callable[[], bool],
                        fresh_boot: bool, what: str = "the VM") -> VmAgentClient:
    """Reach the agent on the VM's virtio-serial socket, watching QEMU and the console meanwhile.

    On a fresh boot one attempt waits the whole `timeout` (QEMU holds our hello until the guest opens
    the port). Re-attaching to a running or restored VM retries with growing per-attempt timeouts: when
    the host side reconnects, the guest's agent may drop what arrived before it noticed the hangup."""
    sock = sandbox_files(d)["agent"]
    deadline = time.monotonic() + timeout
    per_try = timeout if fresh_boot else 2.0
    last: BaseException | None = None
    attempts = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        if not alive():
            break
        attempts += 1
        try:
            r, w = await asyncio.open_unix_connection(str(sock))
        except OSError as e:
            last = e
            await asyncio.sleep(0.05)
            continue
        task = asyncio.ensure_future(VmAgentClient.connect_stream(r, w, timeout=min(per_try, remaining)))
        failed: str | None = None
        while not task.done():
            await asyncio.wait({task}, timeout=0.1)
            if task.done():
                break
            if not alive():
                failed = "QEMU exited"
            elif fresh_boot and (fatal := console_fatal(d)):
                failed = fatal
            if failed:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                break
        if failed:
            break
        try:
            client = task.result()
        except (Timeout, SandboxError) as e:
            last = e
            per_try = min(per_try * 2, 30.0)
            await asyncio.sleep(0.05)
            continue
        assert isinstance(client, VmAgentClient)
        client.base_env = dict(base_env)
        return client
    tail = console_tail(d)
    if not alive():
        fatal = console_fatal(d)
        raise SandboxError(f"{what} failed to boot: QEMU exited" + (f" ({fatal})" if fatal else "") +
                           f"\n--- guest console (last lines) ---\n{tail}")
    if fresh_boot and (fatal := console_fatal(d)):
        raise SandboxError(f"{what} failed to boot: {fatal}\n--- guest console (last lines) ---\n{tail}")
    if fresh_boot:
        raise Timeout(f"{what} did not boot within {timeout:.0f}s (its agent never answered; under TCG a boot "
                      f"takes seconds, set SHOAL_VM_BOOT_TIMEOUT to wait longer)\n"
                      f"--- guest console (last lines) ---\n{tail}")
    raise Timeout(f"the agent of {what} did not answer within {timeout:.0f}s after {attempts} attempts "
                  f"({last}); a VM's agent channel serves one connection at a time: is another shoal process "
                  "attached to this sandbox?")


# ---- the backend ---------------------------------------------------------------------------------
class QemuVmBackend(Backend):
    """VM sandboxes on QEMU: machine `microvm` (backend "microvm") or `q35` (backend "vm")."""

    capabilities = frozenset({Capability.SANDBOXES, Capability.PAUSE, Capability.SNAPSHOT_MEMORY,
                              Capability.FORK_MEMORY, Capability.RESTORE, Capability.NETWORK})
    instead = {
        Capability.SNAPSHOT_FILES: "a VM keeps its writable layer inside a disk image: snapshot(name) saves memory "
                                   "and disks as a named VM snapshot, fork(n) forks processes and memory; for "
                                   "image snapshots use backend='container'",
        Capability.RECLAIM: "pause() already hands the guest's free memory back through the balloon",
    }

    def __init__(self, ctx: NodeContext, name: str | None = "vm") -> None:
        super().__init__(ctx, name)
        if self.name not in ("microvm", "vm"):
            raise BackendUnavailable(f"unknown VM backend {self.name!r}: choose microvm or vm")
        self.paths = ctx.paths
        self.machine = "microvm" if self.name == "microvm" else "q35"
        self._booted: dict[str, VmAgentClient] = {}
        self._accel: str | None = None
        self._accel_detail = ""
        #: what turning KSM on did (shoal.host.ksm.enable), once this process started a VM
        self.ksm_setup: dict[str, Any] = {}
        #: mergeable guest RAM: None = SHOAL_VM_KSM, else this
        self.ksm: bool | None = None
        self._ksm_on = False

    # ---- facts
    def accel(self) -> str:
        """"kvm" when a guest really runs under KVM here, else "tcg" (probed once per boot, see host.kvm)."""
        if self._accel is None:
            from shoal.host.kvm import kvm_status

            st = kvm_status()
            self._accel = "kvm" if st.usable else "tcg"
            self._accel_detail = st.detail
        return self._accel

    def boot_timeout(self) -> float:
        """How long a boot may take before create fails (SHOAL_VM_BOOT_TIMEOUT overrides)."""
        kvm = self.accel() == "kvm"
        default = (30.0 if kvm else 90.0) if self.machine == "microvm" else (90.0 if kvm else 300.0)
        return self.ctx.settings.vm_boot_timeout or default

    async def prepare(self) -> dict[str, Any]:
        """Build (or find cached) the microVM guest kernel + initramfs; report the accelerator."""
        from shoal.backends import vm_images

        out: dict[str, Any] = {"accel": self.accel()}
        if self.machine == "microvm":
            g = await asyncio.to_thread(vm_images.ensure_guest, self.paths, self._agent(), self.ctx.settings)
            out.update(kernel=str(g.kernel), initrd=str(g.initrd))
        return out

    async def close(self) -> None:
        """Close agent connections opened at boot and never handed to the node."""
        for c in list(self._booted.values()):
            with contextlib.suppress(Exception):
                await c.close()
        self._booted.clear()

    def _agent(self) -> Path:
        p = self.ctx.agent_binary
        if p.exists():
            return p
        from shoal.agentbin import find_agent_binary

        return find_agent_binary()

    # ---- create
    async def create(self, rec: SandboxRecord, spec: SandboxSpec, image: Image) -> None:
        """Boot one VM and wait until its agent answers; on any error nothing is left behind."""
        try:
            await self._create(rec, spec, image)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.destroy(rec)
            raise

    def _check(self, spec: SandboxSpec, image: Image) -> None:
        if spec.memory_mb < MIN_VM_MEMORY_MB:
            raise InvalidRequest(f"memory_mb={spec.memory_mb} is too small for a VM: give it at least "
                                 f"{MIN_VM_MEMORY_MB} MiB (the guest kernel alone needs ~60 MiB)")
        if self.machine == "microvm":
            fixed = 3 + (1 if spec.network else 0)  # agent port, balloon, writable disk, network
            if len(image.layers) + fixed > MICROVM_MMIO_SLOTS:
                raise InvalidRequest(
                    f"image {image.ref} has {len(image.layers)} layers; a microVM attaches one disk per layer and "
                    f"has {MICROVM_MMIO_SLOTS} virtio-mmio slots ({MICROVM_MMIO_SLOTS - fixed} for layers here): "
                    "squash the image or use backend='container'")

    async def _create(self, rec: SandboxRecord, spec: SandboxSpec, image: Image) -> None:
        self._check(spec, image)
        qemu = find_qemu(self.ctx.settings)
        d = rec.path
        check_socket_paths(d)
        accel = self.accel()
        env = dict(image.config.env)
        env.update(spec.env)
        hostname = spec.hostname or "sandbox"
        env.setdefault("HOSTNAME", hostname)
        t0 = time.monotonic()
        cfg = await self._machine_config(rec, spec, image, accel, hostname)
        t1 = time.monotonic()
        rec.runtime = f"qemu-{self.machine}"
        rec.extra.update(vmm="qemu", machine=self.machine, accel=accel, vm=cfg.to_dict(), env=env)
        rec.save()
        pid, start = await launch(qemu_argv(qemu, cfg, d, seccomp=self.ctx.settings.vm_seccomp), d)
        rec.init_pid, rec.init_start = pid, start
        rec.save()
        t2 = time.monotonic()
        client = await connect_agent(d, env, timeout=self.boot_timeout(), alive=rec.init_alive,
                                     fresh_boot=True, what=f"the {self.name} {rec.id}")
        self._booted[rec.id] = client
        t3 = time.monotonic()
        rec.extra["boot_s"] = round(t3 - t0, 3)
        rec.extra["boot_phases_s"] = {"prepare": round(t1 - t0, 3), "qemu_start": round(t2 - t1, 3),
                                      "guest_boot_to_agent": round(t3 - t2, 3)}
        rec.save()

    def _ram(self, st: Any) -> str:
        """Guest RAM mergeable by KSM (turned on here, once per node process) unless SHOAL_VM_KSM=0 (or
        `self.ksm` says otherwise: the benchmark compares both)."""
        if not (st.vm_ksm if self.ksm is None else self.ksm):
            return "memfd"
        if not self._ksm_on:
            from shoal.host import ksm

            self.ksm_setup = ksm.enable()
            self._ksm_on = True
        return "ksm" if self.ksm_setup.get("available") else "memfd"

    async def _machine_config(self, rec: SandboxRecord, spec: SandboxSpec, image: Image, accel: str,
                              hostname: str) -> MachineConfig:
        from shoal.backends import vm_images

        d = rec.path
        cpus = max(1, min(64, math.ceil(float(spec.cpus))))
        st = self.ctx.settings
        tb = st.vm_tcg_tb_mb if accel == "tcg" else 0
        quiet = "" if st.vm_verbose else " quiet loglevel=3"
        if self.machine == "microvm":
            # the guest reads each layer as a disk: the node's layer reader's file of it, so every block the
            # guest reads comes from a checked chunk, fetched on demand (released in destroy)
            files = await asyncio.to_thread(self.ctx.layer_mounts.acquire_files, image.layers, rec.id)
            guest = await asyncio.to_thread(vm_images.ensure_guest, self.paths, self._agent(), self.ctx.settings)
            await asyncio.to_thread(vm_images.make_upper_disk, d / "upper.img", spec.disk_mb)
            drives = [Drive(f"layer{i}", str(f), "raw", True, f"shoal-layer{i}") for i, f in enumerate(files)]
            drives.append(Drive("upper", str(d / "upper.img"), "raw", False, "shoal-upper"))
            # no PCI on microvm; TCG's TSC is the host's (reliable); crypto self-tests cost ~0.3 s under TCG
            cmdline = (f"console=ttyS0 reboot=t panic=-1 pci=off tsc=reliable cryptomgr.notests{quiet} "
                       f"shoal.layers={len(image.layers)} shoal.upper=disk shoal.hostname={hostname}")
            if spec.network:
                cmdline += " shoal.net=1"
            if st.vm_verbose:
                cmdline += " shoal.debug=1"
            if accel == "tcg" and (khz := host_tsc_khz()):
                # microvm has no PIT calibration path: tell the kernel the TSC rate (TCG passes the host's)
                cmdline += f" tsc_early_khz={khz}"
            cmdline += _extra_cmdline(st)
            return MachineConfig(self.machine, accel, cpus, spec.memory_mb, str(guest.kernel), str(guest.initrd),
                                 cmdline, drives, network=bool(spec.network), tb_mb=tb, ram=self._ram(st))
        disk = await asyncio.to_thread(vm_images.ensure_vm_disk, self.paths, image, self.ctx.layer_mounts,
                                       self._agent())
        from shoal.host.spawn import run

        qemu_img = shutil.which("qemu-img")
        if not qemu_img:
            raise BackendUnavailable("qemu-img is missing: apt-get install qemu-utils")
        root = d / "root.qcow2"
        r = await run([qemu_img, "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(disk.disk), str(root)],
                      timeout=60)
        if r.returncode != 0:
            raise SandboxError(f"qemu-img create failed: {r.stderr.decode(errors='replace').strip()}")
        cmdline = (f"root=/dev/vda rw console=ttyS0 panic=-1{quiet} systemd.hostname={hostname} "
                   "systemd.show_status=false" + _extra_cmdline(st))
        return MachineConfig(self.machine, accel, cpus, spec.memory_mb, str(disk.kernel),
                             str(disk.initrd) if disk.initrd else None, cmdline,
                             [Drive("root", str(root), "qcow2", False, "shoal-root")],
                             network=bool(spec.network), tb_mb=tb, ram=self._ram(st))

    # ---- reach / destroy
    async def connect(self, rec: SandboxRecord, timeout: float = AGENT_READY_TIMEOUT_S) -> AgentClient:
        """The connection made at boot, or a new one to the VM's virtio-serial socket."""
        c = self._booted.pop(rec.id, None)
        if c is not None and not c.closed:
            return c
        return await connect_agent(rec.path, rec.extra.get("env") or {}, timeout=max(timeout, 10.0),
                                   alive=rec.init_alive, fresh_boot=False, what=f"the {self.name} {rec.id}")

    async def destroy(self, rec: SandboxRecord) -> None:
        """Kill QEMU and remove the sandbox directory (disks, sockets, console). Idempotent."""
        c = self._booted.pop(rec.id, None)
        if c is not None:
            with contextlib.suppress(Exception):
                await c.close()
        errors = []
        pids = []
        if rec.init_pid:
            pids.append((rec.init_pid, rec.init_start or None))
        leftover = qemu_pid_for(rec.path)
        if leftover and leftover != rec.init_pid:
            pids.append((leftover, None))
        for pid, start in pids:
            if not await kill_and_wait(pid, start):
                errors.append(f"QEMU pid {pid} did not exit after SIGKILL")
        if errors:
            raise SandboxError(f"cleanup of sandbox {rec.id} was incomplete: " + "; ".join(errors))
        if rec.layers:  # a microVM's layer drives (acquire_files); a no-op for a full VM
            await asyncio.to_thread(self.ctx.layer_mounts.release, rec.layers, rec.id)
        await asyncio.to_thread(shutil.rmtree, rec.path, True)

    # ---- pause / resume
    async def pause(self, rec: SandboxRecord) -> None:
        """Give the guest's spare memory back to the host, then stop the vCPUs.

        The guest first drops its clean page cache and compacts its memory (one agent exec), so the balloon
        then takes free pages only; whatever the guest cannot free stays (deflate-on-oom)."""
        cfg = MachineConfig.from_dict(rec.extra["vm"])
        target = None
        if cfg.balloon:
            c = self.ctx.connections.get(rec.id)
            if c is not None:
                with contextlib.suppress(ShoalError, KeyError, ValueError, IndexError):
                    # drop clean caches and compact: freed memory becomes whole 2 MiB blocks, which free
                    # page reporting and the balloon hand back to the host
                    r = await c.exec(["/bin/sh", "-c", "sync; echo 3 > /proc/sys/vm/drop_caches; "
                                      "echo 1 > /proc/sys/vm/compact_memory; cat /proc/meminfo"], timeout=10)
                    info = {ln.split(":")[0]: int(ln.split()[1]) for ln in r.stdout.decode().splitlines()}
                    used_mb = (info["MemTotal"] - info["MemAvailable"]) >> 10
                    target = used_mb + 32
            if target is None:
                target = self.ctx.settings.vm_pause_balloon_mb or cfg.memory_mb // 8
            target = min(max(64, target), cfg.memory_mb)
        async with qmp(rec.path) as q:
            if target is not None and target < cfg.memory_mb:
                with contextlib.suppress(ShoalError):
                    await self._balloon_to(q, target, timeout=self.ctx.settings.vm_balloon_wait_s)
            await q.execute("stop")

    @staticmethod
    async def _balloon_to(q: Any, target_mb: int, timeout: float) -> int:
        """Ask for `target_mb` of guest RAM and wait (bounded) until the guest gets there or stops progressing."""
        await q.execute("balloon", {"value": target_mb << 20})
        deadline = time.monotonic() + timeout
        first = last = -1
        still = 0
        actual = 0
        while time.monotonic() < deadline:
            actual = int((await q.execute("query-balloon"))["actual"]) >> 20
            if first < 0:
                first = actual
            if actual <= target_mb + 4:
                break
            # a stall counts once the guest has started giving memory (it takes a moment to start)
            still = still + 1 if (actual == last and actual < first) else 0
            if still >= 8:
                break  # the guest cannot give more (its processes use it): good enough
            last = actual
            await asyncio.sleep(0.1)
        return actual

    async def resume(self, rec: SandboxRecord) -> None:
        """Start the vCPUs and give the guest its memory back."""
        cfg = MachineConfig.from_dict(rec.extra["vm"])
        async with qmp(rec.path) as q:
            await q.execute("cont")
            if cfg.balloon:
                await q.execute("balloon", {"value": cfg.memory_mb << 20})

    def info(self, rec: SandboxRecord) -> dict[str, Any]:
        """VMM, machine, accelerator (kvm or tcg), QEMU pid, console path, boot time."""
        self.accel()
        return {"vmm": rec.extra.get("vmm", "qemu"), "machine": rec.extra.get("machine", self.machine),
                "accel": rec.extra.get("accel"), "kvm": self._accel_detail, "qemu_pid": rec.init_pid,
                "console": str(sandbox_files(rec.path)["console"]), "boot_s": rec.extra.get("boot_s"),
                "boot_phases_s": rec.extra.get("boot_phases_s"),
                "forked_from": rec.extra.get("forked_from")}

    def upper_dir(self, rec: SandboxRecord) -> Path | None:
        """VMs keep their writable layer inside a disk image, not as a host directory."""
        return None


    # ---- memory snapshots, fork, restore (shoal's VM memory snapshots: see below)
    async def snapshot_memory(self, rec: SandboxRecord, name: str) -> dict[str, Any]:
        """Save the VM's memory, devices and disks as the named snapshot (replacing one of the same name)."""
        return await snapshot_vm(self, rec.id, name)

    async def fork_memory(self, rec: SandboxRecord, n: int, **overrides: Any) -> list[SandboxInfo | ShoalError]:
        """`n` children resumed from one memory snapshot of the running VM (processes keep running)."""
        return await fork_vm(self, rec.id, n, **overrides)

    async def restore(self, name: str, n: int = 1) -> list[SandboxInfo | ShoalError]:
        """`n` new VMs resumed from a named snapshot of this host."""
        return await restore_vm_snapshot(self, name, n)


# ---- memory snapshots and fork -------------------------------------------------------------------
def snapshots_dir(paths: Paths) -> Path:
    """Where named VM snapshots live (host-local: memory images are tied to this host's QEMU and store)."""
    return paths.home / "vm" / "snapshots"


def _check_snapshot_name(name: str) -> str:
    if not isinstance(name, str) or not _SNAPSHOT_NAME.match(name):
        raise InvalidRequest(f"bad snapshot name {name!r}: 1-128 of letters, digits, '.', '_', ':', '-'")
    return name


def _qemu_backend(ctx: NodeContext, rec: SandboxRecord) -> QemuVmBackend:
    b = ctx.backend(rec.backend)
    if not isinstance(b, QemuVmBackend):
        raise BackendUnavailable(f"memory snapshots need QEMU; sandbox {rec.id} runs on {rec.runtime or rec.backend}")
    return b


async def _save(rec: SandboxRecord, dest: Path, s: Settings) -> dict[str, Any]:
    """Stop the VM, write its memory and device state to dest/memory.bin and copy its writable disks; the
    VM continues afterwards if it was running. The caller holds the sandbox lock."""
    from shoal.backends.vm_images import copy_sparse

    cfg = MachineConfig.from_dict(rec.extra["vm"])
    mem = dest / "memory.bin"
    t0 = time.monotonic()
    # QEMU serves one monitor client at a time: each step opens its own short session
    async with qmp(rec.path) as q:
        was_running = (await q.execute("query-status"))["status"] == "running"
        if was_running:
            await q.execute("stop")
    try:
        await asyncio.to_thread(migrate_fd, rec.path, mem, incoming=False,
                                timeout=s.vm_snapshot_timeout)
        # the vCPUs are stopped and QEMU flushed the disks: their files match the saved memory
        for drv in cfg.drives:
            if not drv.readonly:
                await asyncio.to_thread(copy_sparse, Path(drv.path), dest / Path(drv.path).name)
    finally:
        if was_running:
            async with qmp(rec.path) as q:
                await q.execute("cont")
    return {"memory_bytes": mem.stat().st_size, "save_s": round(time.monotonic() - t0, 3), "paused": not was_running}


def _snapshot_meta(rec: SandboxRecord, name: str, saved: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "kind": "vm-memory", "backend": rec.backend, "parent": rec.id, "image": rec.image,
            "image_digest": rec.image_digest, "layers": rec.layers, "spec": rec.spec.to_dict(), "project": rec.project,
            "labels": rec.labels, "extra": rec.extra, "created": time.time(), **saved}


async def snapshot_vm(backend: QemuVmBackend, sandbox_id: str, name: str) -> dict[str, Any]:
    """Save a VM's memory, devices and disks as the named snapshot (replacing one of the same name)."""
    ctx = backend.ctx
    _check_snapshot_name(name)
    root = snapshots_dir(ctx.paths)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".new-{name}-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        async with ctx.locks.state(sandbox_id):
            rec = ctx.record(sandbox_id)
            _qemu_backend(ctx, rec)
            if rec.state not in ("running", "paused"):
                raise SandboxError(f"cannot snapshot sandbox {sandbox_id}: it is {rec.state}")
            saved = await _save(rec, tmp, ctx.settings)
        meta = _snapshot_meta(rec, name, saved)
        (tmp / "snapshot.json").write_text(json.dumps(meta))
        final = root / name
        old = None
        if final.exists():
            old = root / f".old-{name}-{time.monotonic_ns()}"
            os.rename(final, old)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {k: meta[k] for k in ("name", "kind", "backend", "parent", "image", "created", "memory_bytes", "save_s")}


def list_vm_snapshots(paths: Paths) -> list[dict[str, Any]]:
    """Named VM snapshots on this host."""
    out = []
    root = snapshots_dir(paths)
    if root.is_dir():
        for p in sorted(root.iterdir()):
            if p.name.startswith(".") or not (p / "snapshot.json").exists():
                continue
            with contextlib.suppress(OSError, ValueError):
                m = json.loads((p / "snapshot.json").read_text())
                size = sum(f.stat().st_blocks * 512 for f in p.iterdir())
                out.append({"name": m["name"], "backend": m["backend"], "parent": m["parent"], "image": m["image"],
                            "created": m["created"], "memory_bytes": m.get("memory_bytes"), "disk_bytes": size})
    return out


def remove_vm_snapshot(paths: Paths, name: str) -> None:
    """Delete a named VM snapshot (VMs restored from it do not need it any more)."""
    p = snapshots_dir(paths) / _check_snapshot_name(name)
    if not (p / "snapshot.json").exists():
        raise SandboxNotFound(f"no VM snapshot named {name!r} on this host")
    shutil.rmtree(p)


async def _restore_one(ctx: NodeContext, snap: Path, meta: dict[str, Any]) -> SandboxInfo:
    """A new sandbox resumed from a saved VM: same memory, processes, and disks (copied)."""
    from shoal.backends.vm_images import copy_sparse

    spec = SandboxSpec.from_record(meta["spec"])
    backend = ctx.backend(meta["backend"])
    if not isinstance(backend, QemuVmBackend):
        raise BackendUnavailable("restoring a VM memory snapshot needs the QEMU VM backend")
    qemu = find_qemu(ctx.settings)
    with ctx.admission.reserve(spec) as res:
        extra = copy.deepcopy(meta["extra"])
        extra.pop("boot_s", None)
        extra.pop("boot_phases_s", None)
        extra.update(forked_from=meta["parent"], snapshot=meta["name"])
        rec = ctx.new_record(backend=meta["backend"], image=meta["image"], image_digest=meta["image_digest"],
                             layers=list(meta["layers"]), spec=spec, extra=extra,
                             runtime=f"qemu-{backend.machine}", project=meta.get("project", "default"),
                             labels=dict(meta.get("labels") or {}))
        d = rec.path
        t0 = time.monotonic()
        try:
            cfg = MachineConfig.from_dict(extra["vm"])
            if cfg.accel != backend.accel():
                raise BackendUnavailable(f"the snapshot was taken under {cfg.accel}, this host runs VMs under "
                                         f"{backend.accel()}: it cannot be restored here")
            for drv in cfg.drives:
                if not drv.readonly:
                    dst = d / Path(drv.path).name
                    await asyncio.to_thread(copy_sparse, snap / Path(drv.path).name, dst)
                    drv.path = str(dst)
            if backend.machine == "microvm" and rec.layers:
                # the layer disks: this sandbox's own use of the node's layer reader files (released in destroy)
                lays = [ctx.store.layer("sha256:" + h) for h in rec.layers]
                files = await asyncio.to_thread(ctx.layer_mounts.acquire_files, lays, rec.id)
                by_id = {f"layer{i}": str(f) for i, f in enumerate(files)}
                for drv in cfg.drives:
                    if drv.readonly and drv.id in by_id:
                        drv.path = by_id[drv.id]
            rec.extra["vm"] = cfg.to_dict()
            rec.save()
            pid, start = await launch(qemu_argv(qemu, cfg, d, incoming=True, seccomp=ctx.settings.vm_seccomp), d)
            rec.init_pid, rec.init_start = pid, start
            rec.save()
            await asyncio.to_thread(migrate_fd, d, snap / "memory.bin", incoming=True,
                                    timeout=ctx.settings.vm_snapshot_timeout)
            async with qmp(d) as q:
                await q.execute("cont")
                if cfg.balloon:
                    await q.execute("balloon", {"value": cfg.memory_mb << 20})
            client = await connect_agent(d, extra.get("env") or {}, timeout=backend.boot_timeout(),
                                         alive=rec.init_alive, fresh_boot=False,
                                         what=f"the restored {rec.backend} {rec.id}")
        except BaseException:
            with contextlib.suppress(Exception):
                await backend.destroy(rec)
            raise
        ctx.connections.put(rec.id, client)
        rec.extra["restore_s"] = round(time.monotonic() - t0, 3)
        rec.state = "running"
        rec.save()
        res.commit(rec.id)
    return ctx.describe(rec)


async def _restore_many(ctx: NodeContext, snap: Path, meta: dict[str, Any], n: int,
                        concurrency: int | None) -> list[SandboxInfo | ShoalError]:
    sem = asyncio.Semaphore(concurrency or 4)

    async def one() -> SandboxInfo | ShoalError:
        async with sem:
            try:
                return await _restore_one(ctx, snap, meta)
            except ShoalError as e:
                return e
            except Exception as e:
                return SandboxError(f"restoring VM snapshot {meta['name']} failed: {e}")

    return list(await asyncio.gather(*(one() for _ in range(n))))


def _check_n(n: int) -> int:
    if not isinstance(n, int) or not 1 <= n <= MAX_VM_BATCH:
        raise InvalidRequest(f"n={n!r} must be between 1 and {MAX_VM_BATCH}")
    return n


async def restore_vm_snapshot(backend: QemuVmBackend, name: str, n: int = 1,
                              concurrency: int | None = None) -> list[SandboxInfo | ShoalError]:
    """`n` new VMs resumed from a named snapshot; each item is an info or the error it met."""
    _check_n(n)
    ctx = backend.ctx
    snap = snapshots_dir(ctx.paths) / _check_snapshot_name(name)
    try:
        meta = json.loads((snap / "snapshot.json").read_text())
    except FileNotFoundError:
        raise SandboxNotFound(f"no VM snapshot named {name!r} on this host (see `shoal vm snapshots`)") from None
    return await _restore_many(ctx, snap, meta, n, concurrency)


async def fork_vm(backend: QemuVmBackend, sandbox_id: str, n: int, concurrency: int | None = None,
                  **overrides: Any) -> list[SandboxInfo | ShoalError]:
    """`n` children of a running VM, each resumed from one memory snapshot: the parent's processes keep
    running in every child (same PIDs, same memory), the parent continues untouched.

    `labels` and `ttl_s` may be overridden; the machine (cpus, memory) is the parent's by nature."""
    _check_n(n)
    overrides = {k: v for k, v in overrides.items() if v is not None and k not in ("memory", "name")}
    bad = sorted(set(overrides) - {"labels", "ttl_s"})
    if bad:
        raise InvalidRequest(f"a VM fork resumes the parent's memory, so {', '.join(bad)} cannot change "
                             "(only labels and ttl_s can)")
    ctx = backend.ctx
    root = snapshots_dir(ctx.paths)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".fork-{sandbox_id}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        async with ctx.locks.state(sandbox_id):
            rec = ctx.record(sandbox_id)
            _qemu_backend(ctx, rec)
            if rec.state not in ("running", "paused"):
                raise SandboxError(f"cannot fork sandbox {sandbox_id}: it is {rec.state}")
            saved = await _save(rec, tmp, ctx.settings)
        meta = _snapshot_meta(rec, f"fork-of-{sandbox_id}", saved)
        if "labels" in overrides:
            validate_labels(overrides["labels"])
            meta["labels"] = {**(meta.get("labels") or {}), **dict(overrides["labels"])}
        if "ttl_s" in overrides:
            meta["spec"] = {**meta["spec"], "ttl_s": overrides["ttl_s"]}
        return await _restore_many(ctx, tmp, meta, n, concurrency)
    finally:
        await asyncio.to_thread(shutil.rmtree, tmp, True)
