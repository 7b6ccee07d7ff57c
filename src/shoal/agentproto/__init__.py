"""Client side of the in-sandbox agent protocol (see docs/protocol.md)."""

from .client import AgentClient, ExecStream, ShellResult, agent_error
from .frames import Frame, FrameDecoder, encode_frame

__all__ = ["AgentClient", "ExecStream", "Frame", "FrameDecoder", "ShellResult", "agent_error", "encode_frame"]
