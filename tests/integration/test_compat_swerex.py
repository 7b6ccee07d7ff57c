"""The unmodified SWE-ReX client (`swerex.runtime.remote.RemoteRuntime` from PyPI) against a real `shoal serve`:
sessions with state, expect and timeouts, execute, files, uploads (a file and a zipped directory), close,
errors in SWE-ReX's own classes, and tokens that do not open other projects' sandboxes."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from shoal.server.proc import ServerProcess
from shoal.server.tokens import TokenStore

swerex = pytest.importorskip("swerex", reason="the compat extra (pip install -e .[compat]) brings SWE-ReX")

from swerex.exceptions import (  # noqa: E402
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SwerexException,
)
from swerex.runtime.abstract import (  # noqa: E402
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)
from swerex.runtime.remote import RemoteRuntime  # noqa: E402

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]


@pytest.fixture
async def rex(api_server: ServerProcess, shoal_home: Path) -> AsyncIterator[dict]:
    """A sandbox of a fresh project (made with shoal's own API) and a RemoteRuntime pointed at it."""
    token = TokenStore(shoal_home).create(f"rex-{secrets.token_hex(3)}", name="swe-rex tests")
    hdr = {"Authorization": f"Bearer {token}"}
    r = httpx.post(f"{api_server.url}/v1/sandboxes", json={"image": "base", "memory_mb": 256}, headers=hdr,
                   timeout=120)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    host = f"{api_server.url}/swerex/{sid}"
    yield {"rt": RemoteRuntime(host=host, port=None, auth_token=token, timeout=30), "url": api_server.url,
           "sid": sid, "host": host, "token": token}
    httpx.delete(f"{api_server.url}/v1/sandboxes/{sid}", headers=hdr, timeout=60)


async def test_swerex_sessions_keep_state(rex: dict) -> None:
    rt: RemoteRuntime = rex["rt"]
    assert (await rt.is_alive()).is_alive
    await rt.create_session(CreateBashSessionRequest())
    with pytest.raises(SessionExistsError):
        await rt.create_session(CreateBashSessionRequest())
    await rt.run_in_session(BashAction(command="cd /tmp && export X=42 && f() { echo fn-$1; }"))
    obs = await rt.run_in_session(BashAction(command="pwd; echo $X; f ok; echo to-stderr >&2"))
    assert obs.exit_code == 0 and obs.output.splitlines() == ["/tmp", "42", "fn-ok", "to-stderr"]
    # non-zero exit: raised by default, reported with check="silent", skipped with check="ignore"
    with pytest.raises(NonZeroExitCodeError):
        await rt.run_in_session(BashAction(command="false"))
    assert (await rt.run_in_session(BashAction(command="(exit 4)", check="silent"))).exit_code == 4
    assert (await rt.run_in_session(BashAction(command="(exit 4)", check="ignore"))).exit_code is None
    # timeout: SWE-ReX's CommandTimeoutError, and the session lives on with its state
    with pytest.raises(CommandTimeoutError):
        await rt.run_in_session(BashAction(command="sleep 30", timeout=0.5))
    assert (await rt.run_in_session(BashAction(command="echo $X"))).output.strip() == "42"
    # expect: returns at the first expected string; an interrupt ends the command still running
    obs = await rt.run_in_session(BashAction(command="echo ready; sleep 30", expect=["ready"], timeout=20))
    assert obs.expect_string == "ready" and obs.exit_code is None
    obs = await rt.run_in_session(BashInterruptAction())
    assert obs.exit_code == 0
    assert (await rt.run_in_session(BashAction(command="echo after"))).output == "after\n"
    # a second session is independent
    await rt.create_session(CreateBashSessionRequest(session="two"))
    assert (await rt.run_in_session(BashAction(command="echo ${X:-unset}", session="two"))).output == "unset\n"
    await rt.close_session(CloseBashSessionRequest(session="two"))
    with pytest.raises(SessionDoesNotExistError):
        await rt.run_in_session(BashAction(command="true", session="two"))
    # a command bash cannot parse: SWE-ReX's BashIncorrectSyntaxError, and none of it ran
    with pytest.raises(BashIncorrectSyntaxError):
        await rt.run_in_session(BashAction(command="export X=changed; if then fi"))
    assert (await rt.run_in_session(BashAction(command="echo $X"))).output.strip() == "42"
    with pytest.raises(SwerexException, match="interactive"):
        await rt.run_in_session(BashAction(command="python3", is_interactive_command=True))
    await rt.close()
    with pytest.raises(SessionDoesNotExistError):
        await rt.run_in_session(BashAction(command="true"))


async def test_swerex_execute_files_and_upload(rex: dict, tmp_path: Path) -> None:
    rt: RemoteRuntime = rex["rt"]
    r = await rt.execute(Command(command=["sh", "-c", "echo out; echo err >&2; exit 3"]))
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 3)
    r = await rt.execute(Command(command="echo $V", shell=True, env={"V": "v1"}, cwd="/tmp"))
    assert r.stdout == "v1\n" and r.exit_code == 0
    r = await rt.execute(Command(command=["sh", "-c", "echo a; echo b >&2"], merge_output_streams=True))
    assert r.stdout == "a\nb\n" and r.stderr == ""
    with pytest.raises(NonZeroExitCodeError):
        await rt.execute(Command(command=["false"], check=True))
    with pytest.raises(CommandTimeoutError):
        await rt.execute(Command(command=["sleep", "30"], timeout=0.5))
    with pytest.raises(FileNotFoundError):
        await rt.execute(Command(command=["/no/such/program"]))

    await rt.write_file(WriteFileRequest(path="/work/new/dir/f.txt", content="héllo\n"))
    assert (await rt.read_file(ReadFileRequest(path="/work/new/dir/f.txt"))).content == "héllo\n"
    with pytest.raises(FileNotFoundError):
        await rt.read_file(ReadFileRequest(path="/work/missing"))

    # a file, and a directory (the client zips it; the server unpacks it at the target)
    (tmp_path / "one.txt").write_text("single")
    await rt.upload(UploadRequest(source_path=str(tmp_path / "one.txt"), target_path="/work/up/one.txt"))
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "mod.py").write_text("print('m')\n")
    (tree / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tree / "run.sh").chmod(0o755)
    (tree / "empty").mkdir()
    await rt.upload(UploadRequest(source_path=str(tree), target_path="/work/tree"))
    r = await rt.execute(Command(command="cat /work/up/one.txt; cat /work/tree/pkg/mod.py; /work/tree/run.sh; "
                                         "test -d /work/tree/empty && echo dir", shell=True))
    assert r.stdout == "singleprint('m')\nran\ndir\n", r.stderr


