"""Pools of pre-created containers for the fncall backend; each container runs one fncall worker.

A `Worker` is one pooled container sandbox plus the long-lived worker process inside it
(`fncall_worker.py`), reached through the shoal agent: requests go in as the process's stdin, answers
come back as its stdout. A worker serves one call at a time, so calls never share a container at the
same moment, and the worker returns the container to its pristine state after each call.

A `Pool` holds the workers of one (image, limits) key: it hands an idle worker to each call (LIFO, so
a lightly loaded pool keeps a few hot workers and lets the rest go idle), starts new ones while calls
wait (up to `max_size`), keeps `min_idle` ready while the pool is in use, retires workers that were
idle too long, are old, served many calls or came back dirty, and replaces dead ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.errors import SandboxError, ShoalError, Timeout
from shoal.spec import SandboxSpec

if TYPE_CHECKING:
    from shoal.agentproto.client import AgentClient, ExecStream
    from shoal.backends.context import SandboxHost

log = logging.getLogger("shoal.fncall")

_U32 = struct.Struct(">I")
_SOURCES: tuple[bytes, bytes] | None = None
#: label on every pooled sandbox (value: the pool key), so they can be told apart and cleaned up
POOL_LABEL = "shoal.fncall.pool"


def worker_sources() -> tuple[bytes, bytes]:
    """(zygote source, dispatcher source) of the in-container worker, sent to each new container."""
    global _SOURCES
    if _SOURCES is None:
        here = Path(__file__).parent
        _SOURCES = ((here / "fncall_zygote.py").read_bytes(), (here / "fncall_worker.py").read_bytes())
    return _SOURCES


def bootstrap_argv(config: dict[str, Any]) -> tuple[list[str], bytes]:
    """The worker's argv and the stdin that must follow: zygote source, configuration, dispatcher source."""
    import marshal

    from shoal.backends.fncall_zygote import BOOTSTRAP

    zsrc, wsrc = worker_sources()
    cfg = marshal.dumps(config, 4)  # plain dicts, lists, strings and ints: the same bytes in any Python 3
    return (["python3", "-I", "-c", BOOTSTRAP, str(len(zsrc)), str(len(cfg)), str(len(wsrc))],
            zsrc + cfg + wsrc)


def encode_message(hdr: dict[str, Any], blobs: list[bytes] | tuple[bytes, ...] = ()) -> bytes:
    """One message of the worker protocol: u32 header length, header JSON, blobs."""
    hdr["blobs"] = [len(b) for b in blobs]
    h = json.dumps(hdr, separators=(",", ":")).encode()
    return b"".join([_U32.pack(len(h)), h, *blobs])


