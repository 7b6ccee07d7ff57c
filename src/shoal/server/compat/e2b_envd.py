"""E2B's in-sandbox daemon ("envd") served by `shoal serve` for every sandbox behind one origin.

The router (`shoal.server.compat.routing`) sends a request here when it names a sandbox: by the
`E2b-Sandbox-Id` header (clients with `E2B_SANDBOX_URL`) or by a `<port>-<id>.<domain>` Host (clients with
`E2B_DOMAIN` behind a TLS proxy). Served:

- Connect RPC (JSON codec) `process.Process`: Start, Connect, List, SendInput, StreamInput, SendSignal,
  CloseStdin, Update (PTY size); `filesystem.Filesystem`: Stat, ListDir, MakeDir, Move, Remove, WatchDir,
  CreateWatcher, GetWatcherEvents, RemoveWatcher.
- HTTP: `GET /health`, `GET /files?path=` (download), `POST /files` (multipart or octet-stream upload).

Not served (answered 501 naming them): `/init`, `/envs`, `/metrics`.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import logging
import posixpath
import re
import stat as statmod
from datetime import UTC, datetime
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile

from shoal.errors import FileNotFound, InvalidRequest, SandboxFileError, SandboxNotFound
from shoal.server.compat import common, e2b_watch
from shoal.server.compat.connect import (
    RpcError,
    client_stream,
    error_response,
    rpc_error,
    server_stream,
    timeout_s,
    unary,
)
from shoal.server.compat.e2b_procs import _int, table
from shoal.server.compat.routes import compat_router
from shoal.server.deps import ServerState, state_of
from shoal.server.tokens import Principal

log = logging.getLogger("shoal.server")
PREFIX = "/_e2b/envd"
#: every endpoint answers an error as _http_error() shapes it (shoal.server.compat.routes)
router = compat_router(lambda e: _http_error(e), prefix=PREFIX, include_in_schema=False)
#: the scope key the router fills with the sandbox a request is for
SCOPE_SANDBOX = "shoal.e2b.sandbox"


def _target(request: Request) -> tuple[ServerState, Principal, str]:
    """(state, caller, sandbox id) of an envd request; the caller must own the sandbox."""
    st = state_of(request)
    sid = request.scope.get(SCOPE_SANDBOX) or ""
    who = common.principal_for_sandbox(st, sid, request.headers)
    try:
        common.sandbox_of(st, who, sid)
    except SandboxNotFound:
        raise SandboxNotFound(f"The sandbox {sid} was not found") from None
    return st, who, sid


def _user(request: Request) -> str | None:
    """The user of an envd request (HTTP Basic `user:` as the SDK sends it)."""
    auth = request.headers.get("authorization") or ""
    if auth.lower().startswith("basic "):
        try:
            name = base64.b64decode(auth[6:].strip()).decode().partition(":")[0]
        except (binascii.Error, UnicodeDecodeError):
            raise RpcError("invalid_argument", "malformed Basic authorization header") from None
        return common.user_of(name)
    return None


def _b64(value: Any, field: str) -> bytes:
    if not isinstance(value, str):
        raise RpcError("invalid_argument", f"{field} must be base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise RpcError("invalid_argument", f"{field} is not valid base64") from None


def _obj(msg: dict[str, Any], field: str, where: str = "") -> dict[str, Any]:
    """A message field that must be an object (absent or null: empty); another type is invalid_argument."""
    v = msg.get(field)
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise RpcError("invalid_argument", f"{where}{field} must be an object, not {type(v).__name__}")
    return v


def _size(pty: dict[str, Any], default: int) -> tuple[int, int]:
    """(rows, cols) of a PTY message (protojson uint32: numbers or strings of digits), each 1-65535."""
    size = _obj(pty, "size", "pty.")
    rows = _int(size["rows"], "pty.size.rows") if size.get("rows") not in (None, 0, "0") else default
    cols = _int(size["cols"], "pty.size.cols") if size.get("cols") not in (None, 0, "0") else default
    return rows, cols


# ---- process.Process ----------------------------------------------------------------------------
_SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}


@router.post("/process.Process/Start")
async def process_start(request: Request) -> Response:
    """Start a command and stream its events (start{pid}, data{stdout|stderr|pty}, end{exitCode})."""

    async def handler(msg: dict[str, Any]) -> Any:
        st, who, sid = _target(request)
        cfg = _obj(msg, "process")
        cmd = cfg.get("cmd")
        if not isinstance(cmd, str) or not cmd:
            raise RpcError("invalid_argument", "process.cmd is required")
        args = cfg.get("args") or []
        envs = cfg.get("envs") or {}
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise RpcError("invalid_argument", "process.args must be a list of strings")
        if not isinstance(envs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in envs.items()):
            raise RpcError("invalid_argument", "process.envs must map strings to strings")
        cwd = cfg.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise RpcError("invalid_argument", "process.cwd must be a string")
        pty = _obj(msg, "pty") if msg.get("pty") is not None else None
        rows, cols = _size(pty or {}, 0)
        rows, cols = rows or 24, cols or 80
        if not (0 < rows < 65536 and 0 < cols < 65536):
            raise RpcError("invalid_argument", "pty size must be 1-65535 rows and cols")
        tag = msg.get("tag")
        if tag is not None and not isinstance(tag, str):
            raise RpcError("invalid_argument", "tag must be a string")
        procs = table(st)
        argv = await _string_command_shell(st, sid, [cmd, *args])
        async with common.slot(st, who):
            p = await procs.start(st, sid, argv, env=envs, cwd=cwd or None, user=_user(request),
                                  timeout=timeout_s(request), tty=pty is not None, stdin=msg.get("stdin") is True,
                                  tag=tag, rows=rows, cols=cols)
        q = p.listen()
        procs.run(p)
        return procs.events(p, q, _keepalive(request))

    return await server_stream(request, handler)


async def _string_command_shell(st: ServerState, sid: str, argv: list[str]) -> list[str]:
    """The E2B SDK sends every string command as `/bin/bash -l -c CMD`; in an image without bash (busybox,
    alpine) that runs with the image's /bin/sh instead, as shoal's own string commands do (NoShell when it
    has neither). Any other argv, or an image with bash, is left as it is."""
    if argv[:3] != ["/bin/bash", "-l", "-c"] or len(argv) != 4:
        return argv
    shell = await st.node.shell_of(st.node.record(sid))
    return argv if shell == "/bin/bash" else [shell, "-c", argv[3]]


def _keepalive(request: Request) -> float:
    try:
        return max(1.0, float(request.headers.get("keepalive-ping-interval") or 50))
    except ValueError:
        return 50.0


@router.post("/process.Process/Connect")
async def process_connect(request: Request) -> Response:
    """Stream the events of a running process from now on."""

    async def handler(msg: dict[str, Any]) -> Any:
        st, _who, sid = _target(request)
        procs = table(st)
        p = procs.find(sid, msg.get("process"))
        return procs.events(p, p.listen(), _keepalive(request))

    return await server_stream(request, handler)


@router.post("/process.Process/List")
async def process_list(request: Request) -> Response:
    """The running processes started through this API."""

    async def handler(msg: dict[str, Any]) -> dict[str, Any]:
        st, _who, sid = _target(request)
        return {"processes": [p.info() for p in table(st).procs(sid)]}

    return await unary(request, handler)


@router.post("/process.Process/SendInput")
async def process_send_input(request: Request) -> Response:
    """Write to a process's stdin (or its PTY)."""

    async def handler(msg: dict[str, Any]) -> dict[str, Any]:
        st, _who, sid = _target(request)
        inp = _obj(msg, "input")  # the message is checked whole before the process is looked up
        key = "pty" if "pty" in inp else "stdin"
        data = _b64(inp.get(key, ""), f"input.{key}")
        p = table(st).find(sid, msg.get("process"))
        if not p.stdin:
            raise RpcError("failed_precondition", f"process {p.pid} was not started with stdin=True")
        await p.handle.write_stdin(data)
        return {}

    return await unary(request, handler)


