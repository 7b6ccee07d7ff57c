"""Cluster mode on a real Ray cluster: a head and 3 worker nodes on 127.0.0.1 (`ray.cluster_utils.Cluster`),
one node agent per worker with its own SHOAL_HOME (`--home-per-node`), one shared image store, real
sandboxes. One cluster serves the whole module (tests run in file order: the node-removal test takes a
node away, the last test takes the agents down and checks nothing is left)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import shoal
from shoal.records import node_of
from tests.waiting import async_wait_for

pytest.importorskip("ray")
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(900)]
SMALL = {"memory_mb": 64, "ttl_s": 900}
REPO = Path(__file__).resolve().parents[2]


class Ctx:
    """The module's cluster: the LocalCluster, the agents' base home, the shared store, `ray://` URL."""

    def __init__(self, lc: object, home: Path, store: Path) -> None:
        self.lc = lc
        self.home = home
        self.store = store
        self.agent_pids: dict[str, int] = {}

    @property
    def url(self) -> str:
        return self.lc.url  # type: ignore[attr-defined]

    @property
    def address(self) -> str:
        return self.lc.address  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def cluster(shoal_home: Path, base_image: str):
    from shoal.cluster import control
    from shoal.cluster.local import LocalCluster
    from shoal.config import Paths

    store = Paths.from_env().store
    home = shoal_home / "c"  # short: Unix socket paths of sandboxes live below HOME/nodes/<id>/
    lc = LocalCluster(3).start()
    ctx = Ctx(lc, home, store)
    try:
        rep = control.up(lc.address, home=str(home), store=str(store), home_per_node=True)
        ctx.agent_pids = {h["node_id"]: h["pid"] for h in rep.started}
        yield ctx
    finally:
        with contextlib.suppress(Exception):
            control.down(lc.address, force=True)
        lc.shutdown()
        # homes of nodes taken away during the tests still hold their sandboxes (their agents died with
        # the Ray node): close them here like an operator would on that machine
        from shoal.node.teardown import teardown_home

        for d in sorted((home / "nodes").glob("*")) if (home / "nodes").exists() else []:
            asyncio.run(teardown_home(Paths.from_env(d, store), close_sandboxes=True))


def _nodes_of(items: list) -> Counter:
    return Counter(node_of(sb.id) for sb in items)


async def test_up_is_idempotent_and_status_lists_every_node(cluster: Ctx) -> None:
    from shoal.cluster import control

    rep = control.up(cluster.address, home=str(cluster.home), home_per_node=True)
    assert rep.started == [] and sorted(rep.existing) == sorted(cluster.agent_pids)
    rows = control.status(cluster.address)
    assert sorted(r["node_id"] for r in rows) == sorted(cluster.agent_pids)
    assert all(r["health"] == "ok" for r in rows)
    for nid in cluster.agent_pids:
        assert (cluster.home / "nodes" / nid / "sandboxes").is_dir()  # --home-per-node
    out = subprocess.run([sys.executable, "-m", "shoal.cli.main", "cluster", "status", "--address", cluster.address,
                          "--json"], capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert sorted(r["node_id"] for r in __import__("json").loads(out.stdout)) == sorted(cluster.agent_pids)


async def test_create_many_spreads_over_the_nodes_and_info_names_the_node(cluster: Ctx) -> None:
    async with shoal.Client(cluster.url) as c:
        items = await c.create_many("base", n=12, **SMALL)
        assert all(isinstance(s, shoal.Sandbox) for s in items), items
        per_node = _nodes_of(items)
        assert set(per_node) == set(cluster.agent_pids)  # every node took a share
        assert max(per_node.values()) <= 6  # split by each node's room (measured: close, not equal), never piled up
        for sb in items:
            assert sb.info.node == node_of(sb.id)
        seen = {i.id for i in await c.list()}
        assert {sb.id for sb in items} <= seen
        one = await c.get(items[5].id)
        assert one.info.state == "running" and one.info.node == node_of(items[5].id)


async def test_locality_and_one_store_for_all_nodes(cluster: Ctx) -> None:
    """An image made on one node is usable on every node (one store, no copy); single creates of it go to
    the node that has its layers mounted already."""
    name = f"cl-loc-{os.getpid()}:1"
    async with shoal.Client(cluster.url) as c:
        src = await c.create("base", **SMALL)
        await src.write_file("/work/marker", b"made on " + node_of(src.id).encode())
        await src.snapshot(name)
        warm = node_of(src.id)
        try:
            singles = [await c.create(name, **SMALL) for _ in range(3)]
            assert {node_of(s.id) for s in singles} == {warm}  # locality: its new layer is mounted there
            burst = await c.create_many(name, n=6, **SMALL)
            assert len(_nodes_of(burst)) == 3  # every node reads the image from the shared store
            for sb in burst:
                assert (await sb.read_file("/work/marker")) == f"made on {warm}".encode()
        finally:
            from shoal.images.store import ImageStore

            await c.aclose()
            with contextlib.suppress(Exception):
                ImageStore(cluster.store).remove_image(name)


async def test_commands_streams_ptys_files_shells_pause_fork_go_to_the_owner_node(cluster: Ctx) -> None:
    import signal as sig

    async with shoal.Client(cluster.url) as c:
        sb = await c.create("base", **SMALL)
        r = await sb.exec("echo $((6*7))")
        assert r.exit_code == 0 and r.stdout == b"42\n"
        st = await sb.stream("cat; echo done >&2", stdin=True)
        await st.write(b"hello\n")
        await st.close_stdin()
        got = [(ev.kind, ev.data) async for ev in st]
        assert ("stdout", b"hello\n") in got and ("stderr", b"done\n") in got and st.result.exit_code == 0
        pty = await sb.stream("stty size; read x; echo got-$x", tty=True, stdin=True)
        await pty.resize(33, 111)
        out = b""
        async for ev in pty:
            if ev.kind == "stdout":
                out += ev.data
                if b"33 111" in out or b"\n" in out:
                    break
        await pty.write(b"abc\n")
        async for ev in pty:
            if ev.kind == "stdout":
                out += ev.data
        assert pty.result is not None and pty.result.exit_code == 0
        assert b"got-abc" in out
        long = await sb.stream("sleep 60")
        await long.signal(sig.SIGTERM)
        assert (await long.wait()).exit_code == 128 + sig.SIGTERM
        await sb.write_file("/work/f.txt", b"x" * 300_000)
        assert len(await sb.read_file("/work/f.txt")) == 300_000
        assert "f.txt" in [e.name for e in await sb.list_dir("/work")]
        sh = await sb.shell()
        await sh.run("cd /tmp && export Z=9")
        assert (await sh.run("echo $PWD $Z")).stdout == b"/tmp 9\n"
        await sh.close()
        await sb.pause()
        assert (await c.get(sb.id)).info.state == "paused"
        assert (await sb.exec("echo awake")).stdout == b"awake\n"  # a call resumes it
        kids = await sb.fork(2)
        for k in kids:
            assert node_of(k.id) == node_of(sb.id)
            assert len(await k.read_file("/work/f.txt")) == 300_000


def test_sync_client_over_the_cluster(cluster: Ctx) -> None:
    with shoal.SyncClient(cluster.url) as c:
        sb = c.create("base", **SMALL)
        assert sb.exec("echo sync").stdout == b"sync\n"
        assert any(i.id == sb.id for i in c.list())


def test_rollout_example_runs_as_a_ray_job(cluster: Ctx) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    out = subprocess.run([sys.executable, str(REPO / "examples" / "cluster_rollout.py"), "--address",
                          cluster.address, "--workers", "3", "--episodes", "2"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "rewards:" in out.stdout and "mean reward 1.00" in out.stdout, out.stdout


async def test_gateway_tokens_and_cluster_wide_quota_survive_a_gateway_restart(cluster: Ctx, shoal_home: Path) -> None:
    from shoal.server.proc import ServerProcess
    from shoal.server.tokens import Quota, TokenStore

    ghome = shoal_home / "gw"
    ghome.mkdir(exist_ok=True)
    tokens = TokenStore(ghome)
    tok = tokens.create("clq", quota=Quota(max_sandboxes=4))
    other = tokens.create("clo")
    env = dict(os.environ, SHOAL_HOME=str(ghome), SHOAL_STORE=str(cluster.store))
    log = ghome / "gateway.log"
    async with shoal.Client(cluster.url, keep=True) as rc:  # 3 of the project's sandboxes, made outside the gateway
        direct = await rc.create_many("base", n=3, project="clq", **SMALL)
        assert all(isinstance(s, shoal.Sandbox) for s in direct), direct
    srv = ServerProcess(args=["--cluster", cluster.url], env=env, log_path=log, token=tok).start(timeout=120)
    port = srv.port
    ids = {s.id for s in direct}
    try:
        async with shoal.Client(srv.url, token=tok, keep=True) as c:
            items = await c.create_many("base", n=3, **SMALL)
            made = [s for s in items if isinstance(s, shoal.Sandbox)]
            refused = [e for e in items if isinstance(e, shoal.QuotaExceeded)]
            assert len(made) == 1 and len(refused) == 2, items  # 3 on other nodes count against the 4
            ids |= {s.id for s in made}
            assert ids == {i.id for i in await c.list()}  # the project's sandboxes on every node
            via = await c.get(direct[-1].id)  # made by another client: the gateway asks its node
            assert (await via.exec("echo via-gateway")).stdout == b"via-gateway\n"
            st = await via.stream("echo streamed")
            assert (await st.wait()).stdout == b"streamed\n"
        async with shoal.Client(srv.url, token=other) as o:
            batch = await o.create_many("base", n=6, **SMALL)  # one batch, placed as one burst
            assert all(isinstance(s, shoal.Sandbox) for s in batch), batch
            assert not ids & {i.id for i in await o.list()}  # another project sees none of them
            with pytest.raises(shoal.SandboxNotFound):
                await o.get(direct[0].id)
        with pytest.raises(shoal.Unauthorized):
            async with shoal.Client(srv.url, token="shoal_aaaaaaaaaa_" + "b" * 43) as bad:
                await bad.list()
        srv.kill()  # kill -9: the gateway's memory is gone
        srv = ServerProcess(port=port, args=["--cluster", cluster.url], env=env, log_path=log,
                            token=tok).start(timeout=120)
        async with shoal.Client(srv.url, token=tok) as c:
            with pytest.raises(shoal.QuotaExceeded):
                await c.create("base", **SMALL)  # the count was rebuilt from the nodes' records
            assert ids <= {i.id for i in await c.list()}
            await (await c.get(direct[0].id)).close()
            sb = await c.create("base", **SMALL)  # room for one again
            await sb.close()
            for sid in ids - {direct[0].id}:
                await (await c.get(sid)).close()
    finally:
        srv.stop()


async def test_gateway_dashboard_views_cover_every_node(cluster: Ctx, shoal_home: Path) -> None:
    """The dashboard's API through the gateway (issue 20): nodes, a page of sandboxes merged from every node,
    a sandbox's events and commands from its node, live series per node, /metrics with a node label."""
    import httpx

    from shoal.server.proc import ServerProcess
    from shoal.server.tokens import TokenStore

    ghome = shoal_home / "gw-ui"
    ghome.mkdir(exist_ok=True)
    admin = TokenStore(ghome).create("ops", admin=True)
    env = dict(os.environ, SHOAL_HOME=str(ghome), SHOAL_STORE=str(cluster.store))
    srv = ServerProcess(args=["--cluster", cluster.url], env=env, log_path=ghome / "gateway.log",
                        token=admin).start(timeout=120)
    H = {"Authorization": f"Bearer {admin}"}
    try:
        async with shoal.Client(srv.url, token=admin) as c, httpx.AsyncClient(base_url=srv.url, timeout=60) as h:
            items = await c.create_many("base", n=6, labels={"t": "dash"}, **SMALL)
            sbs = [s for s in items if isinstance(s, shoal.Sandbox)]
            assert len(sbs) == 6, items
            if len(_nodes_of(sbs)) < 2:
                # this test is about the views, not placement (test_create_many_spreads_... holds that): once in
                # CI, on a loaded machine, a fresh gateway's first view held one node and all 6 went there
                more = await c.create_many("base", n=6, labels={"t": "dash"}, **SMALL)
                sbs += [s for s in more if isinstance(s, shoal.Sandbox)]
                assert len(sbs) == 12, more
            assert (await sbs[0].exec("echo from-gateway")).exit_code == 0
            nodes = (await h.get("/v1/nodes", headers=H)).json()
            assert nodes["kind"] == "cluster"
            ids = {n["node_id"] for n in nodes["nodes"] if n["health"] == "ok"}
            assert ids == set(cluster.agent_pids)  # every node agent of the module's cluster
            page = (await h.get("/v1/sandboxes/page", params={"label": "t=dash", "limit": "4"}, headers=H)).json()
            assert page["total"] == len(sbs) and len(page["items"]) == 4
            assert sum(page["facets"]["node"].values()) == len(sbs) and len(page["facets"]["node"]) >= 2
            rest = {"label": "t=dash", "limit": str(len(sbs)), "offset": "4"}
            second = (await h.get("/v1/sandboxes/page", params=rest, headers=H)).json()
            assert {r["id"] for r in page["items"] + second["items"]} == {s.id for s in sbs}
            ev = (await h.get(f"/v1/sandboxes/{sbs[0].id}/events", headers=H)).json()["events"]
            assert [e["kind"] for e in ev] == ["created"] and ev[0]["node"] == node_of(sbs[0].id)
            cmds = await c.events(sbs[0].id, commands=True)
            assert [e.data["cmd"] for e in cmds] == ["echo from-gateway"]
            stats = (await h.get("/v1/stats", headers=H)).json()
            assert set(stats["nodes"]) == ids
            metrics = (await h.get("/metrics", headers=H)).text
            assert all(f'node="{n}"' in metrics for n in ids) and "shoal_cluster_nodes" in metrics
            assert 'shoal_sandbox_events_total{kind="created",node=' in metrics
            recent = (await h.get("/v1/events", params={"kind": "created"}, headers=H)).json()["events"]
            assert {s.id for s in sbs} <= {e["id"] for e in recent}
            for s in sbs:
                await s.close()
            ev = await c.events(sbs[1].id)
            assert [e.kind for e in ev] == ["created", "closed"]
    finally:
        srv.stop()