async def test_swerex_tokens_and_unsupported(rex: dict, shoal_home: Path) -> None:
    url, sid = rex["url"], rex["sid"]
    bad = RemoteRuntime(host=rex["host"], port=None, auth_token="shoal_aaaaaaaaaa_" + "x" * 43, timeout=5)
    assert not (await bad.is_alive()).is_alive
    other = TokenStore(shoal_home).create(f"rex-other-{secrets.token_hex(3)}")
    theirs = RemoteRuntime(host=rex["host"], port=None, auth_token=other, timeout=5)
    assert not (await theirs.is_alive()).is_alive
    with pytest.raises(SwerexException, match="no sandbox"):
        await theirs.execute(Command(command=["cat", "/etc/hostname"]))
    # an endpoint SWE-ReX does not have: its own error format, naming the path (never a 500)
    r = httpx.post(f"{url}/swerex/{sid}/nope", headers={"X-API-Key": rex["token"]})
    assert r.status_code == 511 and "/nope" in r.json()["swerexception"]["message"]
    r = httpx.post(f"{url}/swerex/{sid}/run_in_session", content=b"not json", headers={"X-API-Key": rex["token"]})
    assert r.status_code == 511 and r.json()["swerexception"]["class_path"] == "builtins.ValueError"


async def test_swerex_blank_commands_and_output_cut(api_server: ServerProcess, shoal_home: Path) -> None:
    """Empty, blank and comment-only commands succeed with empty output (SWE-agent sends '' on every run);
    output past the sandbox's max_output_bytes ends with a notice saying where it was cut, in a session and in
    execute (where a raw caller also gets `stdout_truncated`/`stderr_truncated`)."""
    token = TokenStore(shoal_home).create(f"rex-{secrets.token_hex(3)}", name="swe-rex cut")
    hdr = {"Authorization": f"Bearer {token}"}
    cap = 64 << 10
    r = httpx.post(f"{api_server.url}/v1/sandboxes", json={"image": "base", "max_output_bytes": cap},
                   headers=hdr, timeout=120)
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    try:
        rt = RemoteRuntime(host=f"{api_server.url}/swerex/{sid}", port=None, auth_token=token, timeout=30)
        await rt.create_session(CreateBashSessionRequest())
        for cmd in ("", "  \t", "\n\n", "# only a comment", "# one\n\n  # two"):
            obs = await rt.run_in_session(BashAction(command=cmd, check="raise"))
            assert (obs.output, obs.exit_code) == ("", 0), cmd
        # a comment after a command still runs the command
        assert (await rt.run_in_session(BashAction(command="echo x # note"))).output == "x\n"
        big = "head -c 100000 /dev/zero | tr '\\0' a"
        obs = await rt.run_in_session(BashAction(command=big))
        body, _, notice = obs.output.partition("\n[shoal: output cut at")
        assert body == "a" * cap and str(cap) in notice and obs.exit_code == 0
        small = await rt.run_in_session(BashAction(command="head -c 1000 /dev/zero | tr '\\0' b"))
        assert small.output == "b" * 1000
        r2 = await rt.execute(Command(command=big + "; " + big + " >&2", shell=True))
        for text, what in ((r2.stdout, "stdout"), (r2.stderr, "stderr")):
            body, _, notice = text.partition(f"\n[shoal: {what} cut at")
            assert body == "a" * cap and str(cap) in notice
        raw = httpx.post(f"{api_server.url}/swerex/{sid}/execute", headers={"X-API-Key": token},
                         json={"command": big, "shell": True}, timeout=30).json()
        assert raw["stdout_truncated"] is True and raw["stderr_truncated"] is False
        full = await rt.execute(Command(command=["sh", "-c", "head -c 5000 /dev/zero | tr '\\0' c"]))
        assert full.stdout == "c" * 5000
    finally:
        httpx.delete(f"{api_server.url}/v1/sandboxes/{sid}", headers=hdr, timeout=60)
