"""One small JSON record per sandbox on local disk: the node agent's only durable state.

Crash-only design: a node agent that dies (kill -9) loses nothing; the next one reads these records,
checks each sandbox's init process, and re-adopts the live ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.errors import InvalidRequest, SandboxNotFound
from shoal.fsutil import read_json
from shoal.limits import check_labels

if TYPE_CHECKING:
    from shoal.spec import SandboxSpec

_B32 = "abcdefghijklmnopqrstuvwxyz234567"


def new_sandbox_id(node_id: str) -> str:
    """`<node>-<26 chars>`: 128 random bits (unguessable) prefixed by the node that owns it."""
    n = int.from_bytes(secrets.token_bytes(16), "big")
    chars = []
    for _ in range(26):
        chars.append(_B32[n & 31])
        n >>= 5
    return f"{node_id}-{''.join(chars)}"


def node_of(sandbox_id: str) -> str:
    """The node encoded in a sandbox ID (DSec-style routing without a lookup)."""
    return sandbox_id.rsplit("-", 1)[0]


def check_sandbox_id(sandbox_id: str) -> str:
    """Validate an ID's shape before it is used as a path component."""
    node, _, rnd = sandbox_id.rpartition("-") if isinstance(sandbox_id, str) else ("", "", "")
    if not node or len(rnd) != 26 or any(c not in _B32 for c in rnd) or len(node) > 32 or \
            not all(c.isalnum() or c in "-_" for c in node):
        raise SandboxNotFound(f"no sandbox {sandbox_id!r} (malformed ID)")
    return sandbox_id


