"""Long-lived agent streams that are not processes: a TCP connection the agent relays (`tcp_connect`) and
a directory watch (`watch`). See docs/protocol.md.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shoal.errors import SandboxError, Timeout

from . import frames as F
from .errors import agent_error

if TYPE_CHECKING:
    from .client import AgentClient, _Stream

# inotify event bits (Linux ABI, <sys/inotify.h>): what `watch` events carry in `mask`
IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_ISDIR = 0x40000000


async def _opened(client: AgentClient, s: _Stream, what: str, timeout: float | None) -> dict[str, Any]:
    """Wait for the READY frame of a stream just opened; its ERR is raised as the typed error."""
    try:
        fr = await (asyncio.wait_for(s.get(), timeout) if timeout else s.get())
    except TimeoutError:
        client._forget(s)
        with contextlib.suppress(Exception):
            await client._send(F.encode_signal(s.id, 9))
        raise Timeout(f"{what}: the agent did not answer within {timeout}s") from None
    except BaseException:
        client._forget(s)
        raise
    if fr.type == F.READY:
        return F.decode_json(fr.payload)
    client._forget(s)
    if fr.type == F.ERR:
        raise agent_error(s.op, F.decode_json(fr.payload))
    raise SandboxError(f"{what}: the agent answered {F.FRAME_NAMES.get(fr.type, fr.type)} before READY")


class _LongStream:
    """A stream that lives until either side ends it; the client ends it with a SIGNAL frame."""

    def __init__(self, client: AgentClient, stream: _Stream) -> None:
        self._client = client
        self._s = stream
        self._done = False

    async def _end(self) -> None:
        """Stop listening and tell the agent to end the stream."""
        if not self._done:
            self._finish()
            with contextlib.suppress(SandboxError):
                await self._client._send(F.encode_signal(self._s.id, 9))

    def _finish(self) -> None:
        self._done = True
        self._client._forget(self._s)


class PortStream(_LongStream):
    """A TCP connection to a port inside the sandbox, relayed by its agent: `read`, `write`, `write_eof`,
    `close`. Ends when the server in the sandbox closes its side (`read` returns b"")."""

    def __init__(self, client: AgentClient, stream: _Stream, port: int, info: dict[str, Any]) -> None:
        super().__init__(client, stream)
        self.port = port
        self.info = info
        self.error: SandboxError | None = None

    @classmethod
    async def opened(cls, client: AgentClient, s: _Stream, port: int, timeout: float | None) -> PortStream:
        """The stream once the agent connected (READY), or the error why it could not."""
        return cls(client, s, port, await _opened(client, s, f"connecting to port {port}", timeout))

    async def read(self) -> bytes:
        """The next bytes the server sent; b"" once it closed (or the relay ended with an error, kept in
        `error`)."""
        while not self._done:
            try:
                fr = await self._s.get()
            except SandboxError as e:
                self.error = e
                self._finish()
                return b""
            if fr.type == F.STDOUT:
                return fr.payload
            if fr.type in (F.RESP, F.ERR):
                if fr.type == F.ERR:
                    err = agent_error(self._s.op, F.decode_json(fr.payload))
                    self.error = err if isinstance(err, SandboxError) else SandboxError(str(err))
                self._finish()
        return b""

    def readable(self) -> bool:
        """True when reading would not wait: data or the end is already here."""
        return self._done or bool(self._s.items)

    async def write(self, data: bytes) -> None:
        """Send bytes to the server (in protocol-sized chunks, waiting for the agent to take them)."""
        if self._done:
            raise SandboxError(f"the connection to port {self.port} is closed")
        view = memoryview(data)
        for i in range(0, len(view), F.CHUNK):
            await self._client._send(F.encode_frame(F.STDIN, self._s.id, bytes(view[i:i + F.CHUNK])), drain=True)

    async def write_eof(self) -> None:
        """Half-close: the server reads EOF; what it still sends can be read."""
        if not self._done:
            await self._client._send(F.encode_frame(F.STDIN_EOF, self._s.id))

    async def close(self) -> None:
        """Drop the connection now (the agent resets it)."""
        await self._end()


@dataclass
class WatchEvent:
    """One filesystem event: `name` below the watched directory ("" for the directory itself), the inotify
    `mask`; `overflow` when events were lost (the kernel's queue, or a reader that fell behind)."""

    name: str
    mask: int = 0
    overflow: bool = False


class WatchStream(_LongStream):
    """The events of a directory watch, as an async iterator; `stop()` ends it."""

    def __init__(self, client: AgentClient, stream: _Stream, path: str) -> None:
        super().__init__(client, stream)
        self.path = path

    @classmethod
    async def opened(cls, client: AgentClient, s: _Stream, path: str) -> WatchStream:
        """The stream once the agent armed the watch (READY), or the error why it could not."""
        await _opened(client, s, f"watching {path}", 30.0)
        return cls(client, s, path)

    def __aiter__(self) -> WatchStream:
        return self

    async def __anext__(self) -> WatchEvent:
        while not self._done:
            try:
                fr = await self._s.get()
            except SandboxError:
                self._finish()
                raise
            if fr.type == F.EVENT:
                ev = F.decode_json(fr.payload)
                return WatchEvent(name=str(ev.get("name", "")), mask=int(ev.get("mask", 0)),
                                  overflow=bool(ev.get("overflow", False)))
            if fr.type in (F.RESP, F.ERR):
                self._finish()
                if fr.type == F.ERR:
                    raise agent_error(self._s.op, F.decode_json(fr.payload))
        raise StopAsyncIteration

    async def stop(self) -> None:
        """Stop watching (the agent removes its inotify watches)."""
        await self._end()
