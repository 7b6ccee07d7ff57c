"""The wire form of shoal's data types, shared by the API server and `shoal.sdk.http` (no web imports).

Command output is bytes; JSON carries text. An ExecResult travels with `encoding: "utf-8"` when both
streams are valid UTF-8 (readable with curl) and `encoding: "base64"` otherwise, so the SDK always
gets the exact bytes back.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import json
from collections.abc import Iterator
from dataclasses import fields
from typing import Any

from shoal.errors import InvalidRequest
from shoal.models import DirEntry, ExecResult, SandboxInfo

#: WebSocket output frames start with one byte naming the stream
STDOUT_TAG, STDERR_TAG = 1, 2


def encode_exec_result(r: ExecResult) -> dict[str, Any]:
    """ExecResult → JSON object (bytes kept exact; see module doc)."""
    out, err = r.stdout, r.stderr
    ob = out if isinstance(out, bytes) else str(out).encode()
    eb = err if isinstance(err, bytes) else str(err).encode()
    try:
        so, se, enc = ob.decode("utf-8"), eb.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        so, se, enc = base64.b64encode(ob).decode(), base64.b64encode(eb).decode(), "base64"
    d: dict[str, Any] = {"exit_code": int(r.exit_code), "stdout": so, "stderr": se, "encoding": enc,
                         "duration_s": float(r.duration_s), "timed_out": bool(r.timed_out),
                         "truncated": bool(r.truncated), "signal": int(r.signal)}
    from shoal.agentproto.client import ShellResult

    if isinstance(r, ShellResult):  # a shell's result: whether the command ended the shell
        d["alive"] = bool(r.alive)
    return d


#: results with more output than this are sent as a stream of JSON pieces (iter_exec_result_json)
STREAM_JSON_ABOVE = 1 << 20
_PIECE = 3 << 18  # 768 KiB: a multiple of 3, so base64 pieces join without padding in between


def _is_utf8(b: bytes) -> bool:
    dec = codecs.getincrementaldecoder("utf-8")()
    try:
        for i in range(0, len(b), _PIECE):
            dec.decode(b[i:i + _PIECE])
        dec.decode(b"", final=True)
    except UnicodeDecodeError:
        return False
    return True


def _json_string(b: bytes, enc: str) -> Iterator[bytes]:
    yield b'"'
    if enc == "base64":
        for i in range(0, len(b), _PIECE):
            yield base64.b64encode(b[i:i + _PIECE])
    else:
        dec = codecs.getincrementaldecoder("utf-8")()
        for i in range(0, len(b), _PIECE):
            text = dec.decode(b[i:i + _PIECE], final=i + _PIECE >= len(b))
            yield json.dumps(text, ensure_ascii=False)[1:-1].encode()
    yield b'"'


def iter_exec_result_json(r: ExecResult) -> Iterator[bytes]:
    """The JSON of encode_exec_result(r), in pieces: the output is never copied whole into a str, a
    JSON text and its bytes (a 200 MiB result took ~700 MiB of the server that way)."""
    ob = r.stdout if isinstance(r.stdout, bytes) else str(r.stdout).encode()
    eb = r.stderr if isinstance(r.stderr, bytes) else str(r.stderr).encode()
    enc = "utf-8" if _is_utf8(ob) and _is_utf8(eb) else "base64"
    yield b'{"exit_code":%d,"stdout":' % int(r.exit_code)
    yield from _json_string(ob, enc)
    yield b',"stderr":'
    yield from _json_string(eb, enc)
    tail: dict[str, Any] = {"encoding": enc, "duration_s": float(r.duration_s), "timed_out": bool(r.timed_out),
                            "truncated": bool(r.truncated), "signal": int(r.signal)}
    from shoal.agentproto.client import ShellResult

    if isinstance(r, ShellResult):
        tail["alive"] = bool(r.alive)
    yield b"," + json.dumps(tail, separators=(",", ":")).encode()[1:]


def decode_exec_result(d: dict[str, Any]) -> ExecResult:
    """JSON object → ExecResult (a shell's result keeps its `alive` flag)."""
    enc = d.get("encoding", "utf-8")

    def dec(s: Any) -> bytes:
        s = s or ""
        return base64.b64decode(s) if enc == "base64" else str(s).encode("utf-8")

    kw = dict(exit_code=int(d.get("exit_code", -1)), stdout=dec(d.get("stdout")), stderr=dec(d.get("stderr")),
              duration_s=float(d.get("duration_s", 0.0)), timed_out=bool(d.get("timed_out", False)),
              truncated=bool(d.get("truncated", False)), signal=int(d.get("signal", 0)))
    if "alive" in d:
        from shoal.agentproto.client import ShellResult

        return ShellResult(**kw, alive=bool(d["alive"]))
    return ExecResult(**kw)


def encode_info(info: SandboxInfo) -> dict[str, Any]:
    """SandboxInfo → JSON object."""
    return info.to_dict()


def decode_info(d: dict[str, Any]) -> SandboxInfo:
    """JSON object → SandboxInfo (unknown keys from newer servers are ignored)."""
    known = {f.name for f in fields(SandboxInfo)}
    return SandboxInfo(**{k: v for k, v in d.items() if k in known})


def decode_dir_entry(d: dict[str, Any]) -> DirEntry:
    """JSON object → DirEntry."""
    known = {f.name for f in fields(DirEntry)}
    return DirEntry(**{k: v for k, v in d.items() if k in known})


def b64decode_field(value: str | None, name: str) -> bytes | None:
    """Decode a base64 request field, naming it when it is malformed."""
    if value is None:
        return None
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{name}: not valid base64", field=name) from None


def encode_run_code_result(r: Any) -> dict[str, Any]:
    """A fncall RunCodeResult → JSON object, with the run and compile output kept exact (as ExecResult)."""
    d = r.to_dict()
    d.update(encode_exec_result(r))
    d["compile"] = encode_exec_result(r.compile) if r.compile is not None else None
    return d


def decode_run_code_result(d: dict[str, Any]) -> Any:
    """JSON object → RunCodeResult (output as bytes, like the embedded client's)."""
    from shoal.models import RunCodeResult

    run = decode_exec_result(d)
    comp = d.get("compile")
    known = {f.name for f in fields(RunCodeResult)}
    kw = {k: v for k, v in d.items() if k in known and k not in ("compile", "files")}
    kw.update(exit_code=run.exit_code, stdout=run.stdout, stderr=run.stderr)
    kw["compile"] = decode_exec_result(comp) if isinstance(comp, dict) else None
    kw["files"] = {k: base64.b64decode(v) for k, v in (d.get("files") or {}).items()}
    return RunCodeResult(**kw)
