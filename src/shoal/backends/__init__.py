"""Sandbox backends: container (OCI runtime), microvm and vm (QEMU), fncall (warm pools)."""
