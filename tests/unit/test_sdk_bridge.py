"""The one sync bridge (`shoal.sdk.bridge.Bridge`) under SyncClient and the RL adapters, and the process-wide
SyncClient the adapters share. No sandboxes here: the bridge is plain asyncio; SyncClient is built, not used."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from shoal.sdk.bridge import Bridge


def test_run_returns_the_result_computed_on_the_bridge_thread() -> None:
    b = Bridge("t-bridge")
    try:
        async def where() -> str:
            await asyncio.sleep(0)
            return threading.current_thread().name

        assert b.run(where()) == "t-bridge"
        assert threading.current_thread().name != "t-bridge"
    finally:
        b.close()


def test_exception_is_raised_in_the_caller() -> None:
    b = Bridge()
    try:
        async def boom() -> None:
            raise KeyError("x")

        with pytest.raises(KeyError):
            b.run(boom())
        assert b.run(asyncio.sleep(0, result=7)) == 7  # the loop survives a failed coroutine
    finally:
        b.close()


def test_timeout_cancels_the_coroutine() -> None:
    b = Bridge()
    cancelled = threading.Event()
    try:
        async def forever() -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        with pytest.raises(TimeoutError):
            b.run(forever(), timeout=0.05)
        assert cancelled.wait(10), "the timed-out coroutine was not cancelled on the bridge's loop"
    finally:
        b.close()


def test_run_from_the_bridge_thread_is_an_error_not_a_deadlock() -> None:
    b = Bridge()
    try:
        async def nested() -> str:
            try:
                b.run(asyncio.sleep(0))
            except RuntimeError as e:
                return str(e)
            return "no error"

        assert "own thread" in b.run(nested(), timeout=10)
    finally:
        b.close()


def test_close_stops_the_thread_and_is_idempotent() -> None:
    b = Bridge()
    b.close()
    assert b.closed and b.loop.is_closed()
    b.close()
    coro = asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="closed"):
        b.run(coro)


def test_sync_client_and_shared_client_use_the_bridge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.sdk import sync

    monkeypatch.setenv("SHOAL_HOME", str(tmp_path))
    one = sync.shared_client()
    try:
        assert sync.shared_client() is one
        assert isinstance(one.bridge, Bridge) and not one.bridge.closed
        assert one.async_client is one._client
    finally:
        sync.close_shared_client()
    assert one.bridge.closed
    sync.close_shared_client()  # twice is fine
    two = sync.shared_client()
    try:
        assert two is not one
    finally:
        sync.close_shared_client()
