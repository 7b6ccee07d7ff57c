"""The node's data plane: exec, streams, files and shells, through the in-sandbox agent.

These are the same on every backend (one agent, one protocol), so they live apart from the node's
control plane (create, close, pause, snapshot). `Node` mixes this class in; it supplies `core` (shoal.node.core:
records, `client` and `call`, which resume a paused sandbox and report a dead one).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from shoal.errors import InvalidRequest
from shoal.limits import (
    DEFAULT_EXEC_TIMEOUT_S,
    MAX_EXEC_TIMEOUT_S,
    check_env,
    output_limit,
)
from shoal.models import DirEntry, ExecResult

if TYPE_CHECKING:
    from shoal.agentproto.client import AgentClient
    from shoal.agentproto.relay import PortStream, WatchStream
    from shoal.node.core import NodeCore
    from shoal.records import SandboxRecord


class DataPlane:
    """exec / stream / files / shells of a node's sandboxes."""

    #: the node's internals (shoal.node.core.NodeCore): records, agent connections, events
    core: NodeCore
    #: image digest -> the shell its string commands run with (see shell_of)
    _image_shells: dict[str, str]

    def _log_command(self, rec: SandboxRecord, cmd: str | list[str], r: ExecResult, t0: float, via: str) -> None:
        # one line in the command log; a command killed by SIGKILL may have been the OOM killer's victim
        self.core.events.command(rec.id, rec.project, cmd, exit_code=r.exit_code,
                                 duration_s=time.perf_counter() - t0, timed_out=r.timed_out, via=via, signal=r.signal)
        if r.signal == 9 or r.exit_code == 137:
            self.core.check_oom(rec, cmd=cmd, when=f"{via} killed by SIGKILL")

    # ---- commands -------------------------------------------------------------------------------
    async def shell_of(self, rec: SandboxRecord) -> str:
        """The shell string commands run with in this sandbox: /bin/bash where its image has bash, else
        /bin/sh (busybox, alpine), decided once per image on this node by asking the agent (lstat inside
        the sandbox, so symlinked /bin of merged-usr images resolves as the image has it). The node
        setting `sh` forces /bin/sh. NoShell when the image has neither."""
        if self.core.config.posix_sh:
            return "/bin/sh"
        cache = self._image_shells
        key = rec.image_digest or rec.image
        shell = cache.get(key)
        if shell is None:
            shell = await self._probe_shell(rec)
            if len(cache) > 4096:
                cache.clear()
            cache[key] = shell
        return shell

    async def _probe_shell(self, rec: SandboxRecord) -> str:
        from shoal.errors import FileNotFound, NoShell

        fixed = getattr(self.core.backend(rec.backend), "string_shell", None)
        if fixed is not None:  # a backend whose commands do not run in the image (the fake one)
            return str(fixed(rec))
        for shell in ("/bin/bash", "/bin/sh"):
            def look(c: AgentClient, path: str = shell) -> Any:
                return c.stat(path)

            try:
                await self.core.call(rec, look)
                return shell
            except FileNotFound:
                continue
            except InvalidRequest:
                return shell  # it is there but cannot be looked at (permissions): let exec say what is wrong
        raise NoShell(f"image {rec.image} has neither /bin/bash nor /bin/sh, so a command given as a string "
                      "cannot run: pass it as an argv list, e.g. exec(['/usr/bin/python3', '-c', 'print(1)'])",
                      image=rec.image)

    async def exec(self, sandbox_id: str, cmd: str | list[str], *, timeout: float | None = DEFAULT_EXEC_TIMEOUT_S,
                   cwd: str | None = None, env: dict[str, str] | None = None, user: str | None = None,
                   stdin: bytes | None = None, max_output: int | None = None) -> ExecResult:
        """Run a command to completion in the sandbox."""
        _argv(cmd, "/bin/sh")  # a bad command fails before the record is read
        rec = self.core.record(sandbox_id)
        argv = _argv(cmd, await self.shell_of(rec) if isinstance(cmd, str) else "")
        cwd, user = _exec_defaults(rec, cwd, user)
        cap = _output_cap(rec, max_output)
        check_env(env)
        check_timeout(timeout)
        t0 = time.perf_counter()
        r: ExecResult = await self.core.call(rec, lambda c: c.exec(
            argv, env=env, cwd=cwd, user=user, timeout=timeout, max_output=cap, stdin=stdin))
        self._log_command(rec, cmd, r, t0, "exec")
        await self.core.after_command(rec)
        return r

    async def stream(self, sandbox_id: str, cmd: str | list[str], *, timeout: float | None = DEFAULT_EXEC_TIMEOUT_S,
                     cwd: str | None = None, env: dict[str, str] | None = None, user: str | None = None,
                     tty: bool = False, stdin: bool = False, max_output: int | None = None) -> Any:
        """Start a command and return its stream handle (async iterator of StreamEvent). `max_output` caps
        each output stream (bytes, 0 = no cap; default: the sandbox's `max_output_bytes`)."""
        _argv(cmd, "/bin/sh")
        rec = self.core.record(sandbox_id)
        argv = _argv(cmd, await self.shell_of(rec) if isinstance(cmd, str) else "")
        cwd, user = _exec_defaults(rec, cwd, user)
        check_env(env)
        check_timeout(timeout)
        c = await self.core.client(sandbox_id, rec)
        # a stream is not held in memory (backpressure bounds it): the spec's cap as it is, 0 = all of it
        cap = int(rec.spec.max_output_bytes) if max_output is None else max_output
        t0 = time.perf_counter()
        h = await c.exec_stream(argv, env=env, cwd=cwd, user=user, timeout=timeout, max_output=cap,
                                tty=tty, stdin=stdin)
        if not self.core.events.commands_enabled:
            return h
        return LoggedStream(h, lambda r: self._log_command(rec, cmd, r, t0, "tty" if tty else "stream"))

    # ---- files ----------------------------------------------------------------------------------
    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        """Read a whole file from the sandbox (relative paths start at the sandbox's workdir)."""
        rec = self.core.record(sandbox_id)
        path = _abspath(rec, path)
        return await self.core.call(rec, lambda c: c.read_file(path, limit=self.core.config.max_file_bytes))

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file in the sandbox (atomically; parent directories are created)."""
        rec = self.core.record(sandbox_id)
        path = _abspath(rec, path)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidRequest("data must be bytes")
        if len(data) > self.core.config.max_file_bytes:
            raise InvalidRequest(f"file too large ({len(data)} bytes > {self.core.config.max_file_bytes})")
        await self.core.call(rec, lambda c: c.write_file(path, bytes(data), mode=mode))

    async def write_file_stream(self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes],
                                mode: int = 0o644) -> None:
        """Write a file in the sandbox from chunks as they come (atomically; parent directories are created):
        the node holds one chunk at a time. More than the node's largest file is refused (InvalidRequest)."""
        rec = self.core.record(sandbox_id)
        path = _abspath(rec, path)
        cap = self.core.config.max_file_bytes

        async def bounded() -> AsyncIterator[bytes]:
            total = 0
            async for chunk in chunks:
                total += len(chunk)
                if total > cap:
                    raise InvalidRequest(f"file too large (more than {cap} bytes)")
                yield chunk

        await self.core.call(rec, lambda c: c.write_file_stream(path, bounded(), mode=mode))

    async def list_dir(self, sandbox_id: str, path: str) -> list[DirEntry]:
        """List a directory in the sandbox."""
        rec = self.core.record(sandbox_id)
        path = _abspath(rec, path)
        return await self.core.call(rec, lambda c: c.list_dir(path))

    # ---- shells ---------------------------------------------------------------------------------
    async def shell_open(self, sandbox_id: str, *, cwd: str | None = None, env: dict[str, str] | None = None,
                         user: str | None = None) -> str:
        """Start a persistent bash session in the sandbox; returns its id."""
        rec = self.core.record(sandbox_id)
        if not self.core.config.posix_sh and await self.shell_of(rec) != "/bin/bash":
            from shoal.errors import NoShell

            raise NoShell(f"persistent shells run bash, and image {rec.image} has only /bin/sh: use exec() or "
                          "stream() (string commands run with /bin/sh there)", image=rec.image)
        cwd, user = _exec_defaults(rec, cwd, user)
        check_env(env)
        return await self.core.call(rec, lambda c: c.shell_open(cwd=cwd, env=env, user=user))

    async def shell_run(self, sandbox_id: str, shell_id: str, cmd: str, *,
                        timeout: float | None = DEFAULT_EXEC_TIMEOUT_S, max_output: int | None = None) -> ExecResult:
        """Run one command in a shell session; state (cwd, env, functions) carries over."""
        if not isinstance(cmd, str):
            raise InvalidRequest("shell commands are strings")
        check_timeout(timeout)
        rec = self.core.record(sandbox_id)
        cap = _output_cap(rec, max_output)
        t0 = time.perf_counter()
        r: ExecResult = await self.core.call(rec, lambda c: c.shell_run(shell_id, cmd, timeout=timeout, max_output=cap))
        self._log_command(rec, cmd, r, t0, "shell")
        return r

    async def shell_close(self, sandbox_id: str, shell_id: str) -> None:
        """End a shell session and its processes."""
        rec = self.core.record(sandbox_id)
        await self.core.call(rec, lambda c: c.shell_close(shell_id))

    # ---- ports and watches ----------------------------------------------------------------------
    async def open_port(self, sandbox_id: str, port: int, *, timeout: float | None = 10.0) -> PortStream:
        """A TCP connection to `port` on the sandbox's own loopback, opened by its agent from inside (so also
        for sandboxes without a network, and VMs). Nothing listening → PortNotOpen."""
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise InvalidRequest(f"port must be an integer between 1 and 65535, not {port!r}")
        rec = self.core.record(sandbox_id)
        return await self.core.call(rec, lambda c: c.tcp_connect(port, timeout=timeout))

    async def watch(self, sandbox_id: str, path: str, *, recursive: bool = False) -> WatchStream:
        """inotify events of a directory in the sandbox (relative paths start at its workdir)."""
        rec = self.core.record(sandbox_id)
        path = _abspath(rec, path)
        return await self.core.call(rec, lambda c: c.watch(path, recursive=recursive))


