"""The wire form of command results: bytes survive JSON exactly, text stays readable."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from shoal.agentproto.client import ShellResult
from shoal.errors import ERRORS_BY_CODE, CapacityExceeded, InvalidRequest, QuotaExceeded, error_from_dict
from shoal.models import ExecResult
from shoal.server.codec import decode_exec_result, encode_exec_result


@given(out=st.binary(max_size=200), err=st.binary(max_size=200), code=st.integers(-1, 255),
       timed_out=st.booleans(), truncated=st.booleans())
def test_exec_result_round_trip_keeps_bytes(out: bytes, err: bytes, code: int, timed_out: bool,
                                            truncated: bool) -> None:
    r = ExecResult(exit_code=code, stdout=out, stderr=err, duration_s=0.5, timed_out=timed_out, truncated=truncated)
    wire = json.loads(json.dumps(encode_exec_result(r)))
    back = decode_exec_result(wire)
    assert back == r
    try:
        out.decode(), err.decode()
        assert wire["encoding"] == "utf-8" and wire["stdout"] == out.decode()
    except UnicodeDecodeError:
        assert wire["encoding"] == "base64"


def test_shell_result_keeps_alive_flag() -> None:
    r = ShellResult(exit_code=0, stdout=b"x", alive=False)
    back = decode_exec_result(encode_exec_result(r))
    assert isinstance(back, ShellResult) and back.alive is False


def test_errors_rebuild_typed() -> None:
    e = error_from_dict(CapacityExceeded("full", retry_after_s=2.5, limit_mb=10).to_dict())
    assert isinstance(e, CapacityExceeded) and e.retry_after_s == 2.5 and e.details["limit_mb"] == 10
    q = error_from_dict(QuotaExceeded("over", limit=3, used=3).to_dict())
    assert isinstance(q, QuotaExceeded) and q.details == {"limit": 3, "used": 3}
    assert isinstance(error_from_dict({"code": "invalid_request", "message": "m"}), InvalidRequest)
    assert "forbidden" in ERRORS_BY_CODE
