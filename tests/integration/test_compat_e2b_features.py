"""The E2B features users lean on, with the unmodified `e2b` / `e2b-code-interpreter` SDKs from PyPI against a real
`shoal serve`: list pagination and filters, ports (`get_host`), the code interpreter's rich results and streaming,
`get_metrics` and `files.watch_dir`."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

e2b = pytest.importorskip("e2b", reason="the compat extra (pip install -e .[compat]) brings the E2B SDK")
e2b_ci = pytest.importorskip("e2b_code_interpreter")

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]


def test_list_pages_with_next_token_and_filters(e2b_env: dict) -> None:
    from e2b import Sandbox, SandboxQuery, SandboxState

    tag = secrets.token_hex(4)
    made = [Sandbox.create(timeout=120, metadata={"run": tag, "i": str(i)}) for i in range(5)]
    e2b_env["made"].extend(made)
    ids = [sb.sandbox_id for sb in made]

    pager = Sandbox.list(query=SandboxQuery(metadata={"run": tag}), limit=2)
    pages = []
    while pager.has_next:
        pages.append([s.sandbox_id for s in pager.next_items()])
    assert [len(p) for p in pages] == [2, 2, 1]
    assert [s for p in pages for s in p] == list(reversed(ids))  # newest first, each sandbox once

    asc = Sandbox.list(query=SandboxQuery(metadata={"run": tag}), limit=3, order="asc")
    assert [s.sandbox_id for s in asc.next_items()] == ids[:3] and asc.has_next
    assert [s.sandbox_id for s in asc.next_items()] == ids[3:] and not asc.has_next

    # metadata values the SDK has to escape, and the state filter
    odd = Sandbox.create(timeout=120, metadata={"run": tag, "note": "a b&c=d/é"})
    e2b_env["made"].append(odd)
    assert odd.pause()
    found = Sandbox.list(query=SandboxQuery(metadata={"note": "a b&c=d/é"})).next_items()
    assert [s.sandbox_id for s in found] == [odd.sandbox_id] and found[0].state == SandboxState.PAUSED
    paused = Sandbox.list(query=SandboxQuery(metadata={"run": tag}, state=[SandboxState.PAUSED])).next_items()
    assert [s.sandbox_id for s in paused] == [odd.sandbox_id]
    running = Sandbox.list(query=SandboxQuery(metadata={"run": tag}, state=[SandboxState.RUNNING])).next_items()
    assert {s.sandbox_id for s in running} == set(ids)

    # a token issued for one order is refused by the other, as E2B refuses it
    first = Sandbox.list(query=SandboxQuery(metadata={"run": tag}), limit=1, order="asc")
    first.next_items()
    assert first.next_token
    with pytest.raises(e2b.SandboxException, match="400: Invalid next token"):
        Sandbox.list(query=SandboxQuery(metadata={"run": tag}), next_token=first.next_token).next_items()


@pytest.fixture(scope="session")
def interpreter_image(shoal_home: Path, base_image: str) -> str:
    """The `code-interpreter` image (matplotlib, pandas, IPython from Debian), built once per store (mmdebstrap,
    a few minutes on a fresh machine). An operator's SHOAL_E2B_TEMPLATES alias for code-interpreter-v1 is used
    as it is instead."""
    from shoal.config import Paths, settings
    from shoal.images.store import ImageStore
    from shoal.server.compat.interpreter_image import ensure_interpreter_image

    alias = settings().e2b_templates.get("code-interpreter-v1")
    if alias:
        return alias
    return ensure_interpreter_image(ImageStore(Paths.from_env().store)).ref


def _png(b64: str) -> bytes:
    import base64

    data = base64.b64decode(b64)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    return data


def test_interpreter_rich_results(e2b_env: dict, interpreter_image: str) -> None:
    from e2b_code_interpreter import Sandbox

    sb = Sandbox.create(timeout=300)
    e2b_env["made"].append(sb)
    # plt.show(): the figure as a PNG (display data, not the cell's value)
    ex = sb.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.title('t')\nplt.show()")
    assert ex.error is None, ex.error
    assert len(ex.results) == 1
    fig = ex.results[0]
    _png(fig.png)
    assert fig.text.startswith("<Figure size") and not fig.is_main_result and "png" in fig.formats()
    # a figure left open is shown at the end of the cell, once, as IPython's inline backend does
    ex = sb.run_code("fig, ax = plt.subplots()\nax.bar(['a', 'b'], [1, 2])\nfig.savefig('/tmp/f.png')")
    assert [bool(r.png) for r in ex.results] == [True]
    assert sb.run_code("import matplotlib.pyplot as plt\nplt.get_fignums()").text == "[]"  # closed after

    # a DataFrame as the cell's value: text and HTML (and its columns as `data`, as E2B gives them)
    ex = sb.run_code("import pandas as pd\ndf = pd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})\ndf")
    (res,) = ex.results
    assert res.is_main_result and ex.text == res.text
    assert "<table" in res.html and "</table>" in res.html
    assert res.text.split() == ["a", "b", "0", "1", "x", "1", "2", "y"]
    assert res.data == {"a": [1, 2], "b": ["x", "y"]}

    # display() of HTML, JSON-able values and images, through IPython's own classes
    ex = sb.run_code(
        "from IPython.display import display, HTML, Image, Markdown\n"
        "import io\n"
        "display(HTML('<b>hi</b>'))\n"
        "display({'k': [1, 2]})\n"
        "buf = io.BytesIO(); plt.figure(figsize=(1, 1)).savefig(buf, format='png'); plt.close('all')\n"
        "display(Image(data=buf.getvalue()))\n"
        "display(Markdown('# title'))\n"
        "7 * 6")
    assert ex.error is None, ex.error
    html, js, img, md, main = ex.results
    assert html.html == "<b>hi</b>" and not html.is_main_result
    assert js.json == {"k": [1, 2]} and js.text == "{'k': [1, 2]}"
    _png(img.png)
    assert md.markdown == "# title"
    assert main.is_main_result and main.text == "42" and ex.text == "42"
    # the builtin display() without an import, and a value hidden by ';'
    ex = sb.run_code("display(3)\n1 + 1;")
    assert [(r.text, r.is_main_result) for r in ex.results] == [("3", False)]
    # a string value comes back without its quotes, as E2B's kernel gives it
    assert sb.run_code("'abc'").text == "abc"
    # top-level await, as in a notebook
    assert sb.run_code("import asyncio\nawait asyncio.sleep(0)\n41 + 1").text == "42"


def test_interpreter_streams_in_order_with_clean_tracebacks(e2b_env: dict) -> None:
    from e2b_code_interpreter import Sandbox

    sb = Sandbox.create(timeout=300)
    e2b_env["made"].append(sb)
    # the cell waits for a file the test writes only once it has received 'ready': output that came only at
    # the end of the cell would never let it finish
    seen: list[tuple[str, str]] = []

    def on_out(m) -> None:  # type: ignore[no-untyped-def]
        seen.append(("out", m.line))
        if m.line == "ready\n":
            sb.files.write("/tmp/go", "1")

    code = ("import os, sys, time\nprint('ready')\nwhile not os.path.exists('/tmp/go'):\n    time.sleep(0.05)\n"
            "print('two', file=sys.stderr)\nprint('three')\nos.system('echo from-shell')\nprint('four')")
    ex = sb.run_code(code, on_stdout=on_out, on_stderr=lambda m: seen.append(("err", m.line)), timeout=120)
    assert ex.error is None, ex.error
    assert seen[:3] == [("out", "ready\n"), ("err", "two\n"), ("out", "three\n")]  # in the order printed
    assert sorted(seen[3:]) == [("out", "four\n"), ("out", "from-shell\n")]  # another process: its own pipe
    assert ex.logs.stdout[:2] == ["ready\n", "three\n"] and ex.logs.stderr == ["two\n"]

    # a traceback starts at the cell, with its source lines, and has none of the driver's frames
    ex = sb.run_code("def f(x):\n    return 1 / x\n\nf(0)")
    err = ex.error
    assert err.name == "ZeroDivisionError" and err.value == "division by zero"
    assert 'line 4, in <module>' in err.traceback and 'line 2, in f' in err.traceback
    assert "return 1 / x" in err.traceback
    assert '"<string>"' not in err.traceback and "_run" not in err.traceback and "exec(" not in err.traceback
    err = sb.run_code("1 +").error
    assert err.name == "SyntaxError" and "<string>" not in err.traceback

    # more output over the context's life than one exec stream's default cap (1 MiB): it keeps working
    for _ in range(3):
        ex = sb.run_code("print('x' * 600_000)")
        assert ex.error is None and len("".join(ex.logs.stdout)) == 600_001


# ---- ports -------------------------------------------------------------------------------------------
#: a WebSocket echo server from the standard library alone (the base image has python3, nothing more)
WS_ECHO = r'''
import base64, hashlib, socket, struct, sys, threading
def exact(c, n):
    b = b""
    while len(b) < n:
        d = c.recv(n - len(b))
        if not d:
            raise EOFError
        b += d
    return b
def handle(c):
    data = b""
    while b"\r\n\r\n" not in data:
        data += c.recv(4096)
    lines = data.decode().split("\r\n")
    key = [v.split(":", 1)[1].strip() for v in lines if v.lower().startswith("sec-websocket-key")][0]
    acc = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
    c.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               "Sec-WebSocket-Accept: " + acc + "\r\n\r\n").encode())
    try:
        while True:
            h = exact(c, 2)
            op, n = h[0] & 15, h[1] & 127
            if n == 126:
                n = struct.unpack(">H", exact(c, 2))[0]
            elif n == 127:
                n = struct.unpack(">Q", exact(c, 8))[0]
            mask = exact(c, 4)
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(exact(c, n)))
            if op == 8:
                c.sendall(bytes([0x88, len(payload[:2])]) + payload[:2])
                break
            if n < 126:
                size = bytes([n])
            elif n < 65536:
                size = bytes([126]) + struct.pack(">H", n)
            else:
                size = bytes([127]) + struct.pack(">Q", n)
            c.sendall(bytes([0x80 | op]) + size + payload)
    except EOFError:
        pass
    c.close()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
while True:
    conn, _ = s.accept()
    threading.Thread(target=handle, args=(conn,), daemon=True).start()
'''

#: an HTTP/1.1 (keep-alive) server that describes each POST it gets
HTTP_ECHO = r'''
import hashlib, json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        out = json.dumps({"len": len(body), "sha256": hashlib.sha256(body).hexdigest(), "path": self.path,
                          "host": self.headers.get("host"), "x-test": self.headers.get("x-test"),
                          "leaked": [k for k in self.headers if k.lower() in ("e2b-traffic-access-token",
                                                                              "x-access-token", "x-api-key",
                                                                              "e2b-sandbox-id")]}).encode()
        self.send_response(201)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
    def do_GET(self):  # /stream: an endless response, like server-sent events; notes when its client left
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        try:
            while True:
                self.wfile.write(b"data: tick\n\n")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            open("/tmp/stream-closed", "w").close()
    def log_message(self, *a):
        pass
ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
'''


def _wait_listening(sb, port: int) -> None:  # type: ignore[no-untyped-def]
    """Wait, inside the sandbox, until something accepts connections on `port` (bash's /dev/tcp)."""
    sb.commands.run(f"for i in $(seq 600); do (echo > /dev/tcp/127.0.0.1/{port}) 2>/dev/null && exit 0; "
                    "sleep 0.1; done; exit 1", timeout=90)


def test_ports_http_through_host_and_header_routing(e2b_env: dict) -> None:
    import hashlib
    import os

    import httpx
    from e2b import Sandbox

    from tests.waiting import wait_for

    url = e2b_env["url"]
    sb = Sandbox.create(timeout=300)  # no network (shoal's default for E2B): the agent connects from inside
    e2b_env["made"].append(sb)
    assert sb.get_info().metadata is not None
    sb.files.write("/srv/big.bin", os.urandom(3 << 20))
    sb.files.write("/srv/echo.py", HTTP_ECHO)
    sb.commands.run("cd /srv && python3 -m http.server 8000", background=True)
    sb.commands.run("python3 /srv/echo.py 8001", background=True)
    token = {"e2b-traffic-access-token": sb.traffic_access_token}
    by_host = {"Host": sb.get_host(8000), **token}
    _wait_listening(sb, 8000)
    _wait_listening(sb, 8001)

    # E2B_DOMAIN style: <port>-<id>.<domain> in the Host header (a TLS proxy in front keeps it)
    r = httpx.get(f"{url}/", headers=by_host)
    assert r.status_code == 200 and "big.bin" in r.text and "echo.py" in r.text
    big = httpx.get(f"{url}/big.bin", headers=by_host, timeout=60)
    assert big.status_code == 200 and big.content == sb.files.read("/srv/big.bin", format="bytes")
    # E2B_SANDBOX_URL style: the routing headers
    r = httpx.get(f"{url}/big.bin", headers={"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8000", **token},
                  timeout=60)
    assert r.status_code == 200 and len(r.content) == 3 << 20

    # a request body streams in; the app sees its own Host and headers, never shoal's tokens
    body = os.urandom(2 << 20)
    with httpx.Client(timeout=60) as c:  # one client connection, several requests over the pool
        for i in range(3):
            r = c.post(f"{url}/up?i={i}", content=body, headers={"Host": sb.get_host(8001), "X-Test": "yes", **token})
            assert r.status_code == 201
            got = r.json()
            assert got == {"len": len(body), "sha256": hashlib.sha256(body).hexdigest(), "path": f"/up?i={i}",
                           "host": sb.get_host(8001), "x-test": "yes", "leaked": []}

    # an endless response streams, and ends in the sandbox when its client goes away
    with httpx.stream("GET", f"{url}/stream", headers={"Host": sb.get_host(8001), **token}, timeout=60) as r:
        assert r.headers["content-type"] == "text/event-stream"
        ticks = 0
        for line in r.iter_lines():
            ticks += line == "data: tick"
            if ticks == 3:
                break
    wait_for(lambda: sb.files.exists("/tmp/stream-closed"), 60, what="the server in the sandbox to see its client go")

    # E2B's answers for a closed port and without the token
    r = httpx.get(f"{url}/", headers={"Host": sb.get_host(8999), **token})
    assert r.status_code == 502 and r.json() == {"sandboxId": sb.sandbox_id, "port": 8999, "code": 502,
                                                 "message": "The sandbox is running but port is not open"}
    r = httpx.get(f"{url}/", headers={"Host": sb.get_host(8000)})
    assert r.status_code == 403 and "e2b-traffic-access-token" in r.json()["message"]
    # another sandbox's token does not open this one
    other = Sandbox.create(timeout=120)
    e2b_env["made"].append(other)
    r = httpx.get(f"{url}/", headers={"Host": sb.get_host(8000),
                                      "e2b-traffic-access-token": other.traffic_access_token})
    assert r.status_code == 403
    sb.kill()
    r = httpx.get(f"{url}/", headers=by_host)
    assert r.status_code == 502 and "was not found" in r.json()["message"]

    # E2B's allow_public_traffic: that sandbox's ports answer without the token
    pub = Sandbox.create(timeout=120, network={"allow_public_traffic": True})
    e2b_env["made"].append(pub)
    assert pub.get_info().metadata == {}  # shoal's own bookkeeping is not E2B metadata
    pub.commands.run("cd /tmp && python3 -m http.server 8000", background=True)
    _wait_listening(pub, 8000)
    assert httpx.get(f"{url}/", headers={"Host": pub.get_host(8000)}).status_code == 200


def test_ports_websocket_echo(e2b_env: dict) -> None:
    import socket
    from urllib.parse import urlsplit

    from e2b import Sandbox
    from websockets.sync.client import connect

    url = e2b_env["url"]
    sb = Sandbox.create(timeout=300)
    e2b_env["made"].append(sb)
    sb.files.write("/srv/ws.py", WS_ECHO)
    sb.commands.run("python3 /srv/ws.py 8765", background=True)
    token = {"e2b-traffic-access-token": sb.traffic_access_token}
    _wait_listening(sb, 8765)
    where = urlsplit(url)

    def dial() -> socket.socket:
        return socket.create_connection((where.hostname, where.port))

    # ws://<port>-<id>.<domain>/ as the SDK's get_host gives it, over a connection to shoal serve
    with connect(f"ws://{sb.get_host(8765)}/chat", sock=dial(), additional_headers=token) as ws:
        ws.send("hello")
        assert ws.recv(timeout=30) == "hello"
        blob = bytes(range(256)) * 400  # 100 KiB: a long frame
        ws.send(blob)
        assert ws.recv(timeout=30) == blob
    # a closed port: the handshake is refused with E2B's 502
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus, match="502"):
        connect(f"ws://{sb.get_host(8766)}/", sock=dial(), additional_headers=token, open_timeout=30)