class LoggedStream:
    """A stream handle that reports its result once, when the exit event (or `wait()`) delivers it; every
    other attribute is the wrapped handle's."""

    def __init__(self, inner: Any, on_exit: Callable[[ExecResult], None]) -> None:
        self._inner = inner
        self._on_exit: Callable[[ExecResult], None] | None = on_exit

    def _done(self, r: ExecResult | None) -> None:
        cb, self._on_exit = self._on_exit, None
        if cb is not None and r is not None:
            cb(r)

    def __aiter__(self) -> LoggedStream:
        return self

    async def __anext__(self) -> Any:
        ev = await self._inner.__anext__()
        if ev.kind == "exit":
            self._done(ev.result)
        return ev

    async def wait(self) -> ExecResult:
        """The wrapped handle's wait(), reported."""
        r: ExecResult = await self._inner.wait()
        self._done(r)
        return r

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _argv(cmd: str | list[str], shell: str) -> list[str]:
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidRequest("command is empty")
        return [shell, "-c", cmd]
    if not cmd or not all(isinstance(a, str) for a in cmd):
        raise InvalidRequest("command must be a non-empty string or list of strings")
    return list(cmd)


def _exec_defaults(rec: SandboxRecord, cwd: str | None, user: str | None) -> tuple[str, str | None]:
    spec = rec.spec
    return (cwd or spec.workdir or rec.extra.get("workdir") or "/",
            user or spec.user or rec.extra.get("user") or None)


