"""SWE-agent on shoal: its request sequence (tests/integration/sweagent_replay.py) through the unmodified SWE-ReX
client against `/swerex/{id}`, and the same requests against SWE-ReX's own server (`swerex-remote` from the same
PyPI package, run on this host in a private mount namespace whose /root is a tmpfs) answering alike."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shoal.server.proc import ServerProcess, free_port
from shoal.server.tokens import TokenStore
from tests.waiting import wait_for

swerex = pytest.importorskip("swerex", reason="the compat extra (pip install -e .[compat]) brings SWE-ReX")

from swerex.runtime.abstract import (  # noqa: E402
    BashAction,
    BashInterruptAction,
    BashObservation,
    Command,
    CommandResponse,
    CreateBashSessionRequest,
    ReadFileRequest,
)
from swerex.runtime.remote import RemoteRuntime  # noqa: E402

from tests.integration.sweagent_replay import SUBMISSION, replay, repo_setup_command, write_bundles  # noqa: E402

pytestmark = [pytest.mark.root, pytest.mark.timeout(600)]


class Sandbox:
    """A `base` sandbox made with shoal's API for a fresh project, and a RemoteRuntime pointed at it."""

    def __init__(self, server: ServerProcess, home: Path) -> None:
        self.token = TokenStore(home).create(f"swea-{secrets.token_hex(3)}", name="SWE-agent replay")
        self.hdr = {"Authorization": f"Bearer {self.token}"}
        self.url = server.url
        r = httpx.post(f"{self.url}/v1/sandboxes", json={"image": "base", "memory_mb": 512}, headers=self.hdr,
                       timeout=120)
        assert r.status_code == 201, r.text
        self.id = r.json()["id"]
        self.host = f"{self.url}/swerex/{self.id}"

    def runtime(self) -> RemoteRuntime:
        # what RemoteDeployment.start makes from --env.deployment.host/--env.deployment.auth_token
        return RemoteRuntime(host=self.host, port=None, auth_token=self.token, timeout=0.15)

    def close(self) -> None:
        httpx.delete(f"{self.url}/v1/sandboxes/{self.id}", headers=self.hdr, timeout=60)


async def test_sweagent_default_config_runs_on_shoal(api_server: ServerProcess, shoal_home: Path,
                                                     tmp_path: Path) -> None:
    """The whole sequence of a SWE-agent run with config/default.yaml and a preexisting repository: tool upload
    and install, the empty reset command, state commands, a step that times out and the interrupt SWE-agent
    sends then, review-on-submit, and the patch read back."""
    sb = Sandbox(api_server, shoal_home)
    try:
        rt = sb.runtime()
        made = await rt.execute(Command(command=repo_setup_command("/testbed"), shell=True))
        assert made.stdout.strip() == "made", made
        t = await replay(rt, repo="/testbed", bundles=write_bundles(tmp_path / "tools"), execution_timeout=2)
        got = dict(t.entries)
        assert got["reset commands (empty)"] == ("", 0)
        assert "testbed" in got["ls /"][0].split("\n")
        assert got["cwd"] == "/testbed"
        assert got["which"] == ["/root/tools/edit_anthropic/bin/str_replace_editor",
                                "/root/tools/review_on_submit_m/bin/submit"]
        assert got["state"] == {"working_dir": "/testbed"}
        steps = [v for k, v in t.entries if k.startswith("step ")]
        assert "return a - b" in steps[0][0] and steps[0][1] == 0  # view
        assert "has been edited" in steps[1][0]  # str_replace
        assert steps[2] == ("5\n", 0)  # the check the model ran
        assert steps[3] == "CommandTimeoutError" and got["interrupt"] == 0
        assert "Thank you for your work" in steps[4][0] and SUBMISSION not in steps[4][0]
        assert SUBMISSION in steps[5][0]
        patch = got["submission"]
        assert "-    return a - b\n+    return a + b\n" in patch and patch.startswith("diff --git a/calc.py")
    finally:
        sb.close()


