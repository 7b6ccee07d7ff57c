"""What a backend may use of its node: the one interface between shoal.backends and shoal.node.

Backends are built with a `NodeContext` and see the node only through it; shoal.node implements it
(`shoal.node.core.NodeCore`, the node's internals) and never hands a backend the Node itself. No backend imports
shoal.node (tests/unit/test_architecture.py checks): sandbox records are `shoal.records`, settings
`shoal.config`, and everything else the node offers — admission, agent connections, state locks, the
network, other backends, new records — is one of the protocols below, each as small as its users need.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from shoal.agentproto.client import AgentClient
    from shoal.backends.base import Backend
    from shoal.config import NodeConfig, Paths, Settings
    from shoal.egress import Box, EgressPolicy
    from shoal.images.mounts import LayerMounts
    from shoal.images.store import ImageStore
    from shoal.models import SandboxInfo
    from shoal.records import SandboxRecord
    from shoal.spec import SandboxSpec


class Reservation(Protocol):
    """Memory and CPUs held for one sandbox being made (a context manager: released unless committed)."""

    def commit(self, sandbox_id: str) -> None:
        """The sandbox is live: what was held stays counted for it."""

    def release(self) -> None:
        """Give it back (the create failed); nothing after `commit`."""

    def __enter__(self) -> Reservation: ...

    def __exit__(self, *exc: object) -> None: ...


class AdmissionDoor(Protocol):
    """The node's admission, as a backend that makes sandboxes itself (a VM restore) uses it."""

    def reserve(self, spec: Any) -> Reservation:
        """Hold what `spec` needs, or raise CapacityExceeded."""
        ...


class Connections(Protocol):
    """The node's cache of open agent connections, one per sandbox."""

    def get(self, sandbox_id: str) -> AgentClient | None:
        """The open connection to the sandbox, if any."""
        ...

    def put(self, sandbox_id: str, client: AgentClient, *, idle_close: bool = False) -> None:
        """Keep `client` as the sandbox's connection."""


class StateLocks(Protocol):
    """Per-sandbox state locks (pause, resume, snapshot, close hold one)."""

    def state(self, sandbox_id: str) -> AbstractAsyncContextManager[None]:
        """Hold the sandbox's state lock (in this process and across processes)."""
        ...


class Network(Protocol):
    """The node's sandbox network: a veth pair and NAT per sandbox on one bridge."""

    @property
    def gateway(self) -> str:
        """The bridge's address as sandboxes see it (their router and DNS proxy)."""
        ...

    def blocked_nets(self) -> list[ipaddress.IPv4Network]:
        """Every protected address (the @infra set)."""
        ...

    async def setup(self, rec: SandboxRecord, policy: EgressPolicy | None = None,
                    egress_mbps: float | None = None, grants: list[Box] | None = None) -> str:
        """Make the sandbox's network namespace; returns its path."""
        ...

    def egress_stats(self, rec: SandboxRecord) -> dict[str, int]:
        """What the sandbox sent and what was dropped."""
        ...

    async def teardown(self, rec: SandboxRecord) -> None:
        """Remove the sandbox's network namespace, veth and rules."""


class SandboxHost(Protocol):
    """The node's public sandbox API, for services built on ordinary sandboxes (fncall's warm pools and
    the image it builds)."""

    @property
    def paths(self) -> Paths: ...

    @property
    def store(self) -> ImageStore: ...

    async def create(self, spec: SandboxSpec) -> SandboxInfo: ...

    async def close(self, sandbox_id: str, *, reason: str = "user") -> None: ...

    async def client(self, sandbox_id: str, rec: SandboxRecord | None = None) -> AgentClient: ...

    async def stream(self, sandbox_id: str, cmd: str | list[str], *, timeout: float | None = ...) -> Any: ...

    async def snapshot(self, sandbox_id: str, name: str) -> dict[str, Any]: ...


class NodeContext(Protocol):
    """The node's public parts, as a backend sees them."""

    @property
    def config(self) -> NodeConfig: ...

    @property
    def settings(self) -> Settings:
        """Every setting, resolved once where the node was made (a backend never calls `settings()`)."""
        ...

    @property
    def paths(self) -> Paths: ...

    @property
    def store(self) -> ImageStore: ...

    @property
    def layer_mounts(self) -> LayerMounts: ...

    @property
    def guest_dir(self) -> Path:
        """Where the node keeps its stable copy of the in-sandbox agent binary."""
        ...

    @property
    def agent_binary(self) -> Path:
        """The agent binary the node installed for its sandboxes."""
        ...

    @property
    def admission(self) -> AdmissionDoor: ...

    @property
    def connections(self) -> Connections: ...

    @property
    def locks(self) -> StateLocks: ...

    @property
    def sandboxes(self) -> SandboxHost:
        """The node's public sandbox API (for services built on ordinary sandboxes)."""
        ...

    def network(self) -> Network:
        """The node's network, set up on first use."""
        ...

    def backend(self, name: str) -> Backend:
        """Another backend of the same node (e.g. the VM kind a memory snapshot was taken on)."""
        ...

    def describe(self, rec: SandboxRecord) -> SandboxInfo:
        """The SandboxInfo the node reports for a record."""
        ...

    def record(self, sandbox_id: str) -> SandboxRecord:
        """A sandbox's record (SandboxNotFound when there is none)."""
        ...

    def new_record(self, *, backend: str, image: str, image_digest: str, layers: list[str],
                   spec: SandboxSpec, extra: dict[str, Any], make_dir: Callable[[Path], None] | None = None,
                   runtime: str = "", project: str | None = None, labels: dict[str, str] | None = None,
                   ) -> SandboxRecord:
        """A record (not saved yet) for a new sandbox of this node, its directory made, this process its owner."""
        ...
