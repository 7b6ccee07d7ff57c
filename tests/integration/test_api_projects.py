"""Projects, quotas and admission through a real `shoal serve`: another project's sandboxes and snapshots
are invisible (404, not 403); quotas refuse with the numbers; the node's capacity refusal is a 429 with
Retry-After that the SDK retries within its deadline."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

import shoal
from shoal.server.proc import ServerProcess
from shoal.server.tokens import Quota, TokenStore
from tests.waiting import async_wait_for

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]
SMALL = {"memory_mb": 64}


@pytest.fixture
async def two_projects(api_server: ServerProcess, shoal_home: Path) -> AsyncIterator[tuple]:
    """Clients of two fresh projects and an admin client on the session's server."""
    tag = secrets.token_hex(3)
    ts = TokenStore(shoal_home)
    ta, tb = ts.create(f"pa-{tag}"), ts.create(f"pb-{tag}")
    tadm = ts.create("ops", admin=True)
    async with shoal.Client(api_server.url, token=ta) as a, shoal.Client(api_server.url, token=tb) as b, \
            shoal.Client(api_server.url, token=tadm) as adm:
        yield a, b, adm, tag


async def test_other_projects_sandbox_answers_404(two_projects: tuple, api_server: ServerProcess) -> None:
    a, b, adm, _ = two_projects
    sa = await a.create("base", **SMALL)
    await sa.write_file("/tmp/secret", "a's")
    forged = shoal.Sandbox(b, sa.info)  # B knows (or guessed) A's ID
    for op in (forged.refresh(), forged.exec("cat /tmp/secret"), forged.read_file("/tmp/secret"),
               forged.write_file("/tmp/x", "y"), forged.list_dir("/"), forged.pause(), forged.resume(),
               forged.shell(), forged.snapshot("steal:1"), forged.fork(1), forged.stream("id"), forged.close()):
        with pytest.raises(shoal.SandboxNotFound):
            await op
    assert sa.id not in {i.id for i in await b.list()}
    assert sa.id in {i.id for i in await a.list()}
    assert sa.id in {i.id for i in await adm.list()}  # operators see every project
    assert (await sa.read_file("/tmp/secret")) == b"a's"  # B's attempts changed nothing
    # the answer is the same as for an ID that never existed (no oracle for other projects' IDs)
    hdr = {"Authorization": f"Bearer {b.transport.token}"}
    fake = sa.id[:-5] + "aaaaa"
    r1 = httpx.get(f"{api_server.url}/v1/sandboxes/{sa.id}", headers=hdr)
    r2 = httpx.get(f"{api_server.url}/v1/sandboxes/{fake}", headers=hdr)
    assert r1.status_code == r2.status_code == 404
    assert r1.json()["error"]["message"].replace(sa.id, "ID") == r2.json()["error"]["message"].replace(fake, "ID")


async def test_snapshots_stay_in_their_project(two_projects: tuple, api_server: ServerProcess) -> None:
    a, b, adm, tag = two_projects
    name = f"iso-{tag}"
    sa = await a.create("base", **SMALL)
    await sa.write_file("/work/f", "from a")
    try:
        img = await sa.snapshot(f"{name}:1")
        assert img["ref"] == f"{name}:1" and img["name"] == name
        assert name in {i["name"] for i in await a.images()}
        assert name not in {i["name"] for i in await b.images()}
        assert f"projects/pa-{tag}/{name}" in {i["name"] for i in await adm.images()}
        with pytest.raises(shoal.ImageNotFound):
            await b.create(f"{name}:1", **SMALL)
        with pytest.raises(shoal.ImageNotFound):
            await b.create(f"projects/pa-{tag}/{name}:1", **SMALL)
        child = await a.create(f"{name}:1", **SMALL)
        assert (await child.read_file("/work/f")) == b"from a"
        # B cannot remove A's image nor a shared one; A removes its own
        hb = {"Authorization": f"Bearer {b.transport.token}"}
        ha = {"Authorization": f"Bearer {a.transport.token}"}
        assert httpx.delete(f"{api_server.url}/v1/images/{name}:1", headers=hb).status_code == 404
        assert httpx.delete(f"{api_server.url}/v1/images/base", headers=hb).status_code == 403
        assert httpx.get(f"{api_server.url}/v1/images/{name}:1", headers=ha).json()["name"] == name
        kids = await sa.fork(1)
        assert all(k.info.spec["project"] == f"pa-{tag}" for k in kids)
        fork_imgs = [i["name"] for i in await adm.images() if sa.id in i["name"]]
        assert fork_imgs and all(n.startswith(f"projects/pa-{tag}/") for n in fork_imgs)
        assert httpx.delete(f"{api_server.url}/v1/images/{name}:1", headers=ha).status_code == 204
    finally:
        import os

        from shoal.images.store import ImageStore

        store = ImageStore(os.environ["SHOAL_STORE"])
        for img in store.list_images():
            if img.name.startswith(f"projects/pa-{tag}/") or img.name.startswith(f"projects/pb-{tag}/"):
                store.remove_image(f"{img.name}:{img.tag}")


