"""Per-project limits on bytes in the image store (`Quota.max_store_mb`).

A project's images are the store names under `projects/<project>/` (see deps.Namespace). Its usage is
the size of the distinct layers those images reference, minus layers that images outside every
project (the operator's `base`, shared toolkits) also reference: a snapshot pays for what it added,
not for the image it started from.

Operations that add layers check the quota first: a snapshot or fork gets the bytes left as its
layer budget (the node refuses a layer that could be larger before writing anything), builds and
imports are refused once the project is at its quota. One operation per project at a time runs
under the quota (a lock), so two concurrent snapshots cannot both spend the same remaining bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from shoal.errors import ImageNotFound, InvalidRequest, QuotaExceeded
from shoal.images.store import ImageStore
from shoal.server.deps import PROJECT_IMAGES
from shoal.server.tokens import Principal

_locks: dict[str, asyncio.Lock] = {}


def store_usage(store: ImageStore, project: str) -> int:
    """Bytes of the layers `project`'s images hold in the store (shared images' layers not counted)."""
    prefix = f"{PROJECT_IMAGES}{project}/"
    mine: set[str] = set()
    shared: set[str] = set()
    manifests: dict[str, list[str]] = {}
    for name, _tag, mdigest in store.tags():
        if mdigest not in manifests:
            try:
                manifests[mdigest] = list(store.manifest(mdigest).get("layers") or [])
            except (ImageNotFound, InvalidRequest, OSError, ValueError):
                manifests[mdigest] = []
        if name.startswith(prefix):
            mine.update(manifests[mdigest])
        elif not name.startswith(PROJECT_IMAGES):
            shared.update(manifests[mdigest])
    total = 0
    for digest in mine - shared:
        with contextlib.suppress(ImageNotFound, InvalidRequest, OSError, ValueError):
            total += store.layer(digest).size
    return total


def _limit(who: Principal) -> int | None:
    q = who.quota.max_store_mb
    return None if who.admin or q is None else int(q) << 20


@contextlib.asynccontextmanager
async def store_budget(store: ImageStore, who: Principal, what: str) -> AsyncIterator[int | None]:
    """Hold the project's store lock and yield the bytes it may still add (None: no store quota).
    QuotaExceeded when nothing is left."""
    limit = _limit(who)
    if limit is None:
        yield None
        return
    lock = _locks.setdefault(who.project, asyncio.Lock())
    async with lock:
        used = await asyncio.to_thread(store_usage, store, who.project)
        if used >= limit:
            raise QuotaExceeded(
                f"project {who.project!r} holds {used / 2**20:.0f} MiB in the image store, at its quota of "
                f"{limit >> 20} MiB (max_store_mb): {what} would add more. Remove images of the project "
                "(DELETE /v1/images/{ref}) or ask the operator to raise the quota",
                project=who.project, quota="max_store_mb", limit=limit >> 20, used=round(used / 2**20, 1))
        yield limit - used
