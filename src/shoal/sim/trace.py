"""Sandbox traces for `shoal sim`: the JSONL format, reading and writing it, and node event logs.

A trace is a JSON-lines file, one sandbox per line, sorted by arrival:

    {"t": 12.5, "lifetime": 1020, "image": "task-17", "cpus": 1, "memory_mb": 2048,
     "priority": "train-rollout", "job": "run0/step3"}

| field | meaning | default |
| --- | --- | --- |
| `t` | arrival, seconds from the start of the trace | required |
| `lifetime` | seconds from ready to close | required |
| `image` | image name (reports) | `"base"` |
| `layers` | layer ids, bottom first (locality, cold mounts) | `[image]` |
| `cpus`, `memory_mb` | what the sandbox asks for | 1, 1024 |
| `priority` | priority class | the policy's default (`interactive`) |
| `job`, `project` | fair-share identity | `"project:<project>"`, `"default"` |
| `used_mb` | memory it really holds while running | `memory_mb / 4` |
| `cpu_frac` | fraction of its CPUs it really uses | 0.05 |
| `active_s` | seconds after ready during which it gets calls; idle afterwards | `lifetime` |
| `final_call` | a last call (grading) comes at close time, so a paused sandbox must resume first | true |
| `burst` | id of the burst it arrived in (burst completion times) | none |

shoal nodes can record their own events (`SHOAL_TRACE_FILE`, see `shoal.node.tracelog`): lines of
`{"event": "create", "t": <unix time>, "id": ..., <the fields above but t/lifetime>}` and
`{"event": "close", "t": ..., "id": ...}`. `read_trace` accepts such a log too and joins each
create with its close (a sandbox never closed lives to the end of the log).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from shoal.errors import InvalidRequest

_FIELDS = ("t", "lifetime", "image", "layers", "cpus", "memory_mb", "priority", "job", "project", "used_mb",
           "cpu_frac", "active_s", "final_call", "burst")


@dataclass(slots=True)
class TraceRecord:
    """One sandbox of a trace (see the module docstring for each field)."""

    t: float
    lifetime: float
    image: str = "base"
    layers: tuple[str, ...] = ()
    cpus: float = 1.0
    memory_mb: int = 1024
    priority: str = ""
    job: str = ""
    project: str = "default"
    used_mb: int = -1
    cpu_frac: float = 0.05
    active_s: float = -1.0
    final_call: bool = True
    burst: str | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            self.layers = (self.image,)
        if self.used_mb < 0:
            self.used_mb = self.memory_mb // 4
        if self.active_s < 0:
            self.active_s = self.lifetime

    def to_dict(self) -> dict[str, Any]:
        """The JSONL form (fields at their defaults left out)."""
        d: dict[str, Any] = {"t": round(self.t, 4), "lifetime": round(self.lifetime, 3), "image": self.image}
        if self.layers != (self.image,):
            d["layers"] = list(self.layers)
        d.update(cpus=self.cpus, memory_mb=self.memory_mb)
        for k in ("priority", "job"):
            if getattr(self, k):
                d[k] = getattr(self, k)
        if self.project != "default":
            d["project"] = self.project
        d.update(used_mb=self.used_mb, cpu_frac=round(self.cpu_frac, 4))
        if self.active_s != self.lifetime:
            d["active_s"] = round(self.active_s, 3)
        if not self.final_call:
            d["final_call"] = False
        if self.burst is not None:
            d["burst"] = self.burst
        return d


def record_from_dict(d: dict[str, Any], where: str = "") -> TraceRecord:
    """A TraceRecord from one parsed line; InvalidRequest naming the line and field when it is wrong."""
    unknown = set(d) - set(_FIELDS)
    if unknown:
        raise InvalidRequest(f"{where}unknown trace field(s) {sorted(unknown)}; known: {', '.join(_FIELDS)}")
    try:
        t = float(d["t"])
        life = float(d["lifetime"])
    except KeyError as e:
        raise InvalidRequest(f"{where}a trace line needs {e.args[0]!r}") from None
    except (TypeError, ValueError):
        raise InvalidRequest(f"{where}'t' and 'lifetime' must be numbers of seconds") from None
    if not (t >= 0 and life >= 0):
        raise InvalidRequest(f"{where}'t' and 'lifetime' must be >= 0")
    kw: dict[str, Any] = {}
    try:
        for k, conv in (("image", str), ("cpus", float), ("memory_mb", int), ("priority", str), ("job", str),
                        ("project", str), ("used_mb", int), ("cpu_frac", float), ("active_s", float),
                        ("final_call", bool)):
            if d.get(k) is not None:
                kw[k] = conv(d[k])
        if d.get("layers"):
            if not isinstance(d["layers"], list):
                raise ValueError("layers")
            kw["layers"] = tuple(str(x) for x in d["layers"])
        if d.get("burst") is not None:
            kw["burst"] = str(d["burst"])
    except (TypeError, ValueError):
        raise InvalidRequest(f"{where}a field has the wrong type (see docs/scheduling.md, trace format)") from None
    if kw.get("memory_mb", 1024) <= 0 or kw.get("cpus", 1.0) <= 0:
        raise InvalidRequest(f"{where}cpus and memory_mb must be positive")
    return TraceRecord(t, life, **kw)


def write_trace(records: Iterable[TraceRecord], out: IO[str]) -> int:
    """Write records as JSONL; returns how many."""
    n = 0
    for r in records:
        out.write(json.dumps(r.to_dict(), separators=(",", ":")) + "\n")
        n += 1
    return n


def read_trace(path: str | Path) -> list[TraceRecord]:
    """Load a trace (sandbox lines or a node event log), sorted by arrival, times from 0."""
    recs: list[TraceRecord] = []
    creates: dict[str, dict[str, Any]] = {}
    closes: dict[str, float] = {}
    last_t = 0.0
    with open(path) as f:
        for no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            where = f"{path}:{no}: "
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidRequest(f"{where}not JSON ({e.msg})") from None
            if not isinstance(d, dict):
                raise InvalidRequest(f"{where}each line must be a JSON object")
            ev = d.pop("event", None)
            if ev is None:
                recs.append(record_from_dict(d, where))
                continue
            t = float(d.get("t", 0.0))
            last_t = max(last_t, t)
            sid = str(d.get("id", ""))
            if ev == "create":
                creates[sid] = d
            elif ev == "close":
                closes[sid] = t
            # other events (pause, resume, ...) do not change what the simulator replays
    if creates:
        t0 = min(float(d["t"]) for d in creates.values())
        for sid, d in creates.items():
            start = float(d.pop("t"))
            d.pop("id", None)
            d.pop("node", None)
            d["t"] = start - t0
            d["lifetime"] = max(0.0, closes.get(sid, last_t) - start)
            recs.append(record_from_dict(d, f"{path}: sandbox {sid}: "))
    recs.sort(key=lambda r: r.t)
    return recs


def iter_sorted(records: Iterable[TraceRecord]) -> Iterator[TraceRecord]:
    """Pass records through, checking they come in arrival order (the simulator streams them)."""
    last = float("-inf")
    for r in records:
        if r.t < last:
            raise InvalidRequest(f"trace is not sorted by arrival (t={r.t} after t={last})")
        last = r.t
        yield r
