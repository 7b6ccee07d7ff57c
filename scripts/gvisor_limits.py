"""Measure what a gVisor sandbox takes of the host past its limits (issue 23, item 10).

    SHOAL_HOME=$(mktemp -d) SHOAL_STORE=/var/lib/shoal/store SHOAL_PULL_POLICY=never \
        .venv/bin/python scripts/gvisor_limits.py

(a store that has `base`, and no pull: a fresh home's own store would ask Docker Hub for `base`)

A memory_mb=256 sandbox allocates (and touches) 2.6 GiB in 100 MiB steps: the peak PSS of the sandbox's
host processes (runsc-sandbox, its stubs, runsc-gofer) is sampled every 0.2 s. A pids=128 sandbox forks
2,000 sleeping children: how many it got, and whether it still answers. Prints one line each.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

import shoal

BOMB = r"""
import time
chunks = []
for i in range(26):
    b = bytearray(100 << 20)
    for j in range(0, len(b), 4096):
        b[j] = 1
    chunks.append(b)
    print(len(chunks) * 100, flush=True)
time.sleep(2)
"""
FORK = r"""
import os, time
n, pids = 0, []
try:
    for i in range(2000):
        p = os.fork()
        if p == 0:
            time.sleep(30)
            os._exit(0)
        pids.append(p)
        n += 1
except OSError as e:
    print("refused", e.errno, end=" ")
print("forked", n, flush=True)
for p in pids:
    os.kill(p, 9)
"""


def _tree_pss_mb(root: int) -> float:
    seen: set[int] = set()
    todo, total = [root], 0
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += sum(int(ln.split()[1]) for ln in f if ln.startswith("Pss:"))
            for t in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return total / 1024


def _runsc_roots(sid: str) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    cmd = f.read()
            except OSError:
                continue
            if cmd.startswith((b"runsc-sandbox", b"runsc-gofer")) and sid.encode() in cmd:
                out.append(int(p))
    return out


async def main() -> None:
    """Run both measurements and print them."""
    async with shoal.Client() as c:
        sb = await c.create("base", runtime="gvisor", memory_mb=256, pids=128)
        await sb.write_file("/tmp/bomb.py", BOMB.encode())
        roots = _runsc_roots(sb.id)
        task = asyncio.ensure_future(sb.exec(["python3", "/tmp/bomb.py"], timeout=180))
        peak = 0.0
        while not task.done():
            peak = max(peak, sum(_tree_pss_mb(r) for r in roots))
            await asyncio.sleep(0.2)
        try:
            r = task.result()
            got = f"exit {r.exit_code}, last step {r.stdout.decode().split()[-1:]} MiB"
        except shoal.ShoalError as e:
            got = f"{type(e).__name__}: {e.message[:100]}"
        print(f"memory_mb=256, 2.6 GiB asked: peak host PSS {peak:.0f} MiB; {got}")
        with contextlib.suppress(shoal.ShoalError):  # a sandbox the OOM killer already took
            await sb.close()
        sb = await c.create("base", runtime="gvisor", memory_mb=512, pids=128)
        await sb.write_file("/tmp/fork.py", FORK.encode())
        r = await sb.exec(["python3", "/tmp/fork.py"], timeout=300)
        alive = (await sb.exec("echo alive")).stdout.strip().decode()
        print(f"pids=128, 2,000 forks asked: {r.stdout.decode().strip()}; afterwards the sandbox answers {alive!r}")
        await sb.close()


if __name__ == "__main__":
    t0 = time.time()
    asyncio.run(main())
    print(f"({time.time() - t0:.0f} s; load {os.getloadavg()[0]:.1f})")
