"""Processes started through E2B's envd API, held by the server so later calls can reach them by pid or tag.

Each process is one shoal exec stream. A pump task reads its output and fans it out to every listener
(the `Start` stream that made it and any `Connect` streams); output nobody listens to is dropped, so a
background command never blocks. The pids are the server's own numbers (unique per server process),
not the process ids inside the sandbox; they live as long as the server does.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import logging
import signal as _signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shoal.server.compat import common
from shoal.server.compat.connect import RpcError, rpc_error

if TYPE_CHECKING:
    from shoal.server.deps import ServerState

log = logging.getLogger("shoal.server")
_pids = itertools.count(1000)
#: sentinel put on listener queues when the process stream ends
_DONE: dict[str, Any] = {}
#: key of the event that carries the error a process stream ended with
_ERROR = "_error"


@dataclass
class Proc:
    """One running command."""

    pid: int
    sandbox_id: str
    config: dict[str, Any]
    handle: Any
    tag: str | None = None
    tty: bool = False
    stdin: bool = False
    listeners: set[asyncio.Queue[dict[str, Any]]] = field(default_factory=set)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    end: dict[str, Any] | None = None
    error: RpcError | None = None
    task: asyncio.Task[None] | None = None

    def info(self) -> dict[str, Any]:
        """E2B's ProcessInfo."""
        out: dict[str, Any] = {"config": self.config, "pid": self.pid}
        if self.tag is not None:
            out["tag"] = self.tag
        return out

    def listen(self) -> asyncio.Queue[dict[str, Any]]:
        """A new listener queue (gets every event from now on)."""
        q: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        if self.ended.is_set():
            q.put_nowait(_DONE)
        else:
            self.listeners.add(q)
        return q

    def _emit(self, event: dict[str, Any]) -> None:
        for q in list(self.listeners):
            q.put_nowait(event)


def end_event(result: Any) -> dict[str, Any]:
    """E2B's EndEvent for a shoal ExecResult: a signal death reads like Go's `signal: killed` (exit -1)."""
    if result.signal:
        try:
            name = _signal.Signals(result.signal).name.removeprefix("SIG").lower()
        except ValueError:
            name = str(result.signal)
        name = {"kill": "killed", "term": "terminated", "int": "interrupt"}.get(name, name)
        out: dict[str, Any] = {"exitCode": -1, "exited": False, "status": f"signal: {name}"}
    else:
        out = {"exitCode": int(result.exit_code), "exited": True, "status": f"exit status {result.exit_code}"}
    if result.timed_out:
        out["error"] = "the command ran past its timeout and was killed"
    return out


