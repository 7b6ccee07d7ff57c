"""SandboxFusion compatibility, proven with SandboxFusion's own client (`sandbox-fusion` on PyPI) and with
verl's way of calling it, against `shoal fncall serve` (a real child process) and `shoal serve`."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import requests

from tests.waiting import wait_for

pytestmark = [pytest.mark.root]


class FusionServer:
    """`shoal fncall serve` in a child process on a free loopback port."""

    def __init__(self, log: Path) -> None:
        from shoal.server.proc import free_port

        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> None:
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "shoal.cli.main", "fncall", "serve", "--port", str(self.port),
                 "--warm", "python=1"], stdout=logf, stderr=logf, stdin=subprocess.DEVNULL)
        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"shoal fncall serve exited: {self.log.read_text()[-3000:]}")
            return httpx.get(self.url + "/openapi.json", timeout=1.0).status_code == 200

        try:
            wait_for(up, timeout, what="`shoal fncall serve` to answer")
        except BaseException:
            self.stop()
            raise RuntimeError(f"shoal fncall serve did not come up: {self.log.read_text()[-3000:]}") from None

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.pid


@pytest.fixture(scope="module")
def fusion(shoal_home: Path, base_image: str) -> Iterator[FusionServer]:
    from shoal.backends.fncall_pool import POOL_LABEL
    from shoal.records import list_records

    srv = FusionServer(shoal_home / "fusion-server.log")
    srv.start()
    yield srv
    pid = srv.stop()
    # the server closed its pools on the way out: no pooled container of it is left
    left = [r.id for r in list_records(Path(os.environ["SHOAL_HOME"]) / "sandboxes")
            if POOL_LABEL in r.labels and r.owner_pid == pid]
    assert left == [], f"shoal fncall serve left pooled containers behind: {left}"


@pytest.fixture
def sf(fusion: FusionServer):
    """SandboxFusion's client module, pointed at shoal."""
    import sandbox_fusion

    sandbox_fusion.set_endpoint(fusion.url)
    return sandbox_fusion


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_sandbox_fusion_client_runs_python(sf) -> None:
    r = sf.run_code(sf.RunCodeRequest(code="import sys\nprint(sys.stdin.read()[::-1])", language="python",
                                      stdin="abc"), max_attempts=1)
    assert r.status == sf.RunStatus.Success and r.message == ""
    assert r.compile_result is None
    assert r.run_result.status == sf.CommandRunStatus.Finished and r.run_result.return_code == 0
    assert r.run_result.stdout == "cba\n" and r.run_result.stderr == ""
    assert 0 < r.run_result.execution_time < 10
    assert sf.summary_run_code_result(r, sf.SummaryMapping()) == "Success"


def test_sandbox_fusion_client_compiled_languages_and_summaries(sf) -> None:
    mapping = sf.SummaryMapping(CompileFailed="CE", RunFailed="RE", RunTimeout="TLE")
    ok = sf.run_code(sf.RunCodeRequest(code="#include <iostream>\nint main(){int a,b; std::cin>>a>>b; "
                                            "std::cout<<a+b<<std::endl;}", language="cpp", stdin="2 40",
                                       compile_timeout=60), max_attempts=1)
    assert ok.status == sf.RunStatus.Success, ok
    assert ok.compile_result.status == sf.CommandRunStatus.Finished and ok.compile_result.return_code == 0
    assert ok.run_result.stdout == "42\n"
    ce = sf.run_code(sf.RunCodeRequest(code="int main() { return x; }", language="cpp", compile_timeout=60),
                     max_attempts=1)
    assert ce.status == sf.RunStatus.Failed and ce.run_result is None
    assert ce.compile_result.return_code != 0 and "error" in ce.compile_result.stderr
    assert sf.summary_run_code_result(ce, mapping) == "CE"
    re_ = sf.run_code(sf.RunCodeRequest(code="int main() { return 3; }", language="cpp", compile_timeout=60),
                      max_attempts=1)
    assert re_.status == sf.RunStatus.Failed and re_.run_result.return_code == 3
    assert sf.summary_run_code_result(re_, mapping) == "RE"
    sh = sf.run_code(sf.RunCodeRequest(code="echo $((6*7))", language="bash"), max_attempts=1)
    assert sh.status == sf.RunStatus.Success and sh.run_result.stdout == "42\n"
    tle = sf.run_code(sf.RunCodeRequest(code="while True: pass", language="python", run_timeout=1),
                      max_attempts=1)
    assert tle.status == sf.RunStatus.Failed
    assert tle.run_result.status == sf.CommandRunStatus.TimeLimitExceeded and tle.run_result.return_code is None
    assert sf.summary_run_code_result(tle, mapping) == "TLE"


def test_sandbox_fusion_client_files_in_and_out(sf) -> None:
    code = "data = open('in/data.txt').read()\nopen('out.txt', 'w').write(data.upper())\nprint(len(data))"
    r = sf.run_code(sf.RunCodeRequest(code=code, language="python", files={"in/data.txt": b64(b"hello")},
                                      fetch_files=["out.txt", "not-there.txt"]), max_attempts=1)
    assert r.status == sf.RunStatus.Success and r.run_result.stdout == "5\n"
    assert r.files == {"out.txt": b64(b"HELLO")}


