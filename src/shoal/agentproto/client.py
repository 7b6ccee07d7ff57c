"""Asyncio client of the in-sandbox agent (docs/protocol.md).

One :class:`AgentClient` owns one connection. A single reader task demultiplexes frames into
per-stream queues, so any number of requests run concurrently on the connection. When the
connection dies, every pending request fails promptly with :class:`SandboxError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import AsyncIterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.errors import (
    AgentProtocolError,
    InvalidRequest,
    SandboxError,
    Timeout,
)
from shoal.limits import AGENT_CONNECT_TIMEOUT_S
from shoal.models import DirEntry, ExecResult, StreamEvent

from . import frames as F
from .errors import agent_error
from .relay import PortStream, WatchStream

DEFAULT_MAX_OUTPUT = 1 << 20
_READ_SIZE = 1 << 18
# Output a consumer has not taken yet, per stream: past _HIGH the connection stops reading (the agent's
# socket, then the command's pipe, fill up and the command waits) until the consumer is down to _LOW.
# Without it a slow consumer (a WebSocket client on a slow link) made the node buffer everything.
_HIGH = 4 << 20
_LOW = 1 << 20

@dataclass
class ShellResult(ExecResult):
    """An :class:`ExecResult` of ``shell_run``; ``alive`` is False when the command ended the shell."""

    alive: bool = True


class _Stream:
    """Frames of one stream, in order, plus the connection's failure if it dies first."""

    __slots__ = ("closed", "drained", "id", "items", "nbytes", "op", "waiter")

    def __init__(self, sid: int, op: str) -> None:
        self.id = sid
        self.op = op
        self.items: deque[F.Frame | SandboxError] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False  # a terminal frame (or the failure) was delivered
        #: payload bytes queued and not yet taken by the consumer
        self.nbytes = 0
        #: set when the reader waits for this stream's consumer to catch up (see _HIGH)
        self.drained: asyncio.Event | None = None

    def put(self, item: F.Frame | SandboxError) -> None:
        self.items.append(item)
        if not isinstance(item, SandboxError):
            self.nbytes += len(item.payload)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self) -> F.Frame:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item = self.items[0]
        if isinstance(item, SandboxError):
            # Stays queued so every later get fails the same way; a fresh exception each time
            # keeps tracebacks from piling up on one shared instance.
            raise SandboxError(item.message, **item.details)
        self.items.popleft()
        self.nbytes -= len(item.payload)
        if self.drained is not None and self.nbytes <= _LOW:
            self.drained.set()
        return item

    def terminated_early(self) -> bool:
        """True when the agent already ended the stream (e.g. an upload it refused)."""
        return self.closed


def _result(resp: dict[str, Any], stdout: bytes, stderr: bytes) -> ExecResult:
    return ExecResult(
        exit_code=int(resp.get("exit_code", -1)),
        stdout=stdout,
        stderr=stderr,
        duration_s=float(resp.get("duration_ms", 0)) / 1000.0,
        timed_out=bool(resp.get("timed_out", False)),
        truncated=bool(resp.get("truncated", False)),
        signal=int(resp.get("signal", 0)),
    )


def _shell_result(resp: dict[str, Any], stdout: bytes, stderr: bytes) -> ShellResult:
    return ShellResult(
        exit_code=int(resp.get("exit_code", -1)),
        stdout=stdout,
        stderr=stderr,
        duration_s=float(resp.get("duration_ms", 0)) / 1000.0,
        timed_out=bool(resp.get("timed_out", False)),
        truncated=bool(resp.get("truncated", False)),
        signal=0,
        alive=bool(resp.get("alive", True)),
    )


def _timeout_ms(timeout: float | None) -> int:
    if timeout is None or timeout <= 0:
        return 0
    return max(1, int(timeout * 1000))


