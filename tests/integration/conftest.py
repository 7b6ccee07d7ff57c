"""Fixtures shared by integration test modules."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.server.proc import ServerProcess
from shoal.server.tokens import TokenStore


@pytest.fixture
def e2b_env(api_server: ServerProcess, shoal_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """The E2B SDK pointed at the session's server with the token of a fresh project (as a user would: env vars)."""
    project = f"e2b-{secrets.token_hex(3)}"
    token = TokenStore(shoal_home).create(project, name="e2b tests")
    monkeypatch.setenv("E2B_API_URL", api_server.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", api_server.url)
    monkeypatch.setenv("E2B_API_KEY", token)
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    made: list = []
    yield {"url": api_server.url, "token": token, "project": project, "made": made}
    for sb in made:
        try:
            sb.kill()
        except Exception:
            pass
