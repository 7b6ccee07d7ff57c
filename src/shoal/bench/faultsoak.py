"""A soak of create/close cycles with random crashes of the node (issue 19, item 12).

`soak(cycles, p)` runs worker processes (`python -m shoal.bench.faultsoak --worker`) on a private
SHOAL_HOME with SHOAL_FAULT=random:p: each creates and closes sandboxes (every fourth one with an egress
allowlist, so the network steps run too) until it has done its share or crashes (SIGKILL at a random
step of create or close, shoal.faults). The next worker starts a node on the same home, whose
reconcile is "the next client"; the driver counts crashes and goes on until `cycles` cycles completed.
At the end `shoal gc` runs once more and shoal.node.leaks lists what is left: it must be nothing.

    python -m shoal.bench.faultsoak --cycles 10000 --p 0.003      # the soak (prints a JSON summary)
    python -m shoal.bench.faultsoak --cycles 10000 --max-seconds 3600   # stop starting workers after 1 h
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: an allowlist that needs no DNS: the network steps make every kind of network state
RULES = ["198.18.255.1/32:80"]


async def _work(cycles: int, progress: Path) -> None:
    import shoal
    from shoal.errors import CapacityExceeded

    done = int(progress.read_text() or 0) if progress.exists() else 0
    async with shoal.Client() as c:
        while done < cycles:
            net: Any = RULES if done % 4 == 3 else False
            try:
                sb = await c.create("base", memory_mb=64, network=net)
            except CapacityExceeded:
                # the machine is shared: a refusal under memory pressure is the node working, not a fault
                await asyncio.sleep(3)
                continue
            await sb.close()
            done += 1
            tmp = progress.with_name(progress.name + ".tmp")
            tmp.write_text(str(done))
            os.replace(tmp, progress)


def soak(cycles: int, p: float, store: str | None = None, log: Any = None,
         max_seconds: float | None = None) -> dict[str, Any]:
    """Run the soak (see the module docstring); returns cycles done, crashes, leaks and seconds. With
    `max_seconds` no worker starts after that long (the cycles done so far are reported)."""
    from shoal.config import Paths, settings
    from shoal.node.leaks import find_leaks

    home = Path(tempfile.mkdtemp(prefix="shs-", dir="/tmp"))
    node_id = "s" + secrets.token_hex(3)
    env = dict(os.environ, SHOAL_HOME=str(home), SHOAL_NODE_ID=node_id)
    if store:
        env["SHOAL_STORE"] = store
    progress = home / "soak.progress"
    crashes = errors = workers = 0
    t0 = time.monotonic()
    try:
        while True:
            done = int(progress.read_text() or 0) if progress.exists() else 0
            if done >= cycles or (max_seconds is not None and time.monotonic() - t0 > max_seconds):
                break
            workers += 1
            r = subprocess.run([sys.executable, "-m", "shoal.bench.faultsoak", "--worker", "--cycles", str(cycles),
                                "--progress", str(progress)], env=dict(env, SHOAL_FAULT=f"random:{p}"),
                               capture_output=True, text=True, timeout=3600)
            if r.returncode == -9:
                crashes += 1
            elif r.returncode != 0:
                errors += 1
                if log:
                    log(f"worker failed (exit {r.returncode}): {r.stderr[-1500:]}")
                if errors > 20:
                    raise RuntimeError(f"soak workers keep failing: {r.stderr[-1500:]}")
            if log and workers % 20 == 0:
                log(f"{done}/{cycles} cycles, {crashes} crashes")
        gc = subprocess.run([sys.executable, "-m", "shoal.cli.main", "gc"], env=env, capture_output=True, text=True,
                            timeout=600)
        paths = Paths(home=home, store=Path(env.get("SHOAL_STORE") or settings().store))
        leaks = find_leaks(paths, node_id, settings().net_leases)
        ours = {k: v for k, v in leaks.items()
                if v and k not in ("netns", "veths", "bridge_ports", "allowlist_chains", "leases_without_veth")}
        done = int(progress.read_text() or 0) if progress.exists() else 0
        return {"cycles": done, "cycles_asked": cycles, "crashes": crashes, "worker_errors": errors, "workers": workers,
                "seconds": round(time.monotonic() - t0, 1), "fault": f"random:{p}", "gc_exit": gc.returncode,
                "leaks": ours, "leaked": sum(len(v) for v in ours.values()),
                "host_network_orphans": {k: leaks[k] for k in ("netns", "veths", "bridge_ports",
                                                               "allowlist_chains", "leases_without_veth")}}
    finally:
        subprocess.run([sys.executable, "-m", "shoal.cli.main", "node", "teardown", "--close-sandboxes", "--purge"],
                       env=env, capture_output=True, timeout=600)


def main(argv: list[str] | None = None) -> None:
    """Entry point: the driver (`--cycles N --p P`) or one worker (`--worker`)."""
    ap = argparse.ArgumentParser(prog="python -m shoal.bench.faultsoak")
    ap.add_argument("--cycles", type=int, default=10_000)
    ap.add_argument("--p", type=float, default=0.003, help="crash probability at each step")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--progress")
    ap.add_argument("--max-seconds", type=float, help="start no worker after this many seconds")
    a = ap.parse_args(argv)
    if a.worker:
        asyncio.run(_work(a.cycles, Path(a.progress)))
        return
    out = soak(a.cycles, a.p, log=lambda m: print(m, file=sys.stderr, flush=True), max_seconds=a.max_seconds)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
