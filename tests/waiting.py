"""Waiting in tests: poll a condition until it holds, and fail with what was awaited when it never does.

Tests synchronise on events and conditions, never on fixed sleeps: a sleep is either too short on a busy
machine (a flaky test) or longer than needed everywhere (a slow one). The deadline here is only a safety
net against a hang; a test never asserts how long something took (timings belong to `shoal bench`).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

#: generous: the machines running the suite are shared and often busy
DEFAULT_TIMEOUT = 30.0


def _describe(last: Any, error: BaseException | None) -> str:
    if error is not None:
        return f"; last check raised {type(error).__name__}: {error}"
    return f"; last value {last!r}"[:500]


def wait_for(predicate: Callable[[], T], timeout: float = DEFAULT_TIMEOUT, what: str = "the condition",
             interval: float = 0.01) -> T:
    """Call `predicate` until it returns something truthy, and return that; fail the test naming `what`
    after `timeout` seconds. Exceptions from `predicate` count as "not yet" (the last one is reported)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    error: BaseException | None = None
    while True:
        try:
            last, error = predicate(), None
        except Exception as e:
            error = e
        if error is None and last:
            return last
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}{_describe(last, error)}")
        time.sleep(interval)
        interval = min(interval * 1.5, 0.1)


async def async_wait_for(predicate: Callable[[], T | Awaitable[T]], timeout: float = DEFAULT_TIMEOUT,
                         what: str = "the condition", interval: float = 0.01) -> T:
    """`wait_for` for async tests: `predicate` may be a coroutine function; the event loop keeps running."""
    deadline = time.monotonic() + timeout
    last: Any = None
    error: BaseException | None = None
    while True:
        try:
            got = predicate()
            last, error = (await got) if inspect.isawaitable(got) else got, None
        except Exception as e:
            error = e
        if error is None and last:
            return last  # type: ignore[no-any-return]
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}{_describe(last, error)}")
        await asyncio.sleep(interval)
        interval = min(interval * 1.5, 0.1)
