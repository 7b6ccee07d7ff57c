"""SWE-ReX's runtime API (what `swerex.runtime.remote.RemoteRuntime` calls), one per sandbox under
`/swerex/{sandbox_id}`: point the client's `host` at that URL (with `port=None`) and give it a shoal token as
`auth_token` (sent as `X-API-Key`).

Sessions are shoal's persistent shells (cwd, environment, functions carry over); `execute` is a one-off
exec; files go through shoal's file calls; `upload` writes a file or unpacks a zipped directory. Errors use
SWE-ReX's own transfer format (HTTP 511, `{"swerexception": {message, class_path, traceback, extra_info}}`),
so the client raises the same exception classes as against its own server (CommandTimeoutError,
NonZeroExitCodeError, SessionDoesNotExistError, FileNotFoundError, ...).

Not served: interactive commands (`is_interactive_command`/`is_interactive_quit`: a shoal shell command's
stdin is /dev/null), sessions of types other than bash.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import posixpath
import signal
import zipfile
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shoal.errors import (
    FileNotFound,
    InvalidRequest,
    SandboxError,
    SandboxFileError,
    SandboxNotFound,
    ShellNotFound,
    ShoalError,
    Unauthorized,
)
from shoal.limits import output_limit
from shoal.server.compat import common
from shoal.server.compat.routes import compat_router
from shoal.server.deps import ServerState, state_of

if TYPE_CHECKING:
    from shoal.server.tokens import Principal

log = logging.getLogger("shoal.server")
#: every endpoint answers an error as _error() shapes it (shoal.server.compat.routes)
router = compat_router(lambda e: _error(e), prefix="/swerex/{sandbox_id}", include_in_schema=False)
#: what SWE-ReX reports as the matched expect string when a command ran to its end (its PS1)
PS1 = "SHELLPS1PREFIX"
EXC = "swerex.exceptions."


class Transfer(Exception):
    """An exception to hand to the client in SWE-ReX's transfer format."""

    def __init__(self, class_path: str, message: str, extra_info: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.class_path = class_path
        self.message = message
        self.extra_info = extra_info or {}


def _transfer(e: BaseException) -> Transfer:
    if isinstance(e, Transfer):
        return e
    if isinstance(e, ValidationError):
        return Transfer("builtins.ValueError", f"invalid request: {e}")
    if isinstance(e, ShoalError):
        m = e.message
        if isinstance(e, FileNotFound):
            return Transfer("builtins.FileNotFoundError", m)
        code = e.details.get("agent_code")
        if code == "is_a_directory":
            return Transfer("builtins.IsADirectoryError", m)
        if code == "not_a_directory":
            return Transfer("builtins.NotADirectoryError", m)
        if code == "permission_denied":
            return Transfer("builtins.PermissionError", m)
        if code == "spawn_failed" and isinstance(e, InvalidRequest):
            return Transfer("builtins.FileNotFoundError", m)
        if isinstance(e, SandboxFileError):
            return Transfer("builtins.OSError", m)
        if isinstance(e, InvalidRequest):
            return Transfer("builtins.ValueError", m)
        return Transfer(EXC + "SwerexException", f"{type(e).__name__}: {m}")
    log.exception("SWE-ReX request failed")
    return Transfer(EXC + "SwerexException", f"internal error ({type(e).__name__}): {e}; the server log has the "
                                             "traceback")


def _error(e: BaseException) -> Response:
    if isinstance(e, Unauthorized):
        return JSONResponse({"detail": e.message}, status_code=401)
    t = _transfer(e)
    return JSONResponse({"swerexception": {"message": t.message, "class_path": t.class_path, "traceback": "",
                                           "extra_info": t.extra_info}}, status_code=511)


# ---- request models (the client's own fields; unknown ones are ignored) ----------------------------
class _M(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CreateSession(_M):
    """Open a bash session."""

    startup_source: list[str] = []
    session: str = Field("default", min_length=1, max_length=200)
    session_type: str = "bash"
    startup_timeout: float = 1.0


class RunAction(_M):
    """Run a command in a session (or interrupt it)."""

    command: str = ""
    session: str = "default"
    timeout: float | None = None
    is_interactive_command: bool = False
    is_interactive_quit: bool = False
    check: str = "raise"
    error_msg: str = ""
    expect: list[str] = []
    action_type: str = "bash"
    n_retry: int = 3


class CloseSession(_M):
    """Close a session."""

    session: str = "default"
    session_type: str = "bash"


class Command(_M):
    """A one-off command."""

    command: str | list[str]
    timeout: float | None = None
    shell: bool = False
    check: bool = False
    error_msg: str = ""
    env: dict[str, str] | None = None
    cwd: str | None = None
    merge_output_streams: bool = False


class ReadFile(_M):
    """Read a file as text."""

    path: str
    encoding: str | None = None
    errors: str | None = None


class WriteFile(_M):
    """Write text to a file."""

    content: str
    path: str


# ---- sessions -----------------------------------------------------------------------------------
@dataclass
class Session:
    """One SWE-ReX session: a shoal shell, plus a command still running after an `expect` match."""

    name: str
    shell_id: str
    running: Any = None
    output: list[bytes] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: `$?` of the next command, and the status of an empty one (SWE-ReX's bash: an empty line leaves `$?` as
    #: it was; see _run for what it was)
    last_exit: int = 0


def _ended_shell(result: object) -> bool:
    """True when a shell command's result says the command ended the shell (exit, exec, a killed loop)."""
    from shoal.agentproto.client import ShellResult

    return isinstance(result, ShellResult) and not result.alive


def _sessions(st: ServerState) -> dict[tuple[str, str], Session]:
    sessions: dict[tuple[str, str], Session] = common.server_local(st, "swerex_sessions", dict)
    return sessions


def _caller(request: Request, sandbox_id: str) -> tuple[ServerState, Principal]:
    st = state_of(request)
    who = common.principal_from_key(st, request.headers.get("x-api-key"), request.headers.get("authorization"))
    try:
        common.sandbox_of(st, who, sandbox_id)
    except SandboxNotFound:
        raise Transfer(EXC + "SwerexException", f"no sandbox {sandbox_id!r} (or it belongs to another project)") \
            from None
    return st, who


async def _body(request: Request, model: type[_M] | None) -> Any:
    raw = await request.body()
    try:
        data = json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError) as e:
        raise Transfer("builtins.ValueError", f"request body is not valid JSON: {e}") from None
    if model is None:
        return data
    if not isinstance(data, dict):
        raise Transfer("builtins.ValueError", "request body must be a JSON object")
    return model.model_validate(data)


def _text(b: bytes | str) -> str:
    return b.decode("utf-8", "backslashreplace") if isinstance(b, bytes) else b


@router.get("/is_alive")
async def is_alive(sandbox_id: str, request: Request) -> Response:
    """`{"is_alive": true}` while the sandbox runs; 404 with a `detail` otherwise (the client reads False)."""
    try:
        st, _who = _caller(request, sandbox_id)
        rec = st.node.record(sandbox_id)
        if rec.state not in ("running", "paused"):
            return JSONResponse({"detail": f"sandbox {sandbox_id} is {rec.state}"}, status_code=404)
        return JSONResponse({"is_alive": True, "message": ""})
    except Transfer as e:
        return JSONResponse({"detail": e.message}, status_code=404)


@router.post("/create_session")
async def create_session(sandbox_id: str, request: Request) -> Response:
    """Open a bash session (a shoal persistent shell), sourcing `startup_source` files."""
    st, who = _caller(request, sandbox_id)
    req = await _body(request, CreateSession)
    if req.session_type != "bash":
        raise Transfer("builtins.ValueError", f"unknown session type: {req.session_type!r} (only bash)")
    table = _sessions(st)
    prune(st)
    key = (sandbox_id, req.session)
    if key in table:
        raise Transfer(EXC + "SessionExistsError", f"session {req.session} already exists")
    async with common.slot(st, who):
        shell = await st.node.shell_open(sandbox_id)
        table[key] = sess = Session(req.session, shell)
        out = ""
        for path in req.startup_source:
            r = await st.node.shell_run(sandbox_id, sess.shell_id, f"source {_quote(path)} 2>&1",
                                        timeout=max(1.0, req.startup_timeout) + 30)
            out += _text(r.stdout) + _text(r.stderr)
    return JSONResponse({"output": out, "session_type": "bash"})


def _quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


async def _interrupt(st: ServerState, sandbox_id: str, sess: Session, action: RunAction) -> dict[str, Any]:
    h = sess.running
    if h is None:
        return {"output": "", "exit_code": 0, "failure_reason": "", "expect_string": PS1, "session_type": "bash"}
    with contextlib.suppress(Exception):
        await h.send_signal(signal.SIGINT)
    try:
        await asyncio.wait_for(_finish(sess), max(0.2, action.timeout or 0.2) * max(1, action.n_retry))
    except TimeoutError:
        with contextlib.suppress(Exception):
            await h.send_signal(signal.SIGKILL)
        try:
            await asyncio.wait_for(_finish(sess), 5)
        except TimeoutError:
            raise Transfer("pexpect.exceptions.TIMEOUT", "Failed to interrupt session") from None
    out = _text(b"".join(sess.output)).strip()
    sess.output.clear()
    sess.last_exit = 130  # bash's status for a command ended by Ctrl-C
    return {"output": out, "exit_code": 0, "failure_reason": "", "expect_string": PS1, "session_type": "bash"}


async def _finish(sess: Session) -> Any:
    """Read the rest of a command left running after an expect match; its result."""
    h, res = sess.running, None
    if h is None:
        return None
    async for ev in h:
        if ev.kind == "exit":
            res = ev.result
        else:
            sess.output.append(ev.data)
    sess.running = None
    return res


async def _run(st: ServerState, sandbox_id: str, sess: Session, action: RunAction) -> dict[str, Any]:
    if action.is_interactive_command or action.is_interactive_quit:
        raise Transfer(EXC + "SwerexException", "interactive commands (is_interactive_command/is_interactive_quit) "
                                                "are not supported by shoal's sessions: a command's stdin is "
                                                "/dev/null; run the program non-interactively")
    if sess.running is not None:
        raise Transfer(EXC + "SwerexException", f"session {sess.name!r} is still running the command that matched "
                                                "an expect string: interrupt it (BashInterruptAction) first")
    if nothing_to_run(action.command):
        # SWE-ReX sends these to its shell as they are: bash prints its prompt, runs nothing and `$?` stays
        # (SWE-agent sends '' after every tool reset); a `{ }` group around nothing would be a syntax error
        return _finish_run(action, "", sess.last_exit)
    c = await st.node.client(sandbox_id)
    cap = _cap(st, sandbox_id)
    h = await c.shell_run_stream(sess.shell_id, wrap_command(action.command, sess.last_exit),
                                 timeout=action.timeout, max_output=cap)
    buf = bytearray()
    result = None
    expect = [x for x in action.expect if x]
    async for ev in h:
        if ev.kind == "exit":
            result = ev.result
            break
        buf += ev.data
        if expect:
            text = _text(bytes(buf))
            hits = [(text.find(x), x) for x in expect if x in text]
            if hits:
                pos, matched = min(hits)
                sess.running = h  # the command goes on; BashInterruptAction ends it
                return {"output": text[:pos], "exit_code": None, "failure_reason": "", "expect_string": matched,
                        "session_type": "bash"}
    if result is None:
        raise SandboxError("the command's stream ended without an exit status")
    output = _text(bytes(buf))
    # SWE-ReX reads a command's status by running `echo ...$?...` after it, unless check="ignore": so `$?` is
    # the command's status only after an ignored one, and 0 otherwise
    sess.last_exit = int(result.exit_code) if action.check == "ignore" else 0
    if result.timed_out:
        sess.last_exit = 130  # what bash reports for a command ended by Ctrl-C
        if _ended_shell(result):
            _sessions(st).pop((sandbox_id, sess.name), None)
            raise Transfer(EXC + "CommandTimeoutError",
                           f"timeout after {action.timeout} seconds while running command {action.command!r}; "
                           "the command looped inside the shell itself (no process to interrupt), so the "
                           "session's shell had to be killed: create the session again")
        raise Transfer(EXC + "CommandTimeoutError",
                       f"timeout after {action.timeout} seconds while running command {action.command!r}")
    if _ended_shell(result):
        _sessions(st).pop((sandbox_id, sess.name), None)  # the command ended the shell (exit, exec)
    if result.exit_code == 2 and "syntax error" in output:
        await _check_syntax(st, sandbox_id, action.command)
    if result.truncated:
        output += cut_notice(cap, "output")
    return _finish_run(action, output, int(result.exit_code))


def _finish_run(action: RunAction, output: str, status: int) -> dict[str, Any]:
    """The observation of a command that ran to its end (SWE-ReX's `check` modes applied)."""
    exit_code = None if action.check == "ignore" else status
    if action.check == "raise" and exit_code != 0:
        msg = f"Command {action.command!r} failed with exit code {exit_code}. Here is the output:\n{output!r}"
        if action.error_msg:
            msg = f"{action.error_msg}: {msg}"
        raise Transfer(EXC + "NonZeroExitCodeError", msg)
    return {"output": output, "exit_code": exit_code, "failure_reason": "", "expect_string": PS1,
            "session_type": "bash"}


def nothing_to_run(command: str) -> bool:
    """True for a command of blank and comment lines only (bash runs nothing; SWE-ReX's own rule, widened to
    blank lines between comments)."""
    return all(not line.strip() or line.lstrip().startswith("#") for line in command.splitlines())


def wrap_command(command: str, last_exit: int) -> str:
    """`command` as the session's shell runs it: in the shell itself (state carries over) as one `{ ...\n}`
    group, so bash parses all of it before running any (a syntax error runs nothing, as SWE-ReX's `bash -n`
    check ensures), stderr folded into stdout as a terminal shows it; `$?` is what SWE-ReX's shell would have
    there (`last_exit`; a subshell's exit sets it, only when it is not 0)."""
    prefix = f"(exit {last_exit}); " if last_exit else ""
    return prefix + "{ " + command + "\n} 2>&1"


def cut_notice(cap: int, what: str) -> str:
    """The line that ends output cut at `cap` bytes, so neither a model nor a person mistakes it for all of it."""
    return (f"\n[shoal: {what} cut at {cap} bytes, the sandbox's max_output_bytes; create the sandbox with a "
            "larger max_output_bytes (0: an eighth of its memory, at most 256 MiB) to keep more]\n")


def _cap(st: ServerState, sandbox_id: str) -> int:
    """Bytes of output kept per stream for one command: the sandbox's max_output_bytes (0: as much as its memory
    allows, see limits.output_limit)."""
    rec = st.node.record(sandbox_id)
    cap = int(rec.spec.max_output_bytes)
    return cap or output_limit(int(rec.spec.memory_mb or 1024))


async def _check_syntax(st: ServerState, sandbox_id: str, command: str) -> None:
    """Raise BashIncorrectSyntaxError when bash cannot parse `command` (checked only after a command failed with
    bash's syntax-error status 2, so a good command costs nothing extra; a command that does not parse never
    ran: the shell parses the whole `{ ...; }` group first)."""
    r = await st.node.exec(sandbox_id, ["/bin/bash", "-n"], stdin=command.encode() + b"\n", timeout=30)
    if r.exit_code == 0:
        return
    out, err = _text(r.stdout), _text(r.stderr)
    raise Transfer(EXC + "BashIncorrectSyntaxError",
                   f"Error (exit code {r.exit_code}) while checking bash command \n{command!r}\n"
                   f"---- Stderr ----\n{err}\n---- Stdout ----\n{out}",
                   {"bash_stdout": out, "bash_stderr": err})


@router.post("/run_in_session")
async def run_in_session(sandbox_id: str, request: Request) -> Response:
    """Run a command in a session (BashAction) or interrupt what runs there (BashInterruptAction)."""
    try:
        st, who = _caller(request, sandbox_id)
        action = await _body(request, RunAction)
        sess = _sessions(st).get((sandbox_id, action.session))
        if sess is None:
            raise Transfer(EXC + "SessionDoesNotExistError", f"session {action.session!r} does not exist")
        async with common.slot(st, who), sess.lock:
            if action.action_type == "bash_interrupt":
                out = await _interrupt(st, sandbox_id, sess, action)
            elif action.action_type == "bash":
                out = await _run(st, sandbox_id, sess, action)
            else:
                raise Transfer("builtins.ValueError", f"unknown action type {action.action_type!r}")
        return JSONResponse(out)
    except ShellNotFound as e:
        return _error(Transfer(EXC + "SessionDoesNotExistError", f"the session's shell is gone: {e.message}"))


@router.post("/close_session")
async def close_session(sandbox_id: str, request: Request) -> Response:
    """Close a session and what still runs in it."""
    st, _who = _caller(request, sandbox_id)
    req = await _body(request, CloseSession)
    sess = _sessions(st).pop((sandbox_id, req.session), None)
    if sess is None:
        raise Transfer(EXC + "SessionDoesNotExistError", f"session {req.session!r} does not exist")
    with contextlib.suppress(ShellNotFound):
        await st.node.shell_close(sandbox_id, sess.shell_id)
    return JSONResponse({"session_type": "bash"})


@router.post("/execute")
async def execute(sandbox_id: str, request: Request) -> Response:
    """Run a command outside any session, like `subprocess.run`."""
    st, who = _caller(request, sandbox_id)
    cmd = await _body(request, Command)
    if isinstance(cmd.command, str):
        argv = ["/bin/sh", "-c", cmd.command] if cmd.shell else [cmd.command]
    else:
        argv = list(cmd.command) if not cmd.shell else ["/bin/sh", "-c", " ".join(cmd.command)]
    if not argv or not argv[0]:
        raise Transfer("builtins.ValueError", "command is empty")
    if cmd.merge_output_streams:
        argv = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *argv]
    cap = _cap(st, sandbox_id)
    async with common.slot(st, who):
        r = await st.node.exec(sandbox_id, argv, timeout=cmd.timeout, cwd=cmd.cwd, env=cmd.env, max_output=cap)
    if r.timed_out:
        raise Transfer(EXC + "CommandTimeoutError", f"Timeout ({cmd.timeout}s) exceeded while running command")
    out: dict[str, Any] = {"stdout": _text(r.stdout), "stderr": _text(r.stderr), "exit_code": int(r.exit_code)}
    # the agent keeps `cap` bytes of each stream: say which one was cut, in the text itself (what the client
    # hands its caller) and in fields a raw HTTP caller can test
    cut = [k for k, raw in (("stdout", r.stdout), ("stderr", r.stderr)) if r.truncated and len(raw) >= cap]
    for k in cut:
        out[k] += cut_notice(cap, k)
    out["stdout_truncated"], out["stderr_truncated"] = "stdout" in cut, "stderr" in cut
    if cmd.check and r.exit_code != 0:
        msg = (f"Command {cmd.command!r} failed with exit code {r.exit_code}. "
               f"Stdout:\n{out['stdout']!r}\nStderr:\n{out['stderr']!r}")
        if cmd.error_msg:
            msg = f"{cmd.error_msg}: {msg}"
        raise Transfer(EXC + "NonZeroExitCodeError", msg)
    return JSONResponse(out)


@router.post("/read_file")
async def read_file(sandbox_id: str, request: Request) -> Response:
    """A file's text."""
    st, who = _caller(request, sandbox_id)
    req = await _body(request, ReadFile)
    async with common.slot(st, who):
        data = await st.node.read_file(sandbox_id, req.path)
    try:
        content = data.decode(req.encoding or "utf-8", req.errors or "strict")
    except LookupError:
        raise Transfer("builtins.LookupError", f"unknown encoding: {req.encoding}") from None
    except UnicodeDecodeError as e:
        raise Transfer("builtins.ValueError", f"{req.path} is not valid {req.encoding or 'utf-8'}: {e}") from None
    return JSONResponse({"content": content})


@router.post("/write_file")
async def write_file(sandbox_id: str, request: Request) -> Response:
    """Write text to a file (parent directories are made)."""
    st, who = _caller(request, sandbox_id)
    req = await _body(request, WriteFile)
    async with common.slot(st, who):
        await st.node.write_file(sandbox_id, req.path, req.content.encode())
    return JSONResponse({})


#: what a zip can do wrong while it is read (besides BadZipFile): a bad deflate stream, a truncated member, a
#: compression method or encryption zipfile cannot read
_ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError, OSError)
#: the decompressed bytes one upload holds at a time (a chunk read from the zip, then sent into the sandbox)
UNZIP_CHUNK = 256 * 1024


