"""microVMs on Firecracker, used instead of QEMU microvm when a `firecracker` binary is on PATH and KVM works.

The guest is the same as QEMU's microVM (shoal's initramfs, Debian's kernel as an ELF vmlinux, one
read-only disk per EROFS layer, a sparse ext4 disk for the writable layer). What differs:

- Firecracker has no virtio-serial, so the agent is reached over **vsock**: the guest init starts
  `shoal-vsock-listen 1024 shoal-agent --listen-fd 3`, and the host connects to the Unix socket
  `$SANDBOX_DIR/vsock.sock`, sends `CONNECT 1024\\n` and reads `OK ...\\n` (Firecracker's vsock protocol).
  Unlike a serial port, this channel takes any number of connections.
- Firecracker names virtio-blk disks by drive_id (its VIRTIO_BLK_T_GET_ID answer), so drives are called
  `shoal_layer0`…, `shoal_upper`; the init matches serials with '-' or '_'.
- It passes its virtio-mmio devices on the kernel command line, which Debian's kernel only reads with
  CONFIG_VIRTIO_MMIO_CMDLINE_DEVICES (not set in Debian 12's) — or through ACPI on Firecracker ≥ 1.8.
  So this path needs Firecracker ≥ 1.8 (x86_64 ACPI) or a guest kernel with that option
  (SHOAL_VM_KERNEL_VERSION selects another installed kernel).
- Pause/resume use PATCH /vm; memory snapshots and fork are QEMU-only for now (a clear error says so).

No firecracker binary can be installed on this project's machines (it is not in Debian), so this module
is written against Firecracker's documented API and its test skips with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.backends.base import Backend, Capability
from shoal.backends.qemu import console_tail, kill_and_wait
from shoal.config import Settings
from shoal.errors import BackendUnavailable, InvalidRequest, SandboxError, Timeout
from shoal.host.oom import SANDBOX_OOM_SCORE_ADJ
from shoal.images.store import Image
from shoal.limits import AGENT_READY_TIMEOUT_S
from shoal.records import SandboxRecord, proc_starttime
from shoal.spec import SandboxSpec

if TYPE_CHECKING:
    from shoal.agentproto.client import AgentClient
    from shoal.backends.context import NodeContext

AGENT_VSOCK_PORT = 1024
GUEST_CID = 3


def firecracker_binary(s: Settings) -> str | None:
    """The firecracker setting, else `firecracker` on PATH."""
    given = s.firecracker
    p = str(given) if given else shutil.which("firecracker")
    return p if p and os.access(p, os.X_OK) else None


def firecracker_usable(s: Settings) -> tuple[bool, str]:
    """(usable, why): a binary on PATH and KVM working (the VMM registry's probe, shoal.backends.registry)."""
    binary = firecracker_binary(s)
    if not binary:
        return False, "no firecracker binary on PATH (it is not packaged by Debian; microVMs use QEMU microvm)"
    from shoal.host.kvm import kvm_status

    st = kvm_status()
    if not st.usable:
        return False, f"firecracker is at {binary} but needs KVM: {st.detail}"
    return True, f"firecracker at {binary} with KVM"


class _Api:
    """Firecracker's HTTP API on its Unix socket."""

    def __init__(self, sock: Path) -> None:
        self.sock = sock

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> Any:
        import httpx

        transport = httpx.AsyncHTTPTransport(uds=str(self.sock))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=timeout) as c:
            r = await c.request(method, path, json=body)
        if r.status_code >= 300:
            try:
                why = r.json().get("fault_message", r.text)
            except ValueError:
                why = r.text
            raise SandboxError(f"firecracker refused {method} {path}: {why}")
        return r.json() if r.content else None


