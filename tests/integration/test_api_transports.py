"""The whole SDK surface over both transports (embedded and HTTP via a real `shoal serve`), with the same
assertions: a test here runs twice, `[local]` and `[http]` (fixture `any_client` in tests/conftest.py)."""

from __future__ import annotations

import asyncio
import secrets
import signal

import pytest

import shoal
from shoal.agentproto.client import ShellResult

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]
SMALL = {"memory_mb": 64}


async def test_create_exec_close(any_client: shoal.Client) -> None:
    sb = await any_client.create("base", labels={"t": "basic"}, **SMALL)
    assert sb.info.state == "running" and sb.info.image.startswith("base") and sb.info.labels == {"t": "basic"}
    r = await sb.exec("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out) == (3, b"out\n", b"err\n", False)
    r = await sb.exec("echo $FOO:$PWD", env={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout == b"bar:/tmp\n"
    r = await sb.exec(["id", "-u"], user="nobody", cwd="/")
    assert r.stdout == b"65534\n"
    raw = bytes(range(256))
    r = await sb.exec(["cat"], stdin=raw)
    assert r.stdout == raw  # not UTF-8: exact bytes over both transports
    r = await sb.exec("sleep 5", timeout=0.5)
    assert r.timed_out and not r.ok
    r = await sb.exec("head -c 3000000 /dev/zero")
    assert r.truncated and len(r.stdout) <= 1 << 20
    info = await sb.refresh()
    assert info.id == sb.id and info.spec["memory_mb"] == 64
    got = await any_client.get(sb.id)
    assert got.id == sb.id
    assert sb.id in {i.id for i in await any_client.list(labels={"t": "basic"})}
    assert sb.id not in {i.id for i in await any_client.list(labels={"t": "other"})}
    await sb.close()
    with pytest.raises(shoal.SandboxNotFound):
        await any_client.get(sb.id)
    with pytest.raises(shoal.SandboxNotFound):
        await sb.exec("true")


async def test_bad_input_is_typed(any_client: shoal.Client) -> None:
    with pytest.raises(shoal.InvalidRequest, match="memory_mb"):
        await any_client.create("base", memory_mb=1)
    with pytest.raises(shoal.ImageNotFound):
        await any_client.create("no-such-image-" + secrets.token_hex(3), **SMALL)
    with pytest.raises(shoal.InvalidRequest):
        await any_client.create("Not A Name", **SMALL)
    with pytest.raises(shoal.SandboxNotFound):
        await any_client.get("n0-" + "a" * 26)
    sb = await any_client.create("base", **SMALL)
    with pytest.raises(shoal.InvalidRequest):
        await sb.exec("")
    with pytest.raises(shoal.InvalidRequest):
        await sb.exec("true", timeout=-1)
    with pytest.raises(shoal.FileNotFound):
        await sb.read_file("/no/such/file")
    with pytest.raises(shoal.ShellNotFound):
        await shoal.Shell(sb, "999999").run("true")


async def test_stream_output_stdin_signal_tty(any_client: shoal.Client) -> None:
    sb = await any_client.create("base", **SMALL)
    s = await sb.stream("for i in 1 2 3; do echo $i; sleep 0.05; done; echo e >&2; exit 4")
    events = [ev async for ev in s]
    out = b"".join(e.data for e in events if e.kind == "stdout")
    assert out == b"1\n2\n3\n"
    assert b"".join(e.data for e in events if e.kind == "stderr") == b"e\n"
    assert events[-1].kind == "exit" and events[-1].result.exit_code == 4 and s.result.exit_code == 4

    s = await sb.stream(["cat"], stdin=True)
    await s.write(b"x" * 300_000)
    await s.close_stdin()
    r = await s.wait()
    assert r.exit_code == 0 and r.stdout == b"x" * 300_000

    s = await sb.stream("trap 'echo got-int; exit 7' INT; echo ready; while true; do sleep 0.05; done")
    it = s.__aiter__()
    first = await it.__anext__()
    assert first.data.startswith(b"ready")
    await s.signal(signal.SIGINT)
    r = await s.wait()
    assert r.exit_code == 7 and b"got-int" in r.stdout

    # the resize reaches the program's terminal: `stty size` reports the size before it (printed before the
    # program waits for a line) and the new one after it (run once the line arrives, after the resize)
    s = await sb.stream("stty size; read line; stty size; echo \"[$line]\"", tty=True)
    it = s.__aiter__()
    out = b""
    while b"\n" not in out:
        out += (await asyncio.wait_for(it.__anext__(), 30)).data
    await s.resize(33, 77)
    await s.write(b"hello\n")
    out += b"".join([ev.data async for ev in it])
    assert s.result is not None and s.result.exit_code == 0 and b"[hello]" in out
    sizes = [ln.strip() for ln in out.splitlines() if ln.strip().replace(b" ", b"").isdigit()]
    assert len(sizes) == 2 and sizes[0] != b"33 77" and sizes[1] == b"33 77", out

    # a working directory that does not exist is the caller's mistake, on either transport
    with pytest.raises(shoal.InvalidRequest, match="/does/not/exist"):
        s = await sb.stream("true", cwd="/does/not/exist")
        await s.wait()


async def test_shells_keep_state(any_client: shoal.Client) -> None:
    sb = await any_client.create("base", **SMALL)
    sh = await sb.shell(cwd="/tmp", env={"A": "1"})
    await sh.run("cd /etc && export X=42 && f() { echo fn-$1; }")
    r = await sh.run("echo $X $A $PWD; f z")
    assert r.stdout == b"42 1 /etc\nfn-z\n"
    assert isinstance(r, ShellResult) and r.alive
    r = await sh.run("sleep 10", timeout=0.5)
    assert r.timed_out
    assert (await sh.run("echo still $X")).stdout == b"still 42\n"
    r = await sh.run("exit 3")
    assert isinstance(r, ShellResult) and r.alive is False
    await sh.close() if r.alive else None
    async with await sb.shell() as sh2:
        assert (await sh2.run("echo $X")).stdout == b"\n"


async def test_files(any_client: shoal.Client) -> None:
    sb = await any_client.create("base", **SMALL)
    blob = secrets.token_bytes(3 << 20)
    await sb.write_file("/work/deep/dir/blob.bin", blob, mode=0o600)
    assert await sb.read_file("/work/deep/dir/blob.bin") == blob
    await sb.write_file("rel.txt", "relative to the workdir")
    assert (await sb.exec("cat rel.txt")).stdout == b"relative to the workdir"
    await sb.write_file("/work/deep/x.sh", "#!/bin/sh\necho run\n", mode=0o755)
    assert (await sb.exec("/work/deep/x.sh")).stdout == b"run\n"
    entries = await sb.list_dir("/work/deep")
    by_name = {e.name: e for e in entries}
    assert by_name["dir"].type == "dir" and by_name["x.sh"].type == "file" and by_name["x.sh"].mode & 0o777 == 0o755
    assert [e.name for e in entries] == sorted(e.name for e in entries)
    assert (await sb.list_dir("/work/deep/dir"))[0].size == len(blob)
    with pytest.raises(shoal.FileNotFound):
        await sb.list_dir("/nope")
    with pytest.raises(shoal.SandboxFileError):
        await sb.read_file("/work/deep")


async def test_pause_resume(any_client: shoal.Client) -> None:
    sb = await any_client.create("base", **SMALL)
    await sb.exec("echo kept > /tmp/k")
    await sb.pause()
    assert (await sb.refresh()).state == "paused"
    await sb.resume()
    assert (await sb.refresh()).state == "running"
    await sb.pause()
    r = await sb.exec("cat /tmp/k")  # a request to a paused sandbox resumes it
    assert r.stdout == b"kept\n" and (await sb.refresh()).state == "running"


async def test_create_many(any_client: shoal.Client) -> None:
    items = await any_client.create_many("base", 4, labels={"burst": "1"}, **SMALL)
    assert len(items) == 4 and all(isinstance(i, shoal.Sandbox) for i in items)
    assert len({i.id for i in items}) == 4
    rs = await asyncio.gather(*(i.exec("hostname") for i in items))
    assert all(r.exit_code == 0 for r in rs)
    with pytest.raises(shoal.ImageNotFound):
        await any_client.create_many("no-such-image-" + secrets.token_hex(3), 2, **SMALL)


async def test_snapshot_and_fork(any_client: shoal.Client) -> None:
    sb = await any_client.create("base", **SMALL)
    await sb.write_file("/work/state.txt", "step 3")
    name = f"apitest-{secrets.token_hex(4)}:step3"
    img = await sb.snapshot(name)
    try:
        assert img["ref"] == name  # the project's namespace is invisible to it
        assert name.split(":")[0] in {i["name"] for i in await any_client.images()}
        child = await any_client.create(name, **SMALL)
        assert (await child.exec("cat /work/state.txt")).stdout == b"step 3"
        assert child.info.image == name
        kids = await sb.fork(2)
        assert len(kids) == 2
        for k in kids:
            assert (await k.read_file("/work/state.txt")) == b"step 3"
            assert k.info.labels.get("shoal.fork_of") == sb.id
        await kids[0].write_file("/work/state.txt", "diverged")
        assert (await kids[1].read_file("/work/state.txt")) == b"step 3"
    finally:
        _remove_images(name, sb.id)


def _remove_images(name: str, sandbox_id: str) -> None:
    """Snapshots land in the shared store: remove this test's tags (any project namespace)."""
    import os

    from shoal.images.store import ImageStore

    store = ImageStore(os.environ["SHOAL_STORE"])
    base = name.split(":")[0]
    for img in store.list_images():
        if img.name.endswith(base) or sandbox_id in img.name:
            store.remove_image(f"{img.name}:{img.tag}")


async def test_images_listed(any_client: shoal.Client) -> None:
    from shoal.sdk.http import HttpTransport

    names = {i["name"] for i in await any_client.images()}
    assert "base" in names
    # a project token does not see other projects' images (the embedded client sees the whole store, which
    # other test sessions share: it may hold their projects' images at any moment)
    if isinstance(any_client.transport, HttpTransport):
        assert not any(n.startswith("projects/") for n in names)


async def test_sync_client_over_both(any_transport: object) -> None:
    """SyncClient wraps the same transports (run in a thread: it owns its own loop)."""

    def work() -> bytes:
        kw = {} if any_transport is None else {"url": any_transport.url, "token": any_transport.token}
        with shoal.SyncClient(**kw) as c:
            sb = c.create("base", **SMALL)
            try:
                return sb.exec("echo sync").stdout
            finally:
                sb.close()

    assert await asyncio.to_thread(work) == b"sync\n"


async def test_run_code(any_client: shoal.Client) -> None:
    from shoal.models import RunCodeResult

    r = await any_client.run_code("print(1+1)")
    assert isinstance(r, RunCodeResult) and r.status == "success" and r.stdout == b"2\n"
    r = await any_client.run_code("import sys; sys.stdout.buffer.write(bytes(range(256)))")
    assert r.stdout == bytes(range(256))
    r = await any_client.run_code("import sys; print(open('d.bin','rb').read(), sys.stdin.buffer.read())",
                                  files={"d.bin": b"\xff\x00"}, stdin=b"in\xfe")
    assert r.stdout == b"b'\\xff\\x00' b'in\\xfe'\n", r  # binary files and stdin arrive exactly
    r = await any_client.run_code("raise SystemExit(3)")
    assert r.status == "failed" and r.exit_code == 3
    with pytest.raises(shoal.InvalidRequest, match="language"):
        await any_client.run_code("x", language="cobol")
    many = await any_client.run_code_many(["print(1)", {"code": "echo two", "language": "bash"}])
    assert [m.stdout for m in many] == [b"1\n", b"two\n"]