# ---- files.watch_dir -----------------------------------------------------------------------------------
def test_watch_dir_sync_polls_events(e2b_env: dict) -> None:
    from e2b import FilesystemEventType, Sandbox

    from tests.waiting import wait_for

    sb = Sandbox.create(timeout=300)
    e2b_env["made"].append(sb)
    sb.files.make_dir("/work/w/sub")
    handle = sb.files.watch_dir("/work/w")
    deep = sb.files.watch_dir("/work/w", recursive=True)
    sb.files.write("/work/w/a.txt", "one")
    sb.commands.run("echo more >> /work/w/a.txt; chmod 600 /work/w/a.txt; mv /work/w/a.txt /work/w/b.txt; "
                    "echo x > /work/w/sub/s.txt; rm /work/w/b.txt")
    events: list = []

    def has_all() -> bool:
        events.extend(handle.get_new_events())
        got = {(e.name, e.type) for e in events}
        return ("b.txt", FilesystemEventType.REMOVE) in got
    wait_for(has_all, 30, what="the watcher's events")
    got = {(e.name, e.type) for e in events}
    assert {("a.txt", FilesystemEventType.CREATE), ("a.txt", FilesystemEventType.WRITE),
            ("a.txt", FilesystemEventType.CHMOD), ("a.txt", FilesystemEventType.RENAME),
            ("b.txt", FilesystemEventType.CREATE), ("b.txt", FilesystemEventType.REMOVE)} <= got
    assert not any(e.name.startswith("sub/") for e in events)  # not recursive
    deep_events: list = []
    wait_for(lambda: deep_events.extend(deep.get_new_events()) or "sub/s.txt" in {e.name for e in deep_events},
             30, what="the recursive watcher's event below the directory")
    handle.stop()
    deep.stop()
    # the server forgot the stopped watcher
    import httpx

    r = httpx.post(f"{e2b_env['url']}/filesystem.Filesystem/GetWatcherEvents", json={"watcherId": handle._watcher_id},
                   headers={"E2b-Sandbox-Id": sb.sandbox_id, "X-Access-Token": sb._envd_access_token})
    assert r.status_code == 404 and r.json()["code"] == "not_found"