def proc_starttime(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a live process, None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # comm may contain spaces and parens: fields start after the last ')'
    rest = data[data.rfind(b")") + 2 :].split()
    try:
        if rest[0] == b"Z":
            return None
        return int(rest[19])
    except (IndexError, ValueError):
        return None


_identity: tuple[int, int] | None = None


def my_identity() -> tuple[int, int]:
    """(pid, starttime) of this process: identifies an owner even across pid reuse."""
    global _identity
    pid = os.getpid()
    if _identity is None or _identity[0] != pid:  # (recomputed in a forked child)
        _identity = (pid, proc_starttime(pid) or 0)
    return _identity


@dataclass
class SandboxRecord:
    """Everything needed to find, reach and clean up one sandbox."""

    id: str
    backend: str
    image: str
    image_digest: str
    layers: list[str]  # layer hexes, bottom first
    #: the spec it was made with (record.json holds its JSON form; SandboxRecord.load reads older forms too)
    spec: SandboxSpec
    dir: str
    state: str = "creating"
    runtime: str = ""
    cid: str = ""
    cgroup: str = ""
    init_pid: int = 0
    init_start: int = 0
    owner_pid: int = 0
    owner_start: int = 0
    netns: str = ""
    created_at: float = field(default_factory=time.time)
    expires_at: float | None = None
    project: str = "default"
    labels: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        """The sandbox directory."""
        return Path(self.dir)

    def to_dict(self) -> dict[str, Any]:
        """The record as plain JSON-able data (shallow copies of its dicts and lists)."""
        out: dict[str, Any] = {}
        for name in _FIELDS:
            v = getattr(self, name)
            out[name] = v.copy() if isinstance(v, (dict, list)) else v
        out["spec"] = _spec_json(self.spec)  # (its JSON form: fresh dicts and lists)
        return out

    def save(self) -> None:
        """Persist atomically (rename). No fsync: sandboxes do not outlive the host anyway."""
        # compact JSON (C encoder) written with plain syscalls: this runs twice per create and once per
        # close, and asdict() + indented JSON (pure-Python encoder) + pathlib cost more than the write
        data = json.dumps(self.to_dict(), separators=(",", ":")).encode()
        final = os.path.join(self.dir, "record.json")
        tmp = os.path.join(self.dir, f".record.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        try:
            os.rename(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def init_alive(self) -> bool:
        """True when the sandbox's init (the agent, or the VMM) still runs."""
        return bool(self.init_pid) and proc_starttime(self.init_pid) == self.init_start

    def owner_alive(self) -> bool:
        """True when the process creating this sandbox still runs (its half-made state is not garbage)."""
        return bool(self.owner_pid) and proc_starttime(self.owner_pid) == self.owner_start

    @classmethod
    def load(cls, sandbox_dir: Path) -> SandboxRecord:
        """Read a record; SandboxNotFound if absent or unreadable. Its spec is read with
        `SandboxSpec.from_wire`, so a record.json of an earlier release (fields it lacked, fields since
        removed) loads too."""
        path = os.path.join(sandbox_dir, "record.json")
        try:
            st = os.stat(path)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            hit = _parsed.get(path)
            if hit is not None and hit[0] == key:
                data, spec = hit[1], hit[2]
            else:
                data = read_json(Path(path))
                if not isinstance(data, dict):
                    raise ValueError("not a JSON object")
                from shoal.spec import SandboxSpec

                stored = data.pop("spec", None)
                spec = SandboxSpec.from_wire(stored if isinstance(stored, dict) else {})
                if len(_parsed) > 200_000:
                    _parsed.clear()
                _parsed[path] = (key, data, spec)
        except (FileNotFoundError, NotADirectoryError):
            _parsed.pop(path, None)
            raise SandboxNotFound(f"no sandbox {sandbox_dir.name!r}") from None
        except ValueError as e:
            raise SandboxNotFound(f"sandbox {sandbox_dir.name!r} has a corrupt record: {e}") from None
        return cls(**{k: _copy(v) if type(v) in (dict, list) else v for k, v in data.items() if k in _FIELD_SET},
                   spec=spec_copy(spec))


_FIELDS = tuple(f.name for f in fields(SandboxRecord) if f.name != "spec")  # (the spec is read and written apart)
_FIELD_SET = frozenset(_FIELDS)
# Parsed records by path, keyed by (inode, mtime, size): a save replaces the file (new inode), so an
# unchanged key means unchanged content. The reaper reads every record every few seconds; with thousands
# of sandboxes a stat instead of open+read+parse each time matters.
_parsed: dict[str, tuple[tuple[int, int, int], dict[str, Any], SandboxSpec]] = {}


def spec_copy(spec: SandboxSpec) -> SandboxSpec:
    """A copy of a spec whose dicts and lists are its own, for a record to keep (a caller may change its
    spec, or a loaded record's, later): no validation, a tenth of what building it from its JSON costs."""
    c = spec.model_copy()
    d = c.__dict__
    for name in _SPEC_CONTAINERS:
        v = d[name]
        if type(v) in (dict, list):
            d[name] = v.copy()
    return c


def _spec_json(spec: SandboxSpec) -> dict[str, Any]:
    # what model_dump() gives for this flat model, in a fraction of its time (a record is saved twice per create)
    d = dict(spec.__dict__)
    for name in _SPEC_CONTAINERS:
        v = d[name]
        if type(v) in (dict, list):
            d[name] = v.copy()
    return d


#: the spec's fields that may hold a dict or a list (JSON data: one level deep; test_records checks the list)
_SPEC_CONTAINERS = ("env", "labels", "network", "egress_grants")


def cached_records() -> int:
    """Parsed records kept in the cache now."""
    return len(_parsed)


def forget_record(sandbox_dir: Path) -> None:
    """Drop a closed sandbox's parsed record from the cache (a node that runs for days closes millions)."""
    _parsed.pop(os.path.join(sandbox_dir, "record.json"), None)


def _copy(v: Any) -> Any:
    # callers may change a loaded record: never hand out the cached containers themselves (JSON data:
    # only dicts and lists are mutable)
    t = type(v)
    if t is dict:
        return {k: _copy(x) if type(x) in (dict, list) else x for k, x in v.items()}
    if t is list:
        return [_copy(x) if type(x) in (dict, list) else x for x in v]
    return v


def list_records(sandboxes_dir: Path) -> list[SandboxRecord]:
    """All readable records, oldest first."""
    out = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(sandboxes_dir):
            if entry.is_dir() and not entry.name.startswith("."):
                with contextlib.suppress(SandboxNotFound, TypeError):
                    out.append(SandboxRecord.load(Path(entry.path)))
    out.sort(key=lambda r: r.created_at)
    return out


def validate_labels(labels: dict[str, str]) -> dict[str, str]:
    """Labels are short string pairs; reject anything else with a clear message."""
    if not isinstance(labels, dict):
        raise InvalidRequest("labels must be a mapping of strings to strings")
    for k, v in labels.items():
        if not isinstance(k, str) or not isinstance(v, str) or not k or len(k) > 128 or len(v) > 1024:
            raise InvalidRequest(f"bad label {str(k)[:60]!r}={str(v)[:60]!r}: keys 1-128 chars, values ≤1024 "
                                 "chars, both strings")
    # every record, listing and API answer carries them: a few short pairs, not a data store
    return dict(check_labels(labels))
