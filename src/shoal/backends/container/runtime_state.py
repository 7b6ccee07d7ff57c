"""Sweep the state OCI runtimes keep for shoal containers that are gone.

crun and runc keep one directory per container under their state root (/run/crun, /run/runc) until
`delete`. A node closing a sandbox removes it (shoal.backends.container.kill_and_forget), but a node
process killed mid-run whose home was then deleted — a `shoal bench` or a test home torn down by hand —
leaves entries whose init is dead and whose bundle directory no longer exists: `crun list` shows them
forever and nothing else will ever delete them. The node's reconcile removes exactly those: named
`shoal-*`, init not running (or its pid reused by another process), bundle gone. Anything else —
a running container, one whose bundle still exists (its node will close it), another tool's
container, a state file this code cannot read — is left alone.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from shoal.backends.container.runtime import CrunRuntime, RuncRuntime

log = logging.getLogger(__name__)

PREFIX = "shoal-"


def _crun(d: Path) -> tuple[int, int | None, str] | None:
    data = json.loads((d / "status").read_text())
    return int(data["pid"]), data.get("process-start-time"), str(data["bundle"])


def _runc(d: Path) -> tuple[int, int | None, str] | None:
    data = json.loads((d / "state.json").read_text())
    labels = (data.get("config") or {}).get("labels") or []
    bundle = next((lab.split("=", 1)[1] for lab in labels if lab.startswith("bundle=")), None)
    if bundle is None:
        return None
    return int(data["init_process_pid"]), data.get("init_process_start"), bundle


def _state(d: Path) -> tuple[int, int | None, str] | None:
    """(init pid, its start time in clock ticks or None, bundle path) from either runtime's state file."""
    for read in (_crun, _runc):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            got = read(d)
            if got is not None:
                return got
    return None


def _running(pid: int, start: int | None) -> bool:
    from shoal.records import proc_starttime

    now = proc_starttime(pid) if pid > 0 else None
    return now is not None and (start is None or int(start) == now)


def default_roots() -> list[Path]:
    """The state roots of the runtimes whose state shoal reads (crun, runc)."""
    return [r for r in (CrunRuntime.state_root, RuncRuntime.state_root) if r is not None]


def sweep_stale(roots: Iterable[Path] | None = None) -> list[str]:
    """Remove the runtime state of shoal containers whose init is dead and whose bundle is gone (see the
    module docstring). Returns the container IDs removed."""
    removed: list[str] = []
    for root in default_roots() if roots is None else roots:
        try:
            entries = list(os.scandir(root))
        except OSError:
            continue
        for e in entries:
            if not e.name.startswith(PREFIX) or not e.is_dir(follow_symlinks=False):
                continue
            st = _state(Path(e.path))
            if st is None:
                continue
            pid, start, bundle = st
            if os.path.exists(bundle) or _running(pid, start):
                continue
            shutil.rmtree(e.path, ignore_errors=True)
            if not os.path.exists(e.path):
                removed.append(e.name)
    if removed:
        log.info("removed the runtime state of %d stopped container(s) whose sandbox home is gone: %s",
                 len(removed), ", ".join(removed[:5]))
    return removed
