"""Plain data types shared by the SDK, the node agent, the backends and the API server (the sandbox spec
is shoal.spec.SandboxSpec, also reachable here)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    pass

SandboxState = Literal["creating", "running", "paused", "stopped", "failed"]


def __getattr__(name: str) -> Any:
    # SandboxSpec is a pydantic model (shoal.spec): loaded on first use, so `import shoal` and the CLI
    # do not pay for importing pydantic until a spec is built
    if name == "SandboxSpec":
        from shoal.spec import SandboxSpec

        return SandboxSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class ExecResult:
    """What one command returned. `exit_code` is 128+N when a signal N killed it."""

    exit_code: int
    stdout: bytes | str = b""
    stderr: bytes | str = b""
    duration_s: float = 0.0
    timed_out: bool = False
    truncated: bool = False
    signal: int = 0

    @property
    def ok(self) -> bool:
        """True when the command exited 0 and was not cut short."""
        return self.exit_code == 0 and not self.timed_out

    def text(self) -> ExecResult:
        """Return a copy with stdout/stderr decoded as UTF-8 (invalid bytes replaced)."""
        def dec(b: bytes | str) -> str:
            return b.decode("utf-8", "replace") if isinstance(b, bytes) else b

        return ExecResult(self.exit_code, dec(self.stdout), dec(self.stderr), self.duration_s,
                          self.timed_out, self.truncated, self.signal)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form; bytes are decoded as UTF-8 with replacement."""
        d = asdict(self.text())
        return d


@dataclass
class StreamEvent:
    """One item of `Sandbox.stream()`: output bytes as they come, then one `exit` event."""

    kind: Literal["stdout", "stderr", "exit"]
    data: bytes = b""
    result: ExecResult | None = None


@dataclass
class DirEntry:
    """One entry of `Sandbox.list_dir()`."""

    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


@dataclass
class SandboxInfo:
    """A sandbox as listed by `Client.list()` / `Client.get()`."""

    id: str
    image: str
    backend: str
    state: str
    created_at: float
    spec: dict[str, Any] = field(default_factory=dict)
    runtime: str = ""
    expires_at: float | None = None
    labels: dict[str, str] = field(default_factory=dict)
    node: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


@dataclass
class RunCodeResult(ExecResult):
    """What one `run_code` call did: the run step as an ExecResult, plus the compile step, resource
    use and fetched files. `status` says how it went in one word:

    success · failed (non-zero exit or killed, e.g. by the memory limit) · timeout · compile_error ·
    compile_timeout · error (shoal could not run it; `error` says why, e.g. its container died).
    """

    status: str = "success"
    language: str = ""
    #: the compile step of compiled languages (None for interpreted ones)
    compile: ExecResult | None = None
    #: CPU seconds (user + system) of the run step's processes that were waited for
    cpu_time_s: float = 0.0
    #: peak resident set of the run step's main process, KiB (a python run counts the warm interpreter's pages)
    max_rss_kb: int = 0
    #: fetched files (fetch_files), path -> bytes; missing or oversized files are absent
    files: dict[str, bytes] = field(default_factory=dict)
    error: str = ""
    sandbox_id: str = ""
    #: seconds spent waiting for a free pooled container, and the whole call as the caller saw it
    queued_s: float = 0.0
    total_s: float = 0.0

    @property
    def ok(self) -> bool:
        """True when the code compiled, ran to completion and exited 0."""
        return self.status == "success"

    def text(self) -> RunCodeResult:
        """Return a copy with stdout/stderr (also the compile step's) decoded as UTF-8 (invalid bytes replaced)."""
        base = ExecResult.text(self)
        out = RunCodeResult(**{**self.__dict__, "stdout": base.stdout, "stderr": base.stderr,
                               "compile": self.compile.text() if self.compile is not None else None})
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form: output as text (UTF-8, invalid bytes replaced), files as base64."""
        import base64

        t = self.text()
        d = {k: v for k, v in t.__dict__.items() if k not in ("compile", "files")}
        d["compile"] = asdict(t.compile) if t.compile is not None else None
        d["files"] = {k: base64.b64encode(v).decode() for k, v in self.files.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunCodeResult:
        """Inverse of to_dict (output stays text; files are decoded from base64)."""
        import base64

        known = set(cls.__dataclass_fields__)
        kw = {k: v for k, v in d.items() if k in known and k not in ("compile", "files")}
        comp = d.get("compile")
        if isinstance(comp, dict):
            ekw = {k: v for k, v in comp.items() if k in ExecResult.__dataclass_fields__}
            kw["compile"] = ExecResult(**ekw)
        kw["files"] = {k: base64.b64decode(v) for k, v in (d.get("files") or {}).items()}
        kw.setdefault("exit_code", -1)
        return cls(**kw)
