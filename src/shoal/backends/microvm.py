"""The "microvm" backend: Firecracker when it is installed and KVM works here, else QEMU's microvm machine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.backends.base import Backend
from shoal.backends.firecracker import FirecrackerBackend, firecracker_usable
from shoal.backends.vm import QemuVmBackend

if TYPE_CHECKING:
    from shoal.node.context import NodeContext


def make_microvm_backend(ctx: NodeContext, name: str = "microvm") -> Backend:
    """The backend object for "microvm" on this host (the registry's factory)."""
    if firecracker_usable()[0]:
        return FirecrackerBackend(ctx, name)
    return QemuVmBackend(ctx, name)
