"""The "microvm" backend: the first VM monitor of the VMM registry that can run here (Firecracker when it is
installed and KVM works, else QEMU's microvm machine), or the one SHOAL_VMM names."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.backends.registry import make_vmm_backend

if TYPE_CHECKING:
    from shoal.backends.base import Backend
    from shoal.backends.context import NodeContext


def make_microvm_backend(ctx: NodeContext, name: str = "microvm") -> Backend:
    """The backend object for "microvm" on this host (the registry's factory)."""
    return make_vmm_backend(ctx, name)
