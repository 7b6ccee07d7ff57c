"""`shoal node teardown`: refuses while sandboxes exist, then closes them on request, unmounts everything
the node set up in its SHOAL_HOME and, with --purge, deletes the directory."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root]


def _shoal(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SHOAL_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "shoal.cli.main", *args], env=env, capture_output=True,
                          text=True, timeout=300)


def _mounts_under(home: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [mp for mp in (line.split()[4] for line in f) if mp.startswith(f"{home}/")]


def test_teardown_refuses_then_closes_unmounts_and_purges(shoal_home: Path, base_image: str) -> None:
    home = Path(tempfile.mkdtemp(prefix="shtd-", dir="/tmp"))
    try:
        r = _shoal(home, "create", "base", "--ttl", "600")
        assert r.returncode == 0, r.stderr
        sid = r.stdout.strip().split()[-1]
        assert _mounts_under(home), "a sandbox's node mounts its upper pool and layers"
        r = _shoal(home, "node", "teardown")
        assert r.returncode == 1 and "1 sandbox(es) still exist" in r.stderr and sid in r.stderr
        assert _shoal(home, "exec", sid, "--", "true").returncode == 0, "a refused teardown touched nothing"
        r = _shoal(home, "node", "teardown", "--close-sandboxes", "--purge")
        assert r.returncode == 0, r.stderr
        assert "closed 1 sandbox(es)" in r.stderr
        assert not home.exists() and _mounts_under(home) == []
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert sid not in ps
    finally:
        if home.exists():
            _shoal(home, "node", "teardown", "--close-sandboxes", "--purge")
