"""The node's event log: what happened to each sandbox (lifecycle) and the commands it ran.

Two append-only JSON-lines files under `$SHOAL_HOME/events/`:

* `events.jsonl` — lifecycle: `created`, `paused`, `resumed`, `oom`, `timeout`, `lost`, `closed`
  (one line each; `paused` says `by` whom when it was not the user, `closed` gives the `reason`:
  user, timeout, lost), and node events: `image_corrupt` (id "", with `layer`, `chunk`, `reason`,
  `sandboxes`);
* `commands.jsonl` — one `exec` line per finished command (exec, stream, shell): the command (cut to
  `MAX_CMD_CHARS`), exit code, duration, whether it timed out. Kept apart because commands are many
  and would push lifecycle events out of a size-bounded file.

Every line is written with one `write()` on an `O_APPEND` descriptor, so every node process sharing a
SHOAL_HOME (the server, the CLI, a test) appends whole lines to the same files and each sees the others'
events. When a file passes `SHOAL_EVENTS_MAX_MB` it is renamed to `<name>.1` (the previous `.1` is
dropped): the log keeps between one and two files' worth.

Readers: `read_events` scans the files (the CLI); `EventIndex` tails them incrementally and keeps the
recent events of each sandbox in memory (the API server, the dashboard). Writing an event never fails
the operation it records: an I/O error is logged once.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shoal.config import Settings

log = logging.getLogger(__name__)

#: lifecycle event kinds, in the order a sandbox meets them
LIFECYCLE = ("created", "paused", "resumed", "oom", "timeout", "lost", "closed")
#: the kind of a command line
EXEC = "exec"
#: node events (no sandbox of their own: `id` is ""): a chunk of a layer failed its check when the node's
#: layer reader read it (`layer`, `chunk`, `reason`, `sandboxes` using the layer; shoal.images.corruption)
NODE_KINDS = ("image_corrupt",)
KINDS = (*LIFECYCLE, EXEC, *NODE_KINDS)
#: commands are cut to this many characters in the log
MAX_CMD_CHARS = 300
EVENTS_FILE = "events.jsonl"
COMMANDS_FILE = "commands.jsonl"
#: the writer checks whether it must rotate (or reopen a file rotated by another process) every this many lines
_CHECK_EVERY = 128


@dataclass
class SandboxEvent:
    """One line of the event log."""

    t: float
    kind: str
    sandbox_id: str
    project: str = "default"
    node: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The line's JSON form (as the API answers it)."""
        return {"t": self.t, "kind": self.kind, "id": self.sandbox_id, "project": self.project,
                "node": self.node, **self.data}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SandboxEvent:
        """Parse one line (unknown keys go to `data`)."""
        rest = {k: v for k, v in d.items() if k not in ("t", "kind", "id", "project", "node")}
        return cls(t=float(d.get("t", 0.0)), kind=str(d.get("kind", "")), sandbox_id=str(d.get("id", "")),
                   project=str(d.get("project", "default")), node=str(d.get("node", "")), data=rest)


