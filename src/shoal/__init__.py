"""shoal — an environment factory for agentic RL.

    import shoal
    async with shoal.Client() as client:
        sb = await client.create("base")
        r = await sb.exec("echo hi")
"""

from typing import TYPE_CHECKING, Any

from shoal.errors import (
    BackendUnavailable,
    CapacityExceeded,
    EgressForbidden,
    FileNotFound,
    Forbidden,
    GangUnsatisfiable,
    ImageBuildError,
    ImageCorrupt,
    ImageNotFound,
    InvalidRequest,
    NodeUnavailable,
    NoShell,
    NotImplementedYet,
    QuotaExceeded,
    RegistryAuthFailed,
    RegistryUnavailable,
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
from shoal.models import DirEntry, ExecResult, SandboxInfo, StreamEvent
from shoal.sdk.client import Client
from shoal.sdk.sandbox import Sandbox, Shell, Stream
from shoal.sdk.sync import SyncClient, SyncSandbox

__version__ = "0.1.0"

if TYPE_CHECKING:
    from shoal.spec import SandboxSpec


def __getattr__(name: str) -> Any:
    # the spec model loads pydantic: only when it is first used (see shoal.models)
    if name == "SandboxSpec":
        from shoal.spec import SandboxSpec

        return SandboxSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "BackendUnavailable", "CapacityExceeded", "Client", "DirEntry", "EgressForbidden", "ExecResult", "FileNotFound",
    "Forbidden", "GangUnsatisfiable", "ImageBuildError", "ImageCorrupt", "ImageNotFound", "InvalidRequest",
    "NoShell", "NodeUnavailable", "NotImplementedYet", "QuotaExceeded", "RegistryAuthFailed", "RegistryUnavailable",
    "Sandbox", "SandboxError", "SandboxFileError", "SandboxInfo", "SandboxLost", "SandboxNotFound", "SandboxSpec",
    "Shell", "ShellNotFound", "ShoalError", "StoreUnavailable", "Stream", "StreamEvent", "SyncClient", "SyncSandbox",
    "Timeout", "Unauthorized", "Unsupported", "__version__",
]
