"""Thin, typed wrappers over the host facilities shoal uses (mount, processes, cgroups)."""
