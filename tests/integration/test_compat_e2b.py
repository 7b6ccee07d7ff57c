"""The unmodified E2B SDKs from PyPI (`e2b`, `e2b-code-interpreter`) against a real `shoal serve`: the control
plane, envd (commands, stdin, kill, files) and the code interpreter, routed by E2B_SANDBOX_URL and by Host;
tokens of other projects never reach a sandbox."""

from __future__ import annotations

import json
import secrets
import struct
from pathlib import Path

import httpx
import pytest

from shoal.server.tokens import Quota, TokenStore

e2b = pytest.importorskip("e2b", reason="the compat extra (pip install -e .[compat]) brings the E2B SDK")
e2b_ci = pytest.importorskip("e2b_code_interpreter")

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]


def test_e2b_sandbox_commands_files_and_lifecycle(e2b_env: dict) -> None:
    from e2b import CommandExitException, Sandbox

    sb = Sandbox.create(timeout=120, metadata={"suite": "compat"}, envs={"GREETING": "hej"})
    e2b_env["made"].append(sb)
    assert sb.is_running()

    # foreground: output, the sandbox's env, callbacks
    seen: list[str] = []
    r = sb.commands.run("echo $GREETING; echo oops >&2", on_stdout=seen.append)
    assert (r.exit_code, r.stdout, r.stderr) == (0, "hej\n", "oops\n")
    assert "".join(seen) == "hej\n"
    # non-zero exit: the SDK's own exception, with stderr
    with pytest.raises(CommandExitException) as ei:
        sb.commands.run("echo bad >&2; exit 3")
    assert ei.value.exit_code == 3 and ei.value.stderr == "bad\n"
    # cwd and per-command envs
    r = sb.commands.run("pwd; echo $A", cwd="/tmp", envs={"A": "b"})
    assert r.stdout == "/tmp\nb\n"

    # background with stdin
    h = sb.commands.run("cat", background=True, stdin=True)
    sb.commands.send_stdin(h.pid, "line one\n")
    sb.commands.close_stdin(h.pid)
    assert h.wait().stdout == "line one\n"
    # stdin as a client stream (StreamInput)
    h = sb.commands.run("cat", background=True, stdin=True)
    sb.commands.stream_input(h.pid, ["a", b"b", "c\n"])
    sb.commands.close_stdin(h.pid)
    assert h.wait().stdout == "abc\n"
    # background + list + kill
    h = sb.commands.run("sleep 600", background=True)
    assert h.pid in {p.pid for p in sb.commands.list()}
    assert sb.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        h.wait()
    assert h.pid not in {p.pid for p in sb.commands.list()}
    assert sb.commands.kill(h.pid) is False  # gone

    # files
    info = sb.files.write("/work/dir/a.txt", "hello\n")
    assert info.path == "/work/dir/a.txt"
    assert sb.files.read("/work/dir/a.txt") == "hello\n"
    assert bytes(sb.files.read("/work/dir/a.txt", format="bytes")) == b"hello\n"
    sb.files.write_files([{"path": "/work/dir/b.bin", "data": b"\x00\x01"}, {"path": "/work/dir/c", "data": "c"}])
    entries = {e.name: e for e in sb.files.list("/work/dir")}
    assert set(entries) == {"a.txt", "b.bin", "c"} and entries["a.txt"].size == 6
    assert sb.files.exists("/work/dir/c") and not sb.files.exists("/work/nope")
    assert sb.files.make_dir("/work/dir/sub") is True and sb.files.make_dir("/work/dir/sub") is False
    assert sb.files.get_info("/work/dir/sub").type.value == "dir"
    moved = sb.files.rename("/work/dir/c", "/work/dir/sub/c2")
    assert moved.path == "/work/dir/sub/c2" and sb.commands.run("cat /work/dir/sub/c2").stdout == "c"
    sb.files.remove("/work/dir/sub")
    assert not sb.files.exists("/work/dir/sub")
    with pytest.raises(e2b.FileNotFoundException):
        sb.files.read("/work/missing")

    # set_timeout moves the end of life; list finds it by metadata
    before = sb.get_info().end_at
    sb.set_timeout(3600)
    after = sb.get_info()
    assert after.end_at > before and after.metadata == {"suite": "compat"}
    listed = Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": "compat"})).next_items()
    assert sb.sandbox_id in {s.sandbox_id for s in listed}

    # another client connects by id, then kill
    again = Sandbox.connect(sb.sandbox_id)
    assert again.commands.run("cat /work/dir/a.txt").stdout == "hello\n"
    assert sb.kill() is True
    assert not sb.is_running()
    assert sb.sandbox_id not in {s.sandbox_id for s in Sandbox.list().next_items()}
    assert Sandbox.kill(sb.sandbox_id) is False


