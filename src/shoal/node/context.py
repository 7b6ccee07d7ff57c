"""The node's side of shoal.backends.context: the object every backend of this node gets, never the Node.

The node builds one `NodeContextImpl` and hands it to every backend it creates (see
shoal.backends.registry.create_backend); backends know it only as the `shoal.backends.context.NodeContext`
protocol. Everything here is public API of the node's parts (admission, agent connections, state locks,
records), so a backend that restores VMs or runs a service on pooled sandboxes does it through the same
doors the node uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.config import NodeConfig, Paths, Settings
from shoal.images.mounts import LayerMounts
from shoal.images.store import ImageStore
from shoal.node.admission import Admission
from shoal.node.connections import AgentConnections
from shoal.node.statelock import SandboxLocks
from shoal.records import SandboxRecord, check_sandbox_id, my_identity, new_sandbox_id, spec_copy

if TYPE_CHECKING:
    from shoal.backends.base import Backend
    from shoal.backends.context import SandboxHost
    from shoal.models import SandboxInfo
    from shoal.node.network import NetworkManager
    from shoal.spec import SandboxSpec


class NodeContextImpl:
    """The node's public parts, as a backend sees them (implements shoal.backends.context.NodeContext)."""

    def __init__(self, *, config: NodeConfig, store: ImageStore, layer_mounts: LayerMounts, guest_dir: Path,
                 admission: Admission, connections: AgentConnections, locks: SandboxLocks,
                 network: Callable[[], NetworkManager],
                 backend: Callable[[str], Backend], describe: Callable[[SandboxRecord], SandboxInfo],
                 sandboxes: SandboxHost) -> None:
        self.config = config
        #: every setting, resolved once where the node was made (backends read these, never `settings()`)
        self.settings: Settings = config.settings
        self.paths: Paths = config.paths
        self.store = store
        self.layer_mounts = layer_mounts
        #: where the node keeps its stable copy of the in-sandbox agent binary (shoal-agent)
        self.guest_dir = guest_dir
        self.admission = admission
        self.connections = connections
        self.locks = locks
        self.sandboxes = sandboxes
        self._network = network
        self._backend = backend
        self._describe = describe

    @property
    def agent_binary(self) -> Path:
        """The agent binary the node installed for its sandboxes."""
        return self.guest_dir / "shoal-agent"

    def network(self) -> NetworkManager:
        """The node's network manager (veth + NAT), created on first use."""
        return self._network()

    def backend(self, name: str) -> Backend:
        """Another backend of the same node (e.g. the VM kind a memory snapshot was taken on)."""
        return self._backend(name)

    def describe(self, rec: SandboxRecord) -> SandboxInfo:
        """The SandboxInfo the node reports for a record."""
        return self._describe(rec)

    def record(self, sandbox_id: str) -> SandboxRecord:
        """A sandbox's record (SandboxNotFound when there is none)."""
        check_sandbox_id(sandbox_id)
        return SandboxRecord.load(self.paths.sandboxes / sandbox_id)

    def new_record(self, *, backend: str, image: str, image_digest: str, layers: list[str],
                   spec: SandboxSpec, extra: dict[str, Any], make_dir: Callable[[Path], None] | None = None,
                   runtime: str = "", project: str | None = None, labels: dict[str, str] | None = None,
                   ) -> SandboxRecord:
        """A record (not saved yet) for a new sandbox of this node, with its directory made and this
        process as its owner; it keeps its own copy of `spec`, and its TTL, project and labels come from
        `spec` unless given."""
        sid = new_sandbox_id(self.config.node_id)
        d = self.paths.sandboxes / sid
        (make_dir or Path.mkdir)(d)
        owner_pid, owner_start = my_identity()
        now = time.time()
        ttl = spec.ttl_s
        return SandboxRecord(
            id=sid, backend=backend, image=image, image_digest=image_digest, layers=layers, spec=spec_copy(spec),
            dir=str(d), owner_pid=owner_pid, owner_start=owner_start, created_at=now,
            expires_at=(now + float(ttl)) if ttl else None,
            project=project if project is not None else (spec.project or "default"),
            labels=dict(labels if labels is not None else spec.labels), runtime=runtime, extra=extra)
