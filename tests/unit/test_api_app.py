"""The API app in-process (starlette TestClient, no root, no sandboxes): auth, validation, errors,
limits, project scoping, OpenAPI. Records are real files in a temp SHOAL_HOME; no sandbox runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.config import NodeConfig, Paths
from shoal.node.node import Node
from shoal.records import SandboxRecord, new_sandbox_id
from shoal.server.app import create_app
from shoal.server.settings import ServerSettings
from shoal.server.tokens import TokenStore
from shoal.spec import SandboxSpec


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path


def _app(home: Path, **kw: object) -> tuple[TestClient, Node]:
    cfg = NodeConfig(paths=Paths(home=home, store=home / "store"))
    node = Node(cfg)
    app = create_app(node, ServerSettings(**kw), manage_node=False)  # type: ignore[arg-type]
    return TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1"), node


@pytest.fixture
def client(home: Path) -> Iterator[TestClient]:
    c, _ = _app(home)
    yield c


def _fake_record(node: Node, project: str) -> str:
    sid = new_sandbox_id(node.config.node_id)
    d = node.paths.sandboxes / sid
    d.mkdir(parents=True)
    SandboxRecord(id=sid, backend="container", image="base:latest", image_digest="sha256:" + "0" * 64, layers=[],
                  spec=SandboxSpec(cpus=1.0, memory_mb=64, project=project), dir=str(d), state="running",
                  project=project).save()
    return sid


def test_health_and_openapi(client: TestClient) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["auth"] is False
    spec = client.get("/openapi.json").json()
    paths = spec["paths"]
    for p in ("/v1/sandboxes", "/v1/sandboxes/batch", "/v1/sandboxes/{sandbox_id}", "/v1/sandboxes/{sandbox_id}/exec",
              "/v1/sandboxes/{sandbox_id}/files", "/v1/sandboxes/{sandbox_id}/dir",
              "/v1/sandboxes/{sandbox_id}/shells", "/v1/sandboxes/{sandbox_id}/pause",
              "/v1/sandboxes/{sandbox_id}/snapshot", "/v1/sandboxes/{sandbox_id}/fork",
              "/v1/sandboxes/{sandbox_id}/cpu_class", "/v1/sandboxes/restore", "/v1/images",
              "/v1/images/build", "/v1/images/import", "/v1/run_code", "/healthz", "/metrics"):
        assert p in paths, p
    for path, ops in paths.items():
        for method, op in ops.items():
            if path.startswith("/v1"):
                for code in ("401", "422", "429"):
                    assert code in op["responses"], (method, path, code)
                assert op["responses"]["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorOut")
    assert "HTTPBearer" in json.dumps(spec["components"]["securitySchemes"])


def test_unknown_route_and_method(client: TestClient) -> None:
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert "/openapi.json" in r.json()["error"]["message"]
    r = client.patch("/v1/sandboxes")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "GET, HEAD, POST"
    assert client.options(f"/v1/sandboxes/{new_sandbox_id('n0')}/files").headers["allow"] == "GET, HEAD, PUT"


def test_validation_names_fields(client: TestClient) -> None:
    r = client.post("/v1/sandboxes", json={"memory_mb": "lots", "cpus": -1, "colour": "red"})
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "invalid_request"
    fields = {e["field"] for e in err["details"]["errors"]}
    assert {"body.memory_mb", "body.cpus", "body.colour"} <= fields
    r = client.post("/v1/sandboxes", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422
    r = client.post("/v1/sandboxes/batch", json={"n": 0})
    assert r.status_code == 422 and r.json()["error"]["details"]["errors"][0]["field"] == "body.n"
    r = client.get("/v1/sandboxes", params={"label": "novalue"})
    assert r.status_code == 422 and r.json()["error"]["details"]["errors"][0]["field"] == "query.label.0"


def test_missing_image_and_sandbox(client: TestClient) -> None:
    r = client.post("/v1/sandboxes", json={"image": "no-such-image:v1", "memory_mb": 64})
    assert r.status_code == 404 and r.json()["error"]["code"] == "image_not_found"
    r = client.post("/v1/sandboxes", json={"image": "Bad Name!"})
    assert r.status_code == 422
    r = client.post(f"/v1/sandboxes/{new_sandbox_id('n0')}/exec", json={"cmd": "true"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
    r = client.get("/v1/sandboxes/../../etc/passwd")
    assert r.status_code == 404


def test_auth_turns_on_with_the_first_token(home: Path) -> None:
    c, _ = _app(home)
    assert c.get("/v1/sandboxes").status_code == 200  # no tokens yet: open (loopback-only server)
    tok = TokenStore(home).create("alpha")
    c, _ = _app(home)
    r = c.get("/v1/sandboxes")
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert r.headers["www-authenticate"] == "Bearer"
    assert c.get("/v1/sandboxes", headers={"Authorization": "Bearer shoal_aaaaaaaaaa_" + "x" * 43}).status_code == 401
    assert c.get("/v1/sandboxes", headers={"Authorization": "Basic abc"}).status_code == 401
    assert c.get("/v1/sandboxes", headers={"Authorization": f"Bearer {tok}"}).status_code == 200
    assert c.get("/healthz").json()["auth"] is True
    # /metrics is for operators
    r = c.get("/metrics", headers={"Authorization": f"Bearer {tok}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    admin = TokenStore(home).create("ops", admin=True)
    r = c.get("/metrics", headers={"Authorization": f"Bearer {admin}"})
    assert r.status_code == 200 and "shoal_sandboxes" in r.text and "shoal_api_errors_total" in r.text
    assert 'shoal_api_errors_total{code="unauthorized"}' in r.text
    no_auth, _ = _app(home, no_auth=True)
    assert no_auth.get("/v1/sandboxes").status_code == 200


def test_other_projects_sandbox_is_not_found(home: Path) -> None:
    c, node = _app(home)
    ta, tb = TokenStore(home).create("aa"), TokenStore(home).create("bb")
    admin = TokenStore(home).create("ops", admin=True)
    sid = _fake_record(node, "aa")
    A, B = ({"Authorization": f"Bearer {t}"} for t in (ta, tb))
    assert c.get(f"/v1/sandboxes/{sid}", headers=A).status_code == 200
    assert c.get(f"/v1/sandboxes/{sid}", headers={"Authorization": f"Bearer {admin}"}).status_code == 200
    other = new_sandbox_id(node.config.node_id)
    for method, suffix, body in [("GET", "", None), ("DELETE", "", None), ("POST", "/exec", {"cmd": "id"}),
                                 ("GET", "/files?path=/etc/hostname", None), ("GET", "/dir?path=/", None),
                                 ("POST", "/pause", None), ("POST", "/resume", None),
                                 ("POST", "/cpu_class", {"cpu_class": "batch"}),
                                 ("POST", "/snapshot", {"name": "steal"}), ("POST", "/fork", {"n": 1}),
                                 ("POST", "/shells", {})]:
        r = c.request(method, f"/v1/sandboxes/{sid}{suffix}", headers=B, json=body)
        r2 = c.request(method, f"/v1/sandboxes/{other}{suffix}", headers=B, json=body)
        assert r.status_code == 404, (method, suffix, r.text)
        # indistinguishable from an ID that does not exist
        assert r.json()["error"]["message"].replace(sid, "X") == r2.json()["error"]["message"].replace(other, "X")
    assert c.get("/v1/sandboxes", headers=B).json()["sandboxes"] == []
    assert [s["id"] for s in c.get("/v1/sandboxes", headers=A).json()["sandboxes"]] == [sid]
    assert c.get("/v1/sandboxes?project=aa", headers=B).status_code == 403
    assert (node.paths.sandboxes / sid / "record.json").exists()  # B's DELETE did nothing


def test_cpu_class_route_validates_scopes_and_answers_what_was_set(home: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    c, node = _app(home)
    ta = TokenStore(home).create("aa")
    A = {"Authorization": f"Bearer {ta}"}
    sid = _fake_record(node, "aa")
    calls: list[tuple[str, str]] = []

    async def set_cpu_class(sandbox_id: str, cpu_class: str) -> dict[str, object]:
        calls.append((sandbox_id, cpu_class))
        return {"cpu_class": cpu_class, "idle": cpu_class == "batch"}

    monkeypatch.setattr(node, "set_cpu_class", set_cpu_class)
    r = c.post(f"/v1/sandboxes/{sid}/cpu_class", headers=A, json={"cpu_class": "batch"})
    assert r.status_code == 200 and r.json() == {"cpu_class": "batch", "idle": True}
    assert calls == [(sid, "batch")]
    for bad in ({"cpu_class": "realtime"}, {}, {"cpu_class": "batch", "x": 1}):
        r = c.post(f"/v1/sandboxes/{sid}/cpu_class", headers=A, json=bad)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", bad
    r = c.post(f"/v1/sandboxes/{new_sandbox_id('n0')}/cpu_class", headers=A, json={"cpu_class": "batch"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
    assert calls == [(sid, "batch")]
    op = c.get("/openapi.json").json()["paths"]["/v1/sandboxes/{sandbox_id}/cpu_class"]["post"]
    assert {"404", "501"} <= set(op["responses"])


def test_restore_route_is_admin_only_validates_and_maps_errors(home: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.errors import CapacityExceeded, SandboxNotFound, Unsupported
    from shoal.models import SandboxInfo
    from shoal.server.schemas import SNAPSHOT_NAME_RE

    c, node = _app(home)
    ta = TokenStore(home).create("aa")
    admin = TokenStore(home).create("ops", admin=True)
    A, ADMIN = ({"Authorization": f"Bearer {t}"} for t in (ta, admin))
    calls: list[tuple[str, int, str]] = []

    async def restore(name: str, n: int = 1, *, backend: str = "microvm") -> list[object]:
        calls.append((name, n, backend))
        if name == "gone":
            raise SandboxNotFound(f"no VM snapshot named {name!r} on this host")
        if backend != "microvm":
            raise Unsupported(f"the {backend} backend cannot restore memory snapshots")
        info = SandboxInfo(id=new_sandbox_id("n0"), image="base:latest", backend="microvm", state="running",
                           created_at=1.0, spec={"project": "default"})
        return [info, CapacityExceeded("node full")][:n]

    monkeypatch.setattr(node, "restore", restore)
    # memory snapshots are named per host, not per project: a project token may not restore one
    r = c.post("/v1/sandboxes/restore", headers=A, json={"name": "snap"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden" and calls == []
    r = c.post("/v1/sandboxes/restore", headers=ADMIN, json={"name": "snap", "n": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["created"], body["failed"]) == (1, 1) and body["items"][0]["sandbox"]["backend"] == "microvm"
    assert body["items"][1]["error"]["code"] == "capacity_exceeded"
    assert calls == [("snap", 2, "microvm")]
    r = c.post("/v1/sandboxes/restore", headers=ADMIN, json={"name": "gone"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "sandbox_not_found"
    r = c.post("/v1/sandboxes/restore", headers=ADMIN, json={"name": "snap", "backend": "container"})
    assert r.status_code == 501 and r.json()["error"]["code"] == "unsupported"
    for bad in ({"name": "../etc"}, {"name": "s", "n": 0}, {"name": "s", "backend": "docker"}, {},
                {"name": "s", "x": 1}):
        r = c.post("/v1/sandboxes/restore", headers=ADMIN, json=bad)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_request", bad
    assert len(calls) == 3
    # the schema's name check is the VM backends' own
    from shoal.backends.vm import _SNAPSHOT_NAME

    assert _SNAPSHOT_NAME.pattern == SNAPSHOT_NAME_RE


def test_non_admin_cannot_choose_project_or_build_base(home: Path) -> None:
    c, _ = _app(home)
    tb = TokenStore(home).create("bb")
    B = {"Authorization": f"Bearer {tb}"}
    r = c.post("/v1/sandboxes", headers=B, json={"project": "aa", "memory_mb": 64})
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"
    r = c.post("/v1/images/build", headers=B, json={"name": "base"})
    assert r.status_code == 403
    r = c.post("/v1/images/build", headers=B, json={"name": "thing"})
    assert r.status_code == 404 and "no built-in recipe" in r.json()["error"]["message"]
    r = c.post("/v1/images/pull", headers=B, json={"source": "docker://x/y:z", "name": "y"})
    assert r.status_code == 403


def test_request_size_limits(home: Path) -> None:
    c, node = _app(home, max_request_bytes=1000, max_upload_bytes=2000)
    sid = _fake_record(node, "default")
    r = c.post("/v1/sandboxes/x/exec", content=b"{" + b" " * 5000 + b"}", headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["details"]["limit_bytes"] == 1000
    r = c.put(f"/v1/sandboxes/{new_sandbox_id('n0')}/files", params={"path": "/x"}, content=b"x" * 3000)
    assert r.status_code == 413 and r.json()["error"]["details"]["limit_bytes"] == 2000

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while it arrives
        for _ in range(10):
            yield b"y" * 500

    r = c.put(f"/v1/sandboxes/{sid}/files", params={"path": "/x"}, content=chunks())
    assert r.status_code == 413 and r.json()["error"]["details"]["limit_bytes"] == 2000
    r = c.put(f"/v1/sandboxes/{new_sandbox_id('n0')}/files", params={"path": "/x"}, content=b"x" * 1500)
    assert r.status_code == 404  # under the upload limit: it reaches the route


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids, max_size=4),
    max_leaves=12)
ROUTES = [("POST", "/v1/sandboxes"), ("POST", "/v1/sandboxes/batch"), ("POST", "/v1/sandboxes/{sid}/exec"),
          ("POST", "/v1/sandboxes/{sid}/shells"), ("POST", "/v1/sandboxes/{sid}/shells/s1/run"),
          ("POST", "/v1/sandboxes/{sid}/snapshot"), ("POST", "/v1/sandboxes/{sid}/fork"),
          ("POST", "/v1/sandboxes/{sid}/cpu_class"), ("POST", "/v1/sandboxes/restore"),
          ("POST", "/v1/images/build"), ("POST", "/v1/images/pull"), ("GET", "/v1/sandboxes/{sid}")]


@pytest.fixture
def shared(home: Path) -> TestClient:
    return _app(home)[0]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), body=json_values,
       sid=st.text(alphabet="abcdefghijklmnopqrstuvwxyz234567-_.%", min_size=1, max_size=40))
def test_malformed_input_never_answers_500(shared: TestClient, route: tuple[str, str], body: object,
                                           sid: str) -> None:
    c = shared
    method, path = route
    r = c.request(method, path.replace("{sid}", sid), json=body)
    assert r.status_code < 500 or r.status_code == 501, (method, path, body, r.status_code, r.text)
    assert "error" in r.json() or r.status_code < 400
