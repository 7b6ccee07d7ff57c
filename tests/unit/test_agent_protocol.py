"""Pure framing of the agent protocol: encoding, incremental decoding, garbage, error mapping."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.agentproto import frames as F
from shoal.agentproto.client import agent_error
from shoal.errors import (
    AgentProtocolError,
    FileNotFound,
    InvalidRequest,
    SandboxError,
    SandboxFileError,
    ShellNotFound,
    Unauthorized,
)

frame_st = st.builds(
    F.Frame,
    type=st.integers(0, 255),
    stream=st.integers(0, 2**32 - 1),
    payload=st.binary(max_size=2048),
)


def test_header_layout_is_big_endian_length_type_stream() -> None:
    raw = F.encode_frame(F.REQ, 7, b"{}")
    assert raw == b"\x00\x00\x00\x07" + b"\x01" + b"\x00\x00\x00\x07" + b"{}"
    assert F.HEADER_SIZE == 9


def test_smallest_frame_has_length_5() -> None:
    assert F.encode_frame(F.STDIN_EOF, 1)[:4] == struct.pack(">I", 5)
    assert F.FrameDecoder().feed(F.encode_frame(F.STDIN_EOF, 1)) == [F.Frame(F.STDIN_EOF, 1, b"")]


@given(st.lists(frame_st, max_size=20))
def test_encode_decode_round_trip(frames: list[F.Frame]) -> None:
    raw = b"".join(F.encode_frame(*f) for f in frames)
    assert F.FrameDecoder().feed(raw) == frames


@given(st.lists(frame_st, min_size=1, max_size=10), st.data())
def test_decode_is_independent_of_chunking(frames: list[F.Frame], data: st.DataObject) -> None:
    raw = b"".join(F.encode_frame(*f) for f in frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12)))
    dec = F.FrameDecoder()
    out: list[F.Frame] = []
    prev = 0
    for c in [*cuts, len(raw)]:
        out += dec.feed(raw[prev:c])
        prev = c
    assert out == frames
    assert dec.buffered == 0


@settings(max_examples=300)
@given(st.binary(max_size=4096))
def test_garbage_never_crashes_and_never_buffers_past_a_frame(junk: bytes) -> None:
    dec = F.FrameDecoder(max_payload=1024)
    try:
        frames = dec.feed(junk)
    except AgentProtocolError:
        with pytest.raises(AgentProtocolError):
            dec.feed(b"more")
        return
    for f in frames:
        assert 0 <= f.type <= 255
        assert len(f.payload) <= 1024
    # What stays buffered is at most one incomplete frame.
    assert dec.buffered < F.HEADER_SIZE + 1024


@pytest.mark.parametrize("length", [0, 1, 4, F.MAX_PAYLOAD + 6, 0xFFFFFFFF])
def test_bad_lengths_are_protocol_errors(length: int) -> None:
    with pytest.raises(AgentProtocolError):
        F.FrameDecoder().feed(struct.pack(">IBI", length, 2, 1) + b"x" * 16)


def test_frames_before_a_bad_length_are_delivered_then_the_decoder_fails() -> None:
    good = F.encode_frame(F.RESP, 3, b"{}")
    dec = F.FrameDecoder()
    assert dec.feed(good + struct.pack(">IBI", 2, 2, 1)) == [F.Frame(F.RESP, 3, b"{}")]
    with pytest.raises(AgentProtocolError):
        dec.feed(b"")


def test_largest_payload_is_accepted_and_one_more_byte_is_not() -> None:
    big = b"a" * F.MAX_PAYLOAD
    assert F.FrameDecoder().feed(F.encode_frame(F.DATA, 1, big))[0].payload == big
    with pytest.raises(ValueError):
        F.encode_frame(F.DATA, 1, big + b"a")


@pytest.mark.parametrize("args", [(256, 1), (-1, 1), (1, 2**32), (1, -1)])
def test_encode_rejects_out_of_range_fields(args: tuple[int, int]) -> None:
    with pytest.raises(ValueError):
        F.encode_frame(args[0], args[1], b"")


def test_request_omits_none_fields() -> None:
    raw = F.encode_request(5, "exec", argv=["true"], cwd=None, timeout_ms=0)
    (fr,) = F.FrameDecoder().feed(raw)
    assert fr.type == F.REQ and fr.stream == 5
    assert json.loads(fr.payload) == {"op": "exec", "argv": ["true"], "timeout_ms": 0}


@given(st.binary(max_size=64))
def test_json_strings_carry_arbitrary_bytes_as_surrogate_escapes(name: bytes) -> None:
    # How a non-UTF-8 file name travels: Python str with lone surrogates <-> \udcXX escapes.
    s = name.decode("utf-8", "surrogateescape")
    payload = F.encode_json({"path": s})
    assert payload.isascii()
    assert F.decode_json(payload)["path"].encode("utf-8", "surrogateescape") == name


def test_agent_style_escape_of_an_invalid_byte_decodes_to_that_byte() -> None:
    # The agent writes byte 0xff of a file name as \udcff.
    obj = F.decode_json(b'{"name":"a\\udcffb"}')
    assert obj["name"].encode("utf-8", "surrogateescape") == b"a\xffb"


@pytest.mark.parametrize("payload", [b"[1,2]", b"not json", b"\xff\xfe", b'"str"'])
def test_decode_json_rejects_non_objects(payload: bytes) -> None:
    with pytest.raises(AgentProtocolError):
        F.decode_json(payload)


def test_signal_and_resize_payloads() -> None:
    (s,) = F.FrameDecoder().feed(F.encode_signal(9, 15))
    assert (s.type, s.stream, s.payload) == (F.SIGNAL, 9, b"\x00\x00\x00\x0f")
    (r,) = F.FrameDecoder().feed(F.encode_resize(9, 50, 132))
    assert (r.type, struct.unpack(">HH", r.payload)) == (F.RESIZE, (50, 132))


@pytest.mark.parametrize(
    ("op", "code", "cls"),
    [
        ("read_file", "not_found", FileNotFound),
        ("stat", "not_found", FileNotFound),
        ("read_file", "is_a_directory", SandboxFileError),
        ("write_file", "permission_denied", SandboxFileError),
        ("remove", "io_error", SandboxFileError),
        ("exec", "not_found", InvalidRequest),  # a missing cwd
        ("exec", "not_a_directory", InvalidRequest),
        ("exec", "bad_request", InvalidRequest),
        ("exec", "no_such_user", InvalidRequest),
        ("exec", "spawn_failed", InvalidRequest),  # errno 2: the program does not exist
        ("shell_run", "no_such_shell", ShellNotFound),
        ("shell_run", "shell_busy", InvalidRequest),
        ("hello", "unauthorized", Unauthorized),
        ("exec", "unknown_op", AgentProtocolError),
        ("exec", "something_new", SandboxError),
    ],
)
def test_error_codes_map_to_typed_errors(op: str, code: str, cls: type[Exception]) -> None:
    err = agent_error(op, {"code": code, "message": "m", "errno": 2})
    assert type(err) is cls
    assert err.details["agent_code"] == code


def test_spawn_failure_from_the_sandbox_state_is_a_sandbox_error() -> None:
    err = agent_error("exec", {"code": "spawn_failed", "message": "fork: Resource temporarily unavailable",
                               "errno": 11})
    assert type(err) is SandboxError


def test_file_not_found_is_also_a_python_file_not_found_error() -> None:
    assert isinstance(agent_error("read_file", {"code": "not_found", "message": "x"}), FileNotFoundError)
