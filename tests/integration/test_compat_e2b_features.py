"""The E2B features users lean on, with the unmodified `e2b` / `e2b-code-interpreter` SDKs from PyPI against a real
`shoal serve`: list pagination and filters, ports (`get_host`), the code interpreter's rich results and streaming,
`get_metrics` and `files.watch_dir`."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.server.proc import ServerProcess
from shoal.server.tokens import TokenStore

e2b = pytest.importorskip("e2b", reason="the compat extra (pip install -e .[compat]) brings the E2B SDK")
e2b_ci = pytest.importorskip("e2b_code_interpreter")

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]


@pytest.fixture
def sdk(api_server: ServerProcess, shoal_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    """The E2B SDK configured by environment, as users do, with the token of a fresh project; kills what it made."""
    project = f"e2bf-{secrets.token_hex(3)}"
    token = TokenStore(shoal_home).create(project, name="e2b feature tests")
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


def test_list_pages_with_next_token_and_filters(sdk: dict) -> None:
    from e2b import Sandbox, SandboxQuery, SandboxState

    tag = secrets.token_hex(4)
    made = [Sandbox.create(timeout=120, metadata={"run": tag, "i": str(i)}) for i in range(5)]
    sdk["made"].extend(made)
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
    sdk["made"].append(odd)
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
