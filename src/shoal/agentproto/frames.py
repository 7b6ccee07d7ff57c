"""Framing of the shoal agent protocol (docs/protocol.md): constants, encode, incremental decode.

A frame is ``u32 length | u8 type | u32 stream | payload`` (big-endian); ``length`` counts type,
stream and payload, so the smallest frame has length 5.
"""

from __future__ import annotations

import json
import struct
from typing import Any, NamedTuple

from shoal.errors import AgentProtocolError

PROTOCOL_VERSION = 1

REQ = 0x01
RESP = 0x02
ERR = 0x03
STDOUT = 0x10
STDERR = 0x11
STDIN = 0x12
STDIN_EOF = 0x13
SIGNAL = 0x14
RESIZE = 0x15
DATA = 0x16
DATA_END = 0x17
READY = 0x18
EVENT = 0x19

FRAME_NAMES: dict[int, str] = {
    REQ: "REQ",
    RESP: "RESP",
    ERR: "ERR",
    STDOUT: "STDOUT",
    STDERR: "STDERR",
    STDIN: "STDIN",
    STDIN_EOF: "STDIN_EOF",
    SIGNAL: "SIGNAL",
    RESIZE: "RESIZE",
    DATA: "DATA",
    DATA_END: "DATA_END",
    READY: "READY",
    EVENT: "EVENT",
}

#: Bytes before the payload: u32 length, u8 type, u32 stream.
HEADER = struct.Struct(">IBI")
HEADER_SIZE = HEADER.size
#: Largest payload the protocol allows in one frame.
MAX_PAYLOAD = 1 << 20
#: Largest data chunk we put in one STDIN/DATA frame (and the agent in STDOUT/DATA frames).
CHUNK = 256 * 1024


class Frame(NamedTuple):
    """One decoded frame."""

    type: int
    stream: int
    payload: bytes


def encode_frame(ftype: int, stream: int, payload: bytes = b"") -> bytes:
    """Encode one frame. Raises ValueError for out-of-range fields or an oversized payload."""
    if not 0 <= ftype <= 0xFF:
        raise ValueError(f"frame type out of range: {ftype}")
    if not 0 <= stream <= 0xFFFFFFFF:
        raise ValueError(f"stream id out of range: {stream}")
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"frame payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(len(payload) + 5, ftype, stream) + payload


def encode_json(obj: dict[str, Any]) -> bytes:
    """JSON payload for REQ frames.

    ``ensure_ascii`` escapes everything non-ASCII, so strings holding surrogate-escaped bytes
    (from ``os.fsdecode`` or a ``list_dir`` name) reach the agent as the raw bytes they stand for.
    """
    return json.dumps(obj, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def decode_json(payload: bytes) -> dict[str, Any]:
    """Parse a RESP/ERR payload. Invalid bytes in agent strings arrive as lone surrogates
    (``\\udcXX``), exactly like ``os.fsdecode`` would produce them."""
    try:
        obj = json.loads(payload.decode("utf-8", "surrogateescape"))
    except (UnicodeDecodeError, ValueError) as e:
        raise AgentProtocolError(f"agent sent malformed JSON: {e}") from e
    if not isinstance(obj, dict):
        raise AgentProtocolError(f"agent sent a JSON {type(obj).__name__}, expected an object")
    return obj


def encode_request(stream: int, op: str, **fields: Any) -> bytes:
    """A REQ frame for ``op``; fields whose value is None are left out."""
    body: dict[str, Any] = {"op": op}
    body.update({k: v for k, v in fields.items() if v is not None})
    return encode_frame(REQ, stream, encode_json(body))


def encode_signal(stream: int, sig: int) -> bytes:
    """A SIGNAL frame carrying signal number ``sig``."""
    return encode_frame(SIGNAL, stream, struct.pack(">I", sig))


def encode_resize(stream: int, rows: int, cols: int) -> bytes:
    """A RESIZE frame for a PTY of ``rows`` x ``cols``."""
    return encode_frame(RESIZE, stream, struct.pack(">HH", rows, cols))


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get complete frames back.

    A length outside 5 .. MAX_PAYLOAD+5 is a protocol violation: the stream cannot be
    resynchronized, so the decoder raises AgentProtocolError and stays broken.
    """

    def __init__(self, max_payload: int = MAX_PAYLOAD) -> None:
        self._buf = bytearray()
        self._max = max_payload
        self._error: AgentProtocolError | None = None

    def feed(self, data: bytes) -> list[Frame]:
        """Add bytes; return every frame they complete (possibly none).

        After a bad length, the frames before it are returned and the next call raises.
        """
        if self._error:
            raise self._error
        self._buf += data
        frames: list[Frame] = []
        buf = self._buf
        pos = 0
        n = len(buf)
        while n - pos >= HEADER_SIZE:
            length, ftype, stream = HEADER.unpack_from(buf, pos)
            if length < 5 or length > self._max + 5:
                # Nothing after this point can be trusted; frames before it are still good.
                self._error = AgentProtocolError(f"bad frame length {length}")
                del buf[:pos]
                if frames:
                    return frames
                raise self._error
            end = pos + 4 + length
            if end > n:
                break
            frames.append(Frame(ftype, stream, bytes(buf[pos + HEADER_SIZE : end])))
            pos = end
        if pos:
            del buf[:pos]
        return frames

    @property
    def buffered(self) -> int:
        """Bytes held that do not yet form a complete frame."""
        return len(self._buf)