async def test_watch_dir_async_streams_events(e2b_env: dict) -> None:
    import asyncio

    from e2b import AsyncSandbox, FilesystemEventType

    sb = await AsyncSandbox.create(timeout=300)
    try:
        got: list = []
        seen = asyncio.Event()

        def on_event(e) -> None:  # type: ignore[no-untyped-def]
            got.append((e.name, e.type))
            if e.name == "done":
                seen.set()

        await sb.files.make_dir("/work/aw")
        handle = await sb.files.watch_dir("/work/aw", on_event=on_event, timeout=120)
        await sb.files.write("/work/aw/f.txt", "1")
        await sb.commands.run("mkdir /work/aw/d && touch /work/aw/done")
        await asyncio.wait_for(seen.wait(), 30)
        assert ("f.txt", FilesystemEventType.CREATE) in got and ("d", FilesystemEventType.CREATE) in got
        await handle.stop()
        with pytest.raises(e2b.NotFoundException):
            await sb.files.watch_dir("/work/missing", on_event=on_event)
    finally:
        await sb.kill()


# ---- get_metrics -----------------------------------------------------------------------------------------
def test_get_metrics_series(e2b_env: dict) -> None:
    import datetime

    import httpx
    from e2b import Sandbox, SandboxNotFoundException

    from tests.waiting import wait_for

    sb = Sandbox.create(timeout=300)
    e2b_env["made"].append(sb)
    first = sb.get_metrics()
    assert first  # sampled when the sandbox was made (then every 5 s)
    m = first[0]
    assert m.cpu_count == 1 and m.mem_total == sb.get_info().memory_mb << 20 and m.disk_total > 0
    assert 0 <= m.cpu_used_pct <= 100 and 0 <= m.mem_used < m.mem_total
    # a busy CPU, 200 MiB held and 30 MiB written show in the next samples (one every 5 s; disk every 30 s).
    # (The CPU share is what the sandbox got: on a loaded 2-core machine a busy loop gets far less than 100%.)
    sb.files.write("/root/blob", b"x" * (30 << 20))
    sb.commands.run("python3 -c 'import time; b = bytearray(200 << 20); time.sleep(600)' & "
                    "timeout 600 sh -c 'while :; do :; done' &", background=True)

    def busy() -> list:
        ms = sb.get_metrics()
        last = ms[-1]
        return ms if last.cpu_used_pct > 5 and last.mem_used > 200 << 20 and last.disk_used >= 30 << 20 else []
    series = wait_for(busy, 120, what="a sample with the CPU busy, 200 MiB used and 30 MiB on disk")
    stamps = [x.timestamp for x in series]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    # the time window, and the class-method form
    later = datetime.datetime.now(datetime.UTC) + datetime.timedelta(hours=1)
    assert sb.get_metrics(start=later) == []
    assert len(Sandbox.get_metrics(sb.sandbox_id, end=later)) == len(sb.get_metrics())
    # the latest point of several sandboxes (the dashboard's call)
    r = httpx.get(f"{e2b_env['url']}/sandboxes/metrics", params={"sandbox_ids": f"{sb.sandbox_id},n0-nosuchsandbox"},
                  headers={"X-API-KEY": e2b_env["token"]})
    assert r.status_code == 200 and set(r.json()["sandboxes"]) == {sb.sandbox_id}
    assert r.json()["sandboxes"][sb.sandbox_id]["cpuCount"] == 1
    sb.kill()
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_metrics(sb.sandbox_id)