class _Appender:
    """One append-only file, rotated by size; shared by every process of a SHOAL_HOME."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._fd: int | None = None
        self._ino = 0
        self._n = 0
        self._warned = False

    def write(self, line: bytes) -> None:
        try:
            if self._fd is None:
                self._open()
            elif self._n >= _CHECK_EVERY:
                self._n = 0
                self._maybe_rotate()
            assert self._fd is not None
            os.write(self._fd, line)
            self._n += 1
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("cannot append to the event log %s: %s (events are not recorded)", self.path, e)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._ino = os.fstat(self._fd).st_ino
        self._n = 0

    def _maybe_rotate(self) -> None:
        assert self._fd is not None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            st = None
        if st is None or st.st_ino != self._ino:
            self.close()  # another process rotated it: write to the new file
            self._open()
            return
        if st.st_size >= self.max_bytes:
            # rename is atomic: a process still writing to the old inode lands in `.1`, never loses a line
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            self.close()
            self._open()

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


class EventLog:
    """Appends a node's events (see the module doc). Thread-safe; writes cost one `write()` each."""

    def __init__(self, home: Path | str, node_id: str, *, enabled: bool = True, max_mb: int = 64,
                 commands: bool = True) -> None:
        self.dir = Path(home) / "events"
        self.node_id = node_id
        self.enabled = enabled
        self.commands_enabled = enabled and commands
        max_bytes = max(1, int(max_mb)) << 20
        self._events = _Appender(self.dir / EVENTS_FILE, max_bytes)
        self._commands = _Appender(self.dir / COMMANDS_FILE, max_bytes)
        self._lock = threading.Lock()
        #: events emitted by this process, by kind (the node's Prometheus counter shoal_sandbox_events_total)
        self.counts: collections.Counter[str] = collections.Counter()

    @classmethod
    def from_settings(cls, home: Path | str, node_id: str, s: Settings) -> EventLog:
        """An event log configured by the events, events_max_mb and events_commands settings of `s`."""
        return cls(home, node_id, enabled=s.events, max_mb=s.events_max_mb, commands=s.events_commands)

    def emit(self, kind: str, sandbox_id: str, project: str = "default", **data: Any) -> None:
        """Append one lifecycle event."""
        self.counts[kind] += 1
        if not self.enabled:
            return
        line = {"t": round(time.time(), 4), "kind": kind, "id": sandbox_id, "project": project,
                "node": self.node_id, **data}
        enc = (json.dumps(line, separators=(",", ":"), default=str) + "\n").encode()
        with self._lock:
            self._events.write(enc)

    def command(self, sandbox_id: str, project: str, cmd: str | list[str], *, exit_code: int, duration_s: float,
                timed_out: bool = False, via: str = "exec", signal: int = 0) -> None:
        """Append one finished command."""
        if not self.commands_enabled:
            return
        text = cmd if isinstance(cmd, str) else " ".join(cmd)
        if len(text) > MAX_CMD_CHARS:
            text = text[:MAX_CMD_CHARS] + "…"
        line: dict[str, Any] = {"t": round(time.time(), 4), "kind": EXEC, "id": sandbox_id, "project": project,
                                "node": self.node_id, "cmd": text, "exit_code": exit_code,
                                "duration_s": round(duration_s, 4), "via": via}
        if timed_out:
            line["timed_out"] = True
        if signal:
            line["signal"] = signal
        enc = (json.dumps(line, separators=(",", ":")) + "\n").encode()
        with self._lock:
            self._commands.write(enc)

    def close(self) -> None:
        """Close the files (reopened by the next event)."""
        with self._lock:
            self._events.close()
            self._commands.close()


def _files(events_dir: Path, commands: bool) -> list[Path]:
    names = [EVENTS_FILE] + ([COMMANDS_FILE] if commands else [])
    out = []
    for n in names:
        out += [events_dir / (n + ".1"), events_dir / n]  # older file first
    return out


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        d = json.loads(raw)
    except ValueError:
        return None  # a line cut by a crash mid-write, or not ours
    return d if isinstance(d, dict) and "kind" in d and "id" in d else None


def read_events(home: Path | str, *, sandbox_id: str | None = None, project: str | None = None,
                kinds: Iterable[str] | None = None, since: float | None = None,
                limit: int = 1000) -> list[SandboxEvent]:
    """Events from the log files, oldest first (the newest `limit` that match). Scans the files: for the CLI
    and tests; a server keeps an `EventIndex`."""
    want = set(kinds) if kinds else None
    commands = want is None or EXEC in want
    out: collections.deque[SandboxEvent] = collections.deque(maxlen=max(1, limit))
    needle = sandbox_id.encode() if sandbox_id else None
    for path in _files(Path(home) / "events", commands):
        with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
            for raw in f:
                if needle is not None and needle not in raw:
                    continue  # cheap pre-filter: most lines are other sandboxes'
                d = _parse(raw)
                if d is None or not _match(d, sandbox_id, project, want, since):
                    continue
                out.append(SandboxEvent.from_dict(d))
    items = sorted(out, key=lambda e: e.t)
    return items[-limit:]


def _match(d: dict[str, Any], sandbox_id: str | None, project: str | None, kinds: set[str] | None,
           since: float | None) -> bool:
    if sandbox_id is not None and d.get("id") != sandbox_id:
        return False
    if project is not None and d.get("project") != project:
        return False
    if kinds is not None and d.get("kind") not in kinds:
        return False
    return not (since is not None and float(d.get("t", 0.0)) <= since)


