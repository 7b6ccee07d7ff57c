"""The HTTP transport: the SDK talking to `shoal serve` (`shoal.Client("http://host:8700", token=...)`).

REST calls go through one pooled httpx client; streams use one WebSocket each (protocol in
docs/api.md). Errors come back typed (`shoal.errors.error_from_dict`). A refusal for capacity (429:
the node is full right now, or this token has too many requests in progress) is retried with
jittered exponential backoff, honouring Retry-After, until the call's deadline; so is a connection
that could not be opened (a server restarting). Quota refusals (403) are not retried: they need a
sandbox closed first.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import json
import random
import time
import urllib.parse
import weakref
import zlib
from typing import TYPE_CHECKING, Any

import httpx

from shoal.errors import CapacityExceeded, InvalidRequest, ShoalError, Timeout, error_from_dict
from shoal.limits import DEFAULT_EXEC_TIMEOUT_S
from shoal.models import DirEntry, ExecResult, SandboxInfo, StreamEvent
from shoal.records import check_sandbox_id
from shoal.sdk.transport import Cmd, Transport
from shoal.server.codec import (
    STDERR_TAG,
    decode_dir_entry,
    decode_exec_result,
    decode_info,
    decode_run_code_result,
)

if TYPE_CHECKING:
    from shoal.spec import SandboxSpec

_CHUNK = 1 << 20  # stdin bytes per WebSocket message
_SLACK_S = 30.0   # how much longer than a command's own timeout an exec request may take
_SHARD_CONNECTIONS = 32  # connections per httpx pool (see HttpTransport.start)


def _q(part: str) -> str:
    """Quote one URL path segment (IDs never contain '/', but a caller's typo must not change the route)."""
    return urllib.parse.quote(str(part), safe="")


def _sid(sandbox_id: str) -> str:
    """Validate a sandbox ID like the node does (SandboxNotFound for a malformed one), then quote it."""
    return _q(check_sandbox_id(sandbox_id))


class TransportError(ShoalError):
    """The server could not be reached, or the connection broke mid-request."""

    http_status = 503
    code = "transport_error"


def _error_from_response(r: httpx.Response) -> ShoalError:
    try:
        body = r.json()
        err = body.get("error") if isinstance(body, dict) else None
    except ValueError:
        err = None
    if isinstance(err, dict) and "code" in err:
        e = error_from_dict(err)
        if isinstance(e, CapacityExceeded) and "retry-after" in r.headers:
            try:
                e.retry_after_s = max(e.retry_after_s, float(r.headers["retry-after"]))
            except ValueError:
                pass
        return e
    text = r.text[:300].strip()
    if r.status_code == 429:
        return CapacityExceeded(f"HTTP 429 from the server: {text}", retry_after_s=1.0)
    return ShoalError(f"HTTP {r.status_code} from the server: {text or r.reason_phrase}")


class HttpStream:
    """A running command over a WebSocket: iterate for StreamEvents; feed stdin, signal, resize."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self._done = False
        self.result: ExecResult | None = None

    async def _open(self, start: dict[str, Any]) -> HttpStream:
        from websockets.exceptions import ConnectionClosed

        try:
            await self._ws.send(json.dumps(start))
            first = await self._ws.recv()
        except ConnectionClosed as e:
            await self.aclose()
            raise TransportError(f"stream closed before it started: {e}") from None
        msg = json.loads(first) if isinstance(first, str) else {}
        if msg.get("type") == "started":
            return self
        await self.aclose()
        if msg.get("type") == "error":
            raise error_from_dict(msg["error"])
        raise TransportError(f"unexpected first stream message: {str(first)[:200]}")

    def __aiter__(self) -> HttpStream:
        return self

    async def __anext__(self) -> StreamEvent:
        from websockets.exceptions import ConnectionClosed

        while True:
            if self._done:
                raise StopAsyncIteration
            try:
                msg = await self._ws.recv()
            except ConnectionClosed as e:
                self._done = True
                raise TransportError(f"stream connection lost before the command ended: {e}") from None
            if isinstance(msg, bytes):
                if not msg:
                    continue
                return StreamEvent("stderr" if msg[0] == STDERR_TAG else "stdout", msg[1:])
            d = json.loads(msg)
            kind = d.get("type")
            if kind == "exit":
                self._done = True
                self.result = decode_exec_result(d["result"])
                await self.aclose()
                return StreamEvent("exit", result=self.result)
            if kind == "error":
                self._done = True
                await self.aclose()
                raise error_from_dict(d["error"])
            # other message types: from a newer server, ignored

    async def wait(self) -> ExecResult:
        """Consume the remaining events; return the result with the output not yet iterated."""
        out: list[bytes] = []
        err: list[bytes] = []
        async for ev in self:
            if ev.kind == "stdout":
                out.append(ev.data)
            elif ev.kind == "stderr":
                err.append(ev.data)
        if self.result is None:
            raise TransportError("stream ended without a result")
        self.result.stdout = b"".join(out)
        self.result.stderr = b"".join(err)
        return self.result

    async def _send(self, data: str | bytes) -> None:
        from websockets.exceptions import ConnectionClosed

        if self._done:
            return
        try:
            await self._ws.send(data)
        except ConnectionClosed:
            pass  # the command ended meanwhile; iteration reports how

    async def write_stdin(self, data: bytes) -> None:
        """Send bytes to the command's stdin (or PTY)."""
        for i in range(0, len(data), _CHUNK):
            await self._send(bytes(data[i:i + _CHUNK]))

    async def close_stdin(self) -> None:
        """Signal end of input."""
        await self._send(json.dumps({"type": "stdin_eof"}))

    async def send_signal(self, sig: int) -> None:
        """Deliver a signal to the command's process group."""
        await self._send(json.dumps({"type": "signal", "signal": int(sig)}))

    async def resize(self, rows: int, cols: int) -> None:
        """Resize the PTY (tty=True)."""
        await self._send(json.dumps({"type": "resize", "rows": int(rows), "cols": int(cols)}))

    async def aclose(self) -> None:
        """Close the WebSocket (a command still running is killed by the server)."""
        self._done = True
        try:
            await self._ws.close()
        except Exception:
            pass


class HttpTransport(Transport):
    """Every Transport method as HTTP calls to a shoal API server."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 600.0,
                 max_connections: int = 1024, retry: bool = True, verify: bool | str = True,
                 headers: dict[str, str] | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise InvalidRequest(f"server URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.token = token
        self.timeout = float(timeout)
        self.retry = retry
        self._verify = verify
        self._max_connections = max_connections
        self._headers = {"User-Agent": "shoal-sdk", **(headers or {})}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._shards: list[httpx.AsyncClient] = []
        self._rr = 0
        #: streams still open: closed with the transport (their commands are then killed by the server)
        self._streams: weakref.WeakSet[HttpStream] = weakref.WeakSet()

    # ---- plumbing -------------------------------------------------------------------------------
    async def start(self) -> None:
        # httpcore's connection pool does O(connections x waiting requests) work per request: with
        # hundreds of requests in flight one pool costs milliseconds of CPU each. Several small pools,
        # chosen by sandbox ID (so a sandbox's requests reuse the same keep-alive connections), keep
        # that cost flat.
        if not self._shards:
            n = max(1, -(-self._max_connections // _SHARD_CONNECTIONS))
            per = max(1, -(-self._max_connections // n))
            # each client loads the CA bundle for its TLS context (~0.1 s of CPU): plain http needs none
            verify = self._verify if self.url.startswith("https://") else False
            # twice its share of connections: hashing never spreads sandboxes perfectly evenly
            self._shards = [httpx.AsyncClient(
                base_url=self.url, headers=self._headers, verify=verify,
                timeout=httpx.Timeout(connect=10.0, read=self.timeout, write=60.0, pool=None),
                limits=httpx.Limits(max_connections=2 * per, max_keepalive_connections=per)) for _ in range(n)]

    async def aclose(self) -> None:
        for st in list(self._streams):
            await st.aclose()
        shards, self._shards = self._shards, []
        for c in shards:
            await c.aclose()

    async def _client(self, path: str = "") -> httpx.AsyncClient:
        if not self._shards:
            await self.start()
        n = len(self._shards)
        if n == 1:
            return self._shards[0]
        if path.startswith("/v1/sandboxes/"):
            key = path.split("/", 4)[3]
            if key != "batch":
                return self._shards[zlib.crc32(key.encode()) % n]
        self._rr = (self._rr + 1) % n
        return self._shards[self._rr]

    async def _request(self, method: str, path: str, *, json_body: Any = None, params: Any = None,
                       content: bytes | None = None, read_timeout: float | None = -1.0,
                       retry_capacity: bool = True) -> httpx.Response:
        """One API call with typed errors, retrying capacity refusals and unopened connections until the
        deadline (this transport's `timeout`, or the call's own when it is longer)."""
        http = await self._client(path)
        rt = self.timeout if read_timeout == -1.0 else read_timeout
        deadline = time.monotonic() + max(self.timeout, (rt or 0.0))
        timeout = httpx.Timeout(connect=10.0, read=rt, write=60.0, pool=None)
        headers = {"Content-Type": "application/octet-stream"} if content is not None else None
        attempt = 0
        while True:
            attempt += 1
            try:
                r = await http.request(method, path, json=json_body, params=params, content=content,
                                       timeout=timeout, headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                wait = self._backoff(attempt, 0.0)
                if not self.retry or time.monotonic() + wait > deadline:
                    # sent=False: the request never reached the server (safe to send again, even a create)
                    raise TransportError(f"cannot reach the shoal server at {self.url}: {e}", sent=False) from None
                await asyncio.sleep(wait)
                continue
            except httpx.TimeoutException as e:
                raise Timeout(f"{method} {path}: no answer from {self.url} in time ({type(e).__name__})") from None
            except httpx.HTTPError as e:
                raise TransportError(f"{method} {path} to {self.url} failed: {type(e).__name__}: {e}") from None
            if r.status_code < 400:
                return r
            err = _error_from_response(r)
            if isinstance(err, CapacityExceeded) and self.retry and retry_capacity:
                wait = self._backoff(attempt, err.retry_after_s)
                if time.monotonic() + wait <= deadline:
                    await asyncio.sleep(wait)
                    continue
            raise err

    @staticmethod
    def _backoff(attempt: int, at_least: float) -> float:
        base = min(10.0, 0.25 * 2 ** min(attempt - 1, 6))
        return float(max(at_least, base) * random.uniform(0.8, 1.2))

    @staticmethod
    def _spec_json(spec: SandboxSpec) -> dict[str, Any]:
        d = spec.to_dict()
        if d.get("project") in (None, "default"):
            d.pop("project", None)  # the token decides the project
        return d

    # ---- sandboxes ------------------------------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        r = await self._request("POST", "/v1/sandboxes", json_body=self._spec_json(spec))
        return decode_info(r.json())

    async def create_many(self, spec: SandboxSpec, n: int, *, all_or_nothing: bool = False
                          ) -> list[SandboxInfo | ShoalError]:
        """One batch request; items refused for capacity are asked for again (backoff) until the deadline.
        A gang (`all_or_nothing`) is one request, never retried: all sandboxes, or its error at once."""
        body = self._spec_json(spec)
        if all_or_nothing:
            r = await self._request("POST", "/v1/sandboxes/batch", json_body={**body, "n": int(n),
                                                                             "all_or_nothing": True},
                                    retry_capacity=False)
            return [decode_info(it["sandbox"]) for it in r.json()["items"]]
        out: list[SandboxInfo | ShoalError | None] = [None] * int(n)
        todo = list(range(int(n)))
        deadline = time.monotonic() + self.timeout
        attempt = 0
        while todo:
            attempt += 1
            r = await self._request("POST", "/v1/sandboxes/batch", json_body={**body, "n": len(todo)})
            items = r.json()["items"]
            again: list[int] = []
            retry_after = 0.0
            for idx, it in zip(todo, items, strict=True):
                if it.get("sandbox") is not None:
                    out[idx] = decode_info(it["sandbox"])
                    continue
                e = error_from_dict(it.get("error") or {})
                out[idx] = e
                if isinstance(e, CapacityExceeded):
                    again.append(idx)
                    retry_after = max(retry_after, e.retry_after_s)
            if not again or not self.retry:
                break
            wait = self._backoff(attempt, retry_after)
            if time.monotonic() + wait > deadline:
                break
            await asyncio.sleep(wait)
            todo = again
        return [x if x is not None else ShoalError("no result") for x in out]

    async def events(self, sandbox_id: str | None = None, *, commands: bool = False, kinds: list[str] | None = None,
                     since: float | None = None, limit: int = 200) -> list[Any]:
        from shoal.node.events import SandboxEvent

        if sandbox_id is not None:
            r = await self._request("GET", f"/v1/sandboxes/{_sid(sandbox_id)}/events",
                                    params=[("commands", "true" if commands else "false")])
            evs = r.json()["events"]
            if kinds:
                evs = [e for e in evs if e.get("kind") in kinds]
            if since is not None:
                evs = [e for e in evs if float(e.get("t", 0)) > since]
            evs = evs[-limit:]
        else:
            params: list[tuple[str, str]] = [("limit", str(limit))] + [("kind", k) for k in kinds or []]
            if since is not None:
                params.append(("since", repr(float(since))))
            evs = (await self._request("GET", "/v1/events", params=params)).json()["events"]
        return [SandboxEvent.from_dict(e) for e in evs]

    async def get(self, sandbox_id: str) -> SandboxInfo:
        r = await self._request("GET", f"/v1/sandboxes/{_sid(sandbox_id)}")
        return decode_info(r.json())

    async def list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        r = await self._request("GET", "/v1/sandboxes", params=params)
        return [decode_info(d) for d in r.json()["sandboxes"]]

    async def close(self, sandbox_id: str) -> None:
        await self._request("DELETE", f"/v1/sandboxes/{_sid(sandbox_id)}")

    # ---- commands -------------------------------------------------------------------------------
    async def exec(self, sandbox_id: str, cmd: Cmd, *, timeout: float | None = DEFAULT_EXEC_TIMEOUT_S,
                   cwd: str | None = None, env: dict[str, str] | None = None, user: str | None = None,
                   stdin: bytes | None = None, max_output: int | None = None) -> ExecResult:
        body: dict[str, Any] = {"cmd": cmd, "timeout": timeout, "cwd": cwd, "env": env, "user": user,
                                "max_output": max_output}
        if stdin is not None:
            body["stdin"] = base64.b64encode(stdin).decode()
        r = await self._request("POST", f"/v1/sandboxes/{_sid(sandbox_id)}/exec", json_body=body,
                                read_timeout=None if timeout is None else float(timeout) + _SLACK_S)
        return decode_exec_result(r.json())

    def _ws_url(self, path: str) -> str:
        return ("ws" + self.url[4:] if self.url.startswith("http") else self.url) + path

    async def _ws_connect(self, path: str) -> Any:
        from websockets.asyncio.client import connect

        extra = {k: v for k, v in self._headers.items() if k != "User-Agent"}
        deadline = time.monotonic() + self.timeout
        attempt = 0
        while True:
            attempt += 1
            try:
                return await connect(self._ws_url(path), additional_headers=extra, max_size=64 << 20,
                                     compression=None, open_timeout=10, ping_interval=20, ping_timeout=60,
                                     user_agent_header="shoal-sdk", proxy=None)
            except OSError as e:
                wait = self._backoff(attempt, 0.0)
                if not self.retry or time.monotonic() + wait > deadline:
                    raise TransportError(f"cannot open a stream to {self.url}: {e}", sent=False) from None
                await asyncio.sleep(wait)
            except Exception as e:
                raise TransportError(f"cannot open a stream to {self.url}: {type(e).__name__}: {e}") from None

    async def stream(self, sandbox_id: str, cmd: Cmd, *, timeout: float | None = DEFAULT_EXEC_TIMEOUT_S,
                     cwd: str | None = None, env: dict[str, str] | None = None, user: str | None = None,
                     tty: bool = False, stdin: bool = False) -> HttpStream:
        ws = await self._ws_connect(f"/v1/sandboxes/{_sid(sandbox_id)}/stream")
        st = HttpStream(ws)
        self._streams.add(st)
        return await st._open({"cmd": cmd, "timeout": timeout, "cwd": cwd, "env": env, "user": user,
                               "tty": tty, "stdin": stdin})

    async def shell_stream(self, sandbox_id: str, shell_id: str, cmd: str, *,
                           timeout: float | None = DEFAULT_EXEC_TIMEOUT_S, max_output: int | None = None) -> HttpStream:
        """Run a command in a persistent shell and stream its output (HTTP transport extra)."""
        ws = await self._ws_connect(f"/v1/sandboxes/{_sid(sandbox_id)}/stream")
        st = HttpStream(ws)
        self._streams.add(st)
        return await st._open({"shell": shell_id, "cmd": cmd, "timeout": timeout, "max_output": max_output})

    # ---- files ----------------------------------------------------------------------------------
    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        r = await self._request("GET", f"/v1/sandboxes/{_sid(sandbox_id)}/files", params={"path": path})
        return r.content

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidRequest("data must be bytes")
        await self._request("PUT", f"/v1/sandboxes/{_sid(sandbox_id)}/files",
                            params={"path": path, "mode": format(int(mode) & 0o7777, "04o")}, content=bytes(data))

    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[DirEntry]:
        r = await self._request("GET", f"/v1/sandboxes/{_sid(sandbox_id)}/dir", params={"path": path})
        return [decode_dir_entry(d) for d in r.json()["entries"]]

    # ---- shells ---------------------------------------------------------------------------------
    async def shell_open(self, sandbox_id: str, *, cwd: str | None = None, env: dict[str, str] | None = None,
                         user: str | None = None) -> str:
        r = await self._request("POST", f"/v1/sandboxes/{_sid(sandbox_id)}/shells",
                                json_body={"cwd": cwd, "env": env, "user": user})
        return str(r.json()["shell_id"])

    async def shell_run(self, sandbox_id: str, shell_id: str, cmd: str, *,
                        timeout: float | None = DEFAULT_EXEC_TIMEOUT_S,
                        max_output: int | None = None) -> ExecResult:
        r = await self._request("POST", f"/v1/sandboxes/{_sid(sandbox_id)}/shells/{_q(shell_id)}/run",
                                json_body={"cmd": cmd, "timeout": timeout, "max_output": max_output},
                                read_timeout=None if timeout is None else float(timeout) + _SLACK_S)
        return decode_exec_result(r.json())

    async def shell_close(self, sandbox_id: str, shell_id: str) -> None:
        await self._request("DELETE", f"/v1/sandboxes/{_sid(sandbox_id)}/shells/{_q(shell_id)}")

    # ---- lifecycle ------------------------------------------------------------------------------
    async def pause(self, sandbox_id: str) -> None:
        await self._request("POST", f"/v1/sandboxes/{_sid(sandbox_id)}/pause")

    async def resume(self, sandbox_id: str) -> None:
        await self._request("POST", f"/v1/sandboxes/{_sid(sandbox_id)}/resume")

    async def set_cpu_class(self, sandbox_id: str, cpu_class: str) -> dict[str, Any]:
        r = await self._request("POST", f"/v1/sandboxes/{_sid(sandbox_id)}/cpu_class",
                                json_body={"cpu_class": cpu_class})
        out: dict[str, Any] = r.json()
        return out

    async def snapshot(self, sandbox_id: str, name: str) -> dict[str, Any]:
        r = await self._request("POST", f"/v1/sandboxes/{_sid(sandbox_id)}/snapshot", json_body={"name": name},
                                read_timeout=None)
        out: dict[str, Any] = r.json()
        return out

    async def fork(self, sandbox_id: str, n: int, **kw: Any) -> builtins.list[SandboxInfo | ShoalError]:
        r = await self._request("POST", f"/v1/sandboxes/{_sid(sandbox_id)}/fork", json_body={"n": n, "options": kw},
                                read_timeout=None)
        out: list[SandboxInfo | ShoalError] = []
        for it in r.json()["items"]:
            out.append(decode_info(it["sandbox"]) if it.get("sandbox") is not None
                       else error_from_dict(it.get("error") or {}))
        return out

    async def restore(self, name: str, n: int = 1, *, backend: str = "microvm"
                      ) -> builtins.list[SandboxInfo | ShoalError]:
        r = await self._request("POST", "/v1/sandboxes/restore", json_body={"name": name, "n": n, "backend": backend},
                                read_timeout=None)
        return [decode_info(it["sandbox"]) if it.get("sandbox") is not None
                else error_from_dict(it.get("error") or {}) for it in r.json()["items"]]

    # ---- images and fncall ----------------------------------------------------------------------
    async def images(self) -> builtins.list[dict[str, Any]]:
        r = await self._request("GET", "/v1/images")
        return list(r.json()["images"])

    async def image(self, ref: str) -> dict[str, Any]:
        r = await self._request("GET", f"/v1/images/{urllib.parse.quote(ref, safe='/:@')}")
        out: dict[str, Any] = r.json()
        return out

    async def build_image(self, tag: str, context: str, **opts: Any) -> dict[str, Any]:
        from pathlib import Path

        from shoal.images.dockerbuild import context_tarball

        opts.pop("log", None)  # the server's build log is not streamed back (its result lists the steps)
        unknown = set(opts) - {"dockerfile", "build_args", "target", "no_cache", "platform", "from_map", "network"}
        if unknown:
            raise InvalidRequest(f"unknown build option(s) {sorted(unknown)}")
        if opts.get("from_map"):
            raise InvalidRequest("from_map is a node setting: on a server, name the server's images in FROM (or "
                                 "push/import them there first)")
        data, df_name = await asyncio.to_thread(context_tarball, Path(context), opts.get("dockerfile"))
        params: list[tuple[str, str]] = [("name", tag), ("dockerfile", df_name)]
        for k, v in (opts.get("build_args") or {}).items():
            params.append(("build_arg", f"{k}={v}"))
        for key in ("target", "platform"):
            if opts.get(key):
                params.append((key, str(opts[key])))
        if opts.get("no_cache"):
            params.append(("no_cache", "true"))
        if opts.get("network") is False:
            params.append(("network", "false"))
        elif isinstance(opts.get("network"), list):
            params += [("egress", str(r)) for r in opts["network"]]
        r = await self._request("POST", "/v1/images/dockerfile", params=params, content=data, read_timeout=None)
        out: dict[str, Any] = r.json()
        return out

    async def pull(self, reference: str) -> dict[str, Any]:
        r = await self._request("POST", "/v1/images/pull", json_body={"reference": reference}, read_timeout=None)
        return dict(r.json())

    async def export_image(self, image: str, path: str, tags: builtins.list[str] | None = None) -> None:
        """Streamed to `path` (through a temp file beside it: an interrupted download leaves nothing)."""
        import os

        http = await self._client("/v1/images/export")
        body: dict[str, Any] = {"image": image, **({"tags": tags} if tags else {})}
        part = f"{path}.part-{os.getpid()}"
        try:
            async with http.stream("POST", "/v1/images/export", json=body,
                                   timeout=httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None)) as r:
                if r.status_code >= 400:
                    await r.aread()
                    raise _error_from_response(r)
                with open(part, "wb") as f:
                    async for chunk in r.aiter_raw():
                        f.write(chunk)
            os.replace(part, path)
        except httpx.HTTPError as e:
            raise TransportError(f"exporting {image} from {self.url} failed: {type(e).__name__}: {e}") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(part)

    async def push(self, image: str, target: str) -> dict[str, Any]:
        r = await self._request("POST", "/v1/images/push", json_body={"image": image, "target": target},
                                read_timeout=None)
        return dict(r.json())

    async def run_code(self, code: str, **kw: Any) -> Any:
        body: dict[str, Any] = {"code": code, **kw}
        # bytes travel as base64 (stdin_b64, files_b64); the server turns them back into bytes
        if isinstance(body.get("code"), (bytes, bytearray)):
            body["code"] = _text(body["code"], "code")
        if isinstance(body.get("stdin"), (bytes, bytearray)):
            body["stdin_b64"] = base64.b64encode(body.pop("stdin")).decode()
        if isinstance(body.get("files"), dict):
            files = dict(body["files"])
            binary = {p: base64.b64encode(v).decode() for p, v in files.items() if isinstance(v, (bytes, bytearray))}
            body["files"] = {p: v for p, v in files.items() if p not in binary}
            if binary:
                body["files_b64"] = binary
        timeout = kw.get("timeout")
        r = await self._request("POST", "/v1/run_code", json_body=body,
                                read_timeout=None if timeout is None else float(timeout) + 60)
        res = r.json()["result"]
        if isinstance(res, dict) and "status" in res and "encoding" in res:
            return decode_run_code_result(res)
        return res

    async def run_code_many(self, items: builtins.list[Any], **kw: Any) -> builtins.list[Any]:
        """Many snippets in one request (the fncall backend's `/v1/run_code_many`); one result per item.

        That route carries code, stdin and files as text and sends output back as text: output that is
        not UTF-8 arrives with replacement characters (use run_code for exact bytes).
        """
        from shoal.models import RunCodeResult

        body = {"items": [_texts(it) if isinstance(it, dict) else _text(it, "code") for it in items], **_texts(kw)}
        r = await self._request("POST", "/v1/run_code_many", json_body=body, read_timeout=None)
        out = []
        for d in r.json()["results"]:
            res = RunCodeResult.from_dict(d)
            res.stdout, res.stderr = _b(res.stdout), _b(res.stderr)
            if res.compile is not None:
                res.compile.stdout, res.compile.stderr = _b(res.compile.stdout), _b(res.compile.stderr)
            out.append(res)
        return out


def _b(x: str | bytes) -> bytes:
    return x if isinstance(x, bytes) else str(x).encode()


def _text(v: Any, what: str) -> Any:
    if isinstance(v, (bytes, bytearray)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(f"{what} is not UTF-8 text; run_code_many over HTTP carries text only "
                                 "(use run_code for binary stdin or files)") from None
    return v


def _texts(d: dict[str, Any]) -> dict[str, Any]:
    d = dict(d)
    for k in ("code", "stdin"):
        if k in d:
            d[k] = _text(d[k], k)
    if isinstance(d.get("files"), dict):
        d["files"] = {p: _text(v, f"file {p}") for p, v in d["files"].items()}
    return d