async def test_e2b_async_sandbox(e2b_env: dict) -> None:
    from e2b import AsyncSandbox, CommandExitException

    sb = await AsyncSandbox.create(timeout=120)
    try:
        r = await sb.commands.run("echo async")
        assert r.stdout == "async\n"
        with pytest.raises(CommandExitException):
            await sb.commands.run("false")
        await sb.files.write("/tmp/x", "y")
        assert await sb.files.read("/tmp/x") == "y"
        assert "x" in {e.name for e in await sb.files.list("/tmp")}
        h = await sb.commands.run("sleep 600", background=True)
        assert await h.kill()
        await sb.set_timeout(300)
    finally:
        await sb.kill()
    assert not await sb.is_running()


def test_code_interpreter_keeps_state(e2b_env: dict) -> None:
    from e2b_code_interpreter import Sandbox

    sb = Sandbox.create(timeout=120)
    e2b_env["made"].append(sb)
    first = sb.run_code("x = 6*7")
    assert first.error is None and first.logs.stdout == []
    out: list[str] = []
    second = sb.run_code("print(x)\nx + 1", on_stdout=lambda m: out.append(m.line))
    assert second.logs.stdout == ["42\n"] and "".join(out) == "42\n"
    assert second.text == "43"
    failed = sb.run_code("1/0")
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    assert "ZeroDivisionError" in failed.error.traceback
    # subprocess output comes back too, and a separate context has its own namespace
    assert sb.run_code("import os; os.system('echo from-shell')").logs.stdout == ["from-shell\n"]
    # a run the client stops waiting for is interrupted; the namespace survives it
    with pytest.raises(e2b.TimeoutException):
        sb.run_code("import time\nfor _ in range(300): time.sleep(0.1)\ny = 1", timeout=1)
    after = sb.run_code("print(x); 'y' in globals()")
    assert after.logs.stdout == ["42\n"] and after.text == "False"
    ctx = sb.create_code_context()
    assert sb.run_code("'x' in globals()", context=ctx).text == "False"
    assert sb.run_code("x", context=None).text == "42"


def _connect_unary(url: str, method: str, body: dict, headers: dict) -> httpx.Response:
    return httpx.post(f"{url}/{method}", content=json.dumps(body), headers={"Content-Type": "application/json",
                                                                            **headers})


