"""What every backend provides to the node agent. Exec, files and shells are not here: they go through
the in-sandbox agent's protocol, identical on every backend, once `connect()` returned a client."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.images.store import Image
from shoal.models import SandboxSpec
from shoal.node.records import SandboxRecord

if TYPE_CHECKING:
    from shoal.agentproto.client import AgentClient


class Backend(ABC):
    """Where a sandbox lives: creates it, reaches its agent, pauses it, and cleans it up."""

    name: str = "?"

    @abstractmethod
    async def create(self, rec: SandboxRecord, spec: SandboxSpec, image: Image) -> None:
        """Start the sandbox described by `rec` (fills in runtime fields); on error leave nothing behind."""

    @abstractmethod
    async def connect(self, rec: SandboxRecord, timeout: float = 30.0) -> AgentClient:
        """Open a connection to the sandbox's agent (after `hello`)."""

    @abstractmethod
    async def destroy(self, rec: SandboxRecord) -> None:
        """Stop the sandbox and remove every process, mount, cgroup, device and file it had. Idempotent."""

    def alive(self, rec: SandboxRecord) -> bool:
        """True when the sandbox's init process still runs."""
        return rec.init_alive()

    async def pause(self, rec: SandboxRecord) -> None:
        """Freeze the sandbox."""
        from shoal.errors import NotImplementedYet

        raise NotImplementedYet(f"pause is not supported by the {self.name} backend")

    async def resume(self, rec: SandboxRecord) -> None:
        """Thaw the sandbox."""
        from shoal.errors import NotImplementedYet

        raise NotImplementedYet(f"resume is not supported by the {self.name} backend")

    def upper_dir(self, rec: SandboxRecord) -> Path | None:
        """The sandbox's private writable layer on the host (for snapshots), if it has one."""
        return None

    def info(self, rec: SandboxRecord) -> dict:
        """Backend-specific facts for SandboxInfo.extra (e.g. KVM or TCG)."""
        return {}
