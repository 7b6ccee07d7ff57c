"""The `shoal` command line."""
