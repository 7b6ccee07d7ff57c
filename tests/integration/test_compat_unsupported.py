"""Every part of the E2B and SWE-ReX protocols that shoal does not serve answers a clear error in that protocol's
own format, naming what is missing — never a 500 — and so does malformed input to the parts it serves."""

from __future__ import annotations

import json
import secrets
import struct
from pathlib import Path

import httpx
import pytest

from shoal.server.proc import ServerProcess
from shoal.server.tokens import TokenStore

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]


def test_unsupported_endpoints_answer_clear_errors(api_server: ServerProcess, shoal_home: Path) -> None:
    url = api_server.url
    token = TokenStore(shoal_home).create(f"unsup-{secrets.token_hex(3)}")
    api = {"X-API-KEY": token}
    r = httpx.post(f"{url}/v2/sandboxes", json={"templateID": "base", "timeout": 120}, headers=api, timeout=120)
    assert r.status_code == 201, r.text
    sid, access = r.json()["sandboxID"], r.json()["envdAccessToken"]
    envd = {"E2b-Sandbox-Id": sid, "X-Access-Token": access}
    ci = {**envd, "E2b-Sandbox-Port": "49999"}
    try:
        # E2B control plane: (method, path, body, expected status, words the message must contain)
        plane = [
            ("POST", "/v3/templates", {}, 501, "templates"),
            ("GET", "/templates", None, 501, "templates"),
            ("DELETE", "/templates/base", None, 501, "templates"),
            ("GET", "/volumes", None, 501, "volumes"),
            ("GET", "/snapshots", None, 501, "snapshots"),
            ("GET", "/sandboxes/metrics", None, 400, "sandbox_ids"),
            ("GET", f"/sandboxes/{sid}/metrics?start=x", None, 400, "start"),
            ("GET", f"/sandboxes/{sid}/metrics?start=9&end=3", None, 400, "after end"),
            ("GET", f"/v2/sandboxes/{sid}/logs", None, 501, "logs"),
            ("PUT", f"/sandboxes/{sid}/network", {}, 501, "network"),
            ("POST", f"/sandboxes/{sid}/snapshots", {}, 501, "snapshot"),
            ("GET", f"/sandboxes/{sid}/timeout", None, 405, "POST"),
            ("POST", "/v2/sandboxes", {"templateID": "base", "mcp": {"x": {}}}, 501, "MCP"),
            ("POST", "/v2/sandboxes", {"templateID": "base", "autoPause": True}, 501, "auto-pause"),
            ("POST", "/v2/sandboxes", {"templateID": "no-such-template-x"}, 404, "SHOAL_E2B_TEMPLATES"),
            ("POST", "/v2/sandboxes", {"templateID": "base", "timeout": -1}, 400, "timeout"),
            ("POST", "/v2/sandboxes", {"templateID": 7}, 400, "templateID"),
            ("POST", "/v2/sandboxes", "not an object", 400, "JSON object"),
            ("POST", f"/sandboxes/{sid}/timeout", {"timeout": "soon"}, 400, "timeout"),
            ("GET", "/sandboxes/n0-aaaaaaaaaaaaaaaaaaaaaaaaaa", None, 404, "no sandbox"),
        ]
        for method, path, body, status, words in plane:
            r = httpx.request(method, url + path, headers=api, timeout=30,
                              content=None if body is None else json.dumps(body))
            assert r.status_code == status, (method, path, r.status_code, r.text)
            assert r.json()["code"] == status and words in r.json()["message"], (path, r.text)

        # envd: Connect RPCs shoal does not serve, and malformed calls, in Connect's error shape
        rpc = [
            ("filesystem.Filesystem/CreateWatcher", "No such file", 404, False),
            ("process.Process/Bogus", "Bogus", 501, False),
            ("process.Process/SendSignal", "signal", 400, False),
            ("process.Process/SendInput", "not found", 404, False),
            ("filesystem.Filesystem/Stat", "does not exist", 404, False),
        ]
        for method, words, status, stream in rpc:
            body = {"path": "/no/such", "process": {"pid": 1}}
            if stream:
                msg = json.dumps(body).encode()
                r = httpx.post(f"{url}/{method}", content=struct.pack(">BI", 0, len(msg)) + msg,
                               headers={**envd, "Content-Type": "application/connect+json"})
            else:
                r = httpx.post(f"{url}/{method}", content=json.dumps(body),
                               headers={**envd, "Content-Type": "application/json"})
            assert r.status_code == status, (method, r.status_code, r.text)
            assert words in r.json()["message"], (method, r.text)
        r = httpx.post(f"{url}/process.Process/List", content=b"{nope", headers={**envd, "Content-Type":
                                                                                 "application/json"})
        assert r.status_code == 400 and r.json()["code"] == "invalid_argument"
        r = httpx.post(f"{url}/process.Process/List", content=b"\x00", headers={**envd, "Content-Type":
                                                                               "application/proto"})
        assert r.status_code == 501 and "JSON" in r.json()["message"]
        # a Start stream that fails ends its stream with the error (status 200, as Connect does)
        msg = json.dumps({"process": {"cmd": "/no/such/binary"}}).encode()
        r = httpx.post(f"{url}/process.Process/Start", content=struct.pack(">BI", 0, len(msg)) + msg,
                       headers={**envd, "Content-Type": "application/connect+json"})
        frames, data = [], r.content
        while data:
            flags, n = struct.unpack(">BI", data[:5])
            frames.append((flags, json.loads(data[5:5 + n])))
            data = data[5 + n:]
        assert r.status_code == 200 and frames[-1][0] == 2
        assert frames[-1][1]["error"]["code"] == "invalid_argument" and "cannot run" in frames[-1][1]["error"][
            "message"]

        # envd HTTP endpoints shoal does not serve; a directory is not a file
        for method, path in (("POST", "/init"), ("GET", "/envs"), ("GET", "/metrics")):
            r = httpx.request(method, url + path, headers=envd)
            assert r.status_code == 501 and path.lstrip("/") in r.json()["message"], (path, r.text)
        r = httpx.get(f"{url}/files", params={"path": "/etc"}, headers=envd)
        assert r.status_code == 400 and "cannot read" in r.json()["message"]
        r = httpx.post(f"{url}/files", params={"path": "/tmp/x"}, content=b"gz", headers={**envd, "Content-Encoding":
                                                                                          "gzip"})
        assert r.status_code == 400 and "gzip" in r.json()["message"]
        # a port nothing listens on: E2B's proxy answer
        r = httpx.get(f"{url}/", headers={**envd, "E2b-Sandbox-Port": "8080"})
        assert r.status_code == 502 and r.json()["message"] == "The sandbox is running but port is not open"
        assert r.json()["port"] == 8080

        # the code interpreter: other languages, unknown contexts, endpoints it does not have
        r = httpx.post(f"{url}/execute", json={"code": "1", "language": "r"}, headers=ci)
        assert r.status_code == 400 and "only Python" in r.text
        r = httpx.post(f"{url}/execute", json={"code": "1", "context_id": "nope"}, headers=ci)
        assert r.status_code == 404 and "nope" in r.text
        r = httpx.get(f"{url}/charts", headers=ci)
        assert r.status_code == 501 and "charts" in r.text
    finally:
        httpx.delete(f"{url}/sandboxes/{sid}", headers=api, timeout=60)
