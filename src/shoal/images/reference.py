"""Image references as Docker writes them, and the store name each one maps to.

    parse_reference("python:3.13-slim-bookworm@sha256:…")
    -> Reference(registry="docker.io", repository="library/python", tag="3.13-slim-bookworm", digest="sha256:…")

The grammar is Docker's (distribution/reference): `[host[:port]/]path[:tag][@sha256:hex]`. The first
path component is a registry host when it contains a `.` or a `:`, or is `localhost`; otherwise the
registry is Docker Hub (`docker.io`), and a one-component Hub path gets `library/` in front
(`python` -> `docker.io/library/python`). `index.docker.io` and `registry-1.docker.io` are Docker Hub.

**Store names.** An image is kept in the store under its *familiar* name, the short form Docker prints:
`python:3.12`, `team/app:1`, `ghcr.io/org/img:tag`, `localhost:5000/x:1`. shoal's own names (`base`,
`task-17:step3`, `projects/p/env:v1`) are references too: a name without a registry host is a Docker Hub
name, exactly as in Docker (`docker tag x python:3.12` shadows the Hub's image there too). So:

- `python:3.12`, `docker.io/library/python:3.12` and `index.docker.io/library/python:3.12` are one image;
- a name in the store is used as it is; only a name *not* in the store is pulled (see shoal.images.pull);
- shoal names that Docker's grammar refuses but shoal always allowed (`my_._env`, `a/-b`) still work
  as local names: they are never pulled (`Reference.local_only`).

`name:tag@sha256:…`: the digest decides (as in Docker); the tag is kept only to show and to report.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

from shoal.errors import InvalidRequest

DOCKER_HUB = "docker.io"
#: where Docker Hub's registry API answers (`docker.io` itself does not serve /v2/)
DOCKER_HUB_API = "registry-1.docker.io"
_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io", "registry.hub.docker.com"})
DEFAULT_TAG = "latest"
#: the longest repository name Docker accepts (host and path together)
NAME_MAX = 255

# the pieces of distribution/reference's grammar
_ALNUM = r"[a-z0-9]+"
_SEP = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEP}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[0-9A-Fa-f:.]+\])"
_DOMAIN = rf"{_HOST}(?::[0-9]+)?"
_TAG_RE = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST_RE = r"sha256:[0-9a-f]{64}"
# shoal's own name grammar before references followed Docker's (kept: those names stay valid locally)
_LOCAL_NAME = r"[a-z0-9](?:[a-z0-9._/-]{0,126}[a-z0-9])?"

_PATH = re.compile(rf"^{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*$")
_DOMAIN_FULL = re.compile(rf"^{_DOMAIN}$")
_TAG = re.compile(rf"^{_TAG_RE}$")
_DIGEST = re.compile(rf"^{_DIGEST_RE}$")
_ANY_DIGEST = re.compile(r"^[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}$")
_LOCAL = re.compile(rf"^{_LOCAL_NAME}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")

#: a regular expression every reference this module parses matches (and a little more: the parser has the
#: last word). For schemas that need a pattern (pydantic, OpenAPI): no look-arounds, anchors included.
REFERENCE_PATTERN = (rf"^(?:{_DOMAIN}/)?[a-z0-9][a-z0-9._/-]*"
                     rf"(?::{_TAG_RE})?(?:@{_DIGEST_RE})?$")
#: the longest reference `parse_reference` reads at all
REFERENCE_MAX = NAME_MAX + 140
#: the repository name (all before the tag or digest) is at most NAME_MAX long: a second pattern over the same
#: text, since one pattern cannot bound a part of another without look-arounds. The tag suffix here can only
#: start at the last ':' after the last '/' (a tag holds no '/' or ':'), as the parser reads it.
NAME_LENGTH_PATTERN = rf"^[^@]{{1,{NAME_MAX}}}(?::{_TAG_RE})?(?:@{_DIGEST_RE})?$"
#: the same for the name of a new image (a tag, never a digest)
NEW_NAME_PATTERN = rf"^(?:{_DOMAIN}/)?[a-z0-9][a-z0-9._/-]*(?::{_TAG_RE})?$"


@dataclass(frozen=True)
class Reference:
    """A parsed image reference.

    `registry` is the registry host (`docker.io` for Docker Hub; `host:port` when a port is given),
    `repository` the path inside it (`library/python`), `tag` and `digest` what the text gave (the tag
    defaults to `latest` when neither is given). `explicit_registry` says whether the text named a host.
    `local_only` marks a shoal name outside Docker's grammar: it is looked up in the store, never pulled.
    """

    registry: str
    repository: str
    tag: str | None = DEFAULT_TAG
    digest: str | None = None
    explicit_registry: bool = False
    local_only: bool = False

    # ---- the forms of a reference ------------------------------------------------------------
    @property
    def name(self) -> str:
        """The familiar repository name, the store's key: `python`, `team/app`, `ghcr.io/org/img`."""
        if self.local_only:
            return self.repository
        if self.registry == DOCKER_HUB:
            if self.repository.startswith("library/") and self.repository.count("/") == 1:
                return self.repository[len("library/"):]
            return self.repository
        return f"{self.registry}/{self.repository}"

    @property
    def canonical_name(self) -> str:
        """The fully qualified repository name: `docker.io/library/python`."""
        return self.repository if self.local_only else f"{self.registry}/{self.repository}"

    def _suffix(self) -> str:
        s = f":{self.tag}" if self.tag else ""
        return s + (f"@{self.digest}" if self.digest else "")

    @property
    def canonical(self) -> str:
        """Fully qualified, as given: `docker.io/library/python:3.12[@sha256:…]`."""
        return self.canonical_name + self._suffix()

    @property
    def familiar(self) -> str:
        """Short, as Docker prints it: `python:3.12[@sha256:…]`."""
        return self.name + self._suffix()

    @property
    def store_ref(self) -> str:
        """What the store resolves: `name@digest` when there is a digest (it decides), else `name:tag`."""
        return f"{self.name}@{self.digest}" if self.digest else f"{self.name}:{self.tag or DEFAULT_TAG}"

    @property
    def remote_ref(self) -> str:
        """What a registry is asked for: the digest when there is one, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG

    @property
    def digest_tag(self) -> str | None:
        """The tag an image pulled by digest is kept under (`sha256-<hex>`: a valid tag, so gc keeps it)."""
        return f"sha256-{self.digest[7:]}" if self.digest else None

    @property
    def pullable(self) -> bool:
        """True when a registry could serve this reference (it follows Docker's grammar)."""
        return not self.local_only

    def with_tag(self, tag: str) -> Reference:
        """The same repository at another tag (no digest)."""
        return Reference(self.registry, self.repository, tag, None, self.explicit_registry, self.local_only)

    def __str__(self) -> str:
        return self.familiar


def _fail(text: str, why: str) -> InvalidRequest:
    return InvalidRequest(f"bad image reference {text!r}: {why}. Use Docker's form, e.g. python:3.12, "
                          "ghcr.io/org/img:tag, name@sha256:<64 hex>, or a shoal name like base:v1", reference=text)


def split_registry(name: str) -> tuple[str, str, bool]:
    """Split a repository name into (registry, path, explicit) the way Docker does."""
    first, slash, rest = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost" or first.lower() != first):
        registry = DOCKER_HUB if first in _HUB_ALIASES else first
        return registry, rest, True
    return DOCKER_HUB, name, False


def parse_reference(text: str) -> Reference:
    """Parse a Docker image reference (or a shoal name); InvalidRequest names the bad part."""
    if not isinstance(text, str) or not text:
        raise InvalidRequest("image reference must be a non-empty string like 'python:3.12' or 'base:v1'")
    if len(text) > REFERENCE_MAX or any(c.isspace() or ord(c) < 32 for c in text):
        raise _fail(text[:300], "it is too long or contains spaces or control characters")
    rest, at, digest = text.partition("@")
    if at and not _DIGEST.match(digest):
        if _ANY_DIGEST.match(digest):
            raise _fail(text, f"only sha256 digests are supported (got {digest.split(':', 1)[0]})")
        raise _fail(text, f"the digest {digest!r} is not sha256:<64 lowercase hex>")
    # the tag is after the last ':' that comes after the last '/' (a ':' before it is a registry port)
    tag: str | None = None
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    name = rest
    if colon > slash:
        name, tag = rest[:colon], rest[colon + 1:]
        if not _TAG.match(tag):
            raise _fail(text, f"the tag {tag!r} must be letters, digits, '_', '.', '-' (at most 128, not "
                              "starting with '.' or '-')")
    if not name:
        raise _fail(text, "it has no name")
    if not at and tag is None:
        tag = DEFAULT_TAG
    registry, path, explicit = split_registry(name)
    if explicit and not _DOMAIN_FULL.match(registry):
        raise _fail(text, f"the registry host {registry!r} is not a valid host[:port]")
    # Docker Hub's official images live under library/
    hub_path = f"library/{path}" if registry == DOCKER_HUB and "/" not in path else path
    if _PATH.match(path) and len(name) <= NAME_MAX:
        if _HEX64.match(path):
            raise _fail(text, "a 64-hex name is ambiguous with an image ID; give a name")
        repository = hub_path if registry == DOCKER_HUB else path
        return Reference(registry, repository, tag, digest or None, explicit)
    if not explicit and _LOCAL.match(name) and "//" not in name and ".." not in name:
        # a shoal name from before Docker's grammar (e.g. 'my_.env'): local only, never pulled
        return Reference(DOCKER_HUB, name, tag, digest or None, False, local_only=True)
    if path.lower() != path:
        raise _fail(text, "repository names must be lowercase")
    raise _fail(text, f"the name {name!r} must be path components of lowercase letters and digits, separated "
                      "by '/' and joined inside by '.', '_', '__' or '-'")


def store_name_ok(name: str) -> bool:
    """True when a familiar name fits the store's layout (one file name per repository: at most 255 bytes)."""
    return len(urllib.parse.quote(name, safe="").encode()) <= 255
