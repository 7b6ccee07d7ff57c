"""Helpers shared by the sandbox scenarios: the spec both systems get, timed loops, closing in bulk."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from shoal.bench.context import BenchContext
from shoal.models import SandboxInfo
from shoal.spec import SandboxSpec

if TYPE_CHECKING:
    import shoal

T = TypeVar("T")

#: what both systems are asked for: shoal's default sandbox (1 CPU, 1 GiB, 512 pids, no network)
SPEC_KW: dict[str, Any] = {"cpus": 1.0, "memory_mb": 1024, "pids": 512, "network": False}


def spec(ctx: BenchContext, **kw: Any) -> SandboxSpec:
    """The sandbox spec the scenarios create (same limits as the Docker containers get)."""
    return SandboxSpec(image=ctx.image, **{**SPEC_KW, **kw})


async def create_one(ctx: BenchContext) -> SandboxInfo:
    """One sandbox through the node (the embedded SDK's path minus its thin wrapper)."""
    return await ctx.node.create(spec(ctx))


async def docker_create_one(ctx: BenchContext) -> str:
    """One Docker container with the same limits, running `sleep infinity`."""
    assert ctx.docker is not None
    return await ctx.docker.create_start(memory_mb=SPEC_KW["memory_mb"], cpus=SPEC_KW["cpus"], pids=SPEC_KW["pids"])


async def close_all(ctx: BenchContext, ids: list[str], what: str = "closing sandboxes") -> float:
    """Close sandboxes with bounded parallelism; returns the seconds it took."""
    t0 = time.perf_counter()
    with ctx.task(what, len(ids)) as adv:
        await ctx.bounded([ctx.node.close(i) for i in ids], ctx.node.config.create_concurrency, adv)
    return time.perf_counter() - t0


async def docker_remove_all(ctx: BenchContext, cids: list[str], what: str = "removing Docker containers") -> float:
    """Remove Docker containers with bounded parallelism; returns the seconds it took."""
    if ctx.docker is None or not cids:
        return 0.0
    t0 = time.perf_counter()
    with ctx.task(what, len(cids)) as adv:
        await ctx.bounded([ctx.docker.remove(c) for c in cids], 16, adv)
    return time.perf_counter() - t0


@dataclass
class Timed:
    """Results of a timed closed loop: per-item latency and completion time, plus the items and errors."""

    latencies: list[float] = field(default_factory=list)
    done_at: list[float] = field(default_factory=list)
    items: list[Any] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    duration: float = 0.0
    wall: float = 0.0

    def rate(self) -> float:
        """Completions per second inside the measured window."""
        n = sum(1 for t in self.done_at if t <= self.duration)
        return n / self.duration if self.duration else 0.0


async def closed_loop(fn: Callable[[], Awaitable[Any]], concurrency: int, duration: float,
                      advance: Callable[..., None] | None = None, max_items: int | None = None,
                      on_item: Callable[[Any], Awaitable[Any]] | None = None) -> Timed:
    """`concurrency` workers call `fn` back to back for `duration` seconds (in-flight calls finish).
    `on_item(item)`, when given, is awaited by the worker after each success, before its next call (and
    outside the timed latency)."""
    out = Timed(duration=duration)
    t0 = time.perf_counter()
    stop_at = t0 + duration

    started = 0

    async def worker() -> None:
        nonlocal started
        while time.perf_counter() < stop_at and (max_items is None or started < max_items):
            started += 1
            s = time.perf_counter()
            try:
                item = await fn()
            except Exception as e:
                out.errors.append(f"{type(e).__name__}: {e}"[:300])
                continue
            e = time.perf_counter()
            out.latencies.append(e - s)
            out.done_at.append(e - t0)
            out.items.append(item)
            if advance:
                advance()
            if on_item is not None:
                await on_item(item)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    out.wall = time.perf_counter() - t0
    return out


def first_errors(errors: list[str], k: int = 3) -> list[str]:
    """The distinct first few error messages (for notes)."""
    seen: list[str] = []
    for e in errors:
        if e not in seen:
            seen.append(e)
        if len(seen) >= k:
            break
    return seen


async def gather_bounded(coros: list[Awaitable[T]], limit: int = 8) -> list[T]:
    """asyncio.gather with at most `limit` running at once (the first error is raised)."""
    sem = asyncio.Semaphore(limit)

    async def one(c: Awaitable[T]) -> T:
        async with sem:
            return await c

    return list(await asyncio.gather(*(one(c) for c in coros)))


def shoal_child_env(**extra: str) -> dict[str, str]:
    """The environment of a shoal process a scenario starts (a server, `shoal fncall serve`): this process's
    environment plus its settings' layer store (the run's, see run_bench) and `extra` — a child is configured
    through its own environment at its start, never by changing this process's."""
    import os

    from shoal.config import settings

    return {**os.environ, "SHOAL_STORE": str(settings().store), **extra}


@contextlib.asynccontextmanager
async def private_home(prefix: str) -> AsyncIterator[Path]:
    """A SHOAL_HOME of its own (short path: agent sockets live in it); emptied and removed afterwards."""
    home = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield home
    finally:
        from shoal.config import Paths
        from shoal.node.teardown import teardown_home

        await teardown_home(Paths.from_env(home), close_sandboxes=True)  # also what a failed run left
        shutil.rmtree(home, ignore_errors=True)


@contextlib.asynccontextmanager
async def private_client(ctx: BenchContext, prefix: str) -> AsyncIterator[shoal.Client]:
    """An embedded client on a node of its own (private SHOAL_HOME, the run's layer store), for scenarios
    that leave node-wide state behind (warm pools) which must not reach the next scenario."""
    import shoal
    from shoal.sdk.local import LocalTransport

    async with private_home(prefix) as home, \
            shoal.Client(transport=LocalTransport(home=str(home), store=str(ctx.node.paths.store))) as c:
        yield c