def _bad_zip(e: BaseException) -> Transfer:
    return Transfer("builtins.ValueError", f"unzip=true but the upload is not a readable zip file: "
                                           f"{type(e).__name__}: {e}")


def _plan(zf: zipfile.ZipFile, limit: int) -> list[tuple[zipfile.ZipInfo, str, int]]:
    """(member, relative path, mode) of a zip's members; refuses unsafe paths and archives whose members say
    they unpack to more than `limit` bytes (zipfile never reads a member past the size it declares), and
    checks every member's data (CRC) first, streaming, so a corrupt zip is refused before anything is written."""
    total = 0
    out = []
    for info in zf.infolist():
        name = info.filename
        norm = posixpath.normpath(name)
        if name.startswith("/") or norm == ".." or norm.startswith("../"):
            raise Transfer("builtins.ValueError", f"zip member {name!r} points outside the target directory")
        total += info.file_size
        if total > limit:
            raise Transfer("builtins.ValueError", f"the zip unpacks to more than {limit} bytes")
        mode = (info.external_attr >> 16) & 0o7777
        out.append((info, norm, mode or (0o755 if info.is_dir() else 0o644)))
    bad = zf.testzip()  # reads each member in 1 MiB pieces, keeps none
    if bad is not None:
        raise Transfer("builtins.ValueError", f"unzip=true but zip member {bad!r} is corrupt (bad CRC)")
    return out