class MessageDecoder:
    """Incremental decoder of worker messages from stdout chunks."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict[str, Any], list[bytes]]]:
        """Add bytes; return every message now complete."""
        self.buf += data
        out = []
        while len(self.buf) >= 4:
            (hlen,) = _U32.unpack_from(self.buf, 0)
            if len(self.buf) < 4 + hlen:
                break
            hdr = json.loads(bytes(self.buf[4:4 + hlen]))
            sizes = hdr.get("blobs") or []
            end = 4 + hlen + sum(sizes)
            if len(self.buf) < end:
                break
            blobs, off = [], 4 + hlen
            for n in sizes:
                blobs.append(bytes(self.buf[off:off + n]))
                off += n
            del self.buf[:end]
            out.append((hdr, blobs))
        return out


class WorkerLost(SandboxError):
    """The worker (or its whole container) died or stopped answering."""

    code = "sandbox_error"


@dataclass
class PoolKey:
    """What makes pooled containers interchangeable."""

    image: str
    memory_mb: int
    cpus: float

    def __str__(self) -> str:
        return f"{self.image}|{self.memory_mb}m|{self.cpus:g}cpu"

    def __hash__(self) -> int:
        return hash((self.image, self.memory_mb, self.cpus))


class Worker:
    """One pooled container and the fncall worker inside it."""

    def __init__(self, node: SandboxHost, sandbox_id: str, client: AgentClient, stream: ExecStream) -> None:
        self.node = node
        self.sandbox_id = sandbox_id
        self.client = client
        self.stream = stream
        self.info: dict[str, Any] = {}
        self.created = time.monotonic()
        self.idle_since = self.created
        self.calls = 0
        self.dead: str | None = None
        self.dirty = False
        self._decoder = MessageDecoder()
        self._inbox: deque[tuple[dict[str, Any], list[bytes]]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._stderr_tail = bytearray()
        self._ids = 0
        self._reader: asyncio.Task[None] | None = None
        self._closed = False

    # ---- lifecycle
    @classmethod
    async def start(cls, node: SandboxHost, spec: SandboxSpec, config: dict[str, Any], timeout: float = 60.0) -> Worker:
        """Create a container, start the worker in it and wait until it says it is ready."""
        info = await node.create(spec)
        try:
            client = await node.client(info.id)
            argv, boot = bootstrap_argv(config)
            # LD_BIND_NOW: resolve every symbol once in the worker, not again (copying pages) in each forked call
            stream = await client.exec_stream(argv, cwd="/", user="root", stdin=True, max_output=0, timeout=None,
                                              env={"LD_BIND_NOW": "1"})
            w = cls(node, info.id, client, stream)
            w._reader = asyncio.get_running_loop().create_task(w._read_loop(), name=f"fncall-{info.id}")
            await stream.write_stdin(boot)
            hdr, _ = await asyncio.wait_for(w._next(), timeout)
            if hdr.get("error"):
                raise SandboxError(f"the fncall worker could not start in image {spec.image}: {hdr['error']}")
            w.info = hdr
            return w
        except BaseException as e:
            with contextlib.suppress(Exception):
                await node.close(info.id)
            if isinstance(e, TimeoutError):
                raise Timeout(f"the fncall worker in image {spec.image} did not start within {timeout}s") from e
            if isinstance(e, WorkerLost):
                hint = " (the image needs python3 >= 3.9 for the fncall worker)" if "execvp" in e.message else ""
                raise SandboxError(f"the fncall worker could not start in image {spec.image}: {e.message}{hint}") from e
            raise

    async def close(self) -> None:
        """Destroy the container (and with it the worker and anything a call left)."""
        if self._closed:
            return
        self._closed = True
        self.dead = self.dead or "closed"
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        with contextlib.suppress(ShoalError):
            await self.node.close(self.sandbox_id)

    @property
    def tools(self) -> dict[str, str | None]:
        """Which tools the image has (reported by the worker at startup)."""
        return self.info.get("tools") or {}

    # ---- messages
    async def _read_loop(self) -> None:
        reason = "the fncall worker exited"
        try:
            async for ev in self.stream:
                if ev.kind == "stdout":
                    for msg in self._decoder.feed(ev.data):
                        self._inbox.append(msg)
                    if self._inbox:
                        self._wake()
                elif ev.kind == "stderr":
                    self._stderr_tail += ev.data
                    del self._stderr_tail[:-4096]
                    log.debug("fncall worker %s: %s", self.sandbox_id, ev.data.decode(errors="replace").rstrip())
                elif ev.kind == "exit" and ev.result is not None:
                    r = ev.result
                    how = f"signal {r.signal}" if r.signal else f"exit code {r.exit_code}"
                    reason = f"the fncall worker exited ({how})"
        except asyncio.CancelledError:
            reason = "the fncall worker was closed"
            raise
        except Exception as e:  # the agent connection broke: the container is gone or going
            reason = f"lost the fncall worker's container: {e}"
        finally:
            tail = self._stderr_tail.decode(errors="replace").strip()
            self.dead = reason + (f"; its last words: {tail[-600:]}" if tail else "")
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _next(self) -> tuple[dict[str, Any], list[bytes]]:
        while not self._inbox:
            if self.dead:
                raise WorkerLost(self.dead)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._inbox.popleft()

    async def request(self, hdr: dict[str, Any], blobs: list[bytes], timeout: float) -> tuple[dict[str, Any],
                                                                                              list[bytes]]:
        """Send one request and wait (at most `timeout` s) for its answer. WorkerLost if the worker dies."""
        if self.dead:
            raise WorkerLost(self.dead)
        self._ids += 1
        hdr["id"] = self._ids
        self.calls += 1
        try:
            await self.stream.write_stdin(encode_message(hdr, blobs))
        except ShoalError as e:
            self.dead = self.dead or f"cannot reach the fncall worker: {e}"
            raise WorkerLost(self.dead) from e
        try:
            async with asyncio.timeout(timeout):
                while True:
                    resp = await self._next()
                    if resp[0].get("id") == hdr["id"]:
                        return resp
        except TimeoutError:
            self.dead = f"the fncall worker did not answer within {timeout:.0f}s"
            raise WorkerLost(self.dead) from None


class Pool:
    """Workers of one PoolKey; see the module docstring."""

    def __init__(self, node: SandboxHost, key: PoolKey, spec: SandboxSpec, worker_config: dict[str, Any], *,
                 min_idle: int, max_size: int, idle_timeout_s: float, max_calls: int, max_age_s: float,
                 start_timeout_s: float, keep_warm_s: float) -> None:
        self.node = node
        self.key = key
        self.spec = spec
        self.worker_config = worker_config
        self.min_idle = min_idle
        self.max_size = max(1, max_size)
        self.idle_timeout_s = idle_timeout_s
        self.max_calls = max_calls
        self.max_age_s = max_age_s
        self.start_timeout_s = start_timeout_s
        self.keep_warm_s = keep_warm_s
        self.idle: list[Worker] = []
        self.busy: set[Worker] = set()
        self.waiters: deque[asyncio.Future[Worker]] = deque()
        self.starting = 0
        self.last_used = time.monotonic()
        self.last_error: ShoalError | None = None
        self._fail_streak = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self.stats = {"started": 0, "start_failures": 0, "retired": 0, "died": 0, "calls": 0}

    @property
    def size(self) -> int:
        """Workers alive or being started."""
        return len(self.idle) + len(self.busy) + self.starting

    def snapshot(self) -> dict[str, Any]:
        """Counters for `stats()` and the CLI."""
        return {"key": str(self.key), "idle": len(self.idle), "busy": len(self.busy), "starting": self.starting,
                "waiting": len(self.waiters), "max_size": self.max_size, "min_idle": self.min_idle,
                "last_error": self.last_error.message if self.last_error else None, **self.stats}

    def sandbox_ids(self) -> list[str]:
        """Sandboxes of the pool's live workers (idle and busy)."""
        return [w.sandbox_id for w in (*self.idle, *self.busy)]

    # ---- borrowing
    async def acquire(self) -> Worker:
        """An idle worker, waiting (FIFO) for one to be free or started."""
        if self._closing:
            raise SandboxError("the fncall pool is closing")
        self.last_used = time.monotonic()
        while self.idle:
            w = self.idle.pop()
            if w.dead:
                self._spawn(self._discard(w, died=True))
                continue
            self.busy.add(w)
            return w
        fut: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        self._grow()
        try:
            w = await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result())
            with contextlib.suppress(ValueError):
                self.waiters.remove(fut)
            raise
        return w

    def release(self, w: Worker, *, retire: bool = False) -> None:
        """Give a worker back after a call; dead, dirty or worn-out workers are replaced."""
        self.busy.discard(w)
        now = time.monotonic()
        worn = w.calls >= self.max_calls or now - w.created >= self.max_age_s
        if w.dead or w.dirty or retire or worn or self._closing:
            self._spawn(self._discard(w, died=bool(w.dead) and not w._closed))
            self._grow()
            return
        self._hand_over(w)

    def _hand_over(self, w: Worker) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                self.busy.add(w)
                fut.set_result(w)
                return
        w.idle_since = time.monotonic()
        self.idle.append(w)

    async def _discard(self, w: Worker, died: bool = False) -> None:
        self.stats["died" if died else "retired"] += 1
        if w.dead and w.dead != "closed":
            log.warning("fncall worker %s replaced: %s", w.sandbox_id, w.dead)
        await w.close()

    # ---- growing and shrinking
    def _spawn(self, coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def _grow(self) -> None:
        """Start workers for waiting calls (and to keep min_idle), within max_size."""
        if self._closing:
            return
        if self._fail_streak and not self.waiters:
            return  # starts are failing (missing image, full host): retry when a call asks, not in a loop
        need = len(self.waiters) - self.starting
        if time.monotonic() - self.last_used < self.keep_warm_s:
            need = max(need, self.min_idle - len(self.idle) - self.starting)
        room = self.max_size - self.size
        # failures in a row (a missing image, a full host) start one at a time, not a storm
        n = min(need, room, 1 if self._fail_streak else 4)
        for _ in range(max(0, n)):
            self.starting += 1
            self._spawn(self._start_one())

    async def _start_one(self) -> None:
        try:
            if self._fail_streak:
                await asyncio.sleep(min(5.0, 0.1 * 2 ** min(self._fail_streak, 6)))
            w = await Worker.start(self.node, self.spec, self.worker_config, self.start_timeout_s)
        except asyncio.CancelledError:
            self.starting -= 1
            raise
        except Exception as e:
            self.starting -= 1
            err = e if isinstance(e, ShoalError) else SandboxError(f"could not start a fncall worker: {e}")
            self.last_error = err
            self._fail_streak += 1
            self.stats["start_failures"] += 1
            log.warning("fncall pool %s: %s", self.key, err)
            # Nobody can serve the waiting calls: fail them rather than let them hang. Other starts
            # still under way do not count once starts fail in a row (a full node, a broken image):
            # they fail the same way, and the retries would otherwise keep the calls waiting forever.
            if not self.idle and not self.busy and (self.starting == 0 or self._fail_streak >= 2):
                while self.waiters:
                    fut = self.waiters.popleft()
                    if not fut.done():
                        fut.set_exception(err)
            self._grow()
            return
        self.starting -= 1
        self._fail_streak = 0
        self.stats["started"] += 1
        if self._closing:
            await w.close()
            return
        self._hand_over(w)
        self._grow()

    async def maintain(self) -> None:
        """One housekeeping pass: retire idle, old or dead workers; keep min_idle while in use."""
        now = time.monotonic()
        keep: list[Worker] = []
        warm = now - self.last_used < self.keep_warm_s
        floor = self.min_idle if warm else 0
        # idle is LIFO: the oldest-idle workers sit at the front
        excess = len(self.idle) - floor
        for w in self.idle:
            idle_for = now - w.idle_since
            worn = w.calls >= self.max_calls or now - w.created >= self.max_age_s
            if w.dead or worn or (excess > 0 and idle_for >= self.idle_timeout_s):
                if not w.dead and not worn:
                    excess -= 1
                self._spawn(self._discard(w, died=bool(w.dead)))
            else:
                keep.append(w)
        self.idle = keep
        self._grow()

    async def close(self) -> None:
        """Close every worker (idle and busy) and fail waiting calls."""
        self._closing = True
        err = SandboxError("the fncall pool was closed")
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_exception(err)
        workers = self.idle + list(self.busy)
        self.idle, self.busy = [], set()
        await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)
        # workers still starting close themselves when they come up (see _start_one); wait for them
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