class FirecrackerBackend(Backend):
    """microVM sandboxes on Firecracker (KVM only)."""

    name = "microvm"
    capabilities = frozenset({Capability.SANDBOXES, Capability.PAUSE})
    instead = {
        Capability.SNAPSHOT_MEMORY: "memory snapshots are QEMU-only for now: set SHOAL_VMM=qemu",
        Capability.FORK_MEMORY: "memory forks are QEMU-only for now: set SHOAL_VMM=qemu",
        Capability.RESTORE: "memory snapshots are QEMU-only for now: set SHOAL_VMM=qemu",
        Capability.NETWORK: "network=True is not wired for Firecracker microVMs yet: set SHOAL_VMM=qemu",
        Capability.SNAPSHOT_FILES: "a microVM keeps its writable layer inside a disk image; use backend='container'",
    }

    def __init__(self, ctx: NodeContext, name: str | None = None) -> None:
        super().__init__(ctx, name)
        self.paths = ctx.paths
        self.binary = firecracker_binary(ctx.settings)

    def _files(self, d: Path) -> dict[str, Path]:
        return {"api": d / "fc.sock", "vsock": d / "vsock.sock", "console": d / "console.log", "pid": d / "fc.pid"}

    async def create(self, rec: SandboxRecord, spec: SandboxSpec, image: Image) -> None:
        """Configure a Firecracker microVM through its API, start it and wait for the agent."""
        from shoal.backends import vm_images
        from shoal.backends.vm import MIN_VM_MEMORY_MB
        from shoal.host.spawn import run

        if not self.binary:
            raise BackendUnavailable("firecracker is not installed")
        if spec.memory_mb < MIN_VM_MEMORY_MB:
            raise InvalidRequest(f"memory_mb={spec.memory_mb} is too small for a VM (at least {MIN_VM_MEMORY_MB})")
        d = rec.path
        f = self._files(d)
        env = dict(image.config.env)
        env.update(spec.env)
        hostname = spec.hostname or "sandbox"
        env.setdefault("HOSTNAME", hostname)
        t0 = time.monotonic()
        try:
            agent = self.ctx.agent_binary
            guest = await asyncio.to_thread(vm_images.ensure_guest, self.paths, agent, self.ctx.settings)
            meta = (guest.initrd.parent / "guest.json").read_text()
            if '"vsock_helper": true' not in meta:
                raise BackendUnavailable("the microVM guest has no vsock helper (gcc was missing when it was built)")
            await asyncio.to_thread(vm_images.make_upper_disk, d / "upper.img", spec.disk_mb)
            rec.runtime = "firecracker"
            rec.extra.update(vmm="firecracker", machine="firecracker", accel="kvm", env=env)
            rec.save()
            # setsid -f: Firecracker must outlive this process (crash-only), so it is nobody's child
            # (at the sandboxes' OOM score, not the node agent's: shoal.host.oom)
            shell = (f'echo $$ > "{f["pid"]}"; echo {SANDBOX_OOM_SCORE_ADJ} > /proc/self/oom_score_adj 2>/dev/null; '
                     f'exec "{self.binary}" --api-sock "{f["api"]}" --id "{rec.id[-60:]}" '
                     f'>> "{f["console"]}" 2>&1 < /dev/null')
            r = await run(["setsid", "-f", "/bin/sh", "-c", shell], timeout=10)
            if r.returncode != 0:
                raise SandboxError(f"could not start firecracker: {r.stderr.decode(errors='replace')}")
            pid = 0
            for _ in range(200):
                with contextlib.suppress(OSError, ValueError):
                    pid = int(f["pid"].read_text())
                if pid and f["api"].exists():
                    break
                await asyncio.sleep(0.01)
            start = proc_starttime(pid) if pid else None
            if not start:
                raise SandboxError(f"firecracker exited at once: {console_tail(d)}")
            rec.init_pid, rec.init_start = pid, start
            rec.save()
            api = _Api(f["api"])
            args = (f"console=ttyS0 reboot=k panic=-1 pci=off quiet shoal.vsock={AGENT_VSOCK_PORT} "
                    f"shoal.layers={len(image.layers)} shoal.upper=disk shoal.hostname={hostname}")
            await api.call("PUT", "/machine-config", {"vcpu_count": max(1, min(32, math.ceil(spec.cpus))),
                                                      "mem_size_mib": spec.memory_mb})
            await api.call("PUT", "/boot-source", {"kernel_image_path": str(guest.kernel),
                                                   "initrd_path": str(guest.initrd), "boot_args": args})
            # each layer is a disk: the node's layer reader's file of it (checked chunks, on demand)
            files = await asyncio.to_thread(self.ctx.layer_mounts.acquire_files, image.layers, rec.id)
            for i, lf in enumerate(files):
                await api.call("PUT", f"/drives/shoal_layer{i}", {
                    "drive_id": f"shoal_layer{i}", "path_on_host": str(lf), "is_root_device": False,
                    "is_read_only": True})
            await api.call("PUT", "/drives/shoal_upper", {
                "drive_id": "shoal_upper", "path_on_host": str(d / "upper.img"), "is_root_device": False,
                "is_read_only": False})
            await api.call("PUT", "/vsock", {"guest_cid": GUEST_CID, "uds_path": str(f["vsock"])})
            await api.call("PUT", "/balloon", {"amount_mib": 0, "deflate_on_oom": True,
                                               "stats_polling_interval_s": 0})
            await api.call("PUT", "/actions", {"action_type": "InstanceStart"})
            timeout = self.ctx.settings.vm_boot_timeout or 30.0
            deadline = time.monotonic() + timeout
            while True:
                try:
                    c = await self._connect(rec, timeout=2.0)
                    await c.close()
                    break
                except (SandboxError, Timeout, OSError) as e:
                    if not rec.init_alive():
                        raise SandboxError(f"the microVM failed to boot: firecracker exited\n{console_tail(d)}") from e
                    if time.monotonic() > deadline:
                        raise Timeout(f"the microVM did not boot within {timeout:.0f}s\n{console_tail(d)}") from e
                    await asyncio.sleep(0.05)
            rec.extra["boot_s"] = round(time.monotonic() - t0, 3)
            rec.save()
        except BaseException:
            with contextlib.suppress(Exception):
                await self.destroy(rec)
            raise

    async def _connect(self, rec: SandboxRecord, timeout: float) -> AgentClient:
        from shoal.backends.vm import VmAgentClient

        sock = self._files(rec.path)["vsock"]
        try:
            r, w = await asyncio.wait_for(asyncio.open_unix_connection(str(sock)), timeout)
            w.write(f"CONNECT {AGENT_VSOCK_PORT}\n".encode())
            line = await asyncio.wait_for(r.readline(), timeout)
        except (OSError, TimeoutError) as e:
            raise SandboxError(f"cannot reach the microVM's vsock at {sock}: {e or 'timeout'}") from e
        if not line.startswith(b"OK"):
            w.close()
            raise SandboxError(f"firecracker vsock refused the connection: {line!r}")
        c = await VmAgentClient.connect_stream(r, w, timeout=timeout)
        assert isinstance(c, VmAgentClient)
        c.base_env = dict(rec.extra.get("env") or {})
        return c

    async def connect(self, rec: SandboxRecord, timeout: float = AGENT_READY_TIMEOUT_S) -> AgentClient:
        """A new connection through Firecracker's vsock (any number may be open)."""
        return await self._connect(rec, timeout)

    async def destroy(self, rec: SandboxRecord) -> None:
        """Kill Firecracker and remove the sandbox directory. Idempotent."""
        if rec.init_pid and not await kill_and_wait(rec.init_pid, rec.init_start or None):
            raise SandboxError(f"firecracker pid {rec.init_pid} did not exit after SIGKILL")
        if rec.layers:
            await asyncio.to_thread(self.ctx.layer_mounts.release, rec.layers, rec.id)
        await asyncio.to_thread(shutil.rmtree, rec.path, True)

    async def pause(self, rec: SandboxRecord) -> None:
        """Inflate the balloon, then pause the vCPUs."""
        api = _Api(self._files(rec.path)["api"])
        mem = int(rec.spec.memory_mb)
        with contextlib.suppress(SandboxError):
            await api.call("PATCH", "/balloon", {"amount_mib": max(0, mem - max(64, mem // 8))})
        await api.call("PATCH", "/vm", {"state": "Paused"})

    async def resume(self, rec: SandboxRecord) -> None:
        """Resume the vCPUs and deflate the balloon."""
        api = _Api(self._files(rec.path)["api"])
        await api.call("PATCH", "/vm", {"state": "Resumed"})
        with contextlib.suppress(SandboxError):
            await api.call("PATCH", "/balloon", {"amount_mib": 0})

    def info(self, rec: SandboxRecord) -> dict:
        """VMM facts for SandboxInfo.extra."""
        return {"vmm": "firecracker", "machine": "firecracker", "accel": "kvm", "pid": rec.init_pid,
                "console": str(self._files(rec.path)["console"]), "boot_s": rec.extra.get("boot_s")}
