"""`SyncClient`: the async Client's exact surface, blocking. Its Client runs on a `Bridge` (an event loop in a
private thread). `shared_client()` is one process-wide SyncClient for blocking callers that do not own one."""

from __future__ import annotations

import atexit
import builtins
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

from shoal.errors import ShoalError
from shoal.limits import DEFAULT_EXEC_TIMEOUT_S
from shoal.models import DirEntry, ExecResult, SandboxInfo, StreamEvent
from shoal.sdk.bridge import Bridge
from shoal.sdk.client import Client
from shoal.sdk.jobs import Job
from shoal.sdk.sandbox import Sandbox, Shell, Stream

T = TypeVar("T")


async def _anext(it: AsyncIterator[T]) -> T:
    return await it.__anext__()


class SyncShell:
    """Blocking twin of Shell."""

    def __init__(self, loop: Bridge, shell: Shell) -> None:
        self._loop, self._s = loop, shell
        self.id = shell.id

    def run(self, cmd: str, timeout: float | None = DEFAULT_EXEC_TIMEOUT_S) -> ExecResult:
        """Run one command in the session."""
        return self._loop.run(self._s.run(cmd, timeout=timeout))

    def close(self) -> None:
        """End the session."""
        self._loop.run(self._s.close())

    def __enter__(self) -> SyncShell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncStream:
    """Blocking twin of Stream: iterate for events."""

    def __init__(self, loop: Bridge, stream: Stream) -> None:
        self._loop, self._s = loop, stream
        self._it = stream.__aiter__()

    def __iter__(self) -> Iterator[StreamEvent]:
        while True:
            try:
                yield self._loop.run(_anext(self._it))
            except StopAsyncIteration:
                return

    @property
    def result(self) -> ExecResult | None:
        """The exit result once iteration finished."""
        return self._s.result

    def write(self, data: bytes | str) -> None:
        """Send stdin bytes."""
        self._loop.run(self._s.write(data))

    def close_stdin(self) -> None:
        """End of input."""
        self._loop.run(self._s.close_stdin())

    def signal(self, sig: int) -> None:
        """Send a signal."""
        self._loop.run(self._s.signal(sig))

    def wait(self) -> ExecResult:
        """Discard remaining output; return the result."""
        return self._loop.run(self._s.wait())

    def resize(self, rows: int, cols: int) -> None:
        """Resize the PTY (tty=True only)."""
        self._loop.run(self._s.resize(rows, cols))

    def kill(self) -> None:
        """SIGKILL the command's process group."""
        self._loop.run(self._s.kill())


class SyncSandbox:
    """Blocking twin of Sandbox."""

    def __init__(self, loop: Bridge, sb: Sandbox) -> None:
        self._loop, self._sb = loop, sb

    @property
    def id(self) -> str:
        """Sandbox ID."""
        return self._sb.id

    @property
    def info(self) -> SandboxInfo:
        """Last known info."""
        return self._sb.info

    def __repr__(self) -> str:
        return repr(self._sb).replace("<Sandbox", "<SyncSandbox")

    def exec(self, cmd: str | list[str], **kw: Any) -> ExecResult:
        """Run a command to completion."""
        return self._loop.run(self._sb.exec(cmd, **kw))

    def stream(self, cmd: str | list[str], **kw: Any) -> SyncStream:
        """Start a command; iterate the result for output events."""
        return SyncStream(self._loop, self._loop.run(self._sb.stream(cmd, **kw)))

    def shell(self, **kw: Any) -> SyncShell:
        """Open a persistent bash session."""
        return SyncShell(self._loop, self._loop.run(self._sb.shell(**kw)))

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write a file."""
        self._loop.run(self._sb.write_file(path, data, mode))

    def read_file(self, path: str) -> bytes:
        """Read a file."""
        return self._loop.run(self._sb.read_file(path))

    def list_dir(self, path: str = ".") -> list[DirEntry]:
        """List a directory."""
        return self._loop.run(self._sb.list_dir(path))

    def events(self, *, commands: bool = False) -> list[Any]:
        """This sandbox's events (or commands), oldest first."""
        return self._loop.run(self._sb.events(commands=commands))

    def pause(self) -> None:
        """Freeze."""
        self._loop.run(self._sb.pause())

    def resume(self) -> None:
        """Thaw."""
        self._loop.run(self._sb.resume())

    def snapshot(self, name: str) -> dict[str, Any]:
        """Save as a new image."""
        return self._loop.run(self._sb.snapshot(name))

    def fork(self, n: int = 1, **kw: Any) -> list[SyncSandbox]:
        """Children from a snapshot."""
        return [SyncSandbox(self._loop, s) for s in self._loop.run(self._sb.fork(n, **kw))]

    def close(self) -> None:
        """Destroy the sandbox."""
        self._loop.run(self._sb.close())

    def __enter__(self) -> SyncSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SyncJob:
    """Blocking twin of shoal.sdk.jobs.Job."""

    def __init__(self, loop: Bridge, job: Job) -> None:
        self._loop, self._job = loop, job
        self.name = job.name
        self.labels = job.labels

    def create(self, image: str = "base", **kw: Any) -> SyncSandbox:
        """Create one sandbox of the job."""
        return SyncSandbox(self._loop, self._loop.run(self._job.create(image, **kw)))

    def create_many(self, image: str = "base", n: int = 1, **kw: Any) -> list[SyncSandbox | ShoalError]:
        """Create a burst of the job's sandboxes (all_or_nothing=True: all or GangUnsatisfiable)."""
        items = self._loop.run(self._job.create_many(image, n, **kw))
        return [SyncSandbox(self._loop, it) if isinstance(it, Sandbox) else it for it in items]

    def list(self) -> list[SandboxInfo]:
        """The job's sandboxes."""
        return self._loop.run(self._job.list())

    def close_all(self) -> int:
        """Close the job's sandboxes."""
        return self._loop.run(self._job.close_all())


