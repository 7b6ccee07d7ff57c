"""Shared CLI plumbing: a client for the command, error reporting, rich console."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rich.console import Console

from shoal.errors import ShoalError

console = Console()
# soft_wrap: error messages stay on one line (no breaks inside words or paths) whatever the terminal width
err_console = Console(stderr=True, soft_wrap=True)
T = TypeVar("T")


def make_client(url: str | None = None, keep: bool = True) -> Any:
    """A Client for one CLI command: remote when --url/SHOAL_URL is set, else embedded (no reaper)."""
    from shoal.config import settings
    from shoal.sdk.client import Client

    s = settings()
    url = url or s.url
    if url:
        return Client(url, token=s.token, keep=keep)
    from shoal.sdk.local import LocalTransport

    return Client(transport=LocalTransport(reap=False), keep=keep)


def run_async(fn: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine for a CLI command; typed shoal errors become one red line and exit code 1."""
    try:
        return asyncio.run(fn())
    except ShoalError as e:
        err_console.print(f"[red]error:[/red] {e.message}")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
