"""Item 3 of issue 23: a project booted another project's private image by its manifest digest.

`base@sha256:<B's digest>` (or `anything@sha256:…`) made a sandbox of project A whose `cat` printed B's
private file; `GET /v1/images/…@sha256` and E2B's templateID by digest answered too: the store looked the
digest up alone. Over the session's real `shoal serve`, with two project tokens: every way A can name
B's image by digest (a create, a batch, an E2B template, an image lookup, a build base, a name of B's)
answers "not found" exactly as a digest that does not exist; A's own and the shared images still resolve
by digest; B's own image by digest works for B and for an admin."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

import shoal
from shoal.server.tokens import TokenStore

pytestmark = [pytest.mark.root]
NOWHERE = "sha256:" + "0" * 64


def _h(tok: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {tok}"}


@pytest.fixture(scope="module")
def projects(api_server: Any) -> dict[str, str]:
    store = TokenStore(Path(os.environ["SHOAL_HOME"]))
    return {"a": store.create("vis-a", name="visibility test"), "b": store.create("vis-b", name="visibility test"),
            "admin": store.create("vis-ops", admin=True, name="visibility test")}


async def test_a_project_cannot_resolve_another_projects_image_by_digest(api_server: Any,
                                                                         projects: dict[str, str]) -> None:
    try:
        await _attempts(api_server.url, projects)
    finally:  # whatever a failed refusal made (raw HTTP creates are no client's to close)
        for p in ("vis-a", "vis-b"):
            listed = httpx.get(f"{api_server.url}/v1/sandboxes", params={"project": p}, headers=_h(projects["admin"]))
            for info in listed.json()["sandboxes"]:
                httpx.delete(f"{api_server.url}/v1/sandboxes/{info['id']}", headers=_h(projects["admin"]), timeout=60)


async def _attempts(url: str, projects: dict[str, str]) -> None:
    async with shoal.Client(url, token=projects["b"]) as b, shoal.Client(url, token=projects["a"]) as a:
        src = await b.create("base", memory_mb=128)
        await src.write_file("/root/secret", b"b-only")
        await src.snapshot("secret:v1")
        secret = httpx.get(f"{url}/v1/images/secret:v1", headers=_h(projects["b"])).json()["digest"]
        mine = await a.create("base", memory_mb=128)
        await mine.snapshot("mine:v1")
        own = httpx.get(f"{url}/v1/images/mine:v1", headers=_h(projects["a"])).json()["digest"]
        shared = httpx.get(f"{url}/v1/images/base:latest", headers=_h(projects["a"])).json()["digest"]

        # project A names B's image by digest, every way it can: not found, as a digest that never existed
        for ref in (f"base@{secret}", f"anything@{secret}", f"mine@{secret}", f"secret@{secret}",
                    f"projects/vis-b/secret@{secret}", f"base:latest@{secret}", f"docker.io/library/base@{secret}"):
            for attempt in (ref, f"nowhere@{NOWHERE}"):
                r = httpx.post(f"{url}/v1/sandboxes", json={"image": attempt, "memory_mb": 64},
                               headers=_h(projects["a"]))
                assert r.status_code == 404 and r.json()["error"]["code"] == "image_not_found", (attempt, r.text)
            r = httpx.get(f"{url}/v1/images/{ref}", headers=_h(projects["a"]))
            assert r.status_code == 404, (ref, r.text)
            r = httpx.post(f"{url}/v1/sandboxes/batch", json={"image": ref, "n": 2, "memory_mb": 64},
                           headers=_h(projects["a"]))
            assert r.status_code == 404 or all(it.get("error", {}).get("code") == "image_not_found"
                                               for it in r.json()["items"]), (ref, r.text)
            r = httpx.post(f"{url}/sandboxes", json={"templateID": ref}, headers={"X-API-KEY": projects["a"]})
            assert r.status_code == 404, (ref, r.text)  # E2B's create
            r = httpx.post(f"{url}/v1/images/build", json={"name": "x:1", "recipe": {"from": ref, "steps": []}},
                           headers=_h(projects["a"]))
            assert r.status_code == 404, (ref, r.text)
        assert not [s for s in await a.list() if s.id != mine.id]  # A made nothing of B's

        # what A may name by digest still works: its own image and the shared one
        for ref in (f"mine@{own}", f"base@{shared}"):
            sb = await a.create(ref, memory_mb=128)
            assert (await sb.exec("test -e /root/secret")).exit_code != 0
            await sb.close()
        # B reaches its own by digest; so does an operator, by its store name
        sb = await b.create(f"secret@{secret}", memory_mb=128)
        assert (await sb.read_file("/root/secret")) == b"b-only"
        await sb.close()
        async with shoal.Client(url, token=projects["admin"]) as ops:
            sb = await ops.create(f"projects/vis-b/secret@{secret}", memory_mb=128)
            assert (await sb.read_file("/root/secret")) == b"b-only"
            await sb.close()


def test_the_visibility_rule() -> None:
    """shoal.images.visibility on a store of its own: tags, digest tags and registry digests belong to
    their name only; a digest of no name the project may use is not found; an unknown one is left to
    the pull."""
    import tempfile

    from shoal.errors import ImageNotFound
    from shoal.images.pull import REGISTRY_DIGESTS
    from shoal.images.store import ImageStore
    from shoal.images.visibility import digest_belongs, scoped_ref

    with tempfile.TemporaryDirectory(prefix="shvis-") as d:
        st = ImageStore(Path(d) / "store")
        (Path(d) / "tree").mkdir()
        (Path(d) / "tree" / "f").write_text("x")
        layer = st.add_layer_from_dir(Path(d) / "tree", {"test": "visibility"}).digest
        m_shared = st.put_manifest([layer])
        st.set_tag("tool:1", m_shared)
        m_b = st.put_manifest([layer], lineage={"b": 1})
        st.set_tag("projects/b/env:1", m_b)
        m_untagged = st.put_manifest([layer], lineage={"build step": 1})
        reg = "sha256:" + "ab" * 32
        st.cache_put(REGISTRY_DIGESTS, reg[7:], {"manifest": m_shared, "reference": "docker.io/library/tool"})
        assert digest_belongs(st, "tool", m_shared) and digest_belongs(st, "tool", reg)
        assert not digest_belongs(st, "tool", m_b) and not digest_belongs(st, "other", m_shared)
        assert scoped_ref(st, f"tool@{m_shared}", "a") == f"tool@{m_shared}"
        assert scoped_ref(st, f"tool@{reg}", "a") == f"tool@{reg}"
        assert scoped_ref(st, f"env@{m_b}", "b") == f"projects/b/env@{m_b}"
        assert scoped_ref(st, f"anything@{m_b}", None) == f"anything@{m_b}"  # the operator
        for ref in (f"tool@{m_b}", f"env@{m_b}", f"other@{reg}", f"projects/b/env@{m_b}", f"tool@{m_untagged}"):
            with pytest.raises(ImageNotFound):
                scoped_ref(st, ref, "a")
        assert scoped_ref(st, f"python@{NOWHERE}", "a") == f"python@{NOWHERE}"  # the node may pull it
