"""The embedded Node's side of front operations beyond its data plane (shoal.front.Front): image builds
(which run sandboxes on this node and read their upper layers) and a sandbox's time to live. Kept out of
node.py, which only mixes this class in; the store-only image operations come from
`shoal.images.frontops.StoreImages`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from shoal.images.frontops import StoreImages

if TYPE_CHECKING:
    from shoal.images.dockerbuild import BuildOptions, BuildResult
    from shoal.images.recipe import Recipe
    from shoal.images.store import Image
    from shoal.node.statelock import SandboxLocks
    from shoal.records import SandboxRecord


class NodeFrontOps(StoreImages):
    """Builds and TTLs of the embedded node (mixed into Node: `self` is the Node)."""

    locks: SandboxLocks

    def record(self, sandbox_id: str) -> SandboxRecord:  # pragma: no cover - provided by Node
        """The sandbox's record."""
        raise NotImplementedError

    def _node(self) -> Any:
        # the Node this class is mixed into (named without importing shoal.node.node: no import circle)
        return cast(Any, self)

    async def build_base(self, ref: str = "base:latest") -> Image:
        """Build the built-in `base` image (mmdebstrap) into the store as `ref`."""
        from shoal.images.base import build_base

        return await asyncio.to_thread(build_base, self.store, ref)

    async def build_recipe(self, recipe: Recipe, *, no_cache: bool = False,
                           log: Callable[[str], None] | None = None) -> Image:
        """Build a recipe (its base already a store reference) step by step in sandboxes of this node."""
        from shoal.images.recipe import build_recipe

        return await build_recipe(self._node(), recipe, no_cache=no_cache, log=log)

    async def build_dockerfile(self, opts: BuildOptions, *, log: Callable[[str], None] | None = None,
                               resolve_base: Callable[[str], Any] | None = None) -> BuildResult:
        """`docker build` of a context directory on this host (shoal.images.dockerbuild)."""
        from shoal.images.dockerbuild import build_dockerfile

        return await build_dockerfile(self._node(), opts, log=log, resolve_base=resolve_base)

    async def set_ttl(self, sandbox_id: str, seconds: float, *, only_extend: bool = False) -> None:
        """Make the sandbox expire `seconds` from now (the reaper closes it then); `only_extend`: never
        shorten what it has."""
        async with self.locks.state(sandbox_id):
            rec = self.record(sandbox_id)
            new = time.time() + seconds
            if only_extend and rec.expires_at is not None and rec.expires_at >= new:
                return
            rec.expires_at = new
            rec.spec = rec.spec.model_copy(update={"ttl_s": float(seconds)})
            rec.save()