async def _member_chunks(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> AsyncIterator[bytes]:
    """A member's bytes, UNZIP_CHUNK at a time, decompressed off the event loop."""
    f = await asyncio.to_thread(zf.open, info)
    try:
        while True:
            chunk = await asyncio.to_thread(f.read, UNZIP_CHUNK)
            if not chunk:
                return
            yield chunk
    finally:
        f.close()


async def _file_chunks(src: Any) -> AsyncIterator[bytes]:
    """An uploaded part's bytes, UNZIP_CHUNK at a time (Starlette spools big parts to a temporary file)."""
    while True:
        chunk = await src.read(UNZIP_CHUNK)
        if not chunk:
            return
        yield chunk


def _upload_gate(st: ServerState, who: Principal) -> asyncio.Semaphore:
    """At most `api_max_uploads` uploads of one token write into sandboxes at once (the rest wait): with one
    chunk per upload in memory, what a token's uploads hold in the server is bounded too."""
    gates: dict[str, asyncio.Semaphore] = common.server_local(st, "swerex_upload_gates", dict)
    gate = gates.get(who.token_id)
    if gate is None:
        from shoal.config import settings

        gate = gates[who.token_id] = asyncio.Semaphore(max(1, settings().api_max_uploads))
    return gate


@router.post("/upload")
async def upload(sandbox_id: str, request: Request) -> Response:
    """A multipart upload (`file`, `target_path`, `unzip`): a file, or a zipped directory unpacked at the target.
    Streams: the part is spooled to disk by the form parser and written into the sandbox (or unpacked, member
    by member) a chunk at a time, so the server's memory per upload does not grow with the file."""
    st, who = _caller(request, sandbox_id)
    limit = st.settings.max_upload_bytes
    form = await request.form(max_files=1, max_fields=10, max_part_size=limit)
    try:
        part = form.get("file")
        target = form.get("target_path")
        unzip = str(form.get("unzip") or "false").lower() == "true"
        if part is None or isinstance(part, str):
            raise Transfer("builtins.ValueError", "multipart field 'file' is missing")
        if not isinstance(target, str) or not target:
            raise Transfer("builtins.ValueError", "multipart field 'target_path' is missing")
        async with _upload_gate(st, who), common.slot(st, who):
            if not unzip:
                await st.node.write_file_stream(sandbox_id, target, _file_chunks(part))
            else:
                await _unzip_into(st, sandbox_id, part.file, target, 4 * limit)
    finally:
        await form.close()
    return JSONResponse({})


async def _unzip_into(st: ServerState, sandbox_id: str, src: Any, target: str, limit: int) -> None:
    try:
        zf = await asyncio.to_thread(zipfile.ZipFile, src)
    except _ZIP_ERRORS as e:
        raise _bad_zip(e) from None
    with zf:
        try:
            plan = await asyncio.to_thread(_plan, zf, limit)
        except _ZIP_ERRORS as e:
            raise _bad_zip(e) from None
        c = None
        for info, rel, mode in plan:
            path = posixpath.join(target, rel) if rel != "." else target
            if info.is_dir():
                c = c or await st.node.client(sandbox_id)
                await c.mkdir(path if path.startswith("/") else _abs(st, sandbox_id, path), parents=True)
                continue
            try:
                await st.node.write_file_stream(sandbox_id, path, _member_chunks(zf, info), mode)
            except _ZIP_ERRORS as e:
                raise _bad_zip(e) from None
        if not plan:
            c = c or await st.node.client(sandbox_id)
            await c.mkdir(_abs(st, sandbox_id, target), parents=True)


def _abs(st: ServerState, sandbox_id: str, path: str) -> str:
    if path.startswith("/"):
        return path
    rec = st.node.record(sandbox_id)
    return posixpath.join(rec.spec.workdir or rec.extra.get("workdir") or "/", path)


@router.post("/close")
async def close(sandbox_id: str, request: Request) -> Response:
    """Close every session of the sandbox (the sandbox itself stays: close it with shoal's API)."""
    st, _who = _caller(request, sandbox_id)
    await close_all(st, sandbox_id)
    return JSONResponse({})


def prune(st: ServerState) -> None:
    """Forget the sessions of sandboxes that are gone (closed by shoal's API or their TTL)."""
    table = _sessions(st)
    for key in [k for k in table if not _exists(st, k[0])]:
        table.pop(key, None)


def _exists(st: ServerState, sandbox_id: str) -> bool:
    try:
        st.node.record(sandbox_id)
    except SandboxNotFound:
        return False
    return True


async def close_all(st: ServerState, sandbox_id: str) -> None:
    """Close and forget the sessions of a sandbox."""
    table = _sessions(st)
    for key in [k for k in table if k[0] == sandbox_id]:
        sess = table.pop(key)
        with contextlib.suppress(ShoalError):
            await st.node.shell_close(sandbox_id, sess.shell_id)


@router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
async def unsupported(sandbox_id: str, rest: str, request: Request) -> Response:
    """Anything else: SWE-ReX's error naming the endpoint."""
    return _error(Transfer(EXC + "SwerexException", f"{request.method} /{rest} is not part of SWE-ReX's runtime API "
                                                    "as shoal serves it (see docs/compat.md)"))
