"""Item 8 of issue 23: SWE-ReX uploads must not cost the API server memory in proportion to what they unpack.

Before the fix the server read a whole zipped upload into memory and unpacked every member into bytes before
writing it: 4 concurrent 240 KB zips (240 MiB unpacked each, under the limit) took it from 91 to 1,092 MiB
RSS. Now the part is spooled to disk by the form parser, a corrupt zip is refused before anything is written,
and each member goes into the sandbox 256 KiB at a time; a token's uploads are written a few at a time
(`api_max_uploads`). Memory is the growth of the server's peak RSS (VmHWM, reset just before): a bound, not a
timing. The files must all arrive whole.
"""

from __future__ import annotations

import asyncio
import io
import secrets
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from shoal.server.proc import ServerProcess
from shoal.server.tokens import TokenStore
from tests.security.test_output_bounds import peak_growth

pytestmark = [pytest.mark.root, pytest.mark.timeout(600)]
MiB = 1 << 20
#: per upload: a zip of a few hundred KB that unpacks to this (zeros compress about 1000:1)
UNPACKED = 96 * MiB
UPLOADS = 6


def zero_zip(size: int) -> bytes:
    """A zip with one member of `size` zero bytes (and a directory), built without holding `size` bytes."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("pkg/", b"")
        with zf.open("pkg/zeros.bin", "w", force_zip64=True) as f:
            block = bytes(MiB)
            for _ in range(size // MiB):
                f.write(block)
    return buf.getvalue()


@pytest.fixture
async def rex(api_server: ServerProcess, shoal_home: Path) -> AsyncIterator[dict]:
    token = TokenStore(shoal_home).create(f"upl-{secrets.token_hex(3)}", name="upload memory")
    hdr = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=api_server.url, timeout=300) as h:
        r = await h.post("/v1/sandboxes", json={"image": "base", "memory_mb": 256,
                                                "disk_mb": UPLOADS * UNPACKED // MiB + 512}, headers=hdr)
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        try:
            yield {"h": h, "sid": sid, "token": token, "hdr": hdr, "pid": api_server.proc.pid}
        finally:
            await h.delete(f"/v1/sandboxes/{sid}", headers=hdr)


async def test_concurrent_zip_uploads_do_not_grow_the_server(rex: dict) -> None:
    h, sid = rex["h"], rex["sid"]
    data = zero_zip(UNPACKED)
    assert len(data) < UNPACKED // 200  # a small upload that unpacks big: the attack's shape

    async def upload(i: int) -> httpx.Response:
        return await h.post(f"/swerex/{sid}/upload", headers={"X-API-Key": rex["token"]},
                            files={"file": ("tree.zip", data, "application/zip")},
                            data={"target_path": f"/tmp/up{i}", "unzip": "true"})

    with peak_growth(rex["pid"]) as grew:
        rs = await asyncio.gather(*(upload(i) for i in range(UPLOADS)))
    assert [r.status_code for r in rs] == [200] * UPLOADS, [r.text for r in rs]
    # every file arrived whole
    r = await h.post(f"/v1/sandboxes/{sid}/exec", headers=rex["hdr"],
                     json={"cmd": "stat -c %s /tmp/up*/pkg/zeros.bin; cmp -n 1048576 /tmp/up0/pkg/zeros.bin "
                                  "/dev/zero && echo zeros; rm -rf /tmp/up*"})
    out = r.json()["stdout"].split()
    assert out == [str(UNPACKED)] * UPLOADS + ["zeros"], r.json()
    # 6 x 96 MiB unpacked at once: was held whole per upload (and copied); now a few 256 KiB chunks
    assert grew[0] < 64 * MiB, f"server peak RSS grew {grew[0] / MiB:.0f} MiB"


async def test_a_plain_upload_streams_too(rex: dict) -> None:
    h, sid = rex["h"], rex["sid"]
    blob = bytes(48 * MiB)
    with peak_growth(rex["pid"]) as grew:
        r = await h.post(f"/swerex/{sid}/upload", headers={"X-API-Key": rex["token"]},
                         files={"file": ("blob.bin", blob, "application/octet-stream")},
                         data={"target_path": "/tmp/blob.bin", "unzip": "false"})
    assert r.status_code == 200, r.text
    r = await h.post(f"/v1/sandboxes/{sid}/exec", headers=rex["hdr"],
                     json={"cmd": "stat -c %s /tmp/blob.bin; rm /tmp/blob.bin"})
    assert r.json()["stdout"].split() == [str(48 * MiB)]
    assert grew[0] < 32 * MiB, f"server peak RSS grew {grew[0] / MiB:.0f} MiB"