async def test_sandbox_fusion_async_client(sf) -> None:
    r = await sf.run_code_async(sf.RunCodeRequest(code="print(sum(range(10)))", language="python"),
                                max_attempts=1)
    assert r.status == sf.RunStatus.Success and r.run_result.stdout == "45\n"


def test_verl_style_call(fusion: FusionServer) -> None:
    """How verl's sandbox_fusion reward utils call it: a raw JSON POST to <url>/run_code."""
    payload = json.dumps({"compile_timeout": 10, "run_timeout": 10, "memory_limit_MB": 512,
                          "code": "a, b = map(int, input().split())\nprint(a * b)", "stdin": "6 7",
                          "language": "python", "files": {}, "fetch_files": []})
    resp = requests.post(fusion.url + "/run_code", data=payload, timeout=60,
                         headers={"Content-Type": "application/json", "Accept": "application/json"})
    resp.raise_for_status()
    out = resp.json()
    assert out["status"] == "Success" and out["run_result"]["status"] == "Finished"
    assert out["run_result"]["stdout"].rstrip("\n") == "42" and out["run_result"]["return_code"] == 0


@pytest.mark.parametrize("body, words", [
    ({"code": "x" * (5 << 20), "language": "python"}, "code is"),
    ({"code": "print(1)", "language": "python", "files": {"a": "***"}}, "base64"),
    ({"code": "print(1)", "language": "python", "run_timeout": 0}, "positive"),
    ({"code": "print(1)", "language": "python", "files": {"/etc/x": b64(b"x")}}, "/etc/x"),
])
def test_bad_requests_are_sandbox_errors_not_server_errors(fusion: FusionServer, body: dict, words: str) -> None:
    resp = httpx.post(fusion.url + "/run_code", json=body, timeout=60)
    assert resp.status_code == 200
    out = resp.json()
    assert out["status"] == "SandboxError" and words in out["message"], out
    assert httpx.post(fusion.url + "/run_code", json={"language": "python"}, timeout=10).status_code == 422


def test_output_flood_and_fork_bomb_get_answers(fusion: FusionServer) -> None:
    flood = httpx.post(fusion.url + "/run_code", json={"code": "while True: print('y' * 1000)",
                                                       "language": "python", "run_timeout": 2}, timeout=60).json()
    assert flood["status"] == "Failed" and flood["run_result"]["status"] == "TimeLimitExceeded"
    assert len(flood["run_result"]["stdout"]) <= 4 << 20 and "truncated" in flood["message"]
    bomb = httpx.post(fusion.url + "/run_code", json={"code": ":(){ :|:& };:\nsleep 20", "language": "bash",
                                                      "run_timeout": 2}, timeout=60).json()
    assert bomb["status"] == "Failed" and bomb["run_result"]["status"] == "TimeLimitExceeded"
    after = httpx.post(fusion.url + "/run_code", json={"code": "print('ok')", "language": "python"},
                       timeout=60).json()
    assert after["status"] == "Success"


def test_run_code_many_endpoints(fusion: FusionServer) -> None:
    reqs = [{"code": f"print({i} + 1)", "language": "python"} for i in range(20)]
    reqs.append({"code": "x", "language": "cobol"})
    out = httpx.post(fusion.url + "/run_code_many", json={"requests": reqs}, timeout=120).json()["results"]
    assert [o["run_result"]["stdout"] for o in out[:20]] == [f"{i + 1}\n" for i in range(20)]
    assert out[20]["status"] == "SandboxError"
    native = httpx.post(fusion.url + "/v1/run_code_many", timeout=120,
                        json={"items": ["print(1)", {"code": "echo 2", "language": "bash"}], "timeout": 5}).json()
    from shoal.models import RunCodeResult

    rs = [RunCodeResult.from_dict(d) for d in native["results"]]
    assert [(r.status, r.stdout) for r in rs] == [("success", "1\n"), ("success", "2\n")]
    stats = httpx.get(fusion.url + "/v1/fncall/stats", timeout=10).json()
    assert stats["calls"] >= 23 and stats["pools"]


def test_shoal_serve_includes_run_code(api_server) -> None:
    """`shoal serve` carries the same /run_code, behind its token check."""
    body = {"code": "print('via shoal serve')", "language": "python"}
    denied = httpx.post(api_server.url + "/run_code", json=body, timeout=60)
    assert denied.status_code == 401
    ok = httpx.post(api_server.url + "/run_code", json=body, timeout=120,
                    headers={"Authorization": f"Bearer {api_server.token}"})
    assert ok.status_code == 200 and ok.json()["run_result"]["stdout"] == "via shoal serve\n"


def test_sync_client_run_code(shoal_home: Path, base_image: str) -> None:
    import shoal

    with shoal.SyncClient() as client:
        r = client.run_code("print('sync')")
        assert r.stdout == b"sync\n"
        assert [x.status for x in client.run_code_many(["exit(0)", "exit(1)"])] == ["success", "failed"]