@router.post("/process.Process/CloseStdin")
async def process_close_stdin(request: Request) -> Response:
    """Close a process's stdin (EOF)."""

    async def handler(msg: dict[str, Any]) -> dict[str, Any]:
        st, _who, sid = _target(request)
        p = table(st).find(sid, msg.get("process"))
        if not p.stdin:
            raise RpcError("failed_precondition", f"process {p.pid} was not started with stdin=True")
        await p.handle.close_stdin()
        return {}

    return await unary(request, handler)


@router.post("/process.Process/SendSignal")
async def process_send_signal(request: Request) -> Response:
    """SIGKILL or SIGTERM a process (its whole process group)."""

    async def handler(msg: dict[str, Any]) -> dict[str, Any]:
        st, _who, sid = _target(request)
        raw = msg.get("signal")
        sig = _SIGNALS.get(raw) if isinstance(raw, (str, int)) and not isinstance(raw, bool) else None
        if sig is None:
            raise RpcError("invalid_argument", f"signal {msg.get('signal')!r} is not one of SIGNAL_SIGKILL, "
                                               "SIGNAL_SIGTERM")
        p = table(st).find(sid, msg.get("process"))
        await p.handle.send_signal(sig)
        return {}

    return await unary(request, handler)


@router.post("/process.Process/StreamInput")
async def process_stream_input(request: Request) -> Response:
    """Feed a process's stdin (or PTY) from a client stream: a `start` naming the process, then `data` events."""

    async def handler(messages: Any) -> dict[str, Any]:
        st, _who, sid = _target(request)
        p = None
        async for msg in messages:
            if "start" in msg:
                p = table(st).find(sid, _obj(msg, "start").get("process"))
                if not p.stdin:
                    raise RpcError("failed_precondition", f"process {p.pid} was not started with stdin=True")
            elif "data" in msg:
                if p is None:
                    raise RpcError("failed_precondition", "the input stream must start with a start event")
                inp = _obj(_obj(msg, "data"), "input", "data.")
                key = "pty" if "pty" in inp else "stdin"
                await p.handle.write_stdin(_b64(inp.get(key, ""), f"input.{key}"))
            # keepalive messages only keep the stream open
        if p is None:
            raise RpcError("invalid_argument", "the input stream had no start event")
        return {}

    return await client_stream(request, handler)


