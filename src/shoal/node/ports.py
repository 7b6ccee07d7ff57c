"""What each of the node's parts needs of the node: small protocols, so no part holds (or imports) `Node`.

`Recovery`, `WarmPool`, `NodeScheduling` and the snapshot functions are each given the node's internals
(`shoal.node.core.NodeCore`, which implements all of these) as one of these protocols — never the `Node`,
whose methods are its users' API. A part sees only the doors it names here, and no module in shoal.node
imports shoal.node.node except teardown (which drives a whole node) — tests/unit/test_architecture.py checks
that the package has no import circle, not even one closed by `TYPE_CHECKING` imports, and
tests/unit/test_node_surface.py that the parts are given the core.

This module imports only the node's leaf parts (admission, events, state locks), never a part that is
given one of these protocols.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from shoal.backends.base import Backend
    from shoal.config import NodeConfig, Paths
    from shoal.images.mounts import LayerMounts
    from shoal.images.store import Image, ImageStore
    from shoal.models import SandboxInfo
    from shoal.node.admission import Admission, Reservation
    from shoal.node.events import EventLog
    from shoal.node.statelock import SandboxLocks
    from shoal.records import SandboxRecord
    from shoal.spec import SandboxSpec


class NodeBasics(Protocol):
    """What every part reads: the node's settings and paths, its records and its backends."""

    @property
    def config(self) -> NodeConfig: ...

    @property
    def paths(self) -> Paths: ...

    @property
    def admission(self) -> Admission: ...

    def backend(self, name: str) -> Backend:
        """The backend object for `name` (built on first use)."""
        ...

    def record(self, sandbox_id: str) -> SandboxRecord:
        """A sandbox's record (SandboxNotFound when there is none)."""
        ...

    def describe(self, rec: SandboxRecord) -> SandboxInfo:
        """The SandboxInfo of a record."""
        ...


class Closer(NodeBasics, Protocol):
    """A part that closes sandboxes (through the node: events, admission and connections stay right)."""

    async def close(self, sandbox_id: str, *, reason: str = "user") -> None:
        """Close a sandbox (idempotent)."""


class RecoveryHost(Closer, Protocol):
    """What `Recovery` (reconcile, adopt, reap) uses."""

    @property
    def events(self) -> EventLog: ...

    @property
    def layer_mounts(self) -> LayerMounts: ...

    async def heartbeat_leases(self, force: bool = False) -> None:
        """Renew the node's store leases (the reaper's round)."""

    async def finish_start_records(self) -> None:
        """Write the start records of layers recorded long enough (the reaper's round)."""

    async def watch_store(self) -> None:
        """Probe the store while sandboxes run (the reaper's round)."""


class PoolHost(Closer, Protocol):
    """What `WarmPool` uses: it starts sandboxes the node's way and hands them out as new ones."""

    @property
    def store(self) -> ImageStore: ...

    async def start_sandbox(self, spec: SandboxSpec, image: Image, *, extra: dict[str, Any] | None = None,
                            reservation: Reservation | None = None) -> SandboxInfo:
        """Start a new sandbox of a checked spec (admit, create, connect)."""
        ...

    def sandbox_created(self, rec: SandboxRecord) -> None:
        """Count a sandbox as created now (events, scheduling)."""


class SchedulingHost(NodeBasics, Protocol):
    """What `NodeScheduling` uses: the node's figures, records and its own pause."""

    async def pause(self, sandbox_id: str, reclaim: bool | None = None, *, by: str | None = None) -> None:
        """Pause a sandbox (the preemption and tides response)."""


class SnapshotHost(NodeBasics, Protocol):
    """What the file snapshots and forks (shoal.node.snapshot) use."""

    @property
    def store(self) -> ImageStore: ...

    @property
    def layer_mounts(self) -> LayerMounts: ...

    @property
    def locks(self) -> SandboxLocks: ...
