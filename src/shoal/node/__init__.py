"""The node agent: the only part of shoal that touches the host (mounts, cgroups, runtimes)."""