@router.post("/process.Process/Update")
async def process_update(request: Request) -> Response:
    """Resize a PTY process."""

    async def handler(msg: dict[str, Any]) -> dict[str, Any]:
        st, _who, sid = _target(request)
        rows, cols = _size(_obj(msg, "pty"), 0)
        p = table(st).find(sid, msg.get("process"))
        if not p.tty:
            raise RpcError("failed_precondition", f"process {p.pid} has no PTY to resize")
        if not (0 < rows < 65536 and 0 < cols < 65536):
            raise RpcError("invalid_argument", "pty size must be 1-65535 rows and cols")
        await p.handle.resize(rows, cols)
        return {}

    return await unary(request, handler)


# ---- filesystem.Filesystem ----------------------------------------------------------------------
_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}


def _permissions(kind: str, mode: int) -> str:
    bits = {"file": statmod.S_IFREG, "dir": statmod.S_IFDIR, "symlink": statmod.S_IFLNK}.get(kind, statmod.S_IFREG)
    return statmod.filemode(bits | (mode & 0o7777))


def entry_info(path: str, kind: str, size: int, mode: int, mtime: float, uid: int | None = None,
               gid: int | None = None) -> dict[str, Any]:
    """E2B's EntryInfo (JSON form) of one filesystem object."""
    if kind not in _TYPES:
        kind = "file"
    out: dict[str, Any] = {
        "name": posixpath.basename(path.rstrip("/")) or "/", "type": _TYPES[kind], "path": path, "size": str(size),
        "mode": mode & 0o7777, "permissions": _permissions(kind, mode),
        "owner": "" if uid is None else ("root" if uid == 0 else str(uid)),
        "group": "" if gid is None else ("root" if gid == 0 else str(gid)),
        "modifiedTime": datetime.fromtimestamp(mtime, UTC).isoformat().replace("+00:00", "Z"),
    }
    if kind == "symlink":
        out["isSymlink"] = True
    return out


