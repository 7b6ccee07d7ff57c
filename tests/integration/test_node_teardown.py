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


_KILLED_SESSION = """
import asyncio, sys
from pathlib import Path
from shoal.bench import homes
import shoal

homes.claim(Path(sys.argv[1]))  # what a test session does with its home (tests.sessions.new_home)

async def main():
    c = shoal.Client()
    await c.__aenter__()
    sb = await c.create("base", ttl_s=600)
    assert (await sb.exec("true")).exit_code == 0
    print(sb.id, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def test_a_killed_session_is_torn_down_by_the_next(shoal_home: Path, base_image: str) -> None:
    """A session killed with SIGKILL leaves a live sandbox, its upper pool and layer mounts; the next
    session's start (tests.sessions.reap_dead, from pytest_sessionstart) closes and unmounts all of it and
    deletes the home. A home whose owner still runs is not touched."""
    from shoal.host import syscalls
    from tests import conftest, sessions

    home = Path(tempfile.mkdtemp(prefix=sessions.PREFIX, dir=sessions.ROOT))
    env = {**os.environ, "SHOAL_HOME": str(home)}
    sid = ""
    child = subprocess.Popen([sys.executable, "-c", _KILLED_SESSION, str(home)], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        sid = (child.stdout.readline() if child.stdout else "").strip()
        assert sid, child.stderr.read() if child.stderr else ""
        assert home not in sessions.dead_homes(), "a running session's home is not reaped"
        sessions.reap_dead()
        assert syscalls.mounts_under(str(home)) and conftest.runtime_containers()
    finally:
        child.kill()
        child.wait(timeout=60)
        if not sid:
            sessions.reap_dead()
    container = f"shoal-{sid}"
    assert container in conftest.runtime_containers(), "SIGKILL left the sandbox running"
    assert home in sessions.dead_homes()
    left = sessions.reap_dead()
    assert left.get(str(home)) == [], left
    assert not home.exists()
    assert not syscalls.mounts_under(str(home))
    assert container not in conftest.runtime_containers()
