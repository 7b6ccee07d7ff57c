"""Request and response bodies of the HTTP API (pydantic v2): they validate input with field names
(answered as 422) and they are what `/openapi.json` documents. The sandbox spec (`SpecIn`) is the SDK's
own model, shoal.spec.SandboxSpec: the same fields, limits and defaults."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from shoal.backends.registry import backend_names, check_backend_name
from shoal.limits import CPU_CLASSES, DEFAULT_EXEC_TIMEOUT_S, MAX_EXEC_TIMEOUT_S, MAX_HTTP_BATCH
from shoal.models import SandboxInfo
from shoal.spec import (
    NEW_IMAGE_RE,
    PROJECT_RE,
    Env,
    ImageRef,
    SandboxPath,
    SandboxSpec,
    UserName,
)

#: largest `n` of one batch create or fork (a server may set a lower limit)
MAX_BATCH = MAX_HTTP_BATCH
#: an absolute path inside the sandbox
AbsPath = Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^/[^\x00]*$")]
#: a command: a non-empty string, or a non-empty argv
Arg = Annotated[str, StringConstraints(max_length=1 << 20, pattern=r"^[^\x00]*$")]
#: standard base64 (RFC 4648, padded)
B64 = Annotated[str, StringConstraints(pattern=r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$")]
NewImageName = Annotated[str, StringConstraints(max_length=300, pattern=NEW_IMAGE_RE)]
Command = Annotated[str, StringConstraints(min_length=1, max_length=1 << 20, pattern=r"^[^\x00]*\S[^\x00]*$")] | \
    Annotated[list[Arg], Field(min_length=1, max_length=100_000)]

_ENV_DOC = "environment variables (names without '=' or NUL)"


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpecIn(SandboxSpec):
    """A sandbox to create: the SDK's `SandboxSpec` (same fields, limits and defaults), plus who may
    choose its project."""

    # pydantic's own constructor: a request body's errors stay per field (422 with `details.errors`)
    # instead of becoming one InvalidRequest as in SandboxSpec(...)
    __init__ = BaseModel.__init__
    project: Annotated[str, StringConstraints(pattern=PROJECT_RE)] | None = Field(
        None, description="admin tokens only: create in this project")


class BatchIn(SpecIn):
    """`n` sandboxes of one spec, made in one request; failures are reported per item."""

    n: int = Field(..., ge=1, le=MAX_BATCH)
    all_or_nothing: bool = Field(False, description="a gang: admission for all `n` is reserved before any starts, "
                                 "or 429 gang_unsatisfiable (details.available says how many fit); if one then "
                                 "fails to start, the others are closed and its error is the answer")


class ExecIn(_In):
    """A command to run to completion."""

    cmd: Command = Field(..., description="a string runs under bash -c; a list is an argv")
    timeout: float | None = Field(DEFAULT_EXEC_TIMEOUT_S, gt=0, le=MAX_EXEC_TIMEOUT_S,
                                 description="seconds; null = no limit")
    cwd: AbsPath | None = None
    env: Env | None = Field(None, description=_ENV_DOC)
    user: UserName | None = None
    stdin: B64 | None = Field(None, max_length=1 << 26, description="base64 bytes fed to the command's stdin")
    max_output: int | None = Field(None, ge=0, le=1 << 30, description="bytes of stdout+stderr kept")


class ShellOpenIn(_In):
    """Options of a new persistent shell."""

    cwd: AbsPath | None = None
    env: Env | None = None
    user: UserName | None = None


class ShellRunIn(_In):
    """One command for a persistent shell."""

    cmd: Annotated[str, StringConstraints(min_length=1, max_length=1 << 20, pattern=r"^[^\x00]*$")]
    timeout: float | None = Field(DEFAULT_EXEC_TIMEOUT_S, gt=0, le=MAX_EXEC_TIMEOUT_S)
    max_output: int | None = Field(None, ge=0, le=1 << 30)


class SnapshotIn(_In):
    """Name of the image a snapshot becomes."""

    name: NewImageName


class CpuClassIn(_In):
    """The CPU class a running sandbox moves to (docs/sandboxes.md#cpu-classes)."""

    cpu_class: Annotated[str, StringConstraints(pattern="^(?:" + "|".join(CPU_CLASSES) + ")$")] = Field(
        description="interactive: short steps whose latency matters; batch: runs on CPU time no interactive "
                    "task wants")


#: a VM memory snapshot's name (the VM backends' own check: shoal.backends.vm._SNAPSHOT_NAME)
SNAPSHOT_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"


class RestoreIn(_In):
    """Which named memory snapshot to restore, how many times, with which backend."""

    name: Annotated[str, StringConstraints(pattern=SNAPSHOT_NAME_RE)] = Field(
        description="a memory snapshot taken on this node (`shoal vm snapshot`, `snapshot(memory=True)`)")
    n: int = Field(1, ge=1, le=MAX_BATCH)
    backend: str = Field("microvm", description="the VM backend that took it",
                         json_schema_extra={"enum": [*backend_names()]})

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        return check_backend_name(v)


class ForkIn(_In):
    """How many children to fork."""

    n: int = Field(1, ge=1, le=MAX_BATCH)
    options: dict[str, Any] = Field(default_factory=dict, description="extra fork options of the node")


def _languages() -> list[str]:
    from shoal.backends.fncall_languages import LANGUAGES

    return sorted({n for lang in LANGUAGES.values() for n in (lang.name, *lang.aliases)})


class RunCodeIn(_In):
    """A snippet for the fncall backend (see `Client.run_code`); bytes travel as base64 (`*_b64`)."""

    code: str = Field(..., max_length=1 << 22)
    language: str = Field("python", max_length=32,
                          json_schema_extra={"enum": _languages()})
    stdin: str | None = Field(None, max_length=1 << 24)
    stdin_b64: B64 | None = Field(None, max_length=1 << 26, description="stdin bytes, base64")
    timeout: float | None = Field(None, gt=0, le=600, description="seconds the run step may take")
    compile_timeout: float | None = Field(None, gt=0, le=600)
    memory_mb: int | None = Field(None, ge=16, le=65536)
    cpus: float | None = Field(None, ge=0.01, le=256)
    files: dict[SandboxPath, str] | None = None
    files_b64: dict[SandboxPath, B64] | None = Field(None, description="files whose content is bytes, base64")
    fetch_files: list[SandboxPath] | None = None
    env: Env | None = None
    args: list[Arg] | None = None
    image: ImageRef | None = None
    max_output: int | None = Field(None, ge=1, le=1 << 30)


class RunStep(_In):
    """Run a command (/bin/sh -c) on the image so far; its file changes become one layer."""

    run: Annotated[str, StringConstraints(min_length=1, max_length=1 << 16, pattern=r"^[^\x00]*$")]
    network: bool | None = None
    timeout: float = Field(1800.0, gt=0, le=86400)


class EnvStep(_In):
    """Set environment variables of the image."""

    env: Env


class WorkdirStep(_In):
    """Set the working directory of the image."""

    workdir: Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^/[^\x00]*$")]


class UserStep(_In):
    """Run later steps and the image's commands as this user."""

    user: str = Field(..., min_length=1, max_length=256, pattern=r"^[^\x00:]+(:[^\x00:]+)?$")


class RecipeIn(_In):
    """Build steps on top of `from` (copying files from the client is not offered over the API: build
    those images with `shoal image build` on the server, or write the files in a Run step)."""

    from_: ImageRef = Field(..., alias="from", description="the image to build on")
    steps: list[RunStep | EnvStep | WorkdirStep | UserStep] = Field(default_factory=list, max_length=1000)
    network: bool = True
    env: Env = Field(default_factory=dict)
    workdir: Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^/[^\x00]*$")] | None = None
    user: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[^\x00:]+(:[^\x00:]+)?$")
    cpus: float = Field(2.0, ge=0.01, le=256)
    memory_mb: int = Field(2048, ge=16, le=1 << 20)
    disk_mb: int = Field(16384, ge=1, le=1 << 24)
    no_cache: bool = False


class BuildIn(_In):
    """An image build request."""

    name: NewImageName = Field(..., description="name[:tag] of the image to build")
    recipe: RecipeIn | None = Field(None, description="build steps; omit to build the built-in `base` (admin)")


# ---- responses --------------------------------------------------------------------------------
class ErrorBody(BaseModel):
    """A typed error: `code` names the shoal.errors class the SDK raises."""

    code: str
    message: str
    details: dict[str, Any] = Field(default_factory=dict)


class ErrorOut(BaseModel):
    """Every error response has this shape."""

    error: ErrorBody


#: a sandbox over HTTP is the SDK's SandboxInfo, field for field (one model: shoal.models)
SandboxOut = SandboxInfo


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