async def test_kill9_of_a_node_agent_readopts_and_the_sdk_retries(cluster: Ctx) -> None:
    import ray

    from shoal.cluster.raylink import NAMESPACE, agent_name

    async with shoal.Client(cluster.url) as c:
        sb = await c.create("base", **SMALL)
        await sb.write_file("/work/state", b"before the crash")
        await sb.exec("nohup sleep 1000 >/dev/null 2>&1 &")
        nid = node_of(sb.id)
        actor = ray.get_actor(agent_name(nid), namespace=NAMESPACE)
        hello = await actor.ensure_started.remote()
        inflight = asyncio.create_task(sb.exec("touch /tmp/inflight; sleep 20; echo finished"))
        # the call is in flight once its command runs in the sandbox (seen through another call)
        await async_wait_for(lambda: _exists_in(sb, "/tmp/inflight"), what="the in-flight command to start")
        os.kill(hello["pid"], signal.SIGKILL)
        with pytest.raises(shoal.NodeUnavailable) as ei:
            await inflight  # not idempotent: reported (retryable), not repeated
        assert ei.value.retryable
        # idempotent calls ride out the restart by themselves
        assert (await sb.read_file("/work/state")) == b"before the crash"
        again = await actor.ensure_started.remote()
        assert again["pid"] != hello["pid"] and again["adopted"]["sandboxes"] >= 1
        r = await sb.exec("pgrep -x sleep >/dev/null && echo alive")  # the user's retry
        assert r.stdout == b"alive\n"  # re-adopted: its processes ran on through the crash
        assert (await c.get(sb.id)).info.state == "running"