class ProcessTable:
    """The E2B processes of every sandbox this server serves."""

    def __init__(self) -> None:
        self._by_sandbox: dict[str, dict[int, Proc]] = {}

    def procs(self, sandbox_id: str) -> list[Proc]:
        """Running processes of a sandbox."""
        return [p for p in self._by_sandbox.get(sandbox_id, {}).values() if not p.ended.is_set()]

    def find(self, sandbox_id: str, selector: Any) -> Proc:
        """The running process a ProcessSelector (`{"pid": n}` or `{"tag": s}`) names; not_found otherwise.
        A selector of the wrong shape is invalid_argument (E2B's own answer to a malformed message)."""
        if selector is None:
            selector = {}
        if not isinstance(selector, dict):
            raise RpcError("invalid_argument", f"process must be a ProcessSelector object ({{\"pid\": n}} or "
                                               f"{{\"tag\": s}}), not {type(selector).__name__}")
        pid = _int(selector["pid"]) if selector.get("pid") is not None else None
        tag = selector.get("tag")
        if tag is not None and not isinstance(tag, str):
            raise RpcError("invalid_argument", f"process.tag must be a string, not {type(tag).__name__}")
        if pid is None and tag is None:
            raise RpcError("invalid_argument", "process must name a pid or a tag")
        for p in self.procs(sandbox_id):
            if pid is not None and p.pid == pid:
                return p
            if tag is not None and p.tag is not None and p.tag == tag:
                return p
        what = f"pid {pid}" if pid is not None else f"tag {tag!r}"
        raise RpcError("not_found", f"process with {what} not found (it ended, or was started through another "
                                    "server process)")

    async def start(self, st: ServerState, sandbox_id: str, argv: list[str], *, env: dict[str, str] | None,
                    cwd: str | None, user: str | None, timeout: float | None, tty: bool, stdin: bool,
                    tag: str | None, rows: int = 24, cols: int = 80) -> Proc:
        """Start a command and its output pump."""
        handle = await st.node.stream(sandbox_id, argv, timeout=timeout, cwd=cwd, env=env or None, user=user,
                                      tty=tty, stdin=stdin or tty)
        if tty and (rows, cols) != (24, 80):
            with contextlib.suppress(Exception):
                await handle.resize(rows, cols)
        config: dict[str, Any] = {"cmd": argv[0], "args": argv[1:], "envs": dict(env or {})}
        if cwd:
            config["cwd"] = cwd
        p = Proc(pid=next(_pids), sandbox_id=sandbox_id, config=config, handle=handle, tag=tag, tty=tty,
                 stdin=stdin or tty)
        self._by_sandbox.setdefault(sandbox_id, {})[p.pid] = p
        return p

    def run(self, p: Proc) -> None:
        """Start pumping `p`'s output (after its first listener subscribed, so nothing is missed)."""
        p.task = asyncio.create_task(self._pump(p), name=f"e2b-proc-{p.pid}")

    async def _pump(self, p: Proc) -> None:
        try:
            async for ev in p.handle:
                if ev.kind == "exit":
                    p.end = end_event(ev.result)
                    break
                key = "pty" if p.tty else ev.kind
                p._emit({"data": {key: base64.b64encode(ev.data).decode()}})
        except asyncio.CancelledError:
            p.end = {"exitCode": -1, "exited": False, "status": "detached", "error": "the server let go of it"}
            raise
        except Exception as e:  # it could not start (bad cwd, user or program), or the sandbox died
            p.error = rpc_error(e)
        finally:
            if p.error is not None:
                p._emit({_ERROR: p.error})
            else:
                if p.end is None:
                    p.end = {"exitCode": -1, "exited": False, "status": "lost",
                             "error": "the command's output stream ended without an exit status"}
                p._emit({"end": p.end})
            p.ended.set()
            p._emit(_DONE)
            p.listeners.clear()
            self._by_sandbox.get(p.sandbox_id, {}).pop(p.pid, None)

    async def events(self, p: Proc, q: asyncio.Queue[dict[str, Any]], keepalive_s: float) -> AsyncIterator[
            dict[str, Any]]:
        """The ProcessEvents of one listener: start, then data/end as they come, keepalives while idle."""
        try:
            yield {"event": {"start": {"pid": p.pid}}}
            while True:
                try:
                    ev = await asyncio.wait_for(q.get(), keepalive_s)
                except TimeoutError:
                    yield {"event": {"keepalive": {}}}
                    continue
                if ev is _DONE:
                    return
                if _ERROR in ev:
                    raise ev[_ERROR]
                yield {"event": ev}
        finally:
            p.listeners.discard(q)

    async def drop(self, sandbox_id: str) -> None:
        """Forget a sandbox's processes (it was killed): stop their pumps."""
        procs = self._by_sandbox.pop(sandbox_id, {})
        for p in procs.values():
            if p.task is not None and not p.task.done():
                p.task.cancel()
                with contextlib.suppress(BaseException):
                    await p.task


def table(st: ServerState) -> ProcessTable:
    """The process table of this server."""
    return common.server_local(st, "procs", ProcessTable)


def _int(v: Any, field: str = "process.pid") -> int:
    """A protobuf integer as protojson writes it: a number, or a string of digits; anything else is
    invalid_argument."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise RpcError("invalid_argument", f"{field} must be an integer, not {type(v).__name__}")
    try:
        n = int(v) if not isinstance(v, float) or v.is_integer() else None
    except ValueError:
        n = None
    if n is None:
        raise RpcError("invalid_argument", f"{field} {v!r} is not an integer")
    return n
