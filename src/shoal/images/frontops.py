"""Image operations of the front protocol (shoal.front.Front) that need only an image store: list, look up,
remove, import, export and push. Mixed into the embedded `shoal.node.node.Node` (its own store) and the
cluster gateway's `ClusterFront` (the cluster's shared store, mounted where the gateway runs), so both
fronts answer them the same way; builds and registry pulls, which need a node, are each front's own.

Every method runs the store work off the event loop.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.config import Paths
    from shoal.images.export import ExportReport
    from shoal.images.oci import ImportReport
    from shoal.images.store import Image, ImageStore


class StoreImages:
    """The store-only image operations of a front (see the module doc); the class mixing it in sets
    `store` and `paths`."""

    store: ImageStore
    paths: Paths

    def _image_work_dir(self) -> Path:
        d = Path(self.paths.home) / "tmp"
        d.mkdir(parents=True, exist_ok=True)
        return d

    async def images(self) -> list[Image]:
        """Every image of the store (each project's included: callers filter what a project sees)."""
        return await asyncio.to_thread(self.store.list_images)

    async def image(self, ref: str) -> Image:
        """The stored image `ref` names (ImageNotFound when there is none; nothing is pulled)."""
        return await asyncio.to_thread(self.store.resolve, ref)

    async def image_exists(self, ref: str) -> bool:
        """True when the store holds an image of this reference."""
        return await asyncio.to_thread(self.store.exists, ref)

    async def remove_image(self, ref: str) -> None:
        """Remove a tag (its layers go at the store's `gc`)."""
        await asyncio.to_thread(self.store.remove_image, ref)

    async def import_image(self, path: Path | str, ref: str, *, select: str | None = None,
                           source_label: str | None = None) -> ImportReport:
        """Import a docker-archive or OCI-layout tarball on this host as `ref`."""
        from shoal.images.oci import import_archive

        return await asyncio.to_thread(import_archive, self.store, path, ref, select=select,
                                       source_label=source_label)

    async def import_registry(self, source: str, ref: str, *, tls_verify: bool = True) -> ImportReport:
        """Copy `docker://registry/name:tag` with skopeo and import it as `ref` (the older pull)."""
        from shoal.images.oci import pull_image

        return await asyncio.to_thread(pull_image, self.store, source, ref, tls_verify=tls_verify)

    async def export_image(self, ref: str, out: Path | str | IO[bytes], *,
                           repo_tags: list[str] | None = None) -> ExportReport:
        """Write image `ref` as a docker-archive to `out` (a path on this host or a binary file)."""
        from shoal.images.export import export_image

        work = self._image_work_dir()
        return await asyncio.to_thread(export_image, self.store, ref, out, repo_tags=repo_tags, work_dir=work)

    async def push_image(self, ref: str, target: str) -> ExportReport:
        """Push image `ref` to the registry reference `target` with this host's credentials."""
        from shoal.images.export import push_image

        work = self._image_work_dir()
        return await asyncio.to_thread(push_image, self.store, ref, target, work_dir=work)
