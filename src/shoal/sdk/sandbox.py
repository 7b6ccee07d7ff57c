"""Handles returned by the Client: a `Sandbox` and its persistent `Shell`s."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from shoal.errors import ShoalError
from shoal.limits import DEFAULT_EXEC_TIMEOUT_S
from shoal.models import DirEntry, ExecResult, SandboxInfo, StreamEvent
from shoal.sdk.transport import StreamHandle, Transport

if TYPE_CHECKING:
    from shoal.sdk.client import Client

#: how long exec/stream/shell commands may run unless told (seconds; shoal.limits)
DEFAULT_TIMEOUT = DEFAULT_EXEC_TIMEOUT_S


class Shell:
    """A persistent bash session: cwd, environment, functions and an activated venv carry over."""

    def __init__(self, sandbox: Sandbox, shell_id: str) -> None:
        self.sandbox = sandbox
        self.id = shell_id

    async def run(self, cmd: str, timeout: float | None = DEFAULT_TIMEOUT) -> ExecResult:
        """Run one command in the session. A timeout interrupts the command; the shell lives on."""
        return await self.sandbox._t.shell_run(self.sandbox.id, self.id, cmd, timeout=timeout)

    async def close(self) -> None:
        """End the session (kills what still runs in it)."""
        await self.sandbox._t.shell_close(self.sandbox.id, self.id)

    async def __aenter__(self) -> Shell:
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.close()
        except ShoalError:
            pass


class Stream:
    """A running command: `async for ev in stream` yields output then one exit event."""

    def __init__(self, handle: StreamHandle) -> None:
        self._h = handle
        self.result: ExecResult | None = None

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[StreamEvent]:
        async for ev in self._h:
            if ev.kind == "exit":
                self.result = ev.result
            yield ev

    async def write(self, data: bytes | str) -> None:
        """Send bytes to the command's stdin (or PTY)."""
        await self._h.write_stdin(data.encode() if isinstance(data, str) else data)

    async def close_stdin(self) -> None:
        """Signal end of input."""
        await self._h.close_stdin()

    async def signal(self, sig: int) -> None:
        """Send a signal (e.g. signal.SIGINT) to the command's process group."""
        await self._h.send_signal(int(sig))

    async def resize(self, rows: int, cols: int) -> None:
        """Resize the PTY (tty=True only)."""
        await self._h.resize(rows, cols)

    async def wait(self) -> ExecResult:
        """Discard the remaining output and return the result."""
        self.result = await self._h.wait()
        return self.result

    async def kill(self) -> None:
        """SIGKILL the command's process group (it then ends with exit code 137)."""
        import signal as _signal

        await self._h.send_signal(int(_signal.SIGKILL))

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        # leaving the block early must not leave the command running unseen in the sandbox
        if self.result is None:
            try:
                await self.kill()
                await self.wait()
            except ShoalError:
                pass


class Sandbox:
    """One isolated, stateful sandbox. Get it from `Client.create()`; `await sb.close()` when done."""

    def __init__(self, client: Client, info: SandboxInfo) -> None:
        self._client = client
        self._t: Transport = client._transport
        self.info = info

    @property
    def id(self) -> str:
        """The sandbox ID (encodes the node that owns it)."""
        return self.info.id

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} image={self.info.image} backend={self.info.backend} state={self.info.state}>"

    async def exec(self, cmd: str | list[str], timeout: float | None = DEFAULT_TIMEOUT, cwd: str | None = None,
                   env: dict[str, str] | None = None, user: str | None = None,
                   stdin: bytes | str | None = None) -> ExecResult:
        """Run a command to completion (a string runs under bash -c; a list is an argv)."""
        if isinstance(stdin, str):
            stdin = stdin.encode()
        return await self._t.exec(self.id, cmd, timeout=timeout, cwd=cwd, env=env, user=user, stdin=stdin)

    async def stream(self, cmd: str | list[str], timeout: float | None = DEFAULT_TIMEOUT, cwd: str | None = None,
                     env: dict[str, str] | None = None, user: str | None = None, tty: bool = False,
                     stdin: bool = False) -> Stream:
        """Start a command and get its output as it is produced (`async for ev in await sb.stream(...)`)."""
        h = await self._t.stream(self.id, cmd, timeout=timeout, cwd=cwd, env=env, user=user, tty=tty, stdin=stdin)
        return Stream(h)

    async def shell(self, cwd: str | None = None, env: dict[str, str] | None = None,
                    user: str | None = None) -> Shell:
        """Open a persistent bash session."""
        return Shell(self, await self._t.shell_open(self.id, cwd=cwd, env=env, user=user))

    async def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        """Write a file (atomically; parent directories are created)."""
        await self._t.write_file(self.id, path, data.encode() if isinstance(data, str) else data, mode)

    async def read_file(self, path: str) -> bytes:
        """Read a file's bytes."""
        return await self._t.read_file(self.id, path)

    async def list_dir(self, path: str = ".") -> list[DirEntry]:
        """List a directory (sorted by name)."""
        return await self._t.list_dir(self.id, path)

    async def pause(self) -> None:
        """Freeze the sandbox and let the node reclaim its memory; any later request resumes it."""
        await self._t.pause(self.id)

    async def resume(self) -> None:
        """Thaw the sandbox."""
        await self._t.resume(self.id)

    async def set_cpu_class(self, cpu_class: str) -> dict[str, Any]:
        """Move the running sandbox to another CPU class, `interactive` or `batch` (e.g. around a test suite it
        runs; docs/sandboxes.md#cpu-classes). Container backend only: Unsupported elsewhere. Returns what was
        set (`refresh()` reads the spec with its new class)."""
        return await self._t.set_cpu_class(self.id, cpu_class)

    async def snapshot(self, name: str) -> dict[str, Any]:
        """Save the sandbox's files as a new image `name` (create from it = fork)."""
        return await self._t.snapshot(self.id, name)

    async def fork(self, n: int = 1, **kw: Any) -> list[Sandbox]:
        """`n` independent children starting from this sandbox's current files (the parent keeps running).

        Options: `name` (tag of the intermediate snapshot), `memory=True` (processes and memory too, on
        backends that can checkpoint them; BackendUnavailable otherwise), and spec overrides for the
        children (`cpus`, `memory_mb`, `ttl_s`, `labels`, ...). If any child fails, the first error is
        raised (the children that were made stay owned by the client and close with it).
        """
        items = await self._t.fork(self.id, n, **kw)
        out: list[Sandbox] = []
        # every child that was made is owned before any error is raised: one failed child must not
        # leave the good ones after it running past the client's close
        for it in items:
            if isinstance(it, SandboxInfo):
                sb = Sandbox(self._client, it)
                self._client._owned.add(sb.id)
                out.append(sb)
        for it in items:
            if isinstance(it, ShoalError):
                raise it
        return out

    async def events(self, *, commands: bool = False) -> list[Any]:
        """This sandbox's events (created, paused, resumed, oom, timeout, lost, closed), or with `commands`
        the commands it ran with exit codes and durations; oldest first."""
        return await self._client.transport.events(self.id, commands=commands)

    async def refresh(self) -> SandboxInfo:
        """Re-read the sandbox's info (state, expiry)."""
        self.info = await self._t.get(self.id)
        return self.info

    async def close(self) -> None:
        """Destroy the sandbox and everything it had."""
        await self._t.close(self.id)
        self._client._owned.discard(self.id)

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
