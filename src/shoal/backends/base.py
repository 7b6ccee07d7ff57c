"""The backend interface: every operation a backend can offer the node, and the capabilities it declares.

Exec, files and shells are not here: they go through the in-sandbox agent's protocol, identical on every
backend, once `connect()` returned a client. The node asks `backend.capabilities` before it routes an
operation (pause, reclaim, snapshot, fork, restore); an operation a backend lacks raises `Unsupported`
naming the backend and what to use instead. How to add a backend: docs/architecture.md.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.errors import ShoalError, Unsupported
from shoal.limits import AGENT_READY_TIMEOUT_S

if TYPE_CHECKING:
    from shoal.agentproto.client import AgentClient
    from shoal.backends.context import NodeContext
    from shoal.images.store import Image
    from shoal.models import SandboxInfo
    from shoal.records import SandboxRecord
    from shoal.spec import SandboxSpec


class Capability(enum.Enum):
    """What a backend can do beyond create / connect / destroy."""

    #: hosts sandboxes (create, connect, destroy); fncall does not: it runs code on pooled containers
    SANDBOXES = "sandboxes"
    #: pause/resume: freeze every process, thaw them again
    PAUSE = "pause"
    #: give a paused sandbox's memory back to the host, and read its working set back before the thaw
    RECLAIM = "reclaim"
    #: the writable layer is a directory on the host (`upper_dir`): snapshot into an image, fork from files
    SNAPSHOT_FILES = "snapshot_files"
    #: a named snapshot of memory, processes and disks (`snapshot_memory`)
    SNAPSHOT_MEMORY = "snapshot_memory"
    #: children that continue the parent's processes and memory (`fork_memory`)
    FORK_MEMORY = "fork_memory"
    #: new sandboxes resumed from a named memory snapshot (`restore`)
    RESTORE = "restore"
    #: `network=True` (a veth pair and NAT, or the VMM's equivalent)
    NETWORK = "network"
    #: `network=[rules]` (an egress allowlist, shoal.egress) and `egress_mbps`
    EGRESS_RULES = "egress_rules"
    #: short code runs on warm pools (`run_code`)
    RUN_CODE = "run_code"
    #: CPU classes (`interactive`/`batch`, container.cpuclass) set at create and changed live (`set_cpu_class`)
    CPU_CLASS = "cpu_class"


#: what each capability lets a caller do, for error messages
_DOING = {
    Capability.SANDBOXES: "host sandboxes",
    Capability.PAUSE: "pause or resume sandboxes",
    Capability.RECLAIM: "reclaim the memory of paused sandboxes",
    Capability.SNAPSHOT_FILES: "snapshot or fork a sandbox's files",
    Capability.SNAPSHOT_MEMORY: "snapshot a sandbox's memory",
    Capability.FORK_MEMORY: "fork a sandbox's processes and memory",
    Capability.RESTORE: "restore memory snapshots",
    Capability.NETWORK: "give sandboxes a network",
    Capability.EGRESS_RULES: "enforce egress allowlists (network=[rules]) or egress_mbps",
    Capability.RUN_CODE: "run code snippets",
    Capability.CPU_CLASS: "put sandboxes in CPU classes",
}


@dataclass
class RuntimeStatus:
    """Whether one runtime a backend runs sandboxes on (an OCI runtime: crun, runc, gVisor) works on this
    host: the result of probing it, and when it does not, why and how to fix that."""

    name: str
    binary: str | None
    works: bool
    version: str = ""
    reason: str = ""
    fix: str = ""
    #: the runtime itself runs a plain container on this host; works=False with host_ok=True means
    #: shoal cannot drive a runtime the host runs (a shoal bug, not a host limitation)
    host_ok: bool = True


class Backend(ABC):
    """Where a sandbox lives: creates it, reaches its agent, pauses it, and cleans it up.

    A backend is built by its registry factory with the node's public `NodeContext` (paths, store, layer
    mounts, network, admission, agent connections, settings); it never holds the Node itself.
    """

    #: the registry name ("container", "microvm", ...)
    name: str = "?"
    #: what this backend offers beyond create/connect/destroy; the node routes by this set only
    capabilities: frozenset[Capability] = frozenset({Capability.SANDBOXES})
    #: per missing capability, what to use instead (completes the `Unsupported` message)
    instead: dict[Capability, str] = {}
    #: the node may close an idle agent connection and open a new one on the next request (the agent
    #: accepts connections cheaply: a Unix socket); a VM's virtio-serial line stays open
    idle_close: bool = False
    #: a create mounts the image's layers on the host (LayerMounts.acquire): admission counts the loop
    #: devices those mounts take (shoal.node.capacity); VMs read the layer files instead
    mounts_layers: bool = False

    def __init__(self, ctx: NodeContext, name: str | None = None) -> None:
        self.ctx = ctx
        if name is not None:
            self.name = name

    # ---- capability checks -----------------------------------------------------------------------
    def can(self, cap: Capability) -> bool:
        """True when this backend declares `cap`."""
        return cap in self.capabilities

    def require(self, cap: Capability) -> None:
        """Raise `Unsupported` unless this backend declares `cap`."""
        if cap not in self.capabilities:
            raise self.unsupported(cap)

    def unsupported(self, cap: Capability) -> Unsupported:
        """The error for a missing capability: names the backend and what to use instead."""
        hint = self.instead.get(cap) or "see docs/architecture.md for which backend offers what"
        return Unsupported(f"the {self.name} backend cannot {_DOING[cap]}: {hint}",
                           backend=self.name, capability=cap.value)

    # ---- host setup ------------------------------------------------------------------------------
    async def prepare(self) -> dict[str, Any]:
        """One-time host setup (a guest kernel, a runtime probe); cached, so cheap to call again."""
        return {}

    async def close(self) -> None:
        """Release what this node process holds for the backend (services, pending connections)."""
        return None

    # ---- the host, across sandboxes --------------------------------------------------------------
    # Host-wide machinery a backend keeps beside its sandboxes (the container's zram swap, upper pool,
    # CPU-class cgroups, runtime state). The node calls these hooks on every backend registered with
    # `host=True` (shoal.backends.registry), so it never reaches into a backend's modules itself; a
    # fake-backend node (unit tests, no root) calls none but `host_runtimes` and `host_teardown`.
    async def host_start(self) -> None:
        """At node start, before reconcile: set up what the host needs for this backend's sandboxes."""
        return None

    async def host_reconcile(self) -> dict[str, int]:
        """After the node reconciled its sandboxes: remove host state no live sandbox owns (a crashed or
        killed node's leftovers); returns how many of each kind were removed (merged into the node's
        reconcile report)."""
        return {}

    def host_runtimes(self) -> dict[str, RuntimeStatus]:
        """The runtimes this backend can run sandboxes on, probed on this host (cached per boot)."""
        return {}

    def host_teardown(self) -> bool:
        """Undo the host-wide setup in the node's home once its sandboxes are gone (`shoal node teardown`);
        True when something was unmounted."""
        return False

    # ---- the life of one sandbox -----------------------------------------------------------------
    def make_dir(self, d: Path) -> None:
        """Create the sandbox directory (record, sockets, bundle)."""
        d.mkdir()

    @abstractmethod
    async def create(self, rec: SandboxRecord, spec: SandboxSpec, image: Image) -> None:
        """Start the sandbox described by `rec` (fills in runtime fields); on error leave nothing behind."""

    @abstractmethod
    async def connect(self, rec: SandboxRecord, timeout: float = AGENT_READY_TIMEOUT_S) -> AgentClient:
        """Open a connection to the sandbox's agent (after `hello`)."""

    @abstractmethod
    async def destroy(self, rec: SandboxRecord) -> None:
        """Stop the sandbox and remove every process, mount, cgroup, device and file it had. Idempotent."""

    def alive(self, rec: SandboxRecord) -> bool:
        """True when the sandbox's init process still runs."""
        return rec.init_alive()

    def info(self, rec: SandboxRecord) -> dict[str, Any]:
        """Backend-specific facts for SandboxInfo.extra (e.g. KVM or TCG)."""
        return {}

    # ---- Capability.PAUSE ------------------------------------------------------------------------
    async def pause(self, rec: SandboxRecord) -> None:
        """Freeze the sandbox."""
        raise self.unsupported(Capability.PAUSE)

    async def resume(self, rec: SandboxRecord) -> None:
        """Thaw the sandbox."""
        raise self.unsupported(Capability.PAUSE)

    # ---- Capability.RECLAIM ----------------------------------------------------------------------
    async def reclaim(self, rec: SandboxRecord, *, record_working_set: bool) -> dict[str, Any]:
        """After a pause: give the sandbox's memory back to the host (and record its working set)."""
        raise self.unsupported(Capability.RECLAIM)

    async def prefetch(self, rec: SandboxRecord) -> dict[str, Any]:
        """Before a thaw: read the working set recorded by `reclaim` back in."""
        raise self.unsupported(Capability.RECLAIM)

    def forget_working_set(self, rec: SandboxRecord) -> None:
        """After a thaw: drop the recorded working set."""
        return None

    # ---- Capability.CPU_CLASS --------------------------------------------------------------------
    async def set_cpu_class(self, rec: SandboxRecord, cpu_class: str) -> dict[str, Any]:
        """Move a running sandbox to another CPU class; returns what was set."""
        raise self.unsupported(Capability.CPU_CLASS)

    # ---- Capability.SNAPSHOT_FILES ---------------------------------------------------------------
    def upper_dir(self, rec: SandboxRecord) -> Path | None:
        """The sandbox's private writable layer on the host (for file snapshots), if it has one."""
        return None

    # ---- Capability.SNAPSHOT_MEMORY / FORK_MEMORY / RESTORE --------------------------------------
    async def snapshot_memory(self, rec: SandboxRecord, name: str) -> dict[str, Any]:
        """Save memory, processes and disks as the named snapshot."""
        raise self.unsupported(Capability.SNAPSHOT_MEMORY)

    async def fork_memory(self, rec: SandboxRecord, n: int, **overrides: Any) -> list[SandboxInfo | ShoalError]:
        """`n` children that continue the parent's processes and memory; per-item errors."""
        raise self.unsupported(Capability.FORK_MEMORY)

    async def restore(self, name: str, n: int = 1) -> list[SandboxInfo | ShoalError]:
        """`n` new sandboxes resumed from a named memory snapshot; per-item errors."""
        raise self.unsupported(Capability.RESTORE)
