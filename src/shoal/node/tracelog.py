"""The node's own sandbox events as JSON lines (`SHOAL_TRACE_FILE`), for `shoal sim --trace FILE`.

One line per event, appended with a single write (so several node processes sharing a file do not
interleave lines): `create` (with what the simulator needs: image, layers, cpus, memory, priority,
job, project), `pause` (with who paused it: the user, preemption or tides), `resume` and `close`.
`shoal.sim.trace.read_trace` joins each create with its close to replay the run.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.sched.policy import LABEL_JOB, LABEL_PRIORITY

if TYPE_CHECKING:
    from shoal.spec import SandboxSpec

log = logging.getLogger(__name__)


class TraceLog:
    """Appends events to one JSONL file; a write error is logged once and never fails the operation."""

    def __init__(self, path: str | Path, node_id: str) -> None:
        self.path = Path(path)
        self.node_id = node_id
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._warned = False

    def _write(self, event: dict[str, Any]) -> None:
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        with self._lock:
            try:
                if self._fd is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
                os.write(self._fd, line)
            except OSError as e:
                if not self._warned:
                    self._warned = True
                    log.warning("cannot append to the trace file %s: %s (events are not recorded)", self.path, e)

    def created(self, sandbox_id: str, spec: SandboxSpec, image: str, layers: list[str],
                labels: dict[str, str]) -> None:
        """A sandbox is ready."""
        ev: dict[str, Any] = {"event": "create", "t": round(time.time(), 4), "id": sandbox_id, "node": self.node_id,
                              "image": image, "layers": layers, "cpus": spec.cpus,
                              "memory_mb": spec.memory_mb, "project": spec.project}
        if labels.get(LABEL_PRIORITY):
            ev["priority"] = labels[LABEL_PRIORITY]
        if labels.get(LABEL_JOB):
            ev["job"] = labels[LABEL_JOB]
        self._write(ev)

    def event(self, kind: str, sandbox_id: str, **extra: Any) -> None:
        """A pause, resume or close of a sandbox."""
        self._write({"event": kind, "t": round(time.time(), 4), "id": sandbox_id, **extra})

    def close(self) -> None:
        """Close the file (reopened by the next event)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