async def test_node_removal_loses_its_sandboxes_and_creates_go_elsewhere(cluster: Ctx) -> None:
    import ray

    from shoal.cluster.raylink import NAMESPACE, agent_name

    async with shoal.Client(cluster.url) as c:
        items = await c.create_many("base", n=6, labels={"t": "removal"}, **SMALL)
        victim = node_of(items[0].id)
        hello = await ray.get_actor(agent_name(victim), namespace=NAMESPACE).ensure_started.remote()
        doomed = [s for s in items if node_of(s.id) == victim]
        await _indexed(victim, {s.id for s in doomed})  # what the cluster knows of the node when it goes
        cluster.lc.remove_worker(cluster.lc.worker_by_ray_id(hello["ray_node_id"]))
        # the agent is a process of that Ray node: its machine is gone, so is it (Ray's worker would exit
        # on its own once it notices its raylet died; do not leave that to chance)
        with contextlib.suppress(ProcessLookupError):
            os.kill(hello["pid"], signal.SIGKILL)
        with pytest.raises(shoal.SandboxLost):
            await doomed[0].exec("true")
        listed = {i.id: i.state for i in await c.list(labels={"t": "removal"})}
        assert all(listed[s.id] == "lost" for s in doomed)
        assert all(listed[s.id] == "running" for s in items if node_of(s.id) != victim)
        assert (await c.get(doomed[0].id)).info.state == "lost"
        more = await c.create_many("base", n=4, **SMALL)
        assert all(isinstance(s, shoal.Sandbox) for s in more), more
        assert victim not in _nodes_of(more)  # new creates avoid the lost node
        for s in doomed:
            await s.close()  # forgets it
        assert not {s.id for s in doomed} & {i.id for i in await c.list()}


