"""The homes of test sessions (/tmp/sht-XXXXXXXX) and the teardown of those whose session was killed.

A session's home holds an owner file naming its pytest process (pid + start time, shoal.bench.homes), written
before anything is mounted in it. A session killed with SIGKILL (a CI timeout, a machine stopped mid-run)
leaves its sandboxes, layer mounts, upper pool and the FUSE mounts of its dead layer readers behind; a dead
FUSE mount elsewhere on the host then trips tools such as mkfs.btrfs. The next session tears such homes down
first. Homes of sessions still running (several suites may share a machine) and homes without an owner file
are left alone.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

#: short, because the sandboxes' Unix sockets live in the home
PREFIX = "sht-"
ROOT = Path("/tmp")


def new_home() -> Path:
    """A fresh session home, owned by this process."""
    from shoal.bench import homes

    home = Path(tempfile.mkdtemp(prefix=PREFIX, dir=ROOT))
    homes.claim(home)
    return home


def dead_homes() -> list[Path]:
    """Homes of sessions whose process is gone."""
    from shoal.bench import homes

    return [h for h in sorted(ROOT.glob(f"{PREFIX}*"))
            if (h / homes.OWNER_FILE).is_file() and not homes.owner_alive(h)]


def reap_dead(store: str | None = None) -> dict[str, list[str]]:
    """Tear down every dead session's home (sandboxes, mounts, loop devices, the directory); returns
    {home: what could not be removed}."""
    from shoal.bench import homes

    store = store or os.environ.get("SHOAL_TEST_STORE", "/var/lib/shoal/store")
    out: dict[str, list[str]] = {}
    for home in dead_homes():
        try:
            left = asyncio.run(homes.teardown(home, store))
        except Exception as e:  # a home it cannot undo must not stop the suite: it is reported instead
            out[str(home)] = [f"teardown failed: {e!r}"]
            continue
        out[str(home)] = left.mounts + left.loops
    return out