def _abs(st: ServerState, sid: str, path: Any, field: str = "path") -> str:
    if not isinstance(path, str) or not path:
        raise RpcError("invalid_argument", f"{field} is required")
    if not path.startswith("/"):
        rec = st.node.record(sid)
        base = rec.spec.workdir or rec.extra.get("workdir") or "/"
        path = posixpath.join(base, path)
    return posixpath.normpath(path) if path != "/" else "/"


async def _stat(st: ServerState, sid: str, path: str) -> dict[str, Any]:
    c = await st.node.client(sid)
    try:
        s = await c.stat(path)
    except FileNotFound:
        raise RpcError("not_found", f"path {path} does not exist") from None
    return entry_info(path, s.get("type", "file"), int(s.get("size", 0)), int(s.get("mode", 0)),
                      float(s.get("mtime", 0)), s.get("uid"), s.get("gid"))


@router.post("/filesystem.Filesystem/Stat")
async def fs_stat(request: Request) -> Response:
    """Information about a file or directory."""

    async def handler(msg: dict[str, Any]) -> dict[str, Any]:
        st, _who, sid = _target(request)
        return {"entry": await _stat(st, sid, _abs(st, sid, msg.get("path")))}

    return await unary(request, handler)


@router.post("/filesystem.Filesystem/ListDir")
async def fs_list_dir(request: Request) -> Response:
    """Entries of a directory, `depth` levels deep (1 = its children)."""

    async def handler(msg: dict[str, Any]) -> dict[str, Any]:
        st, _who, sid = _target(request)
        root = _abs(st, sid, msg.get("path"))
        depth = msg.get("depth") or 1
        if not isinstance(depth, int) or depth < 1:
            raise RpcError("invalid_argument", "depth must be at least 1")
        out: list[dict[str, Any]] = []
        level = [root]
        for _ in range(min(depth, 64)):
            nxt = []
            for d in level:
                try:
                    entries = await st.node.list_dir(sid, d)
                except SandboxFileError as e:
                    if d == root:
                        raise RpcError("invalid_argument", f"{root} is not a directory: {e.message}") from None
                    continue  # an unreadable subdirectory: list what can be listed
                for ent in entries:
                    p = posixpath.join(d, ent.name)
                    out.append(entry_info(p, ent.type, ent.size, ent.mode, ent.mtime))
                    if ent.type == "dir":
                        nxt.append(p)
                if len(out) > 100_000:
                    raise RpcError("resource_exhausted", "listing has more than 100000 entries: list less deep")
            level = nxt
            if not level:
                break
        return {"entries": out}

    return await unary(request, handler)


@router.post("/filesystem.Filesystem/MakeDir")
async def fs_make_dir(request: Request) -> Response:
    """Create a directory and its parents; already_exists when it is there."""

    async def handler(msg: dict[str, Any]) -> dict[str, Any]:
        st, _who, sid = _target(request)
        path = _abs(st, sid, msg.get("path"))
        c = await st.node.client(sid)
        with contextlib.suppress(FileNotFound):
            await c.stat(path)
            raise RpcError("already_exists", f"{path} already exists")
        await c.mkdir(path, parents=True)
        return {"entry": await _stat(st, sid, path)}

    return await unary(request, handler)