class SyncClient:
    """Blocking twin of `shoal.Client` (same arguments, same methods)."""

    def __init__(self, url: str | None = None, **kw: Any) -> None:
        self._loop = Bridge("shoal-sync")
        self._client = Client(url, **kw)
        self._closed = False

    @property
    def bridge(self) -> Bridge:
        """The event loop this client's async work runs on (run other coroutines that use it there)."""
        return self._loop

    @property
    def async_client(self) -> Client:
        """The async Client underneath; await its methods only on `bridge` (`bridge.run(coro)`)."""
        return self._client

    def create(self, image: str = "base", **kw: Any) -> SyncSandbox:
        """Create one sandbox."""
        return SyncSandbox(self._loop, self._loop.run(self._client.create(image, **kw)))

    def create_many(self, image: str = "base", n: int = 1, **kw: Any) -> list[SyncSandbox | ShoalError]:
        """Create a burst of sandboxes; per-item errors."""
        items = self._loop.run(self._client.create_many(image, n, **kw))
        return [SyncSandbox(self._loop, it) if isinstance(it, Sandbox) else it for it in items]

    def job(self, name: str, **kw: Any) -> SyncJob:
        """A job (see Client.job): create, list and close its sandboxes."""
        return SyncJob(self._loop, self._client.job(name, **kw))

    def get(self, sandbox_id: str) -> SyncSandbox:
        """Handle to an existing sandbox."""
        return SyncSandbox(self._loop, self._loop.run(self._client.get(sandbox_id)))

    def list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        """Every visible sandbox."""
        return self._loop.run(self._client.list(labels))

    def images(self) -> builtins.list[dict[str, Any]]:
        """Images in the store."""
        return self._loop.run(self._client.images())

    def build_image(self, tag: str, context: str = ".", **kw: Any) -> dict[str, Any]:
        """Build a Dockerfile into image `tag` (see Client.build_image)."""
        return self._loop.run(self._client.build_image(tag, context, **kw))

    def pull(self, reference: str) -> dict[str, Any]:
        """Pull an image from its registry (see Client.pull)."""
        return self._loop.run(self._client.pull(reference))

    def export_image(self, image: str, path: str, *, tags: builtins.list[str] | None = None) -> None:
        """Write an image as a docker-archive (see Client.export_image)."""
        self._loop.run(self._client.export_image(image, path, tags=tags))

    def push(self, image: str, target: str) -> dict[str, Any]:
        """Push an image to a registry (see Client.push)."""
        return self._loop.run(self._client.push(image, target))

    def events(self, sandbox_id: str | None = None, **kw: Any) -> builtins.list[Any]:
        """The event log (see Client.events)."""
        return self._loop.run(self._client.events(sandbox_id, **kw))

    def run_code(self, code: str, language: str = "python", **kw: Any) -> Any:
        """Run a snippet on the fncall backend."""
        return self._loop.run(self._client.run_code(code, language=language, **kw))

    def run_code_many(self, items: builtins.list[Any], **kw: Any) -> builtins.list[Any]:
        """Run many snippets concurrently on the fncall backend; one result per item."""
        return self._loop.run(self._client.run_code_many(items, **kw))

    def close(self, timeout: float | None = None) -> None:
        """Close owned sandboxes and the transport (waiting at most `timeout` s); stop the loop thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run(self._client.aclose(), timeout)
        finally:
            self._loop.close()

    def __enter__(self) -> SyncClient:
        self._loop.run(self._client.__aenter__())
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_shared: SyncClient | None = None
_shared_lock = threading.Lock()
_at_exit = False


def shared_client() -> SyncClient:
    """The process-wide embedded SyncClient (made on first use; its sandboxes are closed at interpreter exit
    or by `close_shared_client()`). For blocking callers that do not own a client, e.g. the RL adapters."""
    global _shared, _at_exit
    with _shared_lock:
        if _shared is None:
            _shared = SyncClient()
            if not _at_exit:
                atexit.register(close_shared_client)
                _at_exit = True
        return _shared


def close_shared_client() -> None:
    """Close the process-wide SyncClient and its sandboxes (safe to call twice; errors are not raised:
    it runs at interpreter exit)."""
    global _shared
    with _shared_lock:
        c, _shared = _shared, None
    if c is not None:
        with contextlib.suppress(Exception):
            c.close(timeout=120)
