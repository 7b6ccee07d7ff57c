"""Image references: `name[:tag]` and `name@sha256:<hex>`, validated strictly."""

from __future__ import annotations

import re
from dataclasses import dataclass

from shoal.errors import InvalidRequest

_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9._/-]{0,126}[a-z0-9])?$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
DEFAULT_TAG = "latest"


@dataclass(frozen=True)
class ImageRef:
    """A parsed reference. Exactly one of `tag` / `digest` is set."""

    name: str
    tag: str | None = DEFAULT_TAG
    digest: str | None = None

    def __str__(self) -> str:
        return f"{self.name}@{self.digest}" if self.digest else f"{self.name}:{self.tag}"


def parse_ref(ref: str) -> ImageRef:
    """Parse `name`, `name:tag` or `name@sha256:…`; raise InvalidRequest naming the bad part."""
    if not isinstance(ref, str) or not ref:
        raise InvalidRequest("image reference must be a non-empty string like 'base' or 'base:v1'")
    if "@" in ref:
        name, digest = ref.split("@", 1)
        if not _DIGEST.match(digest):
            raise InvalidRequest(f"bad image digest {digest!r}: expected sha256:<64 hex chars>")
        _check_name(name, ref)
        return ImageRef(name=name, tag=None, digest=digest)
    name, _, tag = ref.partition(":")
    tag = tag or DEFAULT_TAG
    _check_name(name, ref)
    if not _TAG.match(tag):
        raise InvalidRequest(
            f"bad image tag {tag!r} in {ref!r}: use letters, digits, '_', '.', '-' (at most 128 chars)")
    return ImageRef(name=name, tag=tag)


def _check_name(name: str, ref: str) -> None:
    if not _NAME.match(name) or "//" in name or ".." in name:
        raise InvalidRequest(
            f"bad image name {name!r} in {ref!r}: use lowercase letters, digits, '.', '_', '-', '/' "
            "(must start and end with a letter or digit, at most 128 chars)")
