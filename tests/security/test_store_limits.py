"""Item 3 of issue 19: snapshots must not write more to the image store than the sandbox could hold.

Before the fix, `truncate -s 2G /tmp/sparse` in a disk_mb=100 sandbox and a snapshot wrote a 2 GiB
layer (mkfs.erofs wrote the holes out as zeros), and a project token could repeat it over HTTP without
limit. Now layers keep holes as holes, a layer that could still outgrow the sandbox's disk_mb is
refused before anything is written, and a project's images are held to its `max_store_mb` quota."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import httpx
import pytest

import shoal
from shoal.images.store import ImageStore
from shoal.server.proc import ServerProcess
from shoal.server.store_quota import store_usage
from shoal.server.tokens import Quota, TokenStore

pytestmark = [pytest.mark.root]


def _store_files(store: Path) -> set[str]:
    return {p.name for p in (store / "layers" / "sha256").glob("*")} | set(os.listdir(store / "tmp"))


async def test_sparse_files_cannot_blow_up_a_snapshot(client: shoal.Client) -> None:
    store = Path(os.environ["SHOAL_STORE"])
    sb = await client.create("base", disk_mb=100)
    # the attack: 2 GiB of holes in a 100 MiB sandbox; refused before anything is read or written
    await sb.exec("truncate -s 2G /tmp/sparse")
    before = _store_files(store)
    with pytest.raises(shoal.QuotaExceeded, match=r"disk_mb=100.*/tmp/sparse \(2048 MiB\)"):
        await sb.snapshot(f"sec-sparse-{secrets.token_hex(3)}:1")
    assert _store_files(store) == before
    assert (await sb.exec("echo alive")).stdout == b"alive\n"  # thawed after the refusal
    # a sparse file within the limit is stored as holes, and reads back the same
    await sb.exec("rm /tmp/sparse; truncate -s 64M /tmp/sparse; echo data > /tmp/small")
    img = await sb.snapshot(f"sec-sparse-{secrets.token_hex(3)}:2")
    try:
        assert img["diff_bytes"] < 2 << 20, img
        child = await client.create(img["ref"])
        r = await child.exec("stat -c %s /tmp/sparse; cmp -n 67108864 /tmp/sparse /dev/zero && cat /tmp/small")
        assert r.stdout.decode().split() == [str(64 << 20), "data"], r
        await child.close()
    finally:
        client.transport.node.store.remove_image(img["ref"])


async def test_project_store_quota_over_http(api_server: ServerProcess, shoal_home: Path) -> None:
    project = f"sq-{secrets.token_hex(3)}"
    token = TokenStore(shoal_home).create(project, quota=Quota(max_store_mb=24))
    store = ImageStore(Path(os.environ["SHOAL_STORE"]))
    async with shoal.Client(api_server.url, token=token) as c:
        sb = await c.create("base", disk_mb=200)
        try:
            await sb.exec("head -c 16M /dev/urandom > /root/a")
            await sb.snapshot("s:1")  # 16 MiB of 24
            used = store_usage(store, project)
            assert 16 << 20 <= used < 18 << 20
            await sb.exec("head -c 16M /dev/urandom > /root/b")
            with pytest.raises(shoal.QuotaExceeded, match="max_store_mb"):
                await sb.snapshot("s:2")  # would need 32 MiB more
            with pytest.raises(shoal.QuotaExceeded, match="max_store_mb"):
                await sb.fork(1)
            assert store_usage(store, project) == used  # nothing was added
            await sb.exec("rm /root/a /root/b")
            await sb.snapshot("s:3")  # small again: fits
        finally:
            async with httpx.AsyncClient(base_url=api_server.url, headers={"Authorization": f"Bearer {token}"}) as h:
                for ref in ("s:1", "s:3"):
                    await h.delete(f"/v1/images/{ref}")
