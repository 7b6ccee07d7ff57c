"""Transports carry SDK calls to a node: in-process (`LocalTransport`) or over HTTP (`HttpTransport`).

Like httpx's transports, this is the one seam between the user-facing API and where sandboxes live:
`Client` and `Sandbox` never know which one they talk to.
"""

from __future__ import annotations

import builtins
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from shoal.errors import ShoalError
from shoal.limits import DEFAULT_EXEC_TIMEOUT_S
from shoal.models import DirEntry, ExecResult, SandboxInfo, StreamEvent

if TYPE_CHECKING:
    from shoal.node.events import SandboxEvent
    from shoal.spec import SandboxSpec

#: a command: a shell string (run with bash -c) or an argv list
Cmd: TypeAlias = "str | list[str]"


class StreamHandle(Protocol):
    """A running command: iterate it for output, then an `exit` event; feed stdin; signal it."""

    def __aiter__(self) -> AsyncIterator[StreamEvent]: ...
    async def write_stdin(self, data: bytes) -> None: ...
    async def close_stdin(self) -> None: ...
    async def send_signal(self, sig: int) -> None: ...
    async def resize(self, rows: int, cols: int) -> None: ...
    async def wait(self) -> ExecResult: ...


class Transport(ABC):
    """Everything the SDK can ask of a node."""

    @abstractmethod
    async def start(self) -> None:
        """Connect / initialize."""

    @abstractmethod
    async def aclose(self) -> None:
        """Release connections (sandboxes keep running)."""

    @abstractmethod
    async def create(self, spec: SandboxSpec) -> SandboxInfo: ...

    @abstractmethod
    async def create_many(self, spec: SandboxSpec, n: int, *, all_or_nothing: bool = False
                          ) -> list[SandboxInfo | ShoalError]:
        """`n` sandboxes of `spec`, per-item results; `all_or_nothing`: all or GangUnsatisfiable / the first error
        (the Client passes the keyword only when it is true)."""

    @abstractmethod
    async def get(self, sandbox_id: str) -> SandboxInfo: ...

    @abstractmethod
    async def list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]: ...

    @abstractmethod
    async def close(self, sandbox_id: str) -> None: ...

    @abstractmethod
    async def exec(self, sandbox_id: str, cmd: Cmd, *, timeout: float | None = DEFAULT_EXEC_TIMEOUT_S,
                   cwd: str | None = None, env: dict[str, str] | None = None, user: str | None = None,
                   stdin: bytes | None = None, max_output: int | None = None) -> ExecResult: ...

    @abstractmethod
    async def stream(self, sandbox_id: str, cmd: Cmd, *, timeout: float | None = DEFAULT_EXEC_TIMEOUT_S,
                     cwd: str | None = None, env: dict[str, str] | None = None, user: str | None = None,
                     tty: bool = False, stdin: bool = False) -> StreamHandle: ...

    @abstractmethod
    async def read_file(self, sandbox_id: str, path: str) -> bytes: ...

    @abstractmethod
    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None: ...

    @abstractmethod
    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[DirEntry]: ...

    @abstractmethod
    async def shell_open(self, sandbox_id: str, *, cwd: str | None = None, env: dict[str, str] | None = None,
                         user: str | None = None) -> str: ...

    @abstractmethod
    async def shell_run(self, sandbox_id: str, shell_id: str, cmd: str, *,
                        timeout: float | None = DEFAULT_EXEC_TIMEOUT_S, max_output: int | None = None
                        ) -> ExecResult: ...

    @abstractmethod
    async def shell_close(self, sandbox_id: str, shell_id: str) -> None: ...

    @abstractmethod
    async def pause(self, sandbox_id: str) -> None: ...

    @abstractmethod
    async def resume(self, sandbox_id: str) -> None: ...

    async def set_cpu_class(self, sandbox_id: str, cpu_class: str) -> dict[str, Any]:
        """Move a running sandbox to another CPU class (`interactive` or `batch`); what was set."""
        from shoal.errors import NotImplementedYet

        raise NotImplementedYet("CPU classes are not available on this transport")

    async def snapshot(self, sandbox_id: str, name: str) -> dict[str, Any]:
        """Pack the sandbox's writable layer into a new image `name`."""
        from shoal.errors import NotImplementedYet

        raise NotImplementedYet("snapshot is not available on this transport")

    async def fork(self, sandbox_id: str, n: int, **kw: Any) -> builtins.list[SandboxInfo | ShoalError]:
        """Create `n` children from a snapshot of the sandbox."""
        from shoal.errors import NotImplementedYet

        raise NotImplementedYet("fork is not available on this transport")

    async def restore(self, name: str, n: int = 1, *, backend: str = "microvm"
                      ) -> builtins.list[SandboxInfo | ShoalError]:
        """`n` new sandboxes resumed from a named VM memory snapshot (per-item errors)."""
        from shoal.errors import NotImplementedYet

        raise NotImplementedYet("restoring memory snapshots is not available on this transport")

    async def pull(self, reference: str) -> dict[str, Any]:
        """Pull an image from its registry into the store (a PullReport as a dict)."""
        from shoal.errors import NotImplementedYet

        raise NotImplementedYet("pulling images is not available on this transport")

    async def export_image(self, image: str, path: str, tags: builtins.list[str] | None = None) -> None:
        """Write an image as a docker-archive to the local file `path`."""
        from shoal.errors import NotImplementedYet

        raise NotImplementedYet("exporting images is not available on this transport")

    async def push(self, image: str, target: str) -> dict[str, Any]:
        """Push an image of the store to a registry."""
        from shoal.errors import NotImplementedYet

        raise NotImplementedYet("pushing images is not available on this transport")

    async def images(self) -> builtins.list[dict[str, Any]]:
        """Images in the store."""
        from shoal.errors import NotImplementedYet

        raise NotImplementedYet("listing images is not available on this transport")

    async def image(self, ref: str) -> dict[str, Any]:
        """One image: name, tag, digest, layers, config (entrypoint, cmd, env, workdir, user, labels…)."""
        from shoal.errors import NotImplementedYet

        raise NotImplementedYet("looking up images is not available on this transport")

    async def build_image(self, tag: str, context: str, **opts: Any) -> dict[str, Any]:
        """Build a Dockerfile (`docker build` semantics) into image `tag`; see Client.build_image."""
        from shoal.errors import NotImplementedYet

        raise NotImplementedYet("building images is not available on this transport")

    async def events(self, sandbox_id: str | None = None, *, commands: bool = False,
                     kinds: builtins.list[str] | None = None, since: float | None = None,
                     limit: int = 200) -> builtins.list[SandboxEvent]:
        """A sandbox's events (or its commands), or the newest events of every visible sandbox."""
        from shoal.errors import NotImplementedYet

        raise NotImplementedYet("events are not available on this transport")

    async def run_code(self, code: str, **kw: Any) -> Any:
        """Run a snippet on the fncall backend."""
        from shoal.errors import NotImplementedYet

        raise NotImplementedYet("run_code is not available on this transport")

    async def run_code_many(self, items: builtins.list[Any], **kw: Any) -> builtins.list[Any]:
        """Run many snippets on the fncall backend; one result per item, in order."""
        from shoal.errors import NotImplementedYet

        raise NotImplementedYet("run_code_many is not available on this transport")
