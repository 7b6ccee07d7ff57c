"""E2B's sandbox listing without a server: the SDK's query encoding, keyset pages and tokens, bad parameters."""

from __future__ import annotations

import base64
import urllib.parse

import pytest

from shoal.errors import InvalidRequest
from shoal.server.compat import e2b_list


def _item(sid: str, started: str, state: str = "running", meta: dict | None = None, template: str = "base") -> dict:
    return {"sandboxID": sid, "startedAt": started, "state": state, "metadata": meta or {}, "templateID": template}


def _all_pages(items: list[dict], **params: str) -> list[list[str]]:
    pages, token = [], None
    while True:
        q = e2b_list.parse_query({**params, **({"nextToken": token} if token else {})})
        got, token, _ = e2b_list.page(items, q)
        pages.append([d["sandboxID"] for d in got])
        if token is None:
            return pages


def test_pages_cover_every_sandbox_once_in_both_orders() -> None:
    # two sandboxes share a start time: ties are ordered by id, so a page boundary between them loses neither
    items = [_item(f"n-{i}", f"2026-01-01T00:00:0{i // 2}.000001Z") for i in range(7)]
    desc = _all_pages(items, limit="2")
    assert [len(p) for p in desc] == [2, 2, 2, 1]
    flat = [s for p in desc for s in p]
    assert flat == ["n-6", "n-4", "n-5", "n-2", "n-3", "n-0", "n-1"]  # newest first, ties by id ascending
    asc = [s for p in _all_pages(items, limit="3", order="asc") for s in p]
    assert asc == list(reversed(flat))
    assert _all_pages(items) == [flat]  # default limit 100: one page, no token


def test_token_format_and_cursor_is_a_keyset() -> None:
    items = [_item("n-a", "2026-01-01T00:00:01Z"), _item("n-b", "2026-01-01T00:00:02Z"),
             _item("n-c", "2026-01-01T00:00:03Z")]
    q = e2b_list.parse_query({"limit": "1"})
    got, token, running = e2b_list.page(items, q)
    assert [d["sandboxID"] for d in got] == ["n-c"] and running == 3
    assert base64.urlsafe_b64decode(token).decode() == "2026-01-01T00:00:03Z__n-c"
    # a sandbox created after the first page does not shift the second one
    items.append(_item("n-d", "2026-01-01T00:00:04Z"))
    got, _, _ = e2b_list.page(items, e2b_list.parse_query({"limit": "1", "nextToken": token}))
    assert [d["sandboxID"] for d in got] == ["n-b"]
    asc_token = e2b_list.parse_query({"limit": "1", "order": "asc"})
    _, t2, _ = e2b_list.page(items, asc_token)
    assert base64.urlsafe_b64decode(t2).decode().endswith("__asc")
    with pytest.raises(InvalidRequest, match="other sort order"):
        e2b_list.parse_query({"nextToken": t2})


def test_filters_as_the_sdk_encodes_them() -> None:
    items = [_item("n-1", "2026-01-01T00:00:01Z", meta={"team": "a b&c", "x": "1"}),
             _item("n-2", "2026-01-01T00:00:02Z", state="paused", meta={"team": "a b&c"}),
             _item("n-3", "2026-01-01T00:00:03Z", meta={"team": "z"}, template="py"),
             _item("n-4", "2026-01-01T00:00:04Z")]
    # e2b.sandbox_sync.paginator: urlencode({quote(k): quote(v)}), then httpx encodes the parameter once more
    meta = urllib.parse.urlencode({urllib.parse.quote(k): urllib.parse.quote(v) for k, v in {"team": "a b&c"}.items()})
    q = e2b_list.parse_query({"metadata": meta})
    assert [d["sandboxID"] for d in e2b_list.page(items, q)[0]] == ["n-2", "n-1"]
    q = e2b_list.parse_query({"metadata": meta, "state": "running"})
    got, _, running = e2b_list.page(items, q)
    assert [d["sandboxID"] for d in got] == ["n-1"] and running == 1
    _, _, running = e2b_list.page(items, e2b_list.parse_query({"state": "paused"}))
    assert running is None  # only told when running sandboxes were asked for
    q = e2b_list.parse_query({"startedAfter": "2026-01-01T00:00:03+00:00"})
    assert [d["sandboxID"] for d in e2b_list.page(items, q)[0]] == ["n-4", "n-3"]  # inclusive
    assert [d["sandboxID"] for d in e2b_list.page(items, e2b_list.parse_query({"template": "py"}))[0]] == ["n-3"]


@pytest.mark.parametrize("params, match", [
    ({"limit": "0"}, "between 1 and 100"), ({"limit": "101"}, "between 1 and 100"), ({"limit": "x"}, "integer"),
    ({"order": "up"}, "order"), ({"state": "running,gone"}, "gone"), ({"nextToken": "!!"}, "next token"),
    ({"nextToken": base64.urlsafe_b64encode(b"nope").decode()}, "next token"),
    ({"nextToken": base64.urlsafe_b64encode(b"yesterday__n-1").decode()}, "next token"),
    ({"metadata": "a=b=c"}, "metadata"), ({"startedAfter": "soon"}, "RFC 3339"), ({"template": "t:v1"}, "tags"),
])
def test_bad_parameters_are_400s(params: dict, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        e2b_list.parse_query(params)


def test_micros_cuts_nanoseconds_like_e2b() -> None:
    assert e2b_list.micros("1970-01-01T00:00:01.123456789Z") == 1_123_456
    assert e2b_list.micros("1970-01-01T00:00:01Z") == 1_000_000
    assert e2b_list.micros("1970-01-01T01:00:00+01:00") == 0