def _output_cap(rec: SandboxRecord, asked: int | None = None) -> int:
    """Output bytes per stream kept for one command run to completion: what the call or the spec asks
    (0: as much as allowed), never more than the sandbox's memory allows (spec.output_limit)."""
    limit = output_limit(int(rec.spec.memory_mb or 1024))
    cap = int(rec.spec.max_output_bytes) if asked is None else int(asked)
    if cap < 0:
        raise InvalidRequest(f"max_output={asked!r} must be 0 or more bytes")
    if cap > limit:
        raise InvalidRequest(f"max_output={cap} is over this sandbox's limit of {limit} bytes per stream (an "
                             "eighth of its memory, at most 256 MiB): stream the command to see more",
                             limit_bytes=limit)
    return cap or limit


def _abspath(rec: SandboxRecord, path: str) -> str:
    if isinstance(path, str) and path and not path.startswith("/"):
        path = _exec_defaults(rec, None, None)[0].rstrip("/") + "/" + path
    check_path(path)
    return path


def check_timeout(timeout: float | None) -> None:
    """A command timeout: positive seconds up to MAX_EXEC_TIMEOUT_S, or None (no limit)."""
    if timeout is not None and not (0 < float(timeout) <= MAX_EXEC_TIMEOUT_S):
        raise InvalidRequest(f"timeout={timeout!r} must be positive seconds (at most 7 days) or None")


def check_path(path: str) -> None:
    """A path inside the sandbox: absolute, no NUL, at most 4096 bytes."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise InvalidRequest(f"path {path!r} must be an absolute path inside the sandbox")
    if len(path) > 4096:
        raise InvalidRequest("path longer than 4096 bytes")