class _Tail:
    """Reads what was appended to one file since the last call (follows rotation)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ino = 0
        self.pos = 0
        self.partial = b""

    def new_lines(self, max_bytes: int = 64 << 20) -> Iterator[bytes]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        if st.st_ino != self.ino:
            # first read, or the file was rotated: finish the old one (now `.1`) if it is what we were reading
            old = self.path.with_name(self.path.name + ".1")
            if self.ino:
                with contextlib.suppress(OSError):
                    ost = os.stat(old)
                    if ost.st_ino == self.ino:
                        yield from self._read(old, ost.st_size, max_bytes)
            self.ino, self.pos, self.partial = st.st_ino, 0, b""
        elif st.st_size < self.pos:
            self.pos, self.partial = 0, b""  # truncated by hand
        yield from self._read(self.path, st.st_size, max_bytes)

    def _read(self, path: Path, size: int, max_bytes: int) -> Iterator[bytes]:
        if size <= self.pos:
            return
        with open(path, "rb") as f:
            if size - self.pos > max_bytes:
                self.pos = size - max_bytes  # far behind: skip to the most recent part
                self.partial = b""
                f.seek(self.pos)
                f.readline()
                self.pos = f.tell()
            else:
                f.seek(self.pos)
            data = f.read(size - self.pos)
        self.pos += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        yield from (ln for ln in lines if ln)


class EventIndex:
    """The recent events of every sandbox, in memory, fed by tailing the log files on demand.

    `refresh()` reads only what was appended since the last call (a stat per file when nothing was), so
    a server calls it before each query. Memory is bounded: `per_sandbox` lifecycle events and
    `commands_per_sandbox` commands per sandbox, `sandboxes` sandboxes (least recently seen dropped), and
    the `recent` newest events of all.
    """

    def __init__(self, home: Path | str, *, per_sandbox: int = 100, commands_per_sandbox: int = 50,
                 sandboxes: int = 100_000, recent: int = 5000) -> None:
        d = Path(home) / "events"
        self._tails = [(_Tail(d / EVENTS_FILE), False), (_Tail(d / COMMANDS_FILE), True)]
        self.per_sandbox = per_sandbox
        self.commands_per_sandbox = commands_per_sandbox
        self.max_sandboxes = sandboxes
        self._by_sandbox: collections.OrderedDict[str, tuple[collections.deque[dict[str, Any]],
                                                             collections.deque[dict[str, Any]]]] = \
            collections.OrderedDict()
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=recent)
        self._lock = threading.Lock()
        self.lines = 0

    def refresh(self) -> int:
        """Take in what was appended since the last call; returns how many lines were new."""
        n = 0
        with self._lock:
            for tail, is_cmd in self._tails:
                for raw in tail.new_lines():
                    d = _parse(raw)
                    if d is None:
                        continue
                    self._add(d, is_cmd)
                    n += 1
            self.lines += n
        return n

    def add(self, d: dict[str, Any]) -> None:
        """Take in one event that is not in this index's files (e.g. a gateway's own `lost`)."""
        with self._lock:
            self._add(d, d.get("kind") == EXEC)

    def _add(self, d: dict[str, Any], is_cmd: bool) -> None:
        sid = str(d.get("id"))
        slot = self._by_sandbox.get(sid)
        if slot is None:
            slot = self._by_sandbox[sid] = (collections.deque(maxlen=self.per_sandbox),
                                            collections.deque(maxlen=self.commands_per_sandbox))
            while len(self._by_sandbox) > self.max_sandboxes:
                self._by_sandbox.popitem(last=False)
        else:
            self._by_sandbox.move_to_end(sid)
        slot[1 if is_cmd else 0].append(d)
        if not is_cmd:
            self.recent.append(d)

    def of(self, sandbox_id: str, *, commands: bool = False) -> list[dict[str, Any]]:
        """A sandbox's lifecycle events (or, with `commands`, its commands), oldest first."""
        with self._lock:
            slot = self._by_sandbox.get(sandbox_id)
            return [] if slot is None else list(slot[1 if commands else 0])

    def query(self, *, project: str | None = None, kinds: Iterable[str] | None = None, since: float | None = None,
              limit: int = 200) -> list[dict[str, Any]]:
        """The newest lifecycle events of all sandboxes (of one project), oldest first."""
        want = set(kinds) if kinds else None
        with self._lock:
            out = [d for d in reversed(self.recent) if _match(d, None, project, want, since)][:limit]
        out.reverse()
        return out