@router.post("/filesystem.Filesystem/Remove")
async def fs_remove(request: Request) -> Response:
    """Remove a file or a whole directory tree."""

    async def handler(msg: dict[str, Any]) -> dict[str, Any]:
        st, _who, sid = _target(request)
        path = _abs(st, sid, msg.get("path"))
        if path == "/":
            raise RpcError("invalid_argument", "refusing to remove /")
        c = await st.node.client(sid)
        await c.remove(path, recursive=True)
        return {}

    return await unary(request, handler)


@router.post("/filesystem.Filesystem/Move")
async def fs_move(request: Request) -> Response:
    """Rename a file or directory (like rename(2): a file at the destination is replaced)."""

    async def handler(msg: dict[str, Any]) -> dict[str, Any]:
        st, _who, sid = _target(request)
        src = _abs(st, sid, msg.get("source"), "source")
        dst = _abs(st, sid, msg.get("destination"), "destination")
        await _stat(st, sid, src)
        r = await st.node.exec(sid, ["mv", "-T", "--", src, dst], timeout=60)
        if r.exit_code != 0:
            err = r.stderr.decode(errors="replace") if isinstance(r.stderr, bytes) else str(r.stderr)
            raise RpcError("failed_precondition", f"cannot move {src} to {dst}: {err.strip()}")
        return {"entry": await _stat(st, sid, dst)}

    return await unary(request, handler)


@router.post("/filesystem.Filesystem/WatchDir")
async def fs_watch_dir(request: Request) -> Response:
    """Stream a directory's filesystem events (inotify in the sandbox; shoal.server.compat.e2b_watch)."""

    async def handler(msg: dict[str, Any]) -> Any:
        st, _who, sid = _target(request)
        recursive = e2b_watch.watch_options(msg)
        stream = await st.node.watch(sid, _abs(st, sid, msg.get("path")), recursive=recursive)
        return e2b_watch.stream_events(stream, _keepalive(request))

    return await server_stream(request, handler)


@router.post("/filesystem.Filesystem/CreateWatcher")
async def fs_create_watcher(request: Request) -> Response:
    """Start a watcher whose events GetWatcherEvents returns."""

    async def handler(msg: dict[str, Any]) -> dict[str, Any]:
        st, _who, sid = _target(request)
        recursive = e2b_watch.watch_options(msg)
        w = await e2b_watch.watchers(st).create(st, sid, _abs(st, sid, msg.get("path")), recursive)
        return {"watcherId": w.id}

    return await unary(request, handler)


@router.post("/filesystem.Filesystem/GetWatcherEvents")
async def fs_get_watcher_events(request: Request) -> Response:
    """The events of a watcher since the last call."""

    async def handler(msg: dict[str, Any]) -> dict[str, Any]:
        st, _who, sid = _target(request)
        t = e2b_watch.watchers(st)
        return {"events": t.take(t.find(sid, msg.get("watcherId", msg.get("watcher_id"))))}

    return await unary(request, handler)


@router.post("/filesystem.Filesystem/RemoveWatcher")
async def fs_remove_watcher(request: Request) -> Response:
    """Stop a watcher."""

    async def handler(msg: dict[str, Any]) -> dict[str, Any]:
        st, _who, sid = _target(request)
        t = e2b_watch.watchers(st)
        await t.remove(t.find(sid, msg.get("watcherId", msg.get("watcher_id"))))
        return {}

    return await unary(request, handler)


@router.post("/filesystem.Filesystem/{method}")
@router.post("/process.Process/{method}")
async def unsupported_rpc(method: str, request: Request) -> Response:
    """RPCs shoal does not serve: Connect `unimplemented`, naming the method."""
    svc = request.url.path.split("/")[-2]
    err = RpcError("unimplemented", f"{svc}/{method}: this method is not supported by shoal's envd (see "
                                    "docs/compat.md)")
    return error_response(err)


