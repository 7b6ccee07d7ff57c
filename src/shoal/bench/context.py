"""What every scenario gets besides its parameters: an embedded node on a private SHOAL_HOME, the Docker engine
(if any), where figures go, and progress reporting."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    import shoal
    from shoal.bench.docker import DockerEngine
    from shoal.node.node import Node

T = TypeVar("T")


@dataclass
class BenchContext:
    """Shared state of one `shoal bench` run."""

    client: shoal.Client
    node: Node
    home: Path
    #: the run was asked for --quick (each scenario's parameters already hold their quick values)
    quick: bool
    console: Console
    docker: DockerEngine | None = None
    #: why there is no Docker engine ("" when there is one)
    docker_reason: str = ""
    plot_dir: Path | None = None
    image: str = "base"
    progress: Progress | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def docker_status(self) -> str:
        """'ran' or 'absent: …' for ScenarioResult.docker."""
        return "ran" if self.docker is not None else f"absent: {self.docker_reason}"

    def log(self, msg: str) -> None:
        """A line above the progress bars."""
        self.console.print(f"  [dim]{msg}[/dim]")

    @contextlib.contextmanager
    def task(self, description: str, total: float | None) -> Iterator[Callable[..., None]]:
        """A progress bar for one phase; yields `advance(n=1)`."""
        if self.progress is None:
            yield lambda n=1: None
            return
        tid = self.progress.add_task(description, total=total)

        def advance(n: float = 1) -> None:
            self.progress.advance(tid, n)

        try:
            yield advance
        finally:
            self.progress.remove_task(tid)

    async def bounded(self, coros: list[Awaitable[T]], limit: int, advance: Callable[..., None] | None = None
                      ) -> list[T | BaseException]:
        """Run coroutines with at most `limit` at once; exceptions are returned, not raised."""
        sem = asyncio.Semaphore(limit)

        async def one(c: Awaitable[T]) -> T | BaseException:
            async with sem:
                try:
                    return await c
                except Exception as e:
                    return e
                finally:
                    if advance:
                        advance()

        return list(await asyncio.gather(*(one(c) for c in coros)))

    def figure_path(self, name: str) -> Path:
        """Where a PNG figure goes (call it only when `plot_dir` is set: --plot was given)."""
        if self.plot_dir is None:
            raise RuntimeError(f"figure {name}: no --plot directory (check ctx.plot_dir before drawing)")
        self.plot_dir.mkdir(parents=True, exist_ok=True)
        return self.plot_dir / name


def make_progress(console: Console) -> Progress:
    """The progress display used for long phases."""
    return Progress(TextColumn("  {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)


class Stopwatch:
    """perf_counter-based timings relative to one start."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        """Seconds since start."""
        return time.perf_counter() - self.t0
