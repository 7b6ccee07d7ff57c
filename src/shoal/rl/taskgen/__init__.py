"""Mutation-based task generation from real PyPI projects (see generate.py and projects.toml)."""