def test_e2b_host_routing_and_tokens(e2b_env: dict, shoal_home: Path) -> None:
    """Host-header routing (`<port>-<id>.<domain>`, as behind a TLS proxy with E2B_DOMAIN), and tokens: a bad
    key, another project's key and another sandbox's access token are all refused."""
    from e2b import AuthenticationException, Sandbox, SandboxNotFoundException

    url, token = e2b_env["url"], e2b_env["token"]
    sb = Sandbox.create(timeout=120)
    e2b_env["made"].append(sb)
    access = sb._envd_access_token
    assert access and access != token  # a per-sandbox token, not the API key
    host = {"Host": f"49983-{sb.sandbox_id}.e2b.test", "X-Access-Token": access}
    r = _connect_unary(url, "process.Process/List", {}, host)
    assert r.status_code == 200 and r.json() == {"processes": []}
    assert httpx.get(f"{url}/health", headers=host).status_code == 204
    # a Start stream through Host routing: enveloped JSON in, envelopes out, end-of-stream last
    msg = json.dumps({"process": {"cmd": "/bin/echo", "args": ["routed"]}}).encode()
    r = httpx.post(f"{url}/process.Process/Start", content=struct.pack(">BI", 0, len(msg)) + msg,
                   headers={**host, "Content-Type": "application/connect+json"})
    frames, data = [], r.content
    while data:
        flags, n = struct.unpack(">BI", data[:5])
        frames.append((flags, json.loads(data[5:5 + n])))
        data = data[5 + n:]
    assert frames[0][1]["event"]["start"]["pid"] > 0
    assert any(f[1].get("event", {}).get("data", {}).get("stdout") == "cm91dGVkCg==" for f in frames)  # "routed\n"
    assert frames[-1] == (2, {})

    # a wrong key cannot create; another project's key cannot see or reach this sandbox
    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="shoal_aaaaaaaaaa_" + "x" * 43)
    other = TokenStore(shoal_home).create(f"e2b-other-{secrets.token_hex(3)}")
    with pytest.raises(SandboxNotFoundException):
        Sandbox.connect(sb.sandbox_id, api_key=other)
    assert sb.sandbox_id not in {s.sandbox_id for s in Sandbox.list(api_key=other).next_items()}
    assert Sandbox.kill(sb.sandbox_id, api_key=other) is False
    theirs = {"E2b-Sandbox-Id": sb.sandbox_id, "X-API-KEY": other}
    assert _connect_unary(url, "process.Process/List", {}, theirs).status_code == 404
    assert httpx.get(f"{url}/files", params={"path": "/etc/hostname"}, headers=theirs).status_code == 502
    # this sandbox's access token does not open another sandbox, even of the same project
    sb2 = Sandbox.create(timeout=120)
    e2b_env["made"].append(sb2)
    stolen = {"E2b-Sandbox-Id": sb2.sandbox_id, "X-Access-Token": access}
    r = _connect_unary(url, "process.Process/List", {}, stolen)
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    assert _connect_unary(url, "process.Process/List", {}, {"E2b-Sandbox-Id": sb2.sandbox_id}).status_code == 401
    assert sb.kill() and not sb.is_running()


def test_e2b_pty_reconnect_pause_and_fork(e2b_env: dict) -> None:
    from e2b import PtySize, Sandbox

    sb = Sandbox.create(timeout=120)
    e2b_env["made"].append(sb)
    # a PTY of the asked size, typed into
    seen: list[bytes] = []
    pty = sb.pty.create(PtySize(rows=30, cols=100))
    sb.pty.send_stdin(pty.pid, b"stty size; exit\n")
    assert pty.wait(on_pty=seen.append).exit_code == 0
    assert b"30 100" in b"".join(seen)
    # another listener attaches to a running command by pid
    h = sb.commands.run("sleep 0.3; echo late", background=True)
    assert sb.commands.connect(h.pid).wait().stdout == "late\n"
    # pause, then connect resumes it with its files and processes
    sb.files.write("/work/f", "kept")
    bg = sb.commands.run("sleep 600", background=True)
    assert sb.pause() is True
    assert sb.get_info().state.value == "paused"
    again = Sandbox.connect(sb.sandbox_id)
    assert again.get_info().state.value == "running"
    assert again.commands.run("cat /work/f").stdout == "kept"
    assert bg.pid in {p.pid for p in again.commands.list()}
    # fork: children start from the parent's files
    kids = sb.fork(count=2)
    e2b_env["made"].extend(k for k in kids if not isinstance(k, Exception))
    assert [type(k).__name__ for k in kids] == ["Sandbox", "Sandbox"]
    assert {k.commands.run("cat /work/f").stdout for k in kids} == {"kept"}


def test_e2b_quota_applies(e2b_env: dict, shoal_home: Path) -> None:
    """An E2B key is a shoal token: its project's quota bounds what it creates."""
    from e2b import Sandbox, SandboxException

    token = TokenStore(shoal_home).create(f"e2b-q-{secrets.token_hex(3)}", quota=Quota(max_sandboxes=1))
    sb = Sandbox.create(timeout=120, api_key=token)
    e2b_env["made"].append(sb)
    with pytest.raises(SandboxException, match="quota"):
        Sandbox.create(timeout=120, api_key=token)
    sb.kill()
    e2b_env["made"].append(Sandbox.create(timeout=120, api_key=token))  # room again
