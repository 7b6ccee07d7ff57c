"""The compatible APIs' pure parts without a sandbox: Connect envelopes and error mapping, Host routing,
template resolution and per-sandbox access tokens."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from shoal.errors import FileNotFound, ImageNotFound, InvalidRequest, SandboxError, Unauthorized
from shoal.server.compat import common, connect, routing
from shoal.server.tokens import Principal, TokenStore


def test_connect_envelopes_and_errors() -> None:
    frame = connect.envelope({"a": 1})
    flags, n = struct.unpack(">BI", frame[:5])
    assert flags == 0 and json.loads(frame[5:5 + n]) == {"a": 1}
    end = connect.end_stream(connect.RpcError("not_found", "gone"))
    assert end[0] == connect.END_STREAM and json.loads(end[5:]) == {"error": {"code": "not_found", "message": "gone"}}
    assert connect.rpc_error(FileNotFound("x")).code == "not_found"
    assert connect.rpc_error(InvalidRequest("x")).code == "invalid_argument"
    assert connect.rpc_error(Unauthorized("x")).code == "unauthenticated"
    assert connect.rpc_error(SandboxError("x")).code == "unavailable"
    assert connect.rpc_error(ValueError("bug")).code == "internal"
    assert connect.error_response(connect.RpcError("unimplemented", "no")).status_code == 501


def test_routing_by_header_and_host() -> None:
    sid = "n0-" + "a" * 26

    def scope(*headers: tuple[bytes, bytes]) -> dict:
        return {"type": "http", "path": "/files", "headers": list(headers)}

    assert routing.target(scope((b"e2b-sandbox-id", sid.encode()))) == (sid, 49983)
    assert routing.target(scope((b"e2b-sandbox-id", sid.encode()), (b"e2b-sandbox-port", b"49999"))) == (sid, 49999)
    assert routing.target(scope((b"host", f"49999-{sid}.e2b.example.com".encode()))) == (sid, 49999)
    assert routing.target(scope((b"host", b"127.0.0.1:8700"))) is None
    assert routing.target(scope((b"host", b"api.e2b.example.com"))) is None


class _Store:
    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.root = "/fake-store"
        self.tags_dir = Path("/nonexistent/fake-store/tags")  # no tag files: digests belong to no name here

    def exists(self, ref: str) -> bool:
        # names only: a digest this fake never stored is not there (as in the real store)
        return "@" not in ref and ":sha256-" not in ref and ref.split(":")[0] in self.names

    def resolve(self, ref: str) -> object:
        if not self.exists(ref):
            raise ImageNotFound(f"{ref} not in this fake store")
        return SimpleNamespace(ref=ref)

    def cache_get(self, kind: str, key: str) -> None:
        return None


def test_template_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.config import reset

    st = SimpleNamespace(node=SimpleNamespace(store=_Store({"swe-task", "py", "projects/team/mine"})), compat={})
    team = Principal(project="team")
    monkeypatch.setenv("SHOAL_E2B_TEMPLATES", "code-interpreter-v1=py:3.12")
    reset()
    assert common.resolve_template(st, team, "code-interpreter-v1") == "py:3.12"  # an alias wins
    assert common.resolve_template(st, team, "swe-task") == "swe-task"  # a shared image of that name
    assert common.resolve_template(st, team, "mine") == "projects/team/mine"  # the project's own image first
    assert common.resolve_template(st, team, "base") == "base"  # a stock template → the default image
    with pytest.raises(ImageNotFound, match="SHOAL_E2B_TEMPLATES"):
        common.resolve_template(st, team, "unknown-template")  # pull_policy never (the suite's): not pullable
    monkeypatch.setenv("SHOAL_PULL_POLICY", "missing")
    reset()
    # a registry reference in Docker's form: the create pulls it
    for ref in ("python:3.12-slim", "ghcr.io/laude-institute/t-bench/python-3-13:20250620", f"py@sha256:{'a' * 64}"):
        assert common.resolve_template(st, team, ref) == ref
    with pytest.raises(ImageNotFound, match="SHOAL_E2B_TEMPLATES"):
        common.resolve_template(st, team, "Not A Reference")
    monkeypatch.setenv("SHOAL_PULL_POLICY", "never")
    monkeypatch.setenv("SHOAL_E2B_TEMPLATES", "broken")
    reset()
    with pytest.raises(InvalidRequest, match="SHOAL_E2B_TEMPLATES"):
        common.template_aliases()
    monkeypatch.delenv("SHOAL_E2B_TEMPLATES")
    reset()
    # E2B's interpreter templates: the `code-interpreter` image once it is built, the default image before
    assert common.resolve_template(st, team, "code-interpreter-v1") == "base"
    st.node.store.names.add("code-interpreter")
    assert common.resolve_template(st, team, "code-interpreter-v1") == "code-interpreter:latest"
    assert common.resolve_template(st, team, "base") == "base"


def test_access_tokens_open_one_sandbox_and_die_with_their_token(tmp_path: Path) -> None:
    tokens = TokenStore(tmp_path)
    plain = tokens.create("team")
    who = tokens.authenticate(plain)
    assert who is not None
    st = SimpleNamespace(node=SimpleNamespace(paths=SimpleNamespace(home=tmp_path)), tokens=tokens,
                         auth_required=lambda: True, compat={})
    a, b = "n0-" + "a" * 26, "n0-" + "b" * 26
    tok = common.access_token(st, who, a)
    assert tok != plain and common.access_token(st, who, a) == tok  # stable: the key is kept on disk
    assert (tmp_path / "api" / "compat.key").stat().st_mode & 0o777 == 0o600
    got = common.principal_for_sandbox(st, a, {"x-access-token": tok})
    assert (got.project, got.token_id) == ("team", who.token_id)
    with pytest.raises(Unauthorized, match="does not open"):
        common.principal_for_sandbox(st, b, {"x-access-token": tok})
    with pytest.raises(Unauthorized):
        common.principal_for_sandbox(st, a, {})
    tokens.remove(who.token_id)
    with pytest.raises(Unauthorized, match="revoked"):
        common.principal_for_sandbox(st, a, {"x-access-token": tok})
