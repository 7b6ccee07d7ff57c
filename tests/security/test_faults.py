"""Item 12 of issue 19: the node process crashes (SIGKILL) at each named step of create and close; the
next client (`shoal gc`) must leave nothing behind: no half-made sandbox, mount, writable layer, cgroup,
runtime container, network namespace, veth, bridge registration, allowlist chain, address lease or
layer user (shoal.node.leaks). The crash hook is shoal.faults (SHOAL_FAULT=<step>).

Each case runs in a private SHOAL_HOME with its own node id, so the checks see only what it made. The
sandbox it creates has an egress allowlist, so the network steps make every kind of network state.
The 10,000-cycle soak with random crashes is `python -m shoal.bench.faultsoak` (a small one runs here)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shoal.config import Paths, settings
from shoal.faults import STEPS
from shoal.node.leaks import find_leaks

pytestmark = [pytest.mark.root, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]

CLIENT = r"""
import asyncio, sys
import shoal
async def main():
    async with shoal.Client() as c:
        sb = await c.create("base", memory_mb=128, network=["198.18.255.1/32:80"])
        print(sb.id, flush=True)
        if sys.argv[1] == "close":
            await sb.close()
asyncio.run(main())
"""


@pytest.fixture(scope="module")
def fault_home(base_image: str):  # type: ignore[no-untyped-def]
    home = Path(tempfile.mkdtemp(prefix="shf-", dir="/tmp"))
    yield home
    env = _env(home, "f" + secrets.token_hex(2))
    subprocess.run([sys.executable, "-m", "shoal.cli.main", "node", "teardown", "--close-sandboxes", "--purge"],
                   env=env, capture_output=True, timeout=300)


def _env(home: Path, node_id: str, fault: str | None = None) -> dict[str, str]:
    env = dict(os.environ, SHOAL_HOME=str(home), SHOAL_NODE_ID=node_id)
    env.pop("SHOAL_FAULT", None)
    if fault:
        env["SHOAL_FAULT"] = fault
    return env


def _assert_clean(home: Path, node_id: str) -> None:
    leaks = find_leaks(Paths(home=home, store=Path(os.environ["SHOAL_STORE"])), node_id, settings().net_leases)
    left = {k: v for k, v in leaks.items() if v}
    # host-wide network kinds may show other nodes' sandboxes dying right now: only ours must be absent
    for kind in ("netns", "veths", "bridge_ports", "allowlist_chains", "leases_without_veth"):
        left.pop(kind, None)
    assert not left, left


@pytest.mark.parametrize("step", STEPS)
def test_a_crash_at_each_step_leaves_nothing_after_gc(step: str, fault_home: Path) -> None:
    node_id = "f" + secrets.token_hex(3)
    phase = "close" if step.startswith("close.") else "create"
    r = subprocess.run([sys.executable, "-c", CLIENT, phase], env=_env(fault_home, node_id, step),
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == -9, (r.returncode, r.stdout, r.stderr[-2000:])  # it crashed where asked
    made = list((fault_home / "sandboxes").iterdir())
    assert made, "the crash left no record: gc would have nothing to find"
    ids = {p.name for p in made}
    veths = {"sh" + i.rsplit("-", 1)[1][:10] for i in ids}
    gc = subprocess.run([sys.executable, "-m", "shoal.cli.main", "gc"], env=_env(fault_home, node_id),
                        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert gc.returncode == 0, gc.stderr[-2000:]
    _assert_clean(fault_home, node_id)
    # and the network state of exactly this sandbox is gone too
    net = find_leaks(Paths(home=fault_home, store=Path(os.environ["SHOAL_STORE"])), node_id,
                     settings().net_leases)
    ours = {k: [x for x in v if any(s[2:] in x for s in veths)] for k, v in net.items()
            if k in ("netns", "veths", "bridge_ports", "allowlist_chains")}
    assert not any(ours.values()), ours
    leases = settings().net_leases
    for name in os.listdir(leases) if leases.exists() else []:
        try:
            data = json.loads((leases / name).read_text())
        except (OSError, ValueError):
            continue
        assert not (isinstance(data, dict) and data.get("sandbox") in ids), f"lease {name} of {data} left"


@pytest.mark.slow
def test_small_soak_with_random_crashes(base_image: str) -> None:
    """A few dozen create/close cycles while the node crashes at random steps (3% at each): the restarted
    node (and a final gc) leave nothing. The 10,000-cycle run: `python -m shoal.bench.faultsoak`."""
    from shoal.bench.faultsoak import soak

    out = soak(cycles=30, p=0.03)
    assert out["worker_errors"] == 0 and out["gc_exit"] == 0, out
    assert out["crashes"] >= 1, out  # (0.97 ** 300: a run without a crash is a 1-in-10,000 event)
    assert out["leaked"] == 0, out["leaks"]