class ExecStream:
    """A running exec (or shell command): an async iterator of :class:`StreamEvent`.

    Yields ``stdout``/``stderr`` events as output arrives, then one ``exit`` event whose
    ``result`` carries the exit status (its stdout/stderr are empty: they were streamed).
    Errors of the request itself (bad cwd, unknown user, executable not found) are raised by
    the first iteration or by :meth:`wait`.
    """

    def __init__(self, client: AgentClient, stream: _Stream, *, shell: bool = False) -> None:
        self._client = client
        self._s = stream
        self._shell = shell
        self._result: ExecResult | None = None
        self._done = False
        # Output consumed by wait(): kept here so a cancelled and retried wait() loses nothing.
        self._out: list[bytes] = []
        self._err: list[bytes] = []

    @property
    def stream_id(self) -> int:
        """The protocol stream id of this exec."""
        return self._s.id

    @property
    def result(self) -> ExecResult | None:
        """The final result once the ``exit`` event was consumed, else None."""
        return self._result

    def __aiter__(self) -> ExecStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._done:
            raise StopAsyncIteration
        while True:
            try:
                fr = await self._s.get()
            except SandboxError:
                # The connection died. (A cancelled wait, e.g. by wait_for, leaves the
                # stream intact so the caller can wait again.)
                self._finish()
                raise
            if fr.type == F.STDOUT:
                return StreamEvent("stdout", fr.payload)
            if fr.type == F.STDERR:
                return StreamEvent("stderr", fr.payload)
            if fr.type == F.RESP:
                self._finish()
                resp = F.decode_json(fr.payload)
                res = _shell_result(resp, b"", b"") if self._shell else _result(resp, b"", b"")
                self._result = res
                return StreamEvent("exit", result=res)
            if fr.type == F.ERR:
                self._finish()
                raise agent_error(self._s.op, F.decode_json(fr.payload))
            # any other frame type on an exec stream is ignored (forward compatibility)

    def _finish(self) -> None:
        self._done = True
        self._client._forget(self._s)

    async def wait(self) -> ExecResult:
        """Consume the remaining events; return the result with the output not yet iterated."""
        async for ev in self:
            if ev.kind == "stdout":
                self._out.append(ev.data)
            elif ev.kind == "stderr":
                self._err.append(ev.data)
        if self._result is None:
            raise AgentProtocolError("stream ended without a result")
        if self._out or self._err:
            self._result.stdout = b"".join(self._out)
            self._result.stderr = b"".join(self._err)
            self._out.clear()
            self._err.clear()
        return self._result

    async def write_stdin(self, data: bytes) -> None:
        """Send bytes to the process's stdin (or its PTY). Needs ``stdin=True`` or ``tty=True``."""
        if self._done:
            return
        for i in range(0, len(data), F.CHUNK):
            chunk = bytes(data[i : i + F.CHUNK])
            await self._client._send(F.encode_frame(F.STDIN, self._s.id, chunk), drain=True)

    async def close_stdin(self) -> None:
        """Close the process's stdin (with a PTY: send the terminal's EOF character, ^D)."""
        if not self._done:
            await self._client._send(F.encode_frame(F.STDIN_EOF, self._s.id))

    async def send_signal(self, sig: int) -> None:
        """Deliver ``sig`` to the process group (a shell command: to the command's processes)."""
        if not self._done:
            await self._client._send(F.encode_signal(self._s.id, int(sig)))

    async def resize(self, rows: int, cols: int) -> None:
        """Resize the PTY of a ``tty=True`` exec."""
        if not self._done:
            await self._client._send(F.encode_resize(self._s.id, rows, cols))

    async def aclose(self) -> None:
        """Stop listening to this exec. The process keeps running; its output is dropped here."""
        self._finish()


