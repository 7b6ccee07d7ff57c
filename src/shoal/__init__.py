"""shoal — an environment factory for agentic RL.

    import shoal
    async with shoal.Client() as client:
        sb = await client.create("base")
        r = await sb.exec("echo hi")
"""

from shoal.errors import (
    BackendUnavailable,
    CapacityExceeded,
    FileNotFound,
    Forbidden,
    GangUnsatisfiable,
    ImageBuildError,
    ImageCorrupt,
    ImageNotFound,
    InvalidRequest,
    NodeUnavailable,
    NotImplementedYet,
    QuotaExceeded,
    SandboxError,
    SandboxFileError,
    SandboxLost,
    SandboxNotFound,
    ShellNotFound,
    ShoalError,
    StoreUnavailable,
    Timeout,
    Unauthorized,
    Unsupported,
)
from shoal.models import DirEntry, ExecResult, SandboxInfo, SandboxSpec, StreamEvent
from shoal.sdk.client import Client
from shoal.sdk.sandbox import Sandbox, Shell, Stream
from shoal.sdk.sync import SyncClient, SyncSandbox

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable", "CapacityExceeded", "Client", "DirEntry", "ExecResult", "FileNotFound",
    "Forbidden", "GangUnsatisfiable", "ImageBuildError", "ImageCorrupt", "ImageNotFound", "InvalidRequest",
    "NodeUnavailable", "NotImplementedYet", "QuotaExceeded", "Sandbox",
    "SandboxError", "SandboxFileError", "SandboxInfo", "SandboxLost", "SandboxNotFound", "SandboxSpec", "Shell",
    "ShellNotFound", "ShoalError", "StoreUnavailable", "Stream", "StreamEvent", "SyncClient", "SyncSandbox",
    "Timeout", "Unauthorized", "Unsupported", "__version__",
]