# ---- HTTP endpoints ------------------------------------------------------------------------------
def _http_error(e: BaseException) -> Response:
    """An envd HTTP error: the status E2B's SDK maps (404 file not found, 502 sandbox gone, ...)."""
    if isinstance(e, SandboxNotFound) and "was not found" in e.message:
        return JSONResponse({"code": 502, "message": e.message}, status_code=502)
    err = rpc_error(e)
    status = {"not_found": 404, "invalid_argument": 400, "unauthenticated": 401, "permission_denied": 403,
              "failed_precondition": 400, "already_exists": 409, "resource_exhausted": 429, "unimplemented": 501,
              "deadline_exceeded": 504, "unavailable": 502}.get(err.code, 500)
    if err.code == "internal":
        log.error("envd HTTP request failed: %s", err.message)
    return JSONResponse({"code": status, "message": err.message}, status_code=status)


@router.get("/health")
async def health(request: Request) -> Response:
    """204 while the sandbox runs; 502 'was not found' once it is gone (what the SDK's is_running reads)."""
    st, _who, sid = _target(request)
    rec = st.node.record(sid)
    if rec.state not in ("running", "paused"):
        raise SandboxNotFound(f"The sandbox {sid} was not found")
    return Response(status_code=204)


@router.get("/files")
async def download(request: Request) -> Response:
    """A file's bytes."""
    try:
        st, who, sid = _target(request)
        path = _abs(st, sid, request.query_params.get("path"))
        async with common.slot(st, who):
            data = await st.node.read_file(sid, path)
        name = re.sub(r"[^A-Za-z0-9._-]", "_", posixpath.basename(path)) or "file"
        return Response(data, media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{name}"'})
    except SandboxFileError as e:
        return JSONResponse({"code": 400, "message": f"cannot read: {e.message}"}, status_code=400)


@router.post("/files")
async def upload(request: Request) -> Response:
    """Write files: multipart (`file` parts named by their path, or `?path=` for one) or an octet-stream body."""
    try:
        st, who, sid = _target(request)
        user = _user(request)
        ctype = (request.headers.get("content-type") or "").split(";", 1)[0].strip().lower()
        if request.headers.get("content-encoding", "identity").lower() not in ("identity", ""):
            raise InvalidRequest("compressed uploads (gzip) are not supported by shoal's envd: upload without gzip")
        files: list[tuple[str, bytes]] = []
        if ctype == "multipart/form-data":
            form = await request.form(max_files=10_000, max_fields=10_000, max_part_size=st.settings.max_upload_bytes)
            try:
                parts = [v for _k, v in form.multi_items() if isinstance(v, UploadFile)]
                if not parts:
                    raise InvalidRequest("multipart upload without a file part")
                one = request.query_params.get("path")
                for part in parts:
                    name = one if (one and len(parts) == 1) else (part.filename or one)
                    files.append((_abs(st, sid, name), await part.read()))
            finally:
                await form.close()
        else:
            files.append((_abs(st, sid, request.query_params.get("path")), await request.body()))
        out = []
        async with common.slot(st, who):
            for path, data in files:
                await st.node.write_file(sid, path, data)
                if user is not None:
                    await st.node.exec(sid, ["chown", "--", user, path], timeout=30)
                out.append({"name": posixpath.basename(path), "type": "file", "path": path})
        return JSONResponse(out)
    except SandboxFileError as e:
        return JSONResponse({"code": 400, "message": f"cannot write: {e.message}"}, status_code=400)


@router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
async def unsupported_http(rest: str, request: Request) -> Response:
    """envd HTTP endpoints shoal does not serve (`/init`, `/envs`, `/metrics`, ...): 501 naming them."""
    return JSONResponse({"code": 501, "message": f"{request.method} /{rest} is not supported by shoal's envd "
                                                 "(see docs/compat.md)"}, status_code=501)
