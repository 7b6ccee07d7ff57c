"""config.json as each OCI runtime accepts it: a real root path, and /proc masks runc does not refuse.

(The runtimes themselves run in tests/integration/test_runtimes.py; this checks the config on plain files.)"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from shoal.backends.container.oci import MASKED_PATHS, _masked_dirs, _masked_files, build_config
from shoal.backends.container.runtime import CrunRuntime, GvisorRuntime, RuncRuntime


def _files(tmp_path: Path) -> dict[str, Any]:
    (tmp_path / "empty").mkdir()
    for name in ("empty-file", "cmdline"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "meminfo").write_text("MemTotal: 1 kB\n")
    return {"guest_dir": str(tmp_path / "agent"), "empty_dir": str(tmp_path / "empty"),
            "empty_file": str(tmp_path / "empty-file"),
            "proc_files": {"/proc/cmdline": str(tmp_path / "cmdline"), "/proc/meminfo": str(tmp_path / "meminfo")}}


def _config(tmp_path: Path, rootfs: str, proc_binds: frozenset[str] | None) -> dict[str, Any]:
    return build_config(rootfs=rootfs, hostname="h", env={}, cwd="/", cgroups_path="/x", cpus=1, memory_mb=64,
                        pids=16, proc_binds=proc_binds, **_files(tmp_path))


def test_root_path_is_resolved(tmp_path: Path) -> None:
    """The root is given to the runtime as a real path: runc refuses one with a symlink in it, and sandbox
    directories are symlinks into a tmpfs."""
    (tmp_path / "real" / "rootfs").mkdir(parents=True)
    os.symlink("real", tmp_path / "link")
    cfg = _config(tmp_path, str(tmp_path / "link" / "rootfs"), None)
    assert cfg["root"]["path"] == os.path.realpath(tmp_path / "real" / "rootfs")
    assert not Path(cfg["root"]["path"]).is_symlink() and "link" not in cfg["root"]["path"]


def _proc_binds(cfg: dict[str, Any]) -> set[str]:
    return {m["destination"] for m in cfg["mounts"]
            if m["type"] == "bind" and m["destination"].startswith("/proc/")}


@pytest.mark.parametrize("rt", [CrunRuntime, GvisorRuntime])
def test_runtimes_that_bind_anywhere_get_binds(tmp_path: Path, rt: type) -> None:
    """crun and gVisor take binds over every mask (crun's own file masks would bind the host's /dev/null,
    whose devtmpfs options show the host's RAM)."""
    cfg = _config(tmp_path, str(tmp_path), rt.proc_binds)
    proc = {p for p in _masked_dirs() + _masked_files() if p.startswith("/proc/")}
    assert _proc_binds(cfg) == proc | {"/proc/cmdline", "/proc/meminfo"}
    assert not set(cfg["linux"]["maskedPaths"]) & (proc | {"/proc/cmdline"})


def test_runc_gets_no_bind_inside_proc_it_refuses(tmp_path: Path) -> None:
    """runc refuses binds inside /proc except over LXCFS's files: every other /proc mask is one of runc's
    own maskedPaths (the same protection: empty /dev/null, empty read-only tmpfs), /sys masks stay binds."""
    cfg = _config(tmp_path, str(tmp_path), RuncRuntime.proc_binds)
    assert _proc_binds(cfg) <= RuncRuntime.proc_binds
    assert "/proc/meminfo" in _proc_binds(cfg)  # the sandbox's own meminfo is still bound
    masked = set(cfg["linux"]["maskedPaths"])
    assert "/proc/cmdline" in masked
    for p in MASKED_PATHS:
        bound = p in {m["destination"] for m in cfg["mounts"]}
        assert bound or p in masked, f"{p} is neither bound nor masked"
        if bound and p.startswith("/proc/"):
            assert p in RuncRuntime.proc_binds
    sys_binds = {m["destination"] for m in cfg["mounts"] if m["destination"].startswith("/sys/")}
    assert sys_binds == {p for p in _masked_dirs() + _masked_files() if p.startswith("/sys/")}


def test_a_refused_virtual_file_with_content_is_an_error(tmp_path: Path) -> None:
    """A /proc file with content (meminfo) cannot be replaced by a mask: a runtime that refuses its bind is
    refused, rather than the sandbox silently seeing the host's file or an empty one."""
    with pytest.raises(ValueError, match="/proc/meminfo"):
        _config(tmp_path, str(tmp_path), frozenset())