class AgentClient:
    """A connection to one shoal-agent. Create it with :meth:`connect_unix` or :meth:`connect_stream`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._streams: dict[int, _Stream] = {}
        self._backlogged: _Stream | None = None  # a stream past _HIGH seen by the last dispatch
        self._ids = itertools.count(1)
        self._lost: SandboxError | None = None
        self._decoder = F.FrameDecoder()
        self._read_task: asyncio.Task[None] = asyncio.get_running_loop().create_task(self._read_loop())
        self.agent_info: dict[str, Any] = {}
        #: time.monotonic() of the last request sent or frame received (the node closes idle connections)
        self.last_active = time.monotonic()
        #: set when the node closed this connection for being idle (a request racing it may retry)
        self.closed_idle = False

    # ------------------------------------------------------------------ connection

    @classmethod
    async def connect_unix(cls, path: str, token: str | None = None, timeout: float = AGENT_CONNECT_TIMEOUT_S
                           ) -> AgentClient:
        """Connect to an agent listening on the Unix socket ``path`` and say hello."""
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(path, limit=_READ_SIZE * 4), timeout
            )
        except TimeoutError as e:
            raise Timeout(f"connecting to the agent at {path} took longer than {timeout}s") from e
        except OSError as e:
            raise SandboxError(f"cannot connect to the agent at {path}: {e}") from e
        return await cls._start(reader, writer, token, timeout)

    @classmethod
    async def connect_stream(
        cls,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        token: str | None = None,
        timeout: float = 10.0,
    ) -> AgentClient:
        """Use an already open byte stream (e.g. QEMU's virtio-serial chardev socket) and say hello."""
        return await cls._start(reader, writer, token, timeout)

    @classmethod
    async def _start(
        cls, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, token: str | None, timeout: float
    ) -> AgentClient:
        client = cls(reader, writer)
        try:
            await asyncio.wait_for(client.hello(token), timeout)
        except TimeoutError as e:
            await client.close()
            raise Timeout(f"the agent did not answer hello within {timeout}s") from e
        except BaseException:
            await client.close()
            raise
        return client

    @property
    def closed(self) -> bool:
        """True once the connection is closed or lost."""
        return self._lost is not None

    @property
    def busy(self) -> bool:
        """True while a request or stream is open on this connection (closing it would end them)."""
        return bool(self._streams)

    async def close(self) -> None:
        """Close the connection. Processes in the sandbox keep running (they belong to the agent)."""
        if self._lost is None:
            self._fail_all(SandboxError("the agent connection was closed by the client"))
        self._read_task.cancel()
        with contextlib.suppress(BaseException):
            await self._read_task
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    async def __aenter__(self) -> AgentClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _fail_all(self, exc: SandboxError) -> None:
        if self._lost is None:
            self._lost = exc
        streams = list(self._streams.values())
        self._streams.clear()
        for s in streams:
            s.closed = True
            s.put(self._lost)

    async def _read_loop(self) -> None:
        reason = "the agent closed the connection"
        try:
            while True:
                data = await self._reader.read(_READ_SIZE)
                if not data:
                    break
                for fr in self._decoder.feed(data):
                    self._dispatch(fr)
                full = self._backlogged
                if full is not None:
                    self._backlogged = None
                    if full.nbytes > _HIGH and self._streams.get(full.id) is full:
                        full.drained = asyncio.Event()
                        await full.drained.wait()
                        full.drained = None
        except asyncio.CancelledError:
            reason = "the client closed the connection"
            raise
        except AgentProtocolError as e:
            reason = f"protocol violation: {e}"
            self._writer.close()
        except OSError as e:
            reason = str(e) or type(e).__name__
        finally:
            self._fail_all(SandboxError(f"agent connection lost: {reason}"))

    def _dispatch(self, fr: F.Frame) -> None:
        self.last_active = time.monotonic()
        s = self._streams.get(fr.stream)
        if s is None:
            return  # a stream we stopped listening to, or stream-0 errors we cannot attribute
        if fr.type in (F.RESP, F.ERR):
            del self._streams[fr.stream]
            s.closed = True
        s.put(fr)
        if s.nbytes > _HIGH and not s.closed:
            self._backlogged = s

    def _forget(self, s: _Stream) -> None:
        if self._streams.get(s.id) is s:
            del self._streams[s.id]
        if s.drained is not None:
            s.drained.set()  # nobody will read it any more: the reader goes on (its frames are dropped)

    def _new_stream(self, op: str) -> _Stream:
        if self._lost is not None:
            raise SandboxError(str(self._lost))
        while True:
            sid = next(self._ids) & 0xFFFFFFFF
            if sid and sid not in self._streams:
                break
        s = _Stream(sid, op)
        self._streams[sid] = s
        self.last_active = time.monotonic()
        return s

    async def _send(self, data: bytes, drain: bool = False) -> None:
        if self._lost is not None:
            raise SandboxError(str(self._lost))
        try:
            self._writer.write(data)
            if drain or self._writer.transport.get_write_buffer_size() > (1 << 20):
                await self._writer.drain()
        except (ConnectionError, OSError) as e:
            raise SandboxError(f"agent connection lost: {e}") from e

    async def _open(self, op: str, **fields: Any) -> _Stream:
        s = self._new_stream(op)
        try:
            try:
                frame = F.encode_request(s.id, op, **fields)
            except ValueError as e:
                # the caller's input (a huge env, argv or cwd), not a failure of the sandbox
                raise InvalidRequest(f"{op} request is too large for the agent protocol ({e}): send less "
                                     "(environment, arguments); pass big data as stdin or a file",
                                     limit_bytes=F.MAX_PAYLOAD) from None
            await self._send(frame)
        except BaseException:
            self._forget(s)
            raise
        return s

    async def _call(self, op: str, **fields: Any) -> dict[str, Any]:
        """One request, one RESP (no stream data)."""
        s = await self._open(op, **fields)
        try:
            while True:
                fr = await s.get()
                if fr.type == F.RESP:
                    return F.decode_json(fr.payload)
                if fr.type == F.ERR:
                    raise agent_error(op, F.decode_json(fr.payload))
        finally:
            self._forget(s)

    # ------------------------------------------------------------------ ops

    async def hello(self, token: str | None = None) -> dict[str, Any]:
        """Authenticate (when the agent has a token) and return the agent's version info."""
        resp = await self._call("hello", token=token, version=F.PROTOCOL_VERSION)
        if resp.get("version") != F.PROTOCOL_VERSION:
            raise AgentProtocolError(f"agent speaks protocol version {resp.get('version')}, expected 1")
        self.agent_info = resp
        return resp

    async def exec_stream(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        stdin: bool = False,
        tty: bool = False,
        rows: int = 24,
        cols: int = 80,
    ) -> ExecStream:
        """Start ``argv`` and return a handle streaming its output (see :class:`ExecStream`).

        ``timeout`` (seconds) kills the whole process tree; ``max_output`` caps each stream
        (0 = unlimited); ``stdin=True`` gives the process a stdin pipe fed by ``write_stdin``;
        ``tty=True`` runs it on a PTY (stdout then carries everything).
        """
        if not argv:
            raise InvalidRequest("argv must not be empty")
        s = await self._open(
            "exec",
            argv=list(argv),
            env=dict(env) if env else None,
            cwd=cwd,
            user=user,
            timeout_ms=_timeout_ms(timeout),
            max_output=max_output,
            stdin=stdin or None,
            tty=tty or None,
            rows=rows if tty else None,
            cols=cols if tty else None,
        )
        return ExecStream(self, s)

    async def exec(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
        stdin: bytes | None = None,
        tty: bool = False,
        rows: int = 24,
        cols: int = 80,
    ) -> ExecResult:
        """Run ``argv`` to completion; stdout/stderr are bytes.

        ``stdin`` bytes are fed to the process, then its stdin is closed; with ``tty=True`` they
        are typed into the terminal instead and no EOF follows.
        """
        h = await self.exec_stream(
            argv,
            env=env,
            cwd=cwd,
            user=user,
            timeout=timeout,
            max_output=max_output,
            stdin=stdin is not None and not tty,
            tty=tty,
            rows=rows,
            cols=cols,
        )
        if stdin is not None:
            await h.write_stdin(stdin)
            if not tty:
                await h.close_stdin()
        return await h.wait()

    async def exec_detached(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
    ) -> int:
        """Start ``argv`` in the background (output to /dev/null) and return its pid at once."""
        if not argv:
            raise InvalidRequest("argv must not be empty")
        resp = await self._call(
            "exec",
            argv=list(argv),
            env=dict(env) if env else None,
            cwd=cwd,
            user=user,
            timeout_ms=_timeout_ms(timeout),
            detach=True,
        )
        return int(resp["pid"])

    async def shell_open(
        self, *, env: Mapping[str, str] | None = None, cwd: str | None = None, user: str | None = None
    ) -> str:
        """Start a persistent bash; return its id for :meth:`shell_run`."""
        resp = await self._call("shell_open", env=dict(env) if env else None, cwd=cwd, user=user)
        return str(resp["shell"])

    async def shell_run_stream(
        self,
        shell_id: str,
        cmd: str,
        *,
        timeout: float | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ExecStream:
        """Run ``cmd`` in the shell and stream its output; the exit event carries a :class:`ShellResult`."""
        s = await self._open(
            "shell_run", shell=shell_id, cmd=cmd, timeout_ms=_timeout_ms(timeout), max_output=max_output
        )
        return ExecStream(self, s, shell=True)

    async def shell_run(
        self,
        shell_id: str,
        cmd: str,
        *,
        timeout: float | None = None,
        max_output: int = DEFAULT_MAX_OUTPUT,
    ) -> ShellResult:
        """Run ``cmd`` in the shell (state carries over between runs) and wait for it.

        On timeout the command is interrupted (SIGINT, then SIGKILL) and the shell survives.
        ``result.alive`` is False when the command ended the shell (``exit``, ``exec`` ...).
        """
        h = await self.shell_run_stream(shell_id, cmd, timeout=timeout, max_output=max_output)
        res = await h.wait()
        assert isinstance(res, ShellResult)
        return res

    async def shell_close(self, shell_id: str) -> None:
        """Kill the shell and everything it started."""
        await self._call("shell_close", shell=shell_id)

    async def read_file(self, path: str, offset: int = 0, limit: int = 0) -> bytes:
        """Read a file (``limit`` 0 = to the end). Missing file → :class:`FileNotFound`."""
        s = await self._open("read_file", path=path, offset=offset or None, limit=limit or None)
        parts: list[bytes] = []
        try:
            while True:
                fr = await s.get()
                if fr.type == F.DATA:
                    parts.append(fr.payload)
                elif fr.type == F.RESP:
                    return b"".join(parts)
                elif fr.type == F.ERR:
                    raise agent_error("read_file", F.decode_json(fr.payload))
        finally:
            self._forget(s)

    async def write_file(
        self,
        path: str,
        data: bytes,
        mode: int = 0o644,
        mkdirs: bool = True,
        append: bool = False,
        user: str | None = None,
    ) -> int:
        """Write ``data`` to ``path`` atomically (temp file + rename; ``append`` writes in place).

        Returns the number of bytes written.
        """
        s = await self._open(
            "write_file", path=path, mode=mode, mkdirs=mkdirs, append=append or None, user=user
        )
        try:
            view = memoryview(data)
            for i in range(0, len(view), F.CHUNK):
                if s.terminated_early():
                    break  # the agent refused (e.g. permission denied): stop sending
                await self._send(F.encode_frame(F.DATA, s.id, bytes(view[i : i + F.CHUNK])), drain=True)
            if not s.terminated_early():
                await self._send(F.encode_frame(F.DATA_END, s.id))
            while True:
                fr = await s.get()
                if fr.type == F.RESP:
                    return int(F.decode_json(fr.payload).get("size", len(data)))
                if fr.type == F.ERR:
                    raise agent_error("write_file", F.decode_json(fr.payload))
        finally:
            self._forget(s)

    async def write_file_stream(
        self,
        path: str,
        chunks: AsyncIterable[bytes],
        mode: int = 0o644,
        mkdirs: bool = True,
        user: str | None = None,
    ) -> int:
        """Write the bytes `chunks` yields to ``path`` atomically, as they come: one chunk in memory at a time
        (each is sent, and the connection drained, before the next is asked for). Returns the bytes written.
        A chunk source that fails ends the file where it stopped (the agent has no way to abandon a write)
        and its error is raised."""
        s = await self._open("write_file", path=path, mode=mode, mkdirs=mkdirs, user=user)
        failed: BaseException | None = None
        try:
            sent = 0
            try:
                async for chunk in chunks:
                    view = memoryview(chunk)
                    for i in range(0, len(view), F.CHUNK):
                        if s.terminated_early():
                            break
                        await self._send(F.encode_frame(F.DATA, s.id, bytes(view[i : i + F.CHUNK])), drain=True)
                    sent += len(view)
                    if s.terminated_early():
                        break
            except Exception as e:  # the source failed: close the agent's write, then raise it
                failed = e
            if not s.terminated_early():
                await self._send(F.encode_frame(F.DATA_END, s.id))
            while True:
                fr = await s.get()
                if fr.type == F.RESP:
                    if failed is not None:
                        raise failed
                    return int(F.decode_json(fr.payload).get("size", sent))
                if fr.type == F.ERR:
                    raise agent_error("write_file", F.decode_json(fr.payload))
        finally:
            self._forget(s)

    async def list_dir(self, path: str, limit: int = 10000) -> list[DirEntry]:
        """Entries of a directory, sorted by name, without ``.`` and ``..``."""
        resp = await self._call("list_dir", path=path, limit=limit)
        return [
            DirEntry(
                name=e["name"],
                type=e["type"],
                size=int(e["size"]),
                mode=int(e["mode"]),
                mtime=float(e["mtime"]),
            )
            for e in resp.get("entries", [])
        ]

    async def stat(self, path: str) -> dict[str, Any]:
        """lstat of ``path``: ``{"type","size","mode","mtime","uid","gid"}``."""
        return await self._call("stat", path=path)

    async def mkdir(self, path: str, parents: bool = True, mode: int = 0o755) -> None:
        """Create a directory (with ``parents``, like ``mkdir -p``)."""
        await self._call("mkdir", path=path, parents=parents, mode=mode)

    async def remove(self, path: str, recursive: bool = False) -> None:
        """Remove a file or empty directory (``recursive``: a whole tree, symlinks not followed)."""
        await self._call("remove", path=path, recursive=recursive)

    async def sync(self) -> None:
        """Flush the sandbox's filesystems (before snapshotting a VM disk)."""
        await self._call("sync")

    async def ps(self) -> list[dict[str, Any]]:
        """Processes in the sandbox: ``[{"pid","ppid","comm","state"}]``."""
        resp = await self._call("ps")
        return list(resp.get("processes", []))

    async def tcp_connect(self, port: int, timeout: float | None = 10.0) -> PortStream:
        """A byte stream to TCP ``port`` on the sandbox's own loopback (127.0.0.1, then ::1), opened by the
        agent: works without a network in the sandbox. Nothing listening → :class:`PortClosed`."""
        s = await self._open("tcp_connect", port=int(port))
        return await PortStream.opened(self, s, port, timeout)

    async def watch(self, path: str, *, recursive: bool = False) -> WatchStream:
        """Filesystem events (inotify) of the directory ``path`` and, with ``recursive``, of everything below
        it, until :meth:`WatchStream.stop`."""
        s = await self._open("watch", path=path, recursive=recursive or None)
        return await WatchStream.opened(self, s, path)
