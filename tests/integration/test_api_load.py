"""1,000 concurrent create → exec → close over HTTP from one client: zero errors, zero leaks.

A count, not a clock: how fast this goes is measured by `shoal bench api`.
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest

import shoal
from shoal.server.proc import ServerProcess
from tests.conftest import runtime_containers

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(1800)]
N = 1000


async def test_thousand_concurrent_lifecycles_over_http(api_server: ServerProcess, shoal_home: Path) -> None:
    tag = secrets.token_hex(4)
    ids: list[str] = []

    async with shoal.Client(api_server.url, token=api_server.token, timeout=1200) as c:
        async def one(i: int) -> None:
            sb = await c.create("base", memory_mb=64, cpus=0.25, ttl_s=3600, labels={"load": tag})
            ids.append(sb.id)
            r = await sb.exec(["echo", f"sandbox {i}"])
            assert (r.exit_code, r.stdout) == (0, f"sandbox {i}\n".encode())
            await sb.close()

        results = await asyncio.gather(*(one(i) for i in range(N)), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        assert not errors, f"{len(errors)} of {N} failed; first: {errors[0]!r}"
        assert len(set(ids)) == N
        assert await c.list(labels={"load": tag}) == []

    # nothing of theirs remains on the host
    left_dirs = [i for i in ids if (shoal_home / "sandboxes" / i).exists()]
    assert not left_dirs, f"{len(left_dirs)} sandbox directories left, e.g. {left_dirs[:3]}"
    containers = set(runtime_containers())
    assert not [i for i in ids if f"shoal-{i}" in containers]
    with open("/proc/self/mountinfo") as f:
        mounts = f.read()
    assert not [i for i in ids if i in mounts]
