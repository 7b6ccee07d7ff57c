"""fncall pieces that need no container: languages, request validation, the worker's framing, result
mapping, and the SandboxFusion translation. (The real thing runs in tests/integration/test_fncall*.py.)"""

from __future__ import annotations

import base64
import os
import sys

import pytest

from shoal.backends import fncall_worker
from shoal.backends.fncall import FncallConfig, FncallManager, container_memory_mb
from shoal.backends.fncall_languages import LANGUAGES, get_language, supported
from shoal.backends.fncall_pool import MessageDecoder, encode_message
from shoal.errors import InvalidRequest
from shoal.models import ExecResult, RunCodeResult


def mgr(**kw: object) -> FncallManager:
    return FncallManager(node=None, config=FncallConfig(**kw))  # type: ignore[arg-type]


def build(code: object = "print(1)", lang: str = "python", **kw: object):
    args = {"stdin": None, "timeout": None, "compile_timeout": None, "memory_mb": None, "files": None,
            "fetch_files": None, "env": None, "args": None, "max_output": None}
    args.update(kw)
    return mgr()._request(code, get_language(lang), **args)


# ---- languages -----------------------------------------------------------------------------------------------
def test_languages_and_aliases() -> None:
    assert {"python", "bash", "c", "cpp"} <= set(supported())
    assert get_language("python3").name == "python"
    assert get_language(" C++ ").name == "cpp"
    assert get_language("cpp").compile is not None and get_language("python").compile is None
    assert get_language("python").mode == "python"
    for lang in LANGUAGES.values():
        assert lang.tools, lang.name


@pytest.mark.parametrize("name", ["cobol", "", "php", 3])
def test_unknown_language_names_the_supported_ones(name: object) -> None:
    with pytest.raises(InvalidRequest) as e:
        get_language(name)  # type: ignore[arg-type]
    assert "python" in e.value.message or "string" in e.value.message


# ---- request validation --------------------------------------------------------------------------------------
def test_request_shape_for_compiled_language() -> None:
    hdr, blobs, deadline = build("int main(){}", "cpp", stdin="in", timeout=3, compile_timeout=7,
                                 files={"d/x.txt": b"\x00\x01"}, fetch_files=["out"], env={"A": "1"},
                                 args=["-v"])
    assert [s["name"] for s in hdr["steps"]] == ["compile", "run"]
    assert hdr["steps"][0]["timeout"] == 7 and hdr["steps"][1]["timeout"] == 3
    assert hdr["steps"][1]["argv"] == ["./main", "-v"]
    assert hdr["steps"][0]["memory_mb"] is None and hdr["steps"][1]["memory_mb"] == 1024
    assert hdr["has_stdin"] and hdr["fetch"] == ["out"] and hdr["env"] == {"A": "1"}
    assert blobs == [b"int main(){}", b"in", b"\x00\x01"]
    assert hdr["files"] == [{"path": "d/x.txt", "mode": 0o644}]
    assert deadline > 10


def test_python_request_runs_in_the_warm_interpreter() -> None:
    hdr, blobs, _ = build("print(1)", "python")
    (run,) = hdr["steps"]
    assert run["mode"] == "python" and run["file"] == "/sandbox/main.py"
    assert not hdr["has_stdin"] and blobs[1] == b""


