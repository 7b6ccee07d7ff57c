"""envd's directory watching (`files.watch_dir`): inotify events from the sandbox's agent (`Node.watch`) as
E2B's FilesystemEvents.

Two shapes, as envd has them: `WatchDir`, a server stream (`start`, then `filesystem` events and keepalives;
the async SDK), and `CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher`, a watcher the server holds and the
caller polls (the sync SDK). Event types follow fsnotify's reading of inotify, like envd: a create or a move
in is `EVENT_TYPE_CREATE`, a write `WRITE`, a delete `REMOVE`, a move out `RENAME`, an attribute change
`CHMOD`; `name` is the path below the watched directory ("." for the directory itself). Watchers live as long
as the server process, or until removed or their sandbox is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shoal.agentproto import relay as R
from shoal.server.compat import common
from shoal.server.compat.connect import RpcError, rpc_error

if TYPE_CHECKING:
    from shoal.server.deps import ServerState

#: unread events one polled watcher keeps before it stops with an error
MAX_PENDING = 100_000
#: inotify bits → E2B event types, in the order envd reports the ops of one event
_TYPES = ((R.IN_CREATE | R.IN_MOVED_TO, "EVENT_TYPE_CREATE"), (R.IN_MOVED_FROM | R.IN_MOVE_SELF, "EVENT_TYPE_RENAME"),
          (R.IN_ATTRIB, "EVENT_TYPE_CHMOD"), (R.IN_MODIFY, "EVENT_TYPE_WRITE"),
          (R.IN_DELETE | R.IN_DELETE_SELF, "EVENT_TYPE_REMOVE"))


def e2b_events(ev: R.WatchEvent) -> list[dict[str, Any]]:
    """The FilesystemEvents (JSON) of one inotify event."""
    if ev.overflow:
        raise RpcError("data_loss", "filesystem events were lost (the kernel's queue overflowed, or the watcher "
                                    "fell behind): watch again")
    name = ev.name or "."
    return [{"name": name, "type": kind} for bits, kind in _TYPES if ev.mask & bits]


def watch_options(msg: dict[str, Any]) -> bool:
    """`recursive` of a WatchDir / CreateWatcher request (the options shoal cannot honour are refused)."""
    if msg.get("includeEntry") or msg.get("include_entry"):
        raise RpcError("unimplemented", "include_entry is not supported by shoal's envd: stat the entry by name")
    recursive = msg.get("recursive", False)
    if not isinstance(recursive, bool):
        raise RpcError("invalid_argument", "recursive must be a boolean")
    return recursive


@dataclass
class Watcher:
    """A polled watcher: events pile up until GetWatcherEvents takes them."""

    id: str
    sandbox_id: str
    stream: R.WatchStream
    events: list[dict[str, Any]] = field(default_factory=list)
    error: RpcError | None = None
    task: asyncio.Task[None] | None = None

    async def pump(self) -> None:
        """Collect the stream's events (runs until the watch ends or is stopped)."""
        try:
            async for ev in self.stream:
                self.events.extend(e2b_events(ev))
                if len(self.events) > MAX_PENDING:
                    raise RpcError("resource_exhausted", f"more than {MAX_PENDING} events were not fetched: the "
                                                         "watcher stopped; fetch events more often")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.error = rpc_error(e)
        finally:
            with contextlib.suppress(Exception):
                await self.stream.stop()


class Watchers:
    """The polled watchers of every sandbox this server serves."""

    def __init__(self) -> None:
        self.by_id: dict[str, Watcher] = {}

    async def create(self, st: ServerState, sandbox_id: str, path: str, recursive: bool) -> Watcher:
        """Start watching `path`; the watch is armed when this returns."""
        stream = await st.node.watch(sandbox_id, path, recursive=recursive)
        w = Watcher(id=secrets.token_hex(8), sandbox_id=sandbox_id, stream=stream)
        w.task = asyncio.create_task(w.pump(), name=f"e2b-watch-{w.id}")
        self.by_id[w.id] = w
        return w

    def find(self, sandbox_id: str, watcher_id: Any) -> Watcher:
        """The watcher `watcher_id` of that sandbox; not_found otherwise."""
        w = self.by_id.get(watcher_id) if isinstance(watcher_id, str) else None
        if w is None or w.sandbox_id != sandbox_id:
            raise RpcError("not_found", f"watcher {watcher_id!r} not found (it was removed, or made by another "
                                        "server process)")
        return w

    def take(self, w: Watcher) -> list[dict[str, Any]]:
        """The events since the last take; the watcher's error once they are all taken."""
        out, w.events = w.events, []
        if not out and w.error is not None:
            raise w.error
        return out

    async def remove(self, w: Watcher) -> None:
        """Stop a watcher and forget it."""
        self.by_id.pop(w.id, None)
        if w.task is not None and not w.task.done():
            w.task.cancel()
            with contextlib.suppress(BaseException):
                await w.task
        with contextlib.suppress(Exception):
            await w.stream.stop()

    def prune(self, st: ServerState) -> None:
        """Forget the watchers of sandboxes that are gone (closed by shoal's API or their TTL)."""
        from shoal.errors import SandboxNotFound

        for w in list(self.by_id.values()):
            try:
                st.node.record(w.sandbox_id)
            except SandboxNotFound:
                self.by_id.pop(w.id, None)
                if w.task is not None:
                    w.task.cancel()

    async def drop(self, sandbox_id: str) -> None:
        """Forget a sandbox's watchers (it was killed)."""
        for w in [w for w in self.by_id.values() if w.sandbox_id == sandbox_id]:
            await self.remove(w)


def watchers(st: ServerState) -> Watchers:
    """The watcher table of this server."""
    return common.server_local(st, "watchers", Watchers)


async def stream_events(stream: R.WatchStream, keepalive_s: float) -> AsyncIterator[dict[str, Any]]:
    """WatchDir's answer: `start`, then `filesystem` events, `keepalive` while idle; the watch stops with it."""
    nxt: asyncio.Future[R.WatchEvent] | None = None
    try:
        yield {"start": {}}
        it = stream.__aiter__()
        while True:
            if nxt is None:
                nxt = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({nxt}, timeout=keepalive_s)
            if not done:
                yield {"keepalive": {}}
                continue
            got, nxt = nxt, None
            try:
                ev = got.result()
            except StopAsyncIteration:
                return
            for e in e2b_events(ev):
                yield {"filesystem": e}
    finally:
        if nxt is not None:
            nxt.cancel()
        await stream.stop()