def test_cluster_down_leaves_nothing_behind(cluster: Ctx) -> None:
    import ray

    from shoal.cluster import control
    from shoal.cluster.local import ray_processes_of
    from shoal.cluster.raylink import KV_INDEX_PREFIX, agent_names, kv_keys

    async def keep_one() -> str:
        async with shoal.Client(cluster.url, keep=True) as c:
            return (await c.create("base", **SMALL)).id

    keep = asyncio.run(keep_one())
    before = agent_names()
    with pytest.raises(shoal.InvalidRequest, match="still live"):
        control.down(cluster.address)  # refuses while a sandbox lives ...
    assert agent_names() == before  # ... and touches no node
    assert all(r["health"] == "ok" for r in control.status(cluster.address))
    pids = {h["node_id"]: h["pid"] for h in (ray.get(ray.get_actor(n, namespace="shoal").ensure_started.remote())
                                              for n in agent_names())}
    out = control.down(cluster.address, force=True)
    assert sorted(out) == sorted(pids) and sum(r["closed"] for r in out.values()) >= 1
    assert agent_names() == [] and kv_keys(KV_INDEX_PREFIX) == []
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids.values() if _alive(p)], "node agent processes left"
    from tests.conftest import runtime_containers

    for nid in pids:
        d = cluster.home / "nodes" / nid
        assert not _mounts_under(str(d)), f"mounts left under {d}"
        assert not (d / "sandboxes" / keep).exists()
    left = [c for c in runtime_containers() if c.split("-")[1] in pids]
    assert left == [], f"containers of the cluster's nodes still run: {left}"
    temp = cluster.lc.temp_dir
    cluster.lc.shutdown()
    assert ray_processes_of(temp) == [], "Ray processes left"


async def _exists_in(sb: shoal.Sandbox, path: str) -> bool:
    return (await sb.exec(["test", "-e", path])).exit_code == 0


async def _indexed(node_id: str, ids: set[str]) -> None:
    """Wait until the node agent's published sandbox index lists `ids` (it follows changes within ~0.1 s)."""
    import json

    from shoal.cluster.raylink import KV_INDEX_PREFIX, kv_get

    for _ in range(600):
        raw = await asyncio.to_thread(kv_get, KV_INDEX_PREFIX + node_id)
        if raw and ids <= {d["id"] for d in json.loads(raw)}:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"node {node_id} never published {ids}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _mounts_under(prefix: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [mp for mp in (line.split()[4] for line in f) if mp.startswith(prefix + "/")]
