"""Who may resolve what in the image store: a project's view of it (issue 23, item 3).

The store is shared: every node and every project reads the same layers and manifests, and a manifest
digest names an image wherever it came from. Isolation between projects therefore cannot rest on
digests staying secret (`base@sha256:<another project's digest>` booted that project's private image).
The rule, as Docker's (`name@digest` is a manifest *of that repository*):

- images a project makes are stored as `projects/<project>/<name>`; other projects never see them;
- `name[:tag]` resolves to the project's own `name` first, then to the shared `name`;
- `name@sha256:…` resolves only to a manifest that *belongs* to one of those two names: a tag of the name
  points at it, the name has the digest tag a pull by digest leaves (`name:sha256-<hex>`), or it is a
  registry digest that a pull of that name recorded (shoal.images.pull). A digest that belongs to no such
  name is "not found", the answer a digest that never existed gets: whether another project's image
  exists is not revealed;
- a digest the store does not know at all may still be pulled by the node (`pull_policy`), under the
  shared name, where the registry's content is checked against it.

`scoped_ref` is the one entry point: the API server (`shoal.server.deps.Namespace`, every route that
takes a reference from a project token — creates, batches, E2B templates, image lookups, build bases)
calls it; the embedded client and admin tokens are the operator and see the store as it is (`project`
None).
"""

from __future__ import annotations

import contextlib
import urllib.parse
from typing import TYPE_CHECKING

from shoal.errors import ImageNotFound, InvalidRequest
from shoal.images.refs import parse_ref

if TYPE_CHECKING:
    from shoal.images.store import ImageStore

#: image names under this prefix belong to one project each: projects/<project>/<name>
PROJECT_IMAGES = "projects/"


def project_prefix(project: str) -> str:
    """The store-name prefix of a project's own images."""
    return f"{PROJECT_IMAGES}{project}/"


def foreign(name: str, project: str | None) -> bool:
    """True when a store name is another project's image (never visible to `project`)."""
    return project is not None and name.startswith(PROJECT_IMAGES) and not name.startswith(project_prefix(project))


def name_digests(store: ImageStore, name: str) -> dict[str, str]:
    """tag -> manifest digest of every tag of one name (damaged tag files skipped)."""
    out: dict[str, str] = {}
    d = store.tags_dir / urllib.parse.quote(name, safe="")
    with contextlib.suppress(OSError):
        for f in d.iterdir():
            if f.name.startswith(".tmp-"):
                continue
            with contextlib.suppress(OSError, UnicodeDecodeError):
                out[f.name] = f.read_text().strip()
    return out


def digest_belongs(store: ImageStore, name: str, digest: str) -> bool:
    """True when manifest (or registry) digest `digest` is an image of `name` in the store: a tag of the
    name points at it, the name has its digest tag (`sha256-<hex>`, left by a pull by digest), or a pull
    of the name recorded it as the registry digest of a manifest a tag of the name points at."""
    tags = name_digests(store, name)
    if not tags:
        return False
    if digest in tags.values() or f"sha256-{digest[7:]}" in tags:
        return True
    from shoal.images.pull import REGISTRY_DIGESTS

    hit = store.cache_get(REGISTRY_DIGESTS, digest[7:])
    return hit is not None and str(hit.get("manifest")) in set(tags.values())


def scoped_ref(store: ImageStore, ref: str, project: str | None) -> str:
    """The store reference `ref` means for `project` (None: the operator, who sees the store as it is).

    ImageNotFound (the answer for an image that does not exist) when the project may not see it."""
    if project is None:
        return ref
    r = parse_ref(ref)
    mine = project_prefix(project)
    if foreign(r.name, project):
        raise ImageNotFound(f"image {ref} not found")
    names = [r.name] if r.name.startswith(mine) else [mine + r.name, r.name]
    if not r.digest:
        if len(names) == 1:
            return ref
        return mine + ref if store.exists(mine + ref) else ref
    for n in names:
        if digest_belongs(store, n, r.digest):
            return f"{n}@{r.digest}"
    shared = names[-1]
    if shared.startswith(PROJECT_IMAGES) or _known_elsewhere(store, shared, r.digest):
        # the digest is in the store, but not as an image of a name this project may use
        raise ImageNotFound(f"image {ref} not found")
    return f"{shared}@{r.digest}"  # unknown here: the node may pull it (the registry's content is checked)


def _known_elsewhere(store: ImageStore, name: str, digest: str) -> bool:
    # would the node resolve `name@digest` from the store (a manifest of any name, or a registry digest a
    # pull of another name recorded) instead of pulling it?
    from shoal.images.pull import resolve_local

    try:
        return resolve_local(store, f"{name}@{digest}") is not None
    except (InvalidRequest, ImageNotFound):
        return False
