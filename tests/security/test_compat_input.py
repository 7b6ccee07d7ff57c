"""Item 9 of issue 23: client input to the compat APIs gets the protocol's own error, never a 500.

The attack run found 500s ("internal error (AttributeError)" and the like) for envd `SendSignal
{"process": "zzz"}`, `SendInput {"process": 5}`, `Update {"process": "x"}`, `Start` with a string `process` or
`pty` and rows `"zz"`, the interpreter's `context_id: {}`, and a corrupt zip uploaded to SWE-ReX ("internal
error (BadZipFile)"). Each now answers as its protocol answers bad input: Connect's `invalid_argument`
(HTTP 400 for unary calls, the end-of-stream error for streams), the interpreter's 400, SWE-ReX's transferred
ValueError (its server answers every exception as HTTP 511 with the exception's class, which its client
raises again).

Then a small Connect-RPC fuzzer for envd: for every method, messages built from a valid one with fields
replaced by values of every JSON type (and fields dropped or added), a bounded number per method (the seed is
printed; `SHOAL_FUZZ_SEED` replays it). It fails on any 5xx and on any `internal`/`unknown` Connect code.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import secrets
import struct
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from shoal.server.proc import ServerProcess
from shoal.server.tokens import TokenStore

pytestmark = [pytest.mark.root, pytest.mark.timeout(600)]
#: the fuzzer's budget: messages per method, and a wall-clock cap for all of them (a slow machine does less)
CASES_PER_METHOD = 25
BUDGET_S = 40.0


@pytest.fixture(scope="module")
def e2b(api_server: ServerProcess, shoal_home: Path) -> Iterator[dict[str, Any]]:
    """A sandbox made through E2B's REST API with a fresh project's key; its envd headers."""
    key = TokenStore(shoal_home).create(f"inp-{secrets.token_hex(3)}", name="compat input")
    h = httpx.Client(base_url=api_server.url, timeout=120)
    r = h.post("/sandboxes", json={"templateID": "base", "timeout": 600}, headers={"X-API-Key": key})
    assert r.status_code == 201, r.text
    sb = r.json()
    envd = {"E2b-Sandbox-Id": sb["sandboxID"], "X-Access-Token": sb["envdAccessToken"]}
    try:
        yield {"h": h, "key": key, "sid": sb["sandboxID"], "envd": envd, "url": api_server.url}
    finally:
        h.delete(f"/sandboxes/{sb['sandboxID']}", headers={"X-API-Key": key})
        h.close()


def unary(e2b: dict, method: str, msg: Any) -> httpx.Response:
    return e2b["h"].post(f"/{method}", content=json.dumps(msg),
                         headers={**e2b["envd"], "Content-Type": "application/json"})


def stream(e2b: dict, method: str, msg: Any, timeout_ms: int = 3000) -> tuple[int, list[tuple[int, Any]]]:
    """(HTTP status, [(flags, message)]) of a server-streaming call, read for at most timeout_ms + 2 s: a
    stream that is still open then (a watch, a process that runs on) is left with the frames it sent."""
    data = json.dumps(msg).encode()
    frames: list[tuple[int, Any]] = []
    body = b""
    stop = time.monotonic() + timeout_ms / 1000 + 2
    with e2b["h"].stream("POST", f"/{method}", content=struct.pack(">BI", 0, len(data)) + data,
                         headers={**e2b["envd"], "Content-Type": "application/connect+json",
                                  "Connect-Timeout-Ms": str(timeout_ms)}, timeout=timeout_ms / 1000 + 2) as r:
        with contextlib.suppress(httpx.ReadTimeout):
            for chunk in r.iter_raw():
                body += chunk
                while len(body) >= 5 and len(body) >= 5 + struct.unpack(">BI", body[:5])[1]:
                    flags, n = struct.unpack(">BI", body[:5])
                    frames.append((flags, json.loads(body[5:5 + n] or b"{}")))
                    body = body[5 + n:]
                if time.monotonic() > stop:
                    break
        return r.status_code, frames


def end_error(frames: list[tuple[int, Any]]) -> dict | None:
    assert frames and frames[-1][0] & 2, frames  # a stream always ends with its end-of-stream frame
    return frames[-1][1].get("error")


@pytest.mark.parametrize("method,msg", [
    ("process.Process/SendSignal", {"process": "zzz", "signal": "SIGNAL_SIGKILL"}),
    ("process.Process/SendSignal", {"process": {"pid": "zz"}, "signal": "SIGNAL_SIGKILL"}),
    ("process.Process/SendSignal", {"process": {"pid": 1}, "signal": {}}),
    ("process.Process/SendInput", {"process": 5, "input": {"stdin": "aGk="}}),
    ("process.Process/SendInput", {"process": {"pid": 1}, "input": "hi"}),
    ("process.Process/Update", {"process": "x", "pty": {"size": {"rows": 10, "cols": 10}}}),
    ("process.Process/Update", {"process": {"pid": 1}, "pty": "big"}),
    ("process.Process/CloseStdin", {"process": []}),
])
def test_envd_unary_bad_input_is_invalid_argument(e2b: dict, method: str, msg: dict) -> None:
    r = unary(e2b, method, msg)
    assert r.status_code == 400, (r.status_code, r.text)
    assert r.json()["code"] == "invalid_argument", r.text


@pytest.mark.parametrize("msg", [
    {"process": "ls"},
    {"process": {"cmd": "/bin/echo"}, "pty": "yes"},
    {"process": {"cmd": "/bin/echo"}, "pty": {"size": {"rows": "zz", "cols": 80}}},
    {"process": {"cmd": "/bin/echo"}, "pty": {"size": "24x80"}},
    {"process": {"cmd": "/bin/echo", "cwd": 5}},
    {"process": {"cmd": "/bin/echo"}, "tag": ["t"]},
])
def test_envd_start_bad_input_ends_the_stream_with_invalid_argument(e2b: dict, msg: dict) -> None:
    status, frames = stream(e2b, "process.Process/Start", msg)
    assert status == 200  # Connect streams carry their error in the end-of-stream frame
    err = end_error(frames)
    assert err is not None and err["code"] == "invalid_argument", frames


def test_envd_start_still_runs_a_pty_sized_as_protojson_writes_it(e2b: dict) -> None:
    # uint32 fields may come as strings of digits (protojson); a good message still works
    status, frames = stream(e2b, "process.Process/Start", {"process": {"cmd": "/bin/sh", "args": ["-c", "stty size"]},
                                                           "pty": {"size": {"rows": "30", "cols": 100}}})
    assert status == 200 and end_error(frames) is None, frames
    import base64

    out = b"".join(base64.b64decode(f[1]["event"]["data"]["pty"]) for f in frames
                   if "data" in f[1].get("event", {}) and "pty" in f[1]["event"]["data"])
    assert b"30 100" in out, out


def test_interpreter_context_id_of_the_wrong_type_is_400(e2b: dict) -> None:
    for cid in ({}, [], 5):
        r = e2b["h"].post("/execute", json={"code": "1", "context_id": cid},
                          headers={**e2b["envd"], "E2b-Sandbox-Port": "49999"})
        assert r.status_code == 400 and "context_id" in r.text, (cid, r.status_code, r.text)


def test_a_corrupt_zip_is_swerex_value_error(e2b: dict) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("a.txt", b"x" * 100_000)
    good = bytearray(buf.getvalue())
    good[60:70] = b"\xff" * 10  # inside a.txt's compressed data: the archive opens, the member does not inflate
    for data, what in ((bytes(good), "corrupt member"), (b"PK\x03\x04 not really", "not a zip")):
        r = e2b["h"].post(f"/swerex/{e2b['sid']}/upload", headers={"X-API-Key": e2b["key"]},
                          files={"file": ("t.zip", data, "application/zip")},
                          data={"target_path": "/tmp/z", "unzip": "true"})
        exc = r.json().get("swerexception") or {}
        assert r.status_code == 511 and exc.get("class_path") == "builtins.ValueError", (what, r.text)
        assert "internal error" not in exc.get("message", ""), r.text


# ---- the Connect-RPC fuzzer -----------------------------------------------------------------------------------
#: a valid message per method (paths under /tmp/fz, pids of processes that do not exist or just ended)
SEEDS: dict[str, dict[str, Any]] = {
    "process.Process/Start": {"process": {"cmd": "/bin/echo", "args": ["x"], "envs": {"A": "1"}, "cwd": "/tmp"},
                              "pty": {"size": {"rows": 24, "cols": 80}}, "tag": "t", "stdin": False},
    "process.Process/Connect": {"process": {"pid": 1}},
    "process.Process/List": {},
    "process.Process/SendInput": {"process": {"pid": 1}, "input": {"stdin": "aGk="}},
    "process.Process/CloseStdin": {"process": {"tag": "t"}},
    "process.Process/SendSignal": {"process": {"pid": 1}, "signal": "SIGNAL_SIGTERM"},
    "process.Process/Update": {"process": {"pid": 1}, "pty": {"size": {"rows": 24, "cols": 80}}},
    "filesystem.Filesystem/Stat": {"path": "/tmp"},
    "filesystem.Filesystem/ListDir": {"path": "/tmp", "depth": 2},
    "filesystem.Filesystem/MakeDir": {"path": "/tmp/fz/d"},
    "filesystem.Filesystem/Remove": {"path": "/tmp/fz/d"},
    "filesystem.Filesystem/Move": {"source": "/tmp/fz/a", "destination": "/tmp/fz/b"},
    "filesystem.Filesystem/WatchDir": {"path": "/tmp", "recursive": False},
    "filesystem.Filesystem/CreateWatcher": {"path": "/tmp", "recursive": False},
    "filesystem.Filesystem/GetWatcherEvents": {"watcherId": "w"},
    "filesystem.Filesystem/RemoveWatcher": {"watcherId": "w"},
}
STREAMS = {"process.Process/Start", "process.Process/Connect", "filesystem.Filesystem/WatchDir"}
BAD_CODES = {"internal", "unknown", "data_loss"}


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value of any type, weighted toward the edges (empty, huge, negative, wrong nesting)."""
    kinds = ["null", "bool", "int", "bigint", "float", "str", "path", "list", "dict"]
    kind = rng.choice(kinds if depth < 2 else kinds[:7])
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, -1, 2, 24, 65535, 65536, rng.randint(-10**6, 10**6)])
    if kind == "bigint":
        return rng.choice([2**31, 2**63, -(2**63), 10**30])
    if kind == "float":
        return rng.choice([0.5, -1.5, 1e308, 3.0])
    if kind == "str":
        return rng.choice(["", "zz", "0", "-1", "30", "SIGNAL_SIGKILL", "\u0000", "é" * 50, "x" * 5000, "aGk="])
    if kind == "path":
        return rng.choice(["/", "/tmp/fz", "..", "../../etc", "/proc/self/mem", "/tmp/fz/" + "n" * 300, "rel/x"])
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["pid", "tag", "size", "rows", "cols", "cmd", "stdin", "pty", "x"]): random_value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def mutate(rng: random.Random, msg: Any, depth: int = 0) -> Any:
    """A copy of `msg` with one to three changes at any depth: a value replaced, a field dropped or added."""
    if not isinstance(msg, dict) or depth > 3:
        return random_value(rng)
    out = dict(msg)
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        if out and op < 0.6:
            k = rng.choice(list(out))
            out[k] = mutate(rng, out[k], depth + 1) if rng.random() < 0.5 else random_value(rng)
        elif out and op < 0.8:
            out.pop(rng.choice(list(out)))
        else:
            out[rng.choice(["process", "pty", "size", "input", "path", "signal", "depth", "zz"])] = random_value(rng)
    return out