@pytest.mark.parametrize("kw, word", [
    ({"timeout": 0}, "timeout"), ({"timeout": -1}, "timeout"), ({"timeout": 10_000}, "timeout"),
    ({"timeout": "soon"}, "timeout"), ({"compile_timeout": 0}, "compile_timeout"),
    ({"memory_mb": 8}, "memory_mb"), ({"memory_mb": 1.5}, "memory_mb"), ({"memory_mb": True}, "memory_mb"),
    ({"files": ["a"]}, "files"), ({"files": {"": "x"}}, "path"), ({"files": {"a": 3}}, "files"),
    ({"fetch_files": "out.txt"}, "fetch_files"), ({"env": {"A=B": "1"}}, "env"), ({"env": {"A": 1}}, "env"),
    ({"args": "x"}, "args"), ({"max_output": 0}, "max_output"), ({"stdin": 5}, "stdin"),
])
def test_bad_requests_are_rejected_with_the_field_named(kw: dict, word: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        build(**kw)
    assert word in e.value.message


def test_oversized_inputs_are_rejected() -> None:
    m = mgr(max_code_bytes=100, max_stdin_bytes=10, max_files_bytes=10)
    lang = get_language("python")
    base = {"stdin": None, "timeout": None, "compile_timeout": None, "memory_mb": None, "files": None,
            "fetch_files": None, "env": None, "args": None, "max_output": None}
    with pytest.raises(InvalidRequest, match="code is 101 bytes"):
        m._request("x" * 101, lang, **base)
    with pytest.raises(InvalidRequest, match="stdin"):
        m._request("x", lang, **{**base, "stdin": "y" * 11})
    with pytest.raises(InvalidRequest, match="files hold"):
        m._request("x", lang, **{**base, "files": {"a": "123456", "b": "123456"}})
    with pytest.raises(InvalidRequest, match="code must be str or bytes"):
        m._request(None, lang, **base)


def test_container_memory_leaves_room_for_the_worker() -> None:
    assert container_memory_mb(1024) == 1280
    assert container_memory_mb(16) == 256
    assert container_memory_mb(1000) == 1280
    assert all(container_memory_mb(m) >= m + 128 for m in (16, 100, 512, 4000, 65536))


# ---- framing (the same on both sides of the agent) -----------------------------------------------------------
def test_messages_roundtrip_through_a_pipe_and_the_incremental_decoder() -> None:
    import threading

    r, w = os.pipe()
    # bigger than a pipe buffer: the writer blocks until the reader drains it
    t = threading.Thread(target=lambda: (fncall_worker.write_message(w, {"op": "x", "n": 1},
                                                                     [b"abc", b"", b"\x00" * 70000]), os.close(w)))
    t.start()
    data = b""
    while chunk := os.read(r, 1 << 20):
        data += chunk
    t.join()
    dec = MessageDecoder()
    out = []
    for i in range(0, len(data), 777):  # any chunking
        out += dec.feed(data[i:i + 777])
    assert len(out) == 1
    hdr, blobs = out[0]
    assert hdr["op"] == "x" and blobs == [b"abc", b"", b"\x00" * 70000]
    os.close(r)


def test_worker_reads_what_the_host_encodes() -> None:
    r, w = os.pipe()
    msg = encode_message({"op": "run", "id": 7}, [b"code", b"stdin"]) + encode_message({"op": "ping"})
    os.write(w, msg)
    os.close(w)
    assert fncall_worker.read_message(r) == ({"op": "run", "id": 7, "blobs": [4, 5]}, [b"code", b"stdin"])
    assert fncall_worker.read_message(r)[0]["op"] == "ping"
    assert fncall_worker.read_message(r) is None  # EOF
    os.close(r)


def test_worker_refuses_to_run_outside_a_shoal_sandbox() -> None:
    import subprocess

    from shoal.backends.fncall_pool import bootstrap_argv

    # on a host (or in CI), PID 1 is not shoal-agent: the worker must exit at once and kill nothing
    argv, boot = bootstrap_argv({"preload": ["json"]})
    p = subprocess.run([sys.executable, *argv[1:]], input=boot, capture_output=True, timeout=30)
    assert p.returncode == 2 and b"refusing" in p.stderr


# ---- results -------------------------------------------------------------------------------------------------
def step(name: str, rc: int = 0, **kw: object) -> dict:
    d = {"name": name, "exit_code": rc, "signal": 0, "timed_out": False, "truncated": False,
         "duration_ms": 12.0, "cpu_ms": 3.0, "maxrss_kb": 9000}
    d.update(kw)
    return d


@pytest.mark.parametrize("steps, error, status", [
    ([step("run")], None, "success"),
    ([step("run", 1)], None, "failed"),
    ([step("run", 137, signal=9)], None, "failed"),
    ([step("run", 137, signal=9, timed_out=True)], None, "timeout"),
    ([step("compile", 1)], None, "compile_error"),
    ([step("compile", 137, timed_out=True)], None, "compile_timeout"),
    ([step("compile"), step("run", 3)], None, "failed"),
    ([step("compile"), step("run")], None, "success"),
    ([], "cannot write file /etc/x: Permission denied", "error"),
    ([step("run", -1, spawn_error="fork failed: Resource temporarily unavailable")], None, "error"),
])
def test_result_status(steps: list, error: str | None, status: str) -> None:
    lang = get_language("cpp" if any(s["name"] == "compile" for s in steps) else "python")
    blobs = [b"out", b"err"] * len(steps) + [b"F"]
    resp = {"steps": steps, "error": error, "files": ["f.txt"] if steps else []}
    r = FncallManager._result(resp, blobs, lang, "sb")
    assert r.status == status
    assert r.ok == (status == "success")
    if status in ("compile_error", "compile_timeout"):
        assert r.compile is not None and r.compile.stderr == b"err" and r.stdout == b""
    if steps and steps[-1]["name"] == "run" and not steps[-1].get("spawn_error"):
        assert r.stdout == b"out" and r.cpu_time_s == 0.003 and r.max_rss_kb == 9000
        assert r.files == {"f.txt": b"F"}


def test_run_code_result_dict_roundtrip() -> None:
    r = RunCodeResult(exit_code=1, stdout=b"o\xff", stderr=b"e", status="failed", language="cpp",
                      compile=ExecResult(0, b"", b"warning"), files={"bin": b"\x00\x01"}, cpu_time_s=0.5)
    d = r.to_dict()
    assert d["stdout"] == "o\ufffd" and d["files"] == {"bin": "AAE="} and d["compile"]["stderr"] == "warning"
    back = RunCodeResult.from_dict(d)
    assert back.status == "failed" and back.files == {"bin": b"\x00\x01"} and back.compile.stderr == "warning"
    assert not back.ok and r.text().stdout == "o\ufffd"


# ---- SandboxFusion translation -------------------------------------------------------------------------------
def test_fusion_response_shapes() -> None:
    from shoal.server.fusion import RunStatus, fusion_response

    ok = fusion_response(RunCodeResult(exit_code=0, stdout=b"4\n", status="success", duration_s=0.01,
                                       cpu_time_s=0.002, files={"o": b"x"}, sandbox_id="n0-x"))
    assert ok.status == RunStatus.Success and ok.run_result.return_code == 0 and ok.run_result.stdout == "4\n"
    assert ok.compile_result is None and ok.files == {"o": "eA=="} and ok.message == ""
    tle = fusion_response(RunCodeResult(exit_code=137, signal=9, timed_out=True, status="timeout"))
    assert tle.status == RunStatus.Failed and tle.run_result.status == "TimeLimitExceeded"
    assert tle.run_result.return_code is None
    killed = fusion_response(RunCodeResult(exit_code=137, signal=9, status="failed"))
    assert killed.run_result.return_code == -9 and killed.run_result.status == "Finished"
    ce = fusion_response(RunCodeResult(exit_code=-1, status="compile_error",
                                       compile=ExecResult(1, b"", b"error: x")))
    assert ce.status == RunStatus.Failed and ce.run_result is None and ce.compile_result.return_code == 1
    err = fusion_response(RunCodeResult(exit_code=-1, status="error", error="container died"))
    assert err.status == RunStatus.SandboxError and "died" in err.message


def test_fusion_request_translation() -> None:
    from shoal.server.fusion import RunCodeRequest, _kwargs

    kw = _kwargs(RunCodeRequest(code="c", language="python", files={"a": base64.b64encode(b"A").decode(),
                                                                     "skip": None}, memory_limit_MB=-1))
    assert kw["files"] == {"a": b"A"} and kw["memory_mb"] is None and kw["timeout"] == 10
    with pytest.raises(InvalidRequest, match="base64"):
        _kwargs(RunCodeRequest(code="c", language="python", files={"a": "!!"}))
    with pytest.raises(InvalidRequest, match="positive"):
        _kwargs(RunCodeRequest(code="c", language="python", run_timeout=0))
