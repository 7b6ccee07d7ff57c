"""The store's view of a reference: `name[:tag]` or `name@sha256:<hex>`, where `name` is the familiar
name (see shoal.images.reference for the grammar, Docker's, and how names map)."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.errors import InvalidRequest
from shoal.images.reference import DEFAULT_TAG, parse_reference, store_name_ok

__all__ = ["DEFAULT_TAG", "ImageRef", "parse_ref"]


@dataclass(frozen=True)
class ImageRef:
    """A parsed reference as the store keys it. Exactly one of `tag` / `digest` is set (a digest decides)."""

    name: str
    tag: str | None = DEFAULT_TAG
    digest: str | None = None

    def __str__(self) -> str:
        return f"{self.name}@{self.digest}" if self.digest else f"{self.name}:{self.tag}"


def parse_ref(ref: str) -> ImageRef:
    """Parse any reference Docker accepts (and shoal's own names) into the store's (name, tag | digest)."""
    r = parse_reference(ref)
    if not store_name_ok(r.name):
        raise InvalidRequest(f"image name {r.name!r} is too long for the store (at most 255 bytes once quoted)")
    if r.digest:
        return ImageRef(name=r.name, tag=None, digest=r.digest)
    return ImageRef(name=r.name, tag=r.tag or DEFAULT_TAG)