async def test_quotas_refuse_with_numbers(api_server: ServerProcess, shoal_home: Path) -> None:
    proj = f"pq-{secrets.token_hex(3)}"
    tok = TokenStore(shoal_home).create(proj, quota=Quota(max_sandboxes=2, max_memory_mb=256))
    async with shoal.Client(api_server.url, token=tok) as c:
        s1 = await c.create("base", **SMALL)
        await c.create("base", **SMALL)
        with pytest.raises(shoal.QuotaExceeded) as ei:
            await c.create("base", **SMALL)
        e = ei.value
        assert e.details["quota"] == "max_sandboxes" and e.details["limit"] == 2 and e.details["used"] == 2
        assert "3 sandboxes" in e.message and "quota of 2" in e.message
        r = httpx.post(f"{api_server.url}/v1/sandboxes", json=SMALL, headers={"Authorization": f"Bearer {tok}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "quota_exceeded"
        await s1.close()
        # a batch gets what fits; the rest are per-item refusals
        items = await c.create_many("base", 3, **SMALL)
        assert sum(isinstance(i, shoal.Sandbox) for i in items) == 1
        assert sum(isinstance(i, shoal.QuotaExceeded) for i in items) == 2
        for it in [i for i in items if isinstance(i, shoal.Sandbox)]:
            await it.close()
        # memory: 64 held + 200 asked > 256
        with pytest.raises(shoal.QuotaExceeded) as ei:
            await c.create("base", memory_mb=200)
        assert ei.value.details["quota"] == "max_memory_mb" and ei.value.details["used"] == 64
        sb = (await c.list())[0]
        with pytest.raises(shoal.QuotaExceeded):
            await shoal.Sandbox(c, sb).fork(3)
        assert len(await c.list()) == 1  # refused forks left nothing behind
        # run_code's warm pools are node-wide, but a call may not ask for more than the project's quota
        with pytest.raises(shoal.QuotaExceeded, match="max_memory_mb"):
            await c.run_code("print(1)", memory_mb=4096)
        r = httpx.post(f"{api_server.url}/v1/run_code", json={"code": "print(1)", "memory_mb": 4096},
                       headers={"Authorization": f"Bearer {tok}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "quota_exceeded"
        ok = await c.run_code("print(1)", memory_mb=128)
        assert ok.stdout == b"1\n"


@contextlib.contextmanager
def private_home() -> Iterator[Path]:
    """A SHOAL_HOME of its own (for a server whose node must start with nothing committed)."""
    home = Path(tempfile.mkdtemp(prefix="shta-", dir="/tmp"))
    try:
        yield home
    finally:
        from shoal.config import Paths
        from shoal.node.teardown import teardown_home
        from shoal.records import list_records

        left = list_records(home / "sandboxes")
        asyncio.run(teardown_home(Paths.from_env(home), close_sandboxes=True))
        with open("/proc/self/mountinfo") as f:
            leaks = [ln.split()[4] for ln in f if ln.split()[4].startswith(str(home))]
        assert not leaks, leaks
        assert not left, f"sandboxes left behind: {[r.id for r in left]}"
        import shutil

        shutil.rmtree(home, ignore_errors=True)


def _overcommit_for(limit_mb: int) -> str:
    with open("/proc/meminfo") as f:
        total_mb = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:")) // 1024
    return repr((limit_mb + 0.5) / total_mb)


def test_capacity_refusal_is_429_and_the_sdk_retries(base_image: str) -> None:
    import os

    with private_home() as home:
        env = dict(os.environ, SHOAL_HOME=str(home), SHOAL_MEMORY_OVERCOMMIT=_overcommit_for(100))
        with ServerProcess(env=env, log_path=home / "server.log") as srv:
            asyncio.run(_capacity(srv))


def _capacity_errors(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    for ln in text.splitlines():
        if ln.startswith('shoal_api_errors_total{code="capacity_exceeded"}'):
            return float(ln.split()[-1])
    return 0.0


async def _capacity(srv: ServerProcess) -> None:
    async with shoal.Client(srv.url, timeout=60) as c:
        s1 = await c.create("base", **SMALL)  # 64 of 100 MiB: fits
        r = httpx.post(srv.url + "/v1/sandboxes", json=SMALL)
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        err = r.json()["error"]
        assert err["code"] == "capacity_exceeded" and err["details"]["limit_mb"] == 100
        assert err["details"]["committed_mb"] == 64
        # a short deadline: the SDK retries, then gives the typed refusal
        async with shoal.Client(srv.url, timeout=3) as short:
            before = _capacity_errors(srv.url)
            with pytest.raises(shoal.CapacityExceeded):
                await short.create("base", **SMALL)
            assert _capacity_errors(srv.url) - before >= 2  # it did retry
        # capacity comes back while the SDK waits: the create succeeds
        task = asyncio.create_task(c.create("base", **SMALL))
        await async_wait_for(lambda: _capacity_errors(srv.url) >= before + 3, what="the SDK to be refused and retry")
        assert not task.done()
        await s1.close()
        s2 = await task
        assert (await s2.exec("echo admitted")).stdout == b"admitted\n"
        # a batch: what does not fit is retried per item until the deadline
        async with shoal.Client(srv.url, timeout=2) as short:
            items = await short.create_many("base", 2, **SMALL)
        assert sum(isinstance(i, shoal.CapacityExceeded) for i in items) == 2, items


async def test_images_built_and_imported_over_the_api_belong_to_the_project(two_projects: tuple,
                                                                              api_server: ServerProcess,
                                                                              tmp_path: Path) -> None:
    from shoal.images.archive import layer_tar, write_docker_archive

    a, b, _, tag = two_projects
    ha = {"Authorization": f"Bearer {a.transport.token}"}
    url = api_server.url
    try:
        recipe = {"from": "base", "network": False,
                  "steps": [{"run": f"echo built-{tag} > /opt/marker"}, {"env": {"TOOL": "1"}}, {"workdir": "/opt"}]}
        r = httpx.post(f"{url}/v1/images/build", headers=ha, json={"name": f"tool-{tag}:1", "recipe": recipe},
                       timeout=600)
        assert r.status_code == 200, r.text
        assert r.json()["name"] == f"tool-{tag}" and r.json()["config"]["workdir"] == "/opt"
        sb = await a.create(f"tool-{tag}:1", **SMALL)
        r2 = await sb.exec("cat marker; echo $TOOL")
        assert r2.stdout == f"built-{tag}\n1\n".encode()
        assert f"tool-{tag}" not in {i["name"] for i in await b.images()}
        # a failing step: the build error names the step, nothing is tagged
        bad = {"from": "base", "network": False, "steps": [{"run": "echo oops >&2; exit 3"}]}
        r = httpx.post(f"{url}/v1/images/build", headers=ha, json={"name": f"bad-{tag}:1", "recipe": bad}, timeout=600)
        assert r.status_code == 422 and r.json()["error"]["code"] == "image_build_error"
        assert f"bad-{tag}" not in {i["name"] for i in await a.images()}

        layer = layer_tar([("dir", "etc", 0o755), ("file", "etc/hello", b"imported\n", 0o644)])
        archive = write_docker_archive(tmp_path / "img.tar", [layer])
        r = httpx.post(f"{url}/v1/images/import", headers=ha, params={"name": f"imp-{tag}:1"},
                       content=archive.read_bytes(), timeout=600)
        assert r.status_code == 200, r.text
        assert r.json()["image"]["name"] == f"imp-{tag}" and r.json()["format"]
        assert f"imp-{tag}" in {i["name"] for i in await a.images()}
        assert f"imp-{tag}" not in {i["name"] for i in await b.images()}
        r = httpx.post(f"{url}/v1/images/import", headers=ha, params={"name": f"junk-{tag}:1"},
                       content=b"not a tarball", timeout=60)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request"
    finally:
        import os

        from shoal.images.store import ImageStore

        store = ImageStore(os.environ["SHOAL_STORE"])
        for img in store.list_images():
            if img.name.startswith(f"projects/pa-{tag}/"):
                store.remove_image(f"{img.name}:{img.tag}")
