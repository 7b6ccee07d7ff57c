"""E2B's sandbox listing: `GET /v2/sandboxes` (paged, filtered) and the legacy `GET /sandboxes`.

What the `e2b` SDK's `Sandbox.list(query=SandboxQuery(...), limit=..., order=...)` paginator sends and reads,
answered the way E2B's API answers it:

- `limit` 1-100 (default 100); the page after the last is asked for with `nextToken`, which the previous
  answer gave in the `X-Next-Token` header (absent on the last page).
- order by start time, `desc` (newest first, the default) or `asc`; ties by sandbox ID. A token is the URL-safe
  base64 of `<RFC 3339 start>__<sandbox id>` (`__asc` appended for ascending pages): a keyset cursor, so a page
  never repeats or skips a sandbox that existed when the listing started, whatever is created meanwhile.
- filters: `state` (`running`, `paused`, comma-separated; default both), `metadata` (the SDK's doubly-encoded
  `k=v&...`, every pair must match), `startedAfter` (inclusive), `template` (the template ID it was created from).
- `X-Total-Running`: the running sandboxes that match the filters (all pages), when running ones were asked for.

Bad parameters answer 400 in E2B's error shape, as E2B's validator does.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import unquote

from shoal.errors import InvalidRequest

DEFAULT_LIMIT = 100
MAX_LIMIT = 100
STATES = ("running", "paused")
_ASC = "asc"


@dataclass(frozen=True)
class ListQuery:
    """One `GET /v2/sandboxes` request, validated."""

    states: tuple[str, ...] = STATES
    metadata: tuple[tuple[str, str], ...] = ()
    started_after_us: int | None = None
    template: str | None = None
    limit: int = DEFAULT_LIMIT
    ascending: bool = False
    #: (start in µs, sandbox id) of the last sandbox of the previous page
    cursor: tuple[int, str] | None = None


def micros(iso: str) -> int:
    """Microseconds since the epoch of an RFC 3339 time (finer digits are cut, as E2B cuts them)."""
    s = iso.strip().replace("Z", "+00:00").replace("z", "+00:00")
    date, sep, rest = s.partition(".")
    if sep:
        digits = len(rest) - len(rest.lstrip("0123456789"))
        frac, tail = rest[:digits], rest[digits:]
        s = f"{date}.{(frac + '000000')[:6]}{tail}" if frac else date + tail
    try:
        dt = datetime.fromisoformat(s)
    except ValueError:
        raise InvalidRequest(f"{iso!r} is not an RFC 3339 time") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    delta = dt - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86400 + delta.seconds) * 1_000_000 + delta.microseconds


def make_token(started_at: str, sandbox_id: str, ascending: bool) -> str:
    """The `X-Next-Token` naming the sandbox a page ended with."""
    raw = f"{started_at}__{sandbox_id}" + (f"__{_ASC}" if ascending else "")
    return base64.urlsafe_b64encode(raw.encode()).decode()


def _parse_token(token: str, ascending: bool) -> tuple[int, str]:
    try:
        raw = base64.urlsafe_b64decode(token.encode() + b"=" * (-len(token) % 4)).decode()
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise InvalidRequest("Invalid next token") from None
    parts = raw.split("__")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != _ASC):
        raise InvalidRequest("Invalid next token")
    if (len(parts) == 3) != ascending:
        raise InvalidRequest("Invalid next token: it was issued for the other sort order")
    try:
        return micros(parts[0]), parts[1]
    except InvalidRequest:
        raise InvalidRequest("Invalid next token") from None


def parse_metadata(value: str) -> tuple[tuple[str, str], ...]:
    """The metadata filter as the SDK sends it: `urlencode({quote(k): quote(v)})`, unescaped twice."""
    query = unquote(value)
    out = []
    for pair in query.split("&"):
        parts = pair.split("=")
        if len(parts) != 2:
            raise InvalidRequest("Error parsing metadata: invalid key value pair in query")
        out.append((unquote(parts[0]), unquote(parts[1])))
    return tuple(out)


def parse_query(params: Any) -> ListQuery:
    """A ListQuery from the request's query parameters (a Starlette QueryParams or a plain dict)."""
    order = params.get("order")
    if order not in (None, "", "asc", "desc"):
        raise InvalidRequest(f"Invalid order parameter: unknown order {order!r} (asc or desc)")
    ascending = order == "asc"
    limit = DEFAULT_LIMIT
    raw_limit = params.get("limit")
    if raw_limit not in (None, ""):
        try:
            limit = int(raw_limit)
        except ValueError:
            raise InvalidRequest(f"limit {raw_limit!r} is not an integer") from None
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidRequest(f"limit must be between 1 and {MAX_LIMIT}")
    states = STATES
    raw_state = params.get("state")
    if raw_state:
        states = tuple(dict.fromkeys(s.strip() for s in raw_state.split(",") if s.strip()))
        bad = [s for s in states if s not in STATES]
        if bad:
            raise InvalidRequest(f"state {bad[0]!r} is not one of running, paused")
    metadata: tuple[tuple[str, str], ...] = ()
    if params.get("metadata"):
        metadata = parse_metadata(params.get("metadata"))
    started_after = None
    if params.get("startedAfter"):
        started_after = micros(params.get("startedAfter"))
    template = params.get("template") or None
    if template is not None and ":" in template.rsplit("/", 1)[-1]:
        raise InvalidRequest("Invalid template: tags are not supported here because sandboxes are not tag-scoped")
    cursor = _parse_token(params["nextToken"], ascending) if params.get("nextToken") else None
    return ListQuery(states=states, metadata=metadata, started_after_us=started_after, template=template,
                     limit=limit, ascending=ascending, cursor=cursor)


