"""Item 6 of issue 19: what a command prints must not cost the node (or the API server) more memory than
the sandbox's own limits allow.

Before the fix max_output_bytes could be 1 GiB per stream (0: unlimited): a 64 MiB sandbox printing
600 MiB grew the embedded client from 26 to 1,233 MiB, and 200 MiB of output over HTTP took the API
server from 68 to 699 MiB. Now a command's kept output is at most an eighth of the sandbox's memory per
stream, the server sends big results in pieces, and streams are backpressured instead of buffered.

Memory is measured as the growth of the process's peak RSS (VmHWM, reset through /proc/PID/clear_refs
just before): a bound, not a timing."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

import shoal
from shoal.server.proc import ServerProcess

pytestmark = [pytest.mark.root]
MiB = 1 << 20


def _status(pid: int | str, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


@contextlib.contextmanager
def peak_growth(pid: int | str = "self"):  # type: ignore[no-untyped-def]
    """Yields a list that holds, afterwards, how far the process's peak RSS rose above its RSS at the start."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    start = _status(pid, "VmRSS")
    out: list[int] = []
    yield out
    out.append(_status(pid, "VmHWM") - start)


async def test_output_kept_per_command_follows_the_memory_limit(any_client: shoal.Client) -> None:
    with pytest.raises(shoal.InvalidRequest, match="at most 8388608"):
        await any_client.create("base", memory_mb=64, max_output_bytes=64 * MiB)
    sb = await any_client.create("base", memory_mb=64, max_output_bytes=0)  # 0: as much as allowed
    r = await sb.exec("head -c 100M /dev/zero")
    assert r.truncated and len(r.stdout) == 8 * MiB


async def test_embedded_client_memory_is_bounded(client: shoal.Client) -> None:
    sb = await client.create("base", memory_mb=64, max_output_bytes=0)
    with peak_growth() as grew:
        r = await sb.exec("head -c 600M /dev/zero; head -c 600M /dev/zero >&2", timeout=300)
    assert r.truncated and len(r.stdout) == len(r.stderr) == 8 * MiB
    assert grew[0] < 64 * MiB, grew  # 2 streams x 8 MiB, joined once (was: +1.2 GiB)


async def test_api_server_memory_is_bounded(api_server: ServerProcess) -> None:
    pid = api_server.proc.pid
    async with shoal.Client(api_server.url, token=api_server.token, timeout=300) as c:
        sb = await c.create("base", memory_mb=512, max_output_bytes=0)  # 64 MiB per stream
        with peak_growth(pid) as grew:
            r = await sb.exec("head -c 200M /dev/urandom | base64 -w 1000")
        assert r.truncated and len(r.stdout) == 64 * MiB
    assert grew[0] < 200 * MiB, grew  # the result once, sent in pieces (was: +630 MiB for 200 MiB)


async def test_a_slow_stream_reader_holds_up_the_command_not_the_memory(any_transport, client: shoal.Client,
                                                                        api_server: ServerProcess) -> None:
    """Nobody reads a stream for a while: the command waits (its pipe fills up), the node does not buffer
    its output; then everything arrives."""
    async def run(c: shoal.Client, pid: int | str) -> None:
        sb = await c.create("base", memory_mb=256, max_output_bytes=0)
        with peak_growth(pid) as grew:
            h = await sb.stream("head -c 300M /dev/zero")
            got, first = 0, True
            async for ev in h:
                if ev.kind == "exit":
                    break
                got += len(ev.data)
                if first:
                    first = False
                    await asyncio.sleep(3)  # the command could print all of it meanwhile
        assert got == 300 * MiB
        assert grew[0] < 64 * MiB, grew  # a few MiB in flight (was: all of it)

    if any_transport is None:
        await run(client, "self")
    else:
        async with shoal.Client(api_server.url, token=api_server.token, timeout=300) as c:
            await run(c, api_server.proc.pid)