# ---- the same requests against SWE-ReX's own server ------------------------------------------------------------
class SwerexRemote:
    """`swerex-remote` (SWE-ReX's server) on a loopback port, in a private mount namespace with a tmpfs on /root
    (everything the replay writes lands there and goes with the namespace)."""

    def __init__(self, work: Path) -> None:
        self.port = free_port()
        self.token = secrets.token_hex(8)
        exe = str(Path(sys.executable).with_name("swerex-remote"))
        # the Python running the tests may live under /root (pyenv): bound back in over the tmpfs
        keep = [str(Path(p).resolve()) for p in {sys.base_prefix, sys.prefix}
                if str(Path(p).resolve()).startswith("/root/")]
        orig = work / "orig-root"
        orig.mkdir()
        script = ["set -e", f"mount --bind /root {orig}", "mount -t tmpfs -o size=64m,mode=700 tmpfs /root"]
        for k in keep:
            rel = os.path.relpath(k, "/root")
            script += [f"mkdir -p /root/{rel}", f"mount --bind {orig}/{rel} /root/{rel}"]
        script += ["cd /root", 'exec "$@"']
        log = work / "swerex-remote.log"
        with open(log, "ab") as logf:
            self.proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", "\n".join(script), "sh",
                 exe, "--host", "127.0.0.1", "--port", str(self.port), "--auth-token", self.token],
                stdout=logf, stderr=logf, stdin=subprocess.DEVNULL, start_new_session=True)
        self.log = log

        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"swerex-remote exited: {log.read_text()[-2000:]}")
            return httpx.get(f"http://127.0.0.1:{self.port}/is_alive", headers={"X-API-Key": self.token},
                             timeout=1).status_code == 200

        wait_for(up, 60, what="swerex-remote to answer")

    def runtime(self) -> RemoteRuntime:
        return RemoteRuntime(host="http://127.0.0.1", port=self.port, auth_token=self.token, timeout=0.15)

    def stop(self) -> None:
        with_pg = os.getpgid(self.proc.pid)
        os.killpg(with_pg, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(with_pg, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def swerex_remote(tmp_path: Path) -> Iterator[SwerexRemote]:
    if not shutil.which("unshare"):
        pytest.skip("util-linux's unshare is needed to give swerex-remote a private /root")
    srv = SwerexRemote(tmp_path)
    yield srv
    srv.stop()


async def probe(rt: Any) -> list[tuple[str, Any]]:
    """Requests whose answers depend only on SWE-ReX's semantics (not on the machine): (label, answer or the
    class name of what was raised)."""
    out: list[tuple[str, Any]] = []

    async def call(label: str, coro: Any) -> None:
        try:
            r = await coro
        except Exception as e:
            out.append((label, type(e).__name__))
            return
        if isinstance(r, BashObservation):
            out.append((label, (r.output, r.exit_code)))
        elif isinstance(r, CommandResponse):
            out.append((label, (r.stdout, r.stderr, r.exit_code)))
        else:
            out.append((label, type(r).__name__))

    def run(cmd: str, **kw: Any) -> Any:
        return rt.run_in_session(BashAction(command=cmd, session="probe", **{"timeout": 20, **kw}))

    await call("create", rt.create_session(CreateBashSessionRequest(session="probe")))
    await call("create again", rt.create_session(CreateBashSessionRequest(session="probe")))
    for cmd in ("", "   ", "\n\n", "# a comment", "# one\n# two", "echo visible  # and a comment"):
        await call(f"blank/comment {cmd!r}", run(cmd, check="silent"))
    await call("false", run("false", check="silent"))
    await call("$? carries over", run("echo $?", check="silent"))
    await call("empty keeps $?", run("(exit 4)", check="silent"))
    await call("empty after (exit 4)", run("", check="silent"))
    await call("ignored failure", run("(exit 5)", check="ignore"))
    await call("$? after an ignored command", run("echo $?", check="silent"))
    await call("ignored failure again", run("(exit 6)", check="ignore"))
    await call("empty after an ignored command", run("", check="silent"))
    await call("stderr folded", run("echo out; echo err >&2", check="silent"))
    await call("heredoc", run("cat <<'EOF'\nline1\n  line2\nEOF", check="silent"))
    await call("multi-line", run("V=1\necho v=$V\necho two", check="silent"))
    await call("state set", run("export Y=2 && cd /tmp && g() { echo fn-$1; }", check="silent"))
    await call("state read", run("echo $Y; pwd; g x", check="silent"))
    await call("check silent", run("(exit 3)", check="silent"))
    await call("check ignore", run("(exit 3)", check="ignore"))
    await call("check raise", run("(exit 3)", check="raise"))
    await call("syntax error", run("if then fi", check="silent"))
    await call("timeout", run("sleep 30", timeout=1, check="silent"))
    await call("interrupt", rt.run_in_session(BashInterruptAction(session="probe")))
    await call("$? after interrupt", run("echo $?", check="silent"))
    await call("after interrupt", run("echo after", check="silent"))
    await call("no such session", rt.run_in_session(BashAction(command="true", session="nope")))
    await call("execute", rt.execute(Command(command=["sh", "-c", "echo a; echo b >&2; exit 3"])))
    await call("execute shell env", rt.execute(Command(command="echo $V", shell=True, env={"V": "v1"})))
    await call("execute merged", rt.execute(Command(command=["sh", "-c", "echo a; echo b >&2"],
                                                    merge_output_streams=True)))
    await call("execute check", rt.execute(Command(command=["false"], check=True)))
    await call("execute missing", rt.execute(Command(command=["/no/such/program"])))
    await call("execute timeout", rt.execute(Command(command=["sleep", "30"], timeout=0.5)))
    await call("read missing", rt.read_file(ReadFileRequest(path="/root/no-such-file")))
    await rt.close()
    return out


def _clean(value: Any) -> Any:
    """An answer without the terminal's artifacts: SWE-ReX's server runs bash on a pty, whose bracketed-paste
    escapes leave `\r\r\n` around every output after its own `\r\n` -> `\n` pass (shoal's shell has no
    terminal, so its output is only what the command printed)."""
    if isinstance(value, tuple):
        return tuple(_clean(v) for v in value)
    return value.replace("\r\n", "") if isinstance(value, str) else value


def _comparable(entries: list[tuple[str, Any]]) -> dict[str, Any]:
    """The replay's answers that do not depend on the machine (its root listing, its PATH, git's object ids)."""
    host_specific = {"ls /", "echo $PATH", "create_session", "repository reset"}
    out: dict[str, Any] = {}
    for label, value in entries:
        if label in host_specific:
            value = value[1] if isinstance(value, tuple) else None  # the exit status still has to match
        out.setdefault(label, []).append(_clean(value))
    return out


async def test_sweagent_requests_answer_as_swerex_remote(api_server: ServerProcess, shoal_home: Path,
                                                        swerex_remote: SwerexRemote, tmp_path: Path) -> None:
    """The replay and the probes, against shoal and against SWE-ReX's own server: the same answers."""
    bundles = write_bundles(tmp_path / "tools")
    answers = {}
    sb = Sandbox(api_server, shoal_home)
    try:
        for name, rt in (("swerex-remote", swerex_remote.runtime()), ("shoal", sb.runtime())):
            made = await rt.execute(Command(command=repo_setup_command("/root/testbed"), shell=True))
            assert made.stdout.strip() == "made", (name, made)
            t = await replay(rt, repo="/root/testbed", bundles=bundles, execution_timeout=2)
            answers[name] = (_comparable(t.entries), await probe(rt))
    finally:
        sb.close()
    ref_replay, ref_probe = answers["swerex-remote"]
    got_replay, got_probe = answers["shoal"]
    rdiff = {k: (got_replay.get(k), v) for k, v in ref_replay.items() if got_replay.get(k) != v}
    assert not rdiff, "shoal vs swerex-remote:\n" + "\n".join(f"  {k}: {a!r}\n   != {b!r}"
                                                               for k, (a, b) in rdiff.items())
    # the interrupt's output is whatever the terminal showed (SWE-ReX's pty may echo ^C): compare its status
    norm = [(k, (v[1] if k == "interrupt" and isinstance(v, tuple) else _clean(v))) for k, v in ref_probe]
    got = [(k, (v[1] if k == "interrupt" and isinstance(v, tuple) else _clean(v))) for k, v in got_probe]
    assert [k for k, _ in got] == [k for k, _ in norm]
    diffs = [(k, a, b) for (k, a), (_, b) in zip(got, norm, strict=True) if a != b]
    assert not diffs, "shoal vs swerex-remote:\n" + "\n".join(f"  {k}: {a!r} != {b!r}" for k, a, b in diffs)
    assert re.search(r"CommandTimeoutError", str(dict(norm)["timeout"]))
