"""Request and response bodies of the HTTP API (pydantic v2): they validate input with field names
(answered as 422) and they are what `/openapi.json` documents."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_ENV_DOC = "environment variables (names without '=' or NUL)"


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpecIn(_In):
    """A sandbox to create (defaults as in the Python SDK's `client.create`)."""

    image: str = Field("base", min_length=1, max_length=300,
                       description="image reference: name[:tag] or name@sha256:…")
    backend: Literal["container", "microvm", "vm", "fncall"] = "container"
    runtime: str | None = Field(None, max_length=32, description="container runtime: crun, runc or gvisor")
    cpus: float = Field(1.0, ge=0.01, le=256)
    memory_mb: int = Field(1024, ge=16, le=1 << 20)
    pids: int = Field(512, ge=8, le=1 << 22)
    disk_mb: int = Field(4096, ge=1, le=1 << 24)
    max_output_bytes: int = Field(1 << 20, ge=0, le=1 << 30)
    network: bool = False
    ttl_s: float | None = Field(3600.0, gt=0, le=30 * 86400, description="seconds until auto-close; null = never")
    env: dict[str, str] = Field(default_factory=dict, description=_ENV_DOC)
    labels: dict[str, str] = Field(default_factory=dict)
    workdir: str | None = Field(None, max_length=4096)
    user: str | None = Field(None, max_length=256)
    hostname: str | None = Field(None, max_length=63)
    project: str | None = Field(None, max_length=63, description="admin tokens only: create in this project")


class BatchIn(SpecIn):
    """`n` sandboxes of one spec, made in one request; failures are reported per item."""

    n: int = Field(..., ge=1, le=100_000)


class ExecIn(_In):
    """A command to run to completion."""

    cmd: str | list[str] = Field(..., description="a string runs under bash -c; a list is an argv")
    timeout: float | None = Field(300.0, gt=0, le=7 * 86400, description="seconds; null = no limit")
    cwd: str | None = Field(None, max_length=4096)
    env: dict[str, str] | None = Field(None, description=_ENV_DOC)
    user: str | None = Field(None, max_length=256)
    stdin: str | None = Field(None, description="base64 bytes fed to the command's stdin")
    max_output: int | None = Field(None, ge=0, le=1 << 30, description="bytes of stdout+stderr kept")


class ShellOpenIn(_In):
    """Options of a new persistent shell."""

    cwd: str | None = Field(None, max_length=4096)
    env: dict[str, str] | None = None
    user: str | None = Field(None, max_length=256)


class ShellRunIn(_In):
    """One command for a persistent shell."""

    cmd: str = Field(..., max_length=1 << 20)
    timeout: float | None = Field(300.0, gt=0, le=7 * 86400)
    max_output: int | None = Field(None, ge=0, le=1 << 30)


class SnapshotIn(_In):
    """Name of the image a snapshot becomes."""

    name: str = Field(..., min_length=1, max_length=200)


class ForkIn(_In):
    """How many children to fork."""

    n: int = Field(1, ge=1, le=100_000)
    options: dict[str, Any] = Field(default_factory=dict, description="extra fork options of the node")


class RunCodeIn(BaseModel):
    """A snippet for the fncall backend (extra fields pass through to it)."""

    model_config = ConfigDict(extra="allow")
    code: str = Field(..., max_length=1 << 22)
    language: str = Field("python", max_length=32)


class BuildIn(_In):
    """An image build request."""

    name: str = Field(..., min_length=1, max_length=200, description="name[:tag] of the image to build")
    recipe: dict[str, Any] | None = Field(None, description="build steps (see `shoal image build`); "
                                                            "omit to build the built-in `base`")


# ---- responses --------------------------------------------------------------------------------
class ErrorBody(BaseModel):
    """A typed error: `code` names the shoal.errors class the SDK raises."""

    code: str
    message: str
    details: dict[str, Any] = Field(default_factory=dict)


class ErrorOut(BaseModel):
    """Every error response has this shape."""

    error: ErrorBody


class SandboxOut(BaseModel):
    """A sandbox."""

    id: str
    image: str
    backend: str
    state: str
    created_at: float
    spec: dict[str, Any] = Field(default_factory=dict)
    runtime: str = ""
    expires_at: float | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    node: str = ""
    extra: dict[str, Any] = Field(default_factory=dict)


class SandboxList(BaseModel):
    """Sandboxes visible to the caller."""

    sandboxes: list[SandboxOut]


class BatchItem(BaseModel):
    """One item of a batch: a sandbox, or the error that one met."""

    sandbox: SandboxOut | None = None
    error: ErrorBody | None = None


class BatchOut(BaseModel):
    """Results of a batch create or a fork, in order."""

    items: list[BatchItem]
    created: int
    failed: int


class ExecOut(BaseModel):
    """What a command returned; stdout/stderr are text when `encoding` is utf-8, else base64."""

    exit_code: int
    stdout: str
    stderr: str
    encoding: Literal["utf-8", "base64"]
    duration_s: float
    timed_out: bool
    truncated: bool
    signal: int
    alive: bool | None = Field(None, description="shell commands only: false when the command ended the shell")


class DirEntryOut(BaseModel):
    """One directory entry."""

    name: str
    type: str
    size: int
    mode: int
    mtime: float


class DirList(BaseModel):
    """A directory listing."""

    entries: list[DirEntryOut]


class ShellOut(BaseModel):
    """A new shell session."""

    shell_id: str


class ImageList(BaseModel):
    """Images visible to the caller."""

    images: list[dict[str, Any]]


class Health(BaseModel):
    """Liveness of the server and its node agent."""

    status: Literal["ok"]
    version: str
    node: str
    auth: bool
