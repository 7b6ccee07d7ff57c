"""Item 2 of issue 23: a `shoal serve` without tokens could be driven by any web page the user opened.

A DNS-rebinding page (a name of the attacker's now resolving to 127.0.0.1) listed sandboxes, created one
and ran `id` (uid=0) through the browser; a cross-origin `no-cors` `text/plain` POST to the E2B create
(`/sandboxes` reads the body whatever its content type) made a sandbox. A real `shoal serve` without
tokens, on its own SHOAL_HOME, gets the requests a browser sends in each case: first as raw HTTP with the
exact headers (Host, Origin, Sec-Fetch-Site; a WebSocket handshake), then from Debian's chromium itself
(a page of another origin posting no-cors; a page whose name resolves to the server). Each is refused
with 403 and makes nothing; the SDK, curl-like clients and the dashboard's own page keep working."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import shoal
from shoal.server.proc import ServerProcess

pytestmark = [pytest.mark.root]
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def tokenless(base_image: str) -> Iterator[ServerProcess]:
    """A `shoal serve` without tokens on a SHOAL_HOME of its own (the session's has tokens)."""
    from shoal.config import Paths
    from shoal.node.teardown import teardown_home

    home = Path(tempfile.mkdtemp(prefix="shtb-", dir="/tmp"))
    env = dict(os.environ, SHOAL_HOME=str(home))
    try:
        with ServerProcess(env=env, log_path=home / "server.log") as srv:
            assert httpx.get(srv.url + "/healthz").json()["auth"] is False
            yield srv
    finally:
        asyncio.run(teardown_home(Paths.from_env(home), close_sandboxes=True))
        shutil.rmtree(home, ignore_errors=True)


def _count(srv: ServerProcess) -> int:
    return len(httpx.get(srv.url + "/v1/sandboxes").json()["sandboxes"])


def _ws_status(srv: ServerProcess, path: str, origin: str) -> int:
    """The HTTP status a WebSocket handshake with this Origin gets."""
    host, port = srv.url.split("//")[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nOrigin: {origin}\r\nConnection: Upgrade\r\n"
                  "Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                  "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n".encode())
        return int(s.recv(200).split(b" ", 2)[1])


def test_rebinding_and_cross_origin_requests_are_refused(tokenless: ServerProcess) -> None:
    srv = tokenless
    port = srv.url.rsplit(":", 1)[1]
    before = _count(srv)
    create = {"image": "base", "memory_mb": 64}
    rebound = {"Host": f"rebind.attacker.test:{port}"}
    # DNS rebinding: the page's own name, now 127.0.0.1 — it may neither read nor act
    for method, path, body in (("GET", "/v1/sandboxes", None), ("POST", "/v1/sandboxes", create),
                               ("GET", "/ui", None), ("GET", "/openapi.json", None)):
        r = httpx.request(method, srv.url + path, json=body, headers=rebound)
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", (path, r.text)
        assert "DNS rebinding" in r.json()["error"]["message"]
    # CSRF: what fetch(url, {mode: "no-cors", method: "POST", body}) sends from another origin
    csrf = {"Origin": "http://attacker.test", "Content-Type": "text/plain;charset=UTF-8",
            "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}
    for path, body in (("/sandboxes", {"templateID": "base"}), ("/v1/sandboxes", create)):
        r = httpx.post(srv.url + path, content=json.dumps(body), headers=csrf)
        assert r.status_code == 403 and "another" in r.json()["error"]["message"], (path, r.text)
    # each header alone is enough: an Origin of another site, or Sec-Fetch-Site from an old form post
    for headers in ({"Origin": "http://attacker.test"}, {"Origin": "null"}, {"Sec-Fetch-Site": "same-site"},
                    {"Origin": f"http://127.0.0.1:{int(port) + 1}"}):
        r = httpx.post(srv.url + "/sandboxes", content=b'{"templateID": "base"}', headers=headers)
        assert r.status_code == 403, (headers, r.text)
    # a WebSocket handshake from another origin is refused before it is accepted
    assert _ws_status(srv, "/v1/sandboxes/x/stream", "http://attacker.test") == 403
    assert _count(srv) == before  # nothing was made


async def test_clients_and_the_dashboard_page_keep_working(tokenless: ServerProcess) -> None:
    srv = tokenless
    port = srv.url.rsplit(":", 1)[1]
    async with shoal.Client(srv.url) as c:  # the SDK sends no Origin, and Host 127.0.0.1:port
        sb = await c.create("base", memory_mb=64)
        assert (await sb.exec("id -u")).stdout == b"0\n"
        # the dashboard's own page: same origin, by IP or by localhost
        for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
            r = httpx.post(srv.url + f"/v1/sandboxes/{sb.id}/exec", json={"cmd": "echo ok"},
                           headers={"Host": host, "Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"})
            assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
        await sb.close()


def test_a_real_browser_cannot_drive_it(tokenless: ServerProcess, tmp_path: Path) -> None:
    """Debian's chromium (its Private Network Access checks off, as in browsers that have none): a page of
    another origin posts no-cors to the E2B create; a page whose name resolves to the server (what DNS
    rebinding achieves) lists sandboxes and creates one."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (make setup)")
    from playwright.sync_api import sync_playwright

    srv = tokenless
    port = srv.url.rsplit(":", 1)[1]
    before = _count(srv)
    # Chromium's own Private Network Access checks are turned off: Firefox and Safari have none, so the
    # server must refuse these requests itself
    args = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run",
            "--disable-dev-shm-usage", "--host-resolver-rules=MAP rebind.attacker.test 127.0.0.1, "
            "MAP attacker.test 127.0.0.1", "--disable-features=BlockInsecurePrivateNetworkRequests,"
            "PrivateNetworkAccessSendPreflights,PrivateNetworkAccessRespectPreflightResults,"
            "LocalNetworkAccessChecks"]
    page_html = "<html><body>hello</body></html>"
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                   headless=True, args=args)
        try:
            page = ctx.new_page()
            # the attacker's pages (only the documents are served here; their requests go to the network)
            for url in (f"http://attacker.test:{port}/", f"http://rebind.attacker.test:{port}/"):
                page.route(url, lambda route: route.fulfill(status=200, content_type="text/html", body=page_html))
            page.goto(f"http://attacker.test:{port}/")
            sent = page.evaluate("""async (url) => {
                try { await fetch(url + '/sandboxes', {method: 'POST', mode: 'no-cors',
                        headers: {'Content-Type': 'text/plain'}, body: JSON.stringify({templateID: 'base'})});
                      return 'sent'; } catch (e) { return 'blocked: ' + e; } }""", f"http://127.0.0.1:{port}")
            page.goto(f"http://rebind.attacker.test:{port}/")
            got = page.evaluate("""async () => {
                const l = await fetch('/v1/sandboxes'); const c = await fetch('/v1/sandboxes', {method: 'POST',
                  headers: {'Content-Type': 'application/json'}, body: JSON.stringify({image: 'base', memory_mb: 64})});
                return [l.status, c.status, await c.text()]; }""")
        finally:
            ctx.close()
    assert sent == "sent", sent  # the browser did send it: the server has to refuse it
    assert got[0] == 403 and got[1] == 403, got
    assert _count(srv) == before
