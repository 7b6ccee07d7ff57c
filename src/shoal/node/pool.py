"""A warm pool: sandboxes created ahead of time per (image, limits) and handed out by create().

A pool hit costs a record update instead of a container start (well under a millisecond against
~10-15 ms), so a burst smaller than the pool is ready at once. It does not make creating cheaper: each
hit is refilled in the background by an ordinary create, which competes for the same CPUs (the
sustained create rate with a pool is the cold rate). Like kubernetes-sigs/agent-sandbox's
SandboxWarmPool; off unless configured (`Node.pool.configure`, or SHOAL_WARM_POOL="base=16,img2=4").

Pooled sandboxes are ordinary sandboxes whose record carries `extra["pool"]` (their key) and no TTL;
they are hidden from `Node.list`, owned by the node process that made them, closed when it stops, and
closed by `Node.reconcile` when that process is gone. What is baked into a running container (image,
limits, network, env, hostname, runtime) is the pool key; what only lives in the record (labels,
project, TTL, workdir, user, output cap) is set when the sandbox is handed out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from shoal.config import parse_warm_pool
from shoal.errors import InvalidRequest, SandboxNotFound, ShoalError
from shoal.models import SandboxInfo
from shoal.records import spec_copy

if TYPE_CHECKING:
    from shoal.images.store import Image
    from shoal.node.ports import PoolHost
    from shoal.spec import SandboxSpec

log = logging.getLogger(__name__)

#: spec fields a running sandbox cannot change (the rest is applied when a pooled sandbox is handed out)
BAKED = ("backend", "runtime", "cpus", "memory_mb", "pids", "disk_mb", "network", "env", "hostname", "cpu_class")


def pool_key(spec: SandboxSpec, image: Image) -> str:
    """The pool a spec draws from: the image version plus everything baked into the container."""
    baked = {f: getattr(spec, f) for f in BAKED}
    return image.digest + "|" + json.dumps(baked, sort_keys=True, separators=(",", ":"))


class _Pool:
    def __init__(self, key: str, spec: SandboxSpec, image: Image, size: int) -> None:
        self.key = key
        self.spec = spec
        self.image = image
        self.size = size
        self.ready: deque[str] = deque()
        self.inflight = 0
        self.task: asyncio.Task | None = None
        self.failures = 0


class WarmPool:
    """Warm pools of one node, keyed by `pool_key`."""

    def __init__(self, node: PoolHost, refill_concurrency: int = 4) -> None:
        self.node = node
        self.refill_concurrency = refill_concurrency
        self.pools: dict[str, _Pool] = {}
        self.hits = 0
        self.misses = 0

    @property
    def active(self) -> bool:
        """True when at least one pool is configured."""
        return bool(self.pools)

    def configure(self, spec: SandboxSpec, size: int) -> str:
        """Keep `size` sandboxes of `spec` ready (0 removes the pool; its sandboxes are closed by `trim`)."""
        from shoal.spec import check_spec

        check_spec(spec)
        if not 0 <= int(size) <= 100_000:
            raise InvalidRequest(f"warm pool size {size} must be between 0 and 100000")
        image = self.node.store.resolve(spec.image)
        key = pool_key(spec, image)
        pool = self.pools.get(key)
        if pool is None:
            # no TTL while waiting; a project of its own so quotas never count pooled sandboxes
            # (an internal project name, outside what users may name: model_copy does not validate)
            pool = self.pools[key] = _Pool(key, spec.model_copy(update={"labels": {}, "ttl_s": None,
                                                                        "project": "_pool"}), image,
                                           int(size))
        pool.size = int(size)
        self._kick(pool)
        return key

    def status(self) -> list[dict[str, Any]]:
        """Size, ready count and refills in flight of each pool."""
        return [{"image": p.image.ref, "size": p.size, "ready": len(p.ready), "refilling": p.inflight,
                 "spec": {f: getattr(p.spec, f) for f in BAKED}} for p in self.pools.values()]

    # ---- handing out -------------------------------------------------------------------------
    async def take(self, spec: SandboxSpec, image: Image) -> SandboxInfo | None:
        """A ready sandbox for `spec`, handed over to the caller; None on a miss."""
        pool = self.pools.get(pool_key(spec, image))
        if pool is None:
            return None
        node = self.node
        while pool.ready:
            sid = pool.ready.popleft()
            self._kick(pool)
            try:
                rec = node.record(sid)
            except SandboxNotFound:
                continue
            if rec.state != "running" or not node.backend(rec.backend).alive(rec):
                with contextlib.suppress(Exception):
                    await node.close(sid)
                continue
            now = time.time()
            rec.extra.pop("pool", None)
            rec.extra["pooled_s"] = round(now - rec.created_at, 3)
            rec.spec = spec_copy(spec)
            rec.labels = dict(spec.labels)
            rec.project = spec.project
            rec.created_at = now
            rec.expires_at = (now + float(spec.ttl_s)) if spec.ttl_s else None
            rec.save()
            node.sandbox_created(rec)
            self.hits += 1
            return node.describe(rec)
        self.misses += 1
        return None

    # ---- refilling ---------------------------------------------------------------------------
    def _kick(self, pool: _Pool) -> None:
        if pool.task is None or pool.task.done():
            pool.task = asyncio.get_running_loop().create_task(self._refill(pool), name="shoal-pool-refill")

    async def _refill(self, pool: _Pool) -> None:
        sem = asyncio.Semaphore(self.refill_concurrency)

        async def one() -> None:
            try:
                async with sem:
                    info = await self.node.start_sandbox(pool.spec.model_copy(), pool.image,
                                                         extra={"pool": pool.key})
                if pool.size > len(pool.ready) and self.pools.get(pool.key) is pool:
                    pool.ready.append(info.id)
                    pool.failures = 0
                else:  # the pool shrank meanwhile
                    await self.node.close(info.id)
            except ShoalError as e:
                pool.failures += 1
                log.warning("warm pool refill failed (%s): %s", pool.image.ref, e)
            finally:
                pool.inflight -= 1

        tasks: set[asyncio.Task] = set()
        try:
            while True:
                want = pool.size - len(pool.ready) - pool.inflight
                if want <= 0 and not tasks:
                    break
                if want > 0 and pool.failures < 3:
                    for _ in range(want):
                        pool.inflight += 1
                        tasks.add(asyncio.ensure_future(one()))
                if not tasks:
                    await asyncio.sleep(1.0 * pool.failures)  # back off after failures, then try again
                    pool.failures = max(0, pool.failures - 1)
                    continue
                _done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # the pool is closing: creates in flight are cancelled (each cleans up after itself) and
            # waited for, so none finishes later and leaves a sandbox nobody will hand out or close
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        await self.trim(pool)

    async def trim(self, pool: _Pool) -> None:
        """Close ready sandboxes beyond the pool's size."""
        while len(pool.ready) > pool.size:
            sid = pool.ready.pop()
            with contextlib.suppress(Exception):
                await self.node.close(sid)
        if pool.size == 0 and not pool.ready and not pool.inflight:
            self.pools.pop(pool.key, None)

    async def wait_full(self, timeout: float = 300.0) -> None:
        """Wait until every pool is at its size (for benchmarks and tests)."""
        deadline = time.monotonic() + timeout
        while any(len(p.ready) < p.size for p in self.pools.values()):
            if time.monotonic() > deadline:
                raise TimeoutError("warm pools did not fill in time")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        """Stop refilling and close every pooled sandbox (they belong to this process)."""
        pools = list(self.pools.values())
        self.pools.clear()
        for p in pools:
            p.size = 0
            if p.task is not None:
                p.task.cancel()
                with contextlib.suppress(BaseException):
                    await p.task
        ids = [sid for p in pools for sid in p.ready]
        await asyncio.gather(*(self.node.close(sid) for sid in ids), return_exceptions=True)


def parse_pool_env(value: str) -> dict[str, int]:
    """SHOAL_WARM_POOL="base=16,py:3.12=4" → {"base": 16, "py:3.12": 4} (default limits per image; the node's
    own pool comes from its config's warm_pool)."""
    try:
        return parse_warm_pool(value)
    except ValueError as e:
        raise InvalidRequest(f"SHOAL_WARM_POOL: {e}") from None
