"""The event log, the sandbox index and pages, live stats, and the observability API (issue 20), on the
fake backend: a real Node, the real FastAPI app under uvicorn, real agents (no isolation: unit tests)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time
from pathlib import Path

import httpx
import pytest

import shoal
from shoal.errors import SandboxNotFound
from shoal.node.events import EventIndex, EventLog, read_events
from shoal.node.node import Node
from shoal.sdk.local import LocalTransport
from shoal.server.app import create_app
from shoal.server.live import LiveStats, percentiles
from shoal.server.observe import SandboxQuery, merge_pages, page_rows
from shoal.server.settings import ServerSettings
from shoal.server.tokens import TokenStore
from tests.unit.conftest import AGENT_BUILT, add_image, fake_config
from tests.unit.test_server_fake import Server
from tests.waiting import async_wait_for

FAKE = {"backend": "fake"}


def kinds(evs: list) -> list[str]:
    return [e.kind for e in evs]


# ---- the event log on a node --------------------------------------------------------------------------
@pytest.mark.skipif(not AGENT_BUILT, reason="the agent is not built: run `make agent`")
async def test_a_sandbox_life_is_logged_and_readable_after_close(node: Node) -> None:
    async with shoal.Client(transport=LocalTransport(node)) as c:
        sb = await c.create("t:1", labels={"shoal.job": "j1"}, **FAKE)
        await sb.exec("echo hi")
        r = await sb.exec("exit 3")
        assert r.exit_code == 3
        sh = await sb.shell()
        await sh.run("cd /tmp")
        await sb.pause()
        await sb.resume()
        sid = sb.id
        await sb.close()
        evs = await c.events(sid)
        cmds = await c.events(sid, commands=True)
    assert kinds(evs) == ["created", "paused", "resumed", "closed"]
    assert evs[0].data["image"] == "t:1" and evs[0].data["labels"] == {"shoal.job": "j1"}
    assert evs[0].project == "default" and evs[0].node == node.config.node_id
    assert evs[1].data["by"] == "user"
    assert evs[-1].data["reason"] == "user"
    assert [(e.data["cmd"], e.data["exit_code"], e.data["via"]) for e in cmds] == [
        ("echo hi", 0, "exec"), ("exit 3", 3, "exec"), ("cd /tmp", 0, "shell")]
    assert all(e.data["duration_s"] >= 0 for e in cmds)
    # another process (a fresh index over the same home) reads the same
    idx = EventIndex(node.paths.home)
    idx.refresh()
    assert [e["kind"] for e in idx.of(sid)] == ["created", "paused", "resumed", "closed"]
    assert len(idx.of(sid, commands=True)) == 3


@pytest.mark.skipif(not AGENT_BUILT, reason="the agent is not built: run `make agent`")
async def test_stream_commands_are_logged_with_their_exit(node: Node) -> None:
    from shoal.spec import SandboxSpec

    info = await node.create(SandboxSpec(image="t:1", backend="fake"))
    h = await node.stream(info.id, "echo a; exit 4")
    res = await h.wait()
    assert res.exit_code == 4
    (cmd,) = read_events(node.paths.home, sandbox_id=info.id, kinds=["exec"])
    assert cmd.data["cmd"] == "echo a; exit 4" and cmd.data["exit_code"] == 4 and cmd.data["via"] == "stream"


@pytest.mark.skipif(not AGENT_BUILT, reason="the agent is not built: run `make agent`")
async def test_ttl_expiry_and_a_dead_init_are_logged_as_timeout_and_lost(node: Node) -> None:
    from shoal.spec import SandboxSpec

    a = await node.create(SandboxSpec(image="t:1", backend="fake", ttl_s=1))
    b = await node.create(SandboxSpec(image="t:1", backend="fake"))
    os.kill(node.record(b.id).init_pid, 9)
    async def both_closed() -> bool:
        await node.recovery.reap_once()
        return len([e for e in read_events(node.paths.home) if e.kind == "closed"]) == 2

    await async_wait_for(both_closed, what="the reaper to close the expired and the dead sandbox", interval=0.2)
    ea = kinds(read_events(node.paths.home, sandbox_id=a.id))
    eb = read_events(node.paths.home, sandbox_id=b.id)
    assert ea == ["created", "timeout", "closed"]
    assert kinds(eb) == ["created", "lost", "closed"]
    assert eb[-1].data["reason"] == "lost"
    assert read_events(node.paths.home, sandbox_id=a.id)[-1].data["reason"] == "timeout"


def test_the_log_rotates_and_the_index_follows(tmp_path: Path) -> None:
    log = EventLog(tmp_path, "n0", max_mb=1)
    idx = EventIndex(tmp_path, per_sandbox=5)
    pad = "x" * 200
    for i in range(6000):  # ~1.4 MiB: one rotation
        log.emit("created", f"n0-{i:026d}", "p", pad=pad)
        if i == 100:
            idx.refresh()
    log.close()
    files = sorted(p.name for p in (tmp_path / "events").iterdir())
    assert files == ["events.jsonl", "events.jsonl.1"]
    idx.refresh()
    assert idx.lines == 6000  # nothing lost across the rotation, nothing read twice
    assert len(read_events(tmp_path, limit=10_000)) == 6000
    last = f"n0-{5999:026d}"
    assert idx.of(last)[0]["id"] == last


def test_a_torn_line_is_skipped(tmp_path: Path) -> None:
    log = EventLog(tmp_path, "n0")
    log.emit("created", "n0-" + "a" * 26, "p")
    log.close()
    with open(tmp_path / "events" / "events.jsonl", "ab") as f:
        f.write(b'{"t": 1, "kind": "crea')  # a writer died mid-line
    assert kinds(read_events(tmp_path)) == ["created"]


def test_a_disabled_log_writes_nothing(tmp_path: Path) -> None:
    log = EventLog(tmp_path, "n0", enabled=False)
    log.emit("created", "n0-" + "a" * 26, "p")
    log.command("n0-" + "a" * 26, "p", "true", exit_code=0, duration_s=0.1)
    assert not (tmp_path / "events").exists()
    assert log.counts["created"] == 1  # still counted for /metrics


# ---- pages ----------------------------------------------------------------------------------------
def _rows(n: int, now: float) -> list[dict]:
    rnd = random.Random(7)
    out = []
    for i in range(n):
        out.append({"id": f"n{i % 3}-{i:026d}", "project": rnd.choice(["a", "b"]), "state": rnd.choice(
            ["running", "running", "paused"]), "backend": "container", "image": rnd.choice(["base", "py:3"]),
            "created_at": now - (n - i), "labels": {"k": str(i % 5)}, "job": rnd.choice(["j1", "j2", None]),
            "cpus": 1.0, "memory_mb": rnd.choice([256, 1024]), "node": f"n{i % 3}"})
    return out


def test_pages_filter_count_sort_and_slice_50000_rows() -> None:
    now = time.time()
    rows = _rows(50_000, now)
    q = SandboxQuery(project="a", states=("running",), job="j1", labels={"k": "2"}, image="py", offset=10, limit=20)
    page = page_rows(rows, q, now)
    want = [r for r in rows if r["project"] == "a" and r["state"] == "running" and r["job"] == "j1"
            and r["labels"]["k"] == "2" and "py" in r["image"]]
    assert page["total"] == len(want)
    assert [r["id"] for r in page["items"]] == [r["id"] for r in reversed(want)][10:30]
    assert page["facets"]["state"] == {"running": len(want)}
    young = page_rows(rows, SandboxQuery(max_age_s=100.5, limit=500), now)
    assert young["total"] == 100
    by_mem = page_rows(rows, SandboxQuery(sort="memory_mb", desc=False, limit=5))
    assert all(r["memory_mb"] == 256 for r in by_mem["items"])


@pytest.mark.skipif(not AGENT_BUILT, reason="the agent is not built: run `make agent`")
async def test_the_index_shows_own_changes_at_once_and_catches_up_in_the_background(node: Node) -> None:
    from shoal.server.observe import SandboxIndex
    from shoal.spec import SandboxSpec

    idx = SandboxIndex(node, max_age_s=0.2)
    assert await idx.fresh() == [] and idx.builds == 1
    a = await node.create(SandboxSpec(image="t:1", backend="fake"))
    assert [r["id"] for r in await idx.fresh()] == [a.id] and idx.builds == 2  # its own create: rebuilt first
    # a record this node's log did not announce (another process sharing the home): the index has "seen" the
    # event counter already, so only its age makes it rebuild
    b = await node.create(SandboxSpec(image="t:1", backend="fake"))
    idx._seen = node.events.counts.total()
    assert [r["id"] for r in await idx.fresh()] == [a.id]  # younger than max_age_s: as it is
    await asyncio.sleep(0.25)
    rows = await idx.fresh()  # expired: answered at once with the old rows, rebuilt in the background
    assert [r["id"] for r in rows] == [a.id]
    assert idx._bg is not None
    await idx._bg
    assert {r["id"] for r in await idx.fresh()} == {a.id, b.id} and idx.builds == 3
    await idx.stop()


def test_pages_of_several_nodes_merge_like_one() -> None:
    rows = _rows(3000, time.time())
    q = SandboxQuery(states=("paused",), offset=40, limit=25)
    whole = page_rows(rows, q)
    per_node = [page_rows([r for r in rows if r["node"] == n], SandboxQuery(states=("paused",), offset=0, limit=65))
                for n in ("n0", "n1", "n2")]
    merged = merge_pages(per_node, q)
    assert merged["total"] == whole["total"]
    assert [r["id"] for r in merged["items"]] == [r["id"] for r in whole["items"]]
    assert merged["facets"]["node"] == whole["facets"]["node"]


def test_live_stats_rates_and_percentiles() -> None:
    st = LiveStats(lambda: {"states": {"running": 3}}, interval_s=2.0)
    t0 = time.time()
    st.sample(now=t0)
    for ms in range(1, 101):
        st.observe_create(ms / 1000.0)
    st.observe_create(5.0, ok=False)
    st.observe_exec(0.002)
    p = st.sample(now=time.time() + 2.0)
    assert p["create_errors"] == 1 and p["states"] == {"running": 3}
    assert p["create_p50"] == 50.0 and p["create_p99"] == 99.0 and p["exec_p50"] == 2.0
    assert p["create_rate"] > 0
    assert st.series(since=st.points[0]["t"]) == [p]
    assert percentiles([]) == [None, None, None]


# ---- the API --------------------------------------------------------------------------------------
@pytest.fixture
def served(fake_home: Path):
    """A server on the fake backend with tokens: admin, project `alpha`, project `beta`."""
    if not AGENT_BUILT:
        pytest.skip("the agent is not built: run `make agent`")
    node = Node(fake_config(fake_home))
    add_image(node.store, "t:1", {"/work/hello.txt": "hi\n"})
    tokens = TokenStore(node.paths.home)
    toks = {"admin": tokens.create("ops", admin=True), "alpha": tokens.create("alpha"), "beta": tokens.create("beta")}
    with Server(create_app(node, ServerSettings(), tokens=tokens, manage_node=True)) as url:
        yield url, toks


async def _close_all(url: str, token: str) -> None:
    async with shoal.Client(url, token=token) as c:
        for i in await c.list():
            await (await c.get(i.id)).close()


async def test_the_api_scopes_pages_events_and_figures_by_token(served) -> None:
    url, toks = served
    H = {k: {"Authorization": f"Bearer {v}"} for k, v in toks.items()}
    try:
        async with shoal.Client(url, token=toks["alpha"]) as a, shoal.Client(url, token=toks["beta"]) as b:
            mine = [await a.create("t:1", labels={"shoal.job": "train", "step": str(i)}, **FAKE) for i in range(3)]
            theirs = await b.create("t:1", **FAKE)
            await mine[0].exec("true")
            await mine[1].pause()
            async with httpx.AsyncClient(base_url=url, timeout=30) as h:
                pa = (await h.get("/v1/sandboxes/page", headers=H["alpha"])).json()
                assert pa["total"] == 3 and {r["project"] for r in pa["items"]} == {"alpha"}
                paused = (await h.get("/v1/sandboxes/page", params={"state": "paused"}, headers=H["alpha"])).json()
                assert [r["id"] for r in paused["items"]] == [mine[1].id]
                lab = (await h.get("/v1/sandboxes/page", params=[("label", "step=2"), ("job", "train")],
                                   headers=H["alpha"])).json()
                assert [r["id"] for r in lab["items"]] == [mine[2].id]
                # an empty filter is what a form sends for "any" (CI's schemathesis run found these as 422s)
                empty = [("label", ""), ("job", ""), ("state", ""), ("image", ""), ("backend", ""), ("q", "")]
                anyp = (await h.get("/v1/sandboxes/page", params=empty, headers=H["alpha"])).json()
                assert anyp["total"] == 3
                bad = await h.get("/v1/sandboxes/page", params={"label": "no-equals"}, headers=H["alpha"])
                assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request", bad.text
                assert (await h.get("/v1/events", params={"kind": ""}, headers=H["alpha"])).status_code == 200
                bad = await h.get("/v1/events", params={"kind": "exploded"}, headers=H["alpha"])
                assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request", bad.text
                pb = (await h.get("/v1/sandboxes/page", headers=H["beta"])).json()
                assert [r["id"] for r in pb["items"]] == [theirs.id]
                assert (await h.get("/v1/sandboxes/page", params={"project": "alpha"},
                                    headers=H["beta"])).status_code == 403
                everything = (await h.get("/v1/sandboxes/page", headers=H["admin"])).json()
                assert everything["total"] == 4 and everything["facets"]["project"] == {"alpha": 3, "beta": 1}
                # events: own only, also after close; another project's are "not found"
                await mine[2].close()
                ev = (await h.get(f"/v1/sandboxes/{mine[2].id}/events", headers=H["alpha"])).json()["events"]
                assert [e["kind"] for e in ev] == ["created", "closed"]
                assert (await h.get(f"/v1/sandboxes/{mine[2].id}/events", headers=H["beta"])).status_code == 404
                cmds = (await h.get(f"/v1/sandboxes/{mine[0].id}/events", params={"commands": "true"},
                                    headers=H["alpha"])).json()["events"]
                assert [c["cmd"] for c in cmds] == ["true"]
                recent = (await h.get("/v1/events", headers=H["beta"])).json()["events"]
                assert {e["id"] for e in recent} == {theirs.id}
                assert (await h.get(f"/v1/sandboxes/{theirs.id}/usage", headers=H["alpha"])).status_code == 404
                # node-wide figures: admin only
                assert (await h.get("/v1/nodes", headers=H["alpha"])).status_code == 403
                assert (await h.get("/v1/stats", headers=H["alpha"])).status_code == 403
                nodes = (await h.get("/v1/nodes", headers=H["admin"])).json()
                assert nodes["kind"] == "node" and nodes["nodes"][0]["health"] == "ok"
                assert nodes["nodes"][0]["sandboxes"]["paused"] == 1
                me = (await h.get("/v1/ui/whoami", headers=H["alpha"])).json()
                assert me == {"project": "alpha", "admin": False, "auth": True, "kind": "node"}
                users = (await h.get("/v1/ui/image-users", headers=H["alpha"])).json()
                assert users["images"] == {"t:1": 2} and list(users["layers"].values()) == [2]
                assert set(users["sizes"]) and all(v > 0 for v in users["sizes"].values())
                metrics = (await h.get("/metrics", headers=H["admin"])).text
                assert 'shoal_sandbox_events_total{kind="created"} 4.0' in metrics
                assert "shoal_memory_used_mb" in metrics
                # live stats: a point appears within a few sampling intervals, with the creates counted
                async def points() -> list:
                    pts = (await h.get("/v1/stats", headers=H["admin"])).json()["total"]
                    return pts if any(p.get("create_p50") for p in pts) else []

                pts = await async_wait_for(points, what="a stats point with the creates counted", interval=0.5)
                assert pts[-1]["states"]["paused"] == 1
            # the SDK reads the same log over HTTP
            evs = await a.events(mine[1].id)
            assert kinds(evs) == ["created", "paused"]
            with pytest.raises(SandboxNotFound):
                await b.events(mine[1].id)
    finally:
        await _close_all(url, toks["admin"])


async def test_a_terminal_ticket_opens_one_stream_once(served) -> None:
    import websockets

    url, toks = served
    try:
        async with shoal.Client(url, token=toks["alpha"]) as a:
            sb = await a.create("t:1", **FAKE)
            async with httpx.AsyncClient(base_url=url) as h:
                H = {"Authorization": f"Bearer {toks['alpha']}"}
                ticket = (await h.post("/v1/ui/ticket", headers=H)).json()["ticket"]
                ws_url = url.replace("http", "ws") + f"/v1/sandboxes/{sb.id}/stream?ticket={ticket}"
                async with websockets.connect(ws_url) as ws:
                    await ws.send(json.dumps({"cmd": "cat", "stdin": True, "timeout": 30}))
                    assert json.loads(await ws.recv())["type"] == "started"
                    await ws.send(b"typed\n")
                    out = await ws.recv()
                    assert out == b"\x01typed\n"
                    await ws.send(json.dumps({"type": "stdin_eof"}))
                    assert json.loads(await ws.recv())["type"] == "exit"
                async with websockets.connect(ws_url) as ws:  # used once already
                    msg = json.loads(await ws.recv())
                    assert msg["type"] == "error" and msg["error"]["code"] == "unauthorized"
                # a ticket of project beta does not reach alpha's sandbox
                tb = (await h.post("/v1/ui/ticket", headers={"Authorization": f"Bearer {toks['beta']}"})).json()
                async with websockets.connect(url.replace("http", "ws") +
                                              f"/v1/sandboxes/{sb.id}/stream?ticket={tb['ticket']}") as ws:
                    await ws.send(json.dumps({"cmd": "true"}))
                    msg = json.loads(await ws.recv())
                    assert msg["type"] == "error" and msg["error"]["code"] == "sandbox_not_found"
    finally:
        await _close_all(url, toks["admin"])


async def _cli(*args: str, token: str) -> tuple[int, str, str]:
    # the installed `shoal` command, as a user runs it (a subprocess: its own event loop and console)
    import sys

    env = dict(os.environ, SHOAL_TOKEN=token, COLUMNS="200", NO_COLOR="1")
    env.pop("SHOAL_URL", None)
    p = await asyncio.create_subprocess_exec(str(Path(sys.executable).with_name("shoal")), *args, env=env,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 120)
    return p.returncode or 0, out.decode(), err.decode()


async def test_shoal_events_and_shoal_top_read_the_server(served) -> None:
    url, toks = served
    try:
        async with shoal.Client(url, token=toks["alpha"]) as a, shoal.Client(url, token=toks["beta"]) as b:
            sb = await a.create("t:1", **FAKE)
            theirs = await b.create("t:1", **FAKE)
            assert (await sb.exec("exit 3")).exit_code == 3
            await sb.pause()
            rc, out, err = await _cli("events", "--json", "--url", url, token=toks["alpha"])
            assert rc == 0, err
            evs = [json.loads(ln) for ln in out.splitlines()]
            assert [(e["kind"], e["id"]) for e in evs] == [("created", sb.id), ("paused", sb.id)]
            rc, out, err = await _cli("events", sb.id, "--commands", "--json", "--url", url, token=toks["alpha"])
            (cmd,) = [json.loads(ln) for ln in out.splitlines()]
            assert rc == 0 and cmd["cmd"] == "exit 3" and cmd["exit_code"] == 3 and cmd["duration_s"] >= 0, err
            rc, out, err = await _cli("events", theirs.id, "--url", url, token=toks["alpha"])
            assert rc != 0 and "no sandbox" in err and "Traceback" not in err, (out, err)
            # shoal top: one frame with the node, its sandboxes by state and the newest events (admin token)
            rc, out, err = await _cli("top", "--once", "--url", url, token=toks["admin"])
            assert rc == 0, err
            assert "shoal top" in out and "(node)" in out and "paused 1" in out and "running 1" in out, out
            assert sb.id in out and theirs.id in out
            rc, out, err = await _cli("top", "--once", "--url", url, token=toks["alpha"])
            assert rc != 0 and "admin" in err and "Traceback" not in err, (out, err)
    finally:
        await _close_all(url, toks["admin"])


def test_the_dashboard_is_served_by_the_package(served) -> None:
    url, _ = served
    with httpx.Client(base_url=url) as h:
        page = h.get("/ui")
        assert page.status_code == 200 and "/ui/static/app.js" in page.text
        for asset in ("app.js", "charts.js", "app.css", "vendor/xterm/xterm.js", "vendor/xterm/addon-fit.js",
                      "vendor/xterm/xterm.css"):
            assert h.get(f"/ui/static/{asset}").status_code == 200, asset
        assert "/ui" not in h.get("/openapi.json").json()["paths"]


# ---- the Grafana dashboard --------------------------------------------------------------------------
async def test_the_grafana_dashboard_asks_for_metrics_the_server_exports(node: Node) -> None:
    from prometheus_client import generate_latest

    from shoal.server.limits import TokenLimiter
    from shoal.server.metrics import Metrics

    repo = Path(__file__).resolve().parents[2]
    dash = json.loads((repo / "deploy" / "grafana" / "shoal.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 15 and len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    wanted = {re.sub(r"_(bucket|count|sum|total)$", "", m) for e in exprs for m in re.findall(r"shoal_[a-z0-9_]+", e)}
    m = Metrics(node, TokenLimiter(8, 8))
    m.create_seconds.labels("fake").observe(0.01)
    m.exec_seconds.labels("exec").observe(0.01)
    m.errors.labels("x").inc()
    text = generate_latest(m.registry).decode()
    exported = {re.sub(r"_(bucket|count|sum|total|created)$", "", ln.split("{")[0].split()[0])
                for ln in text.splitlines() if ln and not ln.startswith("#")}
    gateway_only = {"shoal_cluster_nodes"}  # added by a gateway's /metrics (shoal.server.metrics.cluster_metrics)
    assert wanted - exported == gateway_only, wanted - exported
