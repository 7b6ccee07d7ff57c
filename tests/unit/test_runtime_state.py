"""shoal.backends.container.runtime_state: only the state of shoal containers that stopped and whose bundle is gone
is removed; running containers, live bundles, other tools' containers and unreadable state stay."""

from __future__ import annotations

import json
import os
from pathlib import Path

from shoal.backends.container.runtime_state import sweep_stale
from shoal.records import proc_starttime


def _dead_pid() -> int:
    pid = 4_000_000
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


def _crun(root: Path, name: str, pid: int, start: int | None, bundle: Path) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "status").write_text(json.dumps({"pid": pid, "process-start-time": start, "bundle": str(bundle)}))
    return d


def _runc(root: Path, name: str, pid: int, start: int | None, bundle: Path) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "state.json").write_text(json.dumps({"init_process_pid": pid, "init_process_start": start,
                                              "config": {"labels": [f"bundle={bundle}"]}}))
    return d


def test_sweeps_only_stopped_shoal_containers_whose_bundle_is_gone(tmp_path: Path) -> None:
    crun, runc = tmp_path / "crun", tmp_path / "runc"
    gone, here = tmp_path / "deleted-home" / "sb", tmp_path / "home" / "sb"
    here.mkdir(parents=True)
    me, my_start = os.getpid(), proc_starttime(os.getpid())
    dead = _dead_pid()
    stale_crun = _crun(crun, "shoal-n0-a", dead, 123, gone)
    stale_runc = _runc(runc, "shoal-n0-b", dead, 123, gone)
    reused = _crun(crun, "shoal-n0-c", me, (my_start or 0) + 1, gone)  # the pid now belongs to another process
    running = _crun(crun, "shoal-n0-d", me, my_start, gone)
    live_bundle = _crun(crun, "shoal-n0-e", dead, 123, here)
    other = _crun(crun, "someone-else", dead, 123, gone)
    unreadable = crun / "shoal-n0-f"
    unreadable.mkdir()
    (unreadable / "status").write_text("{not json")
    removed = sweep_stale([crun, runc, tmp_path / "no-such-runtime"])
    assert sorted(removed) == ["shoal-n0-a", "shoal-n0-b", "shoal-n0-c"]
    assert not stale_crun.exists() and not stale_runc.exists() and not reused.exists()
    assert running.exists() and live_bundle.exists() and other.exists() and unreadable.exists()
    assert sweep_stale([crun, runc]) == []  # nothing more to do