def _key(item: dict[str, Any]) -> tuple[int, str]:
    return micros(item["startedAt"]), item["sandboxID"]


def _after_cursor(key: tuple[int, str], cursor: tuple[int, str], ascending: bool) -> bool:
    t, sid = key
    ct, cid = cursor
    if ascending:  # time ascending, ties by id descending: the exact reverse of the default order
        return t > ct or (t == ct and sid < cid)
    return t < ct or (t == ct and sid > cid)


def sort_listed(items: list[dict[str, Any]], ascending: bool) -> None:
    """E2B's order: start time descending with ties by ID ascending, or the exact reverse."""
    if ascending:  # time ascending, ties by ID descending
        items.sort(key=lambda d: d["sandboxID"], reverse=True)
        items.sort(key=lambda d: micros(d["startedAt"]))
        return
    items.sort(key=lambda d: d["sandboxID"])
    items.sort(key=lambda d: micros(d["startedAt"]), reverse=True)


def matches(item: dict[str, Any], q: ListQuery) -> bool:
    """True when a listed sandbox passes every filter of the query (the cursor aside)."""
    if item["state"] not in q.states:
        return False
    meta = item.get("metadata") or {}
    if any(meta.get(k) != v for k, v in q.metadata):
        return False
    if q.started_after_us is not None and micros(item["startedAt"]) < q.started_after_us:
        return False
    return not (q.template is not None and item.get("templateID") != q.template)


def page(items: list[dict[str, Any]], q: ListQuery) -> tuple[list[dict[str, Any]], str | None, int | None]:
    """(this page, the next page's token or None, X-Total-Running or None) of every listed sandbox."""
    kept = [d for d in items if matches(d, q)]
    total_running = sum(1 for d in kept if d["state"] == "running") if "running" in q.states else None
    if q.cursor is not None:
        kept = [d for d in kept if _after_cursor(_key(d), q.cursor, q.ascending)]
    sort_listed(kept, q.ascending)
    out = kept[:q.limit]
    token = None
    if len(kept) > q.limit:
        last = out[-1]
        token = make_token(last["startedAt"], last["sandboxID"], q.ascending)
    return out, token, total_running