def test_envd_connect_rpc_fuzz(e2b: dict) -> None:
    seed = int(os.environ.get("SHOAL_FUZZ_SEED") or secrets.randbelow(2**32))
    rng = random.Random(seed)
    unary(e2b, "filesystem.Filesystem/MakeDir", {"path": "/tmp/fz"})
    failures: list[str] = []
    sent = 0
    deadline = time.monotonic() + BUDGET_S
    for i in range(CASES_PER_METHOD):
        for method, good in SEEDS.items():
            if time.monotonic() > deadline:
                break
            msg = mutate(rng, good) if i else good
            if rng.random() < 0.05:
                msg = random_value(rng)  # not even an object
            sent += 1
            if method in STREAMS:
                status, frames = stream(e2b, method, msg, timeout_ms=1500)
                # a stream still open after its deadline (a watch) is fine; one that ended says how
                err = frames[-1][1].get("error") if frames and frames[-1][0] & 2 else None
                if status >= 500 or (err and err.get("code") in BAD_CODES):
                    failures.append(f"{method} {json.dumps(msg)[:300]} -> {status} {err}")
            else:
                r = unary(e2b, method, msg)
                code = r.json().get("code") if r.headers.get("content-type", "").startswith("application/json") \
                    and r.status_code != 200 else None
                if r.status_code >= 500 or code in BAD_CODES:
                    failures.append(f"{method} {json.dumps(msg)[:300]} -> {r.status_code} {r.text[:300]}")
    print(f"envd fuzz: seed {seed}, {sent} messages, {len(failures)} failures")
    assert sent >= len(SEEDS), "the budget did not cover every method once"
    assert not failures, f"seed {seed}:\n" + "\n".join(failures[:20])
