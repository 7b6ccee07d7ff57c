"""The function-call backend: short code runs (python, bash, sh, c, cpp, go, java, nodejs, typescript, rust,
pytest) on warm pools of containers.

`node.fncall().run_code(code, language="python", ...)` borrows an idle container from the
pool of its (image, limits), runs the code there in a fresh process and a fresh working directory,
and returns a `RunCodeResult`; the container is cleaned and goes back to the pool. No sandbox to
create or close: `Client.run_code` / `run_code_many` are the user-facing doors, `/run_code` (see
`shoal.server.fusion`) the SandboxFusion-compatible HTTP one. Design and guarantees: docs/fncall.md.

Modules: `fncall_languages` (what to run), `fncall_pool` (containers and workers),
`fncall_worker` (what runs inside a pooled container), `fncall_image` (the images beyond `base`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shoal.backends.base import Backend, Capability
from shoal.backends.fncall_languages import ALL_TOOLS, BASE_IMAGE, FNCALL_IMAGE, LANGS_IMAGE, Language, get_language
from shoal.backends.fncall_pool import POOL_LABEL, Pool, PoolKey, Worker, WorkerLost
from shoal.config import Settings
from shoal.errors import BackendUnavailable, ImageNotFound, InvalidRequest, QuotaExceeded, ShoalError
from shoal.limits import AGENT_READY_TIMEOUT_S
from shoal.models import ExecResult, RunCodeResult
from shoal.spec import SandboxSpec

if TYPE_CHECKING:
    from shoal.agentproto.client import AgentClient
    from shoal.backends.context import NodeContext, SandboxHost
    from shoal.images.store import Image
    from shoal.records import SandboxRecord

log = logging.getLogger("shoal.fncall")

#: modules the warm interpreter imports once, so calls that use them start at fork speed
# (chosen by what short judge-style programs import, weighed against memory: each preloaded MiB makes
# every fork dearer, so heavy ones like dataclasses (via inspect), hashlib or datetime are left out)
DEFAULT_PRELOAD = (
    "bisect", "collections", "copy", "decimal", "functools", "heapq", "itertools", "json", "math", "operator",
    "random", "re", "string", "typing",
)
# extra seconds beyond the call's own timeouts before the host gives up on a worker (kill, clean, transfer)
_HOST_GRACE_S = 30.0
_MEMORY_OVERHEAD_MB = 128


def _default_max_size() -> int:
    return max(4, 4 * (os.cpu_count() or 1))


@dataclass
class FncallConfig:
    """Knobs of the fncall backend; `FncallConfig.from_settings(s)` takes the fncall_* settings (the node's
    fncall backend does that with the node's settings), plain construction uses the settings' defaults."""

    #: ready workers kept per pool while it is in use (setting fncall_min_idle)
    min_idle: int = 2
    #: most containers per pool (setting fncall_max_size; default 4 per core, at least 4)
    max_size: int = field(default_factory=_default_max_size)
    #: an idle worker beyond min_idle is retired after this long
    idle_timeout_s: float = 60.0
    #: a pool unused this long shrinks to zero (min_idle no longer applies)
    keep_warm_s: float = 600.0
    #: workers are replaced after this many calls or seconds (bounds anything slow to leak)
    max_calls_per_worker: int = 10_000
    max_worker_age_s: float = 1800.0
    #: TTL of pooled containers: the node's reaper removes them if this process dies without closing them
    container_ttl_s: float = 3600.0
    start_timeout_s: float = 60.0
    preload: tuple[str, ...] = DEFAULT_PRELOAD
    default_timeout_s: float = 10.0
    default_compile_timeout_s: float = 10.0
    max_timeout_s: float = 600.0
    default_memory_mb: int = 1024
    max_memory_mb: int = 65536
    cpus: float = 1.0
    pids: int = 256
    disk_mb: int = 2048
    max_output_bytes: int = 4 << 20
    max_code_bytes: int = 4 << 20
    max_stdin_bytes: int = 64 << 20
    max_files_bytes: int = 64 << 20
    max_fetch_bytes: int = 64 << 20
    #: calls run as this uid/gid (nobody), in this working directory, with files capped at fsize_mb
    uid: int = 65534
    gid: int = 65534
    workdir: str = "/sandbox"
    fsize_mb: int = 256
    #: build a language's image (fncall: gcc/g++; fncall-langs: go, java, ...) on its first call when missing
    auto_build_image: bool = True
    maintain_interval_s: float = 1.0
    #: default concurrency of run_code_many
    many_concurrency: int = 256

    @classmethod
    def from_settings(cls, s: Settings, **overrides: Any) -> FncallConfig:
        """The config the fncall_* settings of `s` describe (keyword arguments win)."""
        kw: dict[str, Any] = {"min_idle": s.fncall_min_idle, "max_size": s.fncall_max_size or _default_max_size(),
                              "preload": DEFAULT_PRELOAD if s.fncall_preload is None else s.fncall_preload}
        return cls(**{**kw, **overrides})


def container_memory_mb(memory_mb: int) -> int:
    """Memory limit of the pooled containers serving calls limited to `memory_mb` (+ the worker, rounded)."""
    return int(math.ceil((memory_mb + _MEMORY_OVERHEAD_MB) / 256.0) * 256)


def _as_bytes(value: str | bytes | bytearray | memoryview, what: str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise InvalidRequest(f"{what} must be str or bytes, not {type(value).__name__}")


def _check_path(p: Any, what: str) -> str:
    if not isinstance(p, str) or not p or "\0" in p or len(p) > 4096:
        raise InvalidRequest(f"{what} {p!r} must be a non-empty path (relative to the working dir, or absolute)")
    return p


#: The most memory (MiB) and CPUs the current caller may ask of a pool: the API server sets it per
#: request from the token's quota, so a small project cannot make the node keep huge warm containers.
#: (project, max_memory_mb, max_cpus); None = no limit (embedded use, admin tokens).
caller_limits: contextvars.ContextVar[tuple[str, int | None, float | None] | None] = contextvars.ContextVar(
    "shoal_fncall_caller_limits", default=None)


def _check_caller_limits(memory_mb: int, cpus: float) -> None:
    lim = caller_limits.get()
    if lim is None:
        return
    project, max_mem, max_cpus = lim
    if max_mem is not None and memory_mb > max_mem:
        raise QuotaExceeded(f"run_code memory_mb={memory_mb} is over project {project!r}'s quota of {max_mem} MiB "
                            "(max_memory_mb)", project=project, requested_memory_mb=memory_mb, max_memory_mb=max_mem)
    if max_cpus is not None and cpus > max_cpus:
        raise QuotaExceeded(f"run_code cpus={cpus:g} is over project {project!r}'s quota of {max_cpus:g} CPUs "
                            "(max_cpus)", project=project, requested_cpus=cpus, max_cpus=max_cpus)



class FncallManager:
    """All fncall pools of one node. Get it with `node.fncall()`."""

    def __init__(self, node: SandboxHost, config: FncallConfig | None = None) -> None:
        self.node = node
        self.config = config or FncallConfig()
        self.pools: dict[PoolKey, Pool] = {}
        self._maint: asyncio.Task[None] | None = None
        self._closed = False
        self._swept = False
        self._images_seen: set[str] = set()
        self.counters = {"calls": 0, "errors": 0}

    # ---- pools
    def _worker_config(self) -> dict[str, Any]:
        c = self.config
        return {"uid": c.uid, "gid": c.gid, "workdir": c.workdir, "fsize_mb": c.fsize_mb,
                "preload": list(c.preload), "tools": ALL_TOOLS}

    def pool(self, image: str, memory_mb: int | None = None, cpus: float | None = None) -> Pool:
        """The pool for (image, limits), created on first use."""
        if self._closed:
            raise BackendUnavailable("the fncall backend of this node was closed")
        c = self.config
        _check_caller_limits(int(memory_mb or c.default_memory_mb), float(cpus or c.cpus))
        mem = container_memory_mb(int(memory_mb or c.default_memory_mb))
        key = PoolKey(image, mem, float(cpus or c.cpus))
        p = self.pools.get(key)
        if p is None:
            spec = SandboxSpec(image=image, backend="container", cpus=key.cpus, memory_mb=mem, pids=c.pids,
                               disk_mb=c.disk_mb, network=False, ttl_s=c.container_ttl_s,
                               labels={POOL_LABEL: str(key)}, max_output_bytes=0)
            p = Pool(self.node, key, spec, self._worker_config(), min_idle=c.min_idle, max_size=c.max_size,
                     idle_timeout_s=c.idle_timeout_s, max_calls=c.max_calls_per_worker,
                     max_age_s=c.max_worker_age_s, start_timeout_s=c.start_timeout_s, keep_warm_s=c.keep_warm_s)
            self.pools[key] = p
            self._ensure_maintenance()
        return p

    def _ensure_maintenance(self) -> None:
        if self._maint is None or self._maint.done():
            self._maint = asyncio.get_running_loop().create_task(self._maintain_loop(), name="shoal-fncall-pools")
        if not self._swept:
            self._swept = True
            asyncio.get_running_loop().create_task(self._sweep_orphans())

    async def _maintain_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.config.maintain_interval_s)
            for key, p in list(self.pools.items()):
                try:
                    await p.maintain()
                except Exception as e:  # housekeeping must never stop
                    log.warning("fncall pool %s maintenance failed: %s", key, e)
                if p.size == 0 and not p.waiters and time.monotonic() - p.last_used > self.config.keep_warm_s:
                    self.pools.pop(key, None)

    async def _sweep_orphans(self) -> None:
        """Close pooled containers left by processes that died without closing their pools."""
        from shoal.records import list_records

        try:
            recs = await asyncio.to_thread(list_records, self.node.paths.sandboxes)
            for rec in recs:
                if rec.labels.get(POOL_LABEL) is not None and not rec.owner_alive():
                    with contextlib.suppress(ShoalError):
                        await self.node.close(rec.id)
        except Exception as e:
            log.debug("fncall orphan sweep failed: %s", e)

    async def warm(self, language: str = "python", n: int | None = None, *, image: str | None = None,
                   memory_mb: int | None = None, cpus: float | None = None) -> dict[str, Any]:
        """Start the pool for `language` and wait until `n` workers (default min_idle) are ready."""
        lang = get_language(language)
        image = await self._image_for(lang, image)
        p = self.pool(image, memory_mb, cpus)
        n = max(1, min(int(n or self.config.min_idle or 1), p.max_size))
        ws = await asyncio.gather(*(p.acquire() for _ in range(n)), return_exceptions=True)
        for w in ws:
            if isinstance(w, Worker):
                p.release(w)
        errs = [w for w in ws if isinstance(w, BaseException)]
        if errs and len(errs) == len(ws):
            raise errs[0]
        return p.snapshot()

    @property
    def closed(self) -> bool:
        """True once `close()` ran: the manager serves no more calls."""
        return self._closed

    def sandbox_ids(self) -> list[str]:
        """Every pooled sandbox this manager holds right now."""
        return [sid for p in self.pools.values() for sid in p.sandbox_ids()]

    def stats(self) -> dict[str, Any]:
        """Counters of every pool."""
        return {**self.counters, "pools": [p.snapshot() for p in self.pools.values()]}

    async def close(self) -> None:
        """Close every pool: every pooled container is destroyed."""
        self._closed = True
        if self._maint is not None:
            self._maint.cancel()
            with contextlib.suppress(BaseException):
                await self._maint
        pools = list(self.pools.values())
        self.pools.clear()
        await asyncio.gather(*(p.close() for p in pools), return_exceptions=True)

    async def _image_for(self, lang: Language, image: str | None) -> str:
        if image:
            if not isinstance(image, str):
                raise InvalidRequest("image must be a string (name[:tag])")
            from shoal.images.refs import parse_ref

            r = parse_ref(image)  # "base" and "base:latest" share one pool
            ref = f"{r.name}@{r.digest}" if r.digest else f"{r.name}:{r.tag or 'latest'}"
            # Checked once per image (not per call: this is the hot path), so a missing image answers
            # ImageNotFound at once instead of sending a new pool into its start-retry backoff.
            if ref not in self._images_seen:
                if not await asyncio.to_thread(self.node.store.exists, ref):
                    raise ImageNotFound(f"image {image!r} is not in the store (see `shoal image ls`)")
                self._images_seen.add(ref)
            return ref
        image = lang.image
        if image != BASE_IMAGE and image not in self._images_seen:
            if not await asyncio.to_thread(self.node.store.exists, image):
                if not self.config.auto_build_image:
                    flag = " --all" if image == LANGS_IMAGE else ""
                    raise ImageNotFound(f"language {lang.name} runs in image {image}, which is not built: "
                                        f"run `shoal fncall setup{flag}`")
                from shoal.backends.fncall_image import ensure_fncall_image

                log.warning("building image %s for %s (once per store; takes a few minutes)", image, lang.name)
                await ensure_fncall_image(self.node, image, log=lambda s: log.info("fncall image: %s", s))
            self._images_seen.add(image)
        return image

    # ---- requests
    def _request(self, code: Any, lang: Language, *, stdin: Any, timeout: Any, compile_timeout: Any,
                 memory_mb: Any, files: Any, fetch_files: Any, env: Any, args: Any,
                 max_output: Any) -> tuple[dict[str, Any], list[bytes], float]:
        c = self.config
        code_b = _as_bytes(code, "code")
        if len(code_b) > c.max_code_bytes:
            raise InvalidRequest(f"code is {len(code_b)} bytes; the limit is {c.max_code_bytes} bytes")
        stdin_b = None if stdin is None else _as_bytes(stdin, "stdin")
        if stdin_b is not None and len(stdin_b) > c.max_stdin_bytes:
            raise InvalidRequest(f"stdin is {len(stdin_b)} bytes; the limit is {c.max_stdin_bytes} bytes")

        def seconds(v: Any, default: float, what: str) -> float:
            v = default if v is None else v
            try:
                v = float(v)
            except (TypeError, ValueError):
                raise InvalidRequest(f"{what} must be a number of seconds") from None
            if not 0 < v <= c.max_timeout_s:
                raise InvalidRequest(f"{what}={v:g} must be positive and at most {c.max_timeout_s:g} seconds")
            return v

        run_t = seconds(timeout, c.default_timeout_s, "timeout")
        comp_t = seconds(compile_timeout, c.default_compile_timeout_s, "compile_timeout")
        mem = c.default_memory_mb if memory_mb is None else memory_mb
        if not isinstance(mem, int) or isinstance(mem, bool) or not 16 <= mem <= c.max_memory_mb:
            raise InvalidRequest(f"memory_mb={memory_mb!r} must be an integer between 16 and {c.max_memory_mb}")
        cap = c.max_output_bytes if max_output is None else max_output
        if not isinstance(cap, int) or isinstance(cap, bool) or not 0 < cap <= 256 << 20:
            raise InvalidRequest(f"max_output={max_output!r} must be a positive number of bytes (at most 256 MiB)")
        file_list, file_blobs, total = [], [], 0
        if files:
            if not isinstance(files, Mapping):
                raise InvalidRequest("files must map paths to contents (str or bytes)")
            for p, data in files.items():
                b = _as_bytes(data, f"files[{p!r}]")
                total += len(b)
                file_list.append({"path": _check_path(p, "file path"), "mode": 0o644})
                file_blobs.append(b)
            if total > c.max_files_bytes:
                raise InvalidRequest(f"files hold {total} bytes; the limit is {c.max_files_bytes} bytes")
        fetch = []
        if fetch_files:
            if isinstance(fetch_files, str) or not isinstance(fetch_files, Sequence):
                raise InvalidRequest("fetch_files must be a list of paths")
            fetch = [_check_path(p, "fetch_files path") for p in fetch_files]
        if env is not None and (not isinstance(env, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
                for k, v in env.items())):
            raise InvalidRequest("env must map non-empty names without '=' or NUL to strings")
        if args is not None and (isinstance(args, str) or not all(isinstance(a, str) and "\0" not in a
                                                                   for a in args)):
            raise InvalidRequest("args must be a list of strings")
        args = list(args or [])
        steps = []
        if lang.compile is not None:
            steps.append({"name": "compile", "mode": "exec", "argv": list(lang.compile), "timeout": comp_t,
                          "memory_mb": None, "stdin": False})
        steps.append({"name": "run", "mode": lang.mode, "argv": [*lang.run, *args], "args": args,
                      "file": f"{c.workdir.rstrip('/')}/{lang.source}", "timeout": run_t,
                      "memory_mb": mem if lang.limit_address_space else None, "pool_memory_mb": mem,
                      "stdin": True})
        hdr = {"op": "run", "steps": steps, "source": lang.source, "has_stdin": stdin_b is not None,
               "env": {**dict(lang.env), **dict(env or {})}, "max_output": cap, "files": file_list, "fetch": fetch,
               "max_fetch": c.max_fetch_bytes}
        deadline = sum(s["timeout"] for s in steps) + _HOST_GRACE_S
        return hdr, [code_b, stdin_b or b"", *file_blobs], deadline

    async def run_code(self, code: str | bytes, language: str = "python", *, stdin: str | bytes | None = None,
                       timeout: float | None = None, compile_timeout: float | None = None,
                       memory_mb: int | None = None, files: Mapping[str, str | bytes] | None = None,
                       fetch_files: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
                       args: Sequence[str] | None = None, image: str | None = None, max_output: int | None = None,
                       cpus: float | None = None) -> RunCodeResult:
        """Run `code` in a fresh process of a pooled container and return what happened.

        Raises InvalidRequest for a request that cannot be run (unknown language, oversized code,
        bad timeout ...); everything that happens once the code runs — errors, timeouts, a killed or
        crashed container — is reported in the result's `status`.
        """
        t0 = time.monotonic()
        lang = get_language(language)
        hdr, blobs, deadline = self._request(code, lang, stdin=stdin, timeout=timeout,
                                             compile_timeout=compile_timeout, memory_mb=memory_mb, files=files,
                                             fetch_files=fetch_files, env=env, args=args, max_output=max_output)
        image = await self._image_for(lang, image)
        p = self.pool(image, hdr["steps"][-1]["pool_memory_mb"], cpus)
        w = await p.acquire()
        queued = time.monotonic() - t0
        missing = [t for t in lang.tools if not w.tools.get(t)]
        if missing:
            p.release(w)
            raise BackendUnavailable(f"image {image} has no {', '.join(missing)}, which language {lang.name} needs: "
                                     f"use image={FNCALL_IMAGE!r} (`shoal fncall setup` builds it) or add it")
        self.counters["calls"] += 1
        p.stats["calls"] += 1
        try:
            resp, out = await w.request(hdr, blobs, deadline)
        except WorkerLost as e:
            p.release(w)
            self.counters["errors"] += 1
            return RunCodeResult(exit_code=-1, status="error", language=lang.name, sandbox_id=w.sandbox_id,
                                 error=f"the container running this call died or stopped answering, so the call's "
                                       f"outcome is unknown; the pool replaced it ({e.message})",
                                 queued_s=queued, total_s=time.monotonic() - t0)
        except BaseException:
            # cancelled mid-call: the worker is still busy with it, so it cannot serve anyone else
            p.release(w, retire=True)
            raise
        if resp.get("fatal"):
            w.dead = resp.get("error") or "the worker reported a fatal error"
        w.dirty = bool(resp.get("dirty"))
        if w.dirty:
            log.warning("fncall worker %s came back dirty (%s); replacing it", w.sandbox_id,
                        resp.get("cleanup_problems") or resp.get("error"))
        p.release(w)
        r = self._result(resp, out, lang, w.sandbox_id)
        r.queued_s = queued
        r.total_s = time.monotonic() - t0
        if r.status == "error":
            self.counters["errors"] += 1
        return r

    @staticmethod
    def _result(resp: dict[str, Any], blobs: list[bytes], lang: Language, sandbox_id: str) -> RunCodeResult:
        steps = resp.get("steps") or []
        outs = [(blobs[2 * i], blobs[2 * i + 1]) for i in range(len(steps))]
        comp = run = None
        comp_out = run_out = (b"", b"")
        for s, o in zip(steps, outs, strict=True):
            if s["name"] == "compile":
                comp, comp_out = s, o
            else:
                run, run_out = s, o

        def exec_result(s: dict[str, Any], o: tuple[bytes, bytes]) -> ExecResult:
            return ExecResult(exit_code=int(s["exit_code"]), stdout=o[0], stderr=o[1],
                              duration_s=float(s["duration_ms"]) / 1000.0, timed_out=bool(s["timed_out"]),
                              truncated=bool(s["truncated"]), signal=int(s["signal"]))

        files = dict(zip(resp.get("files") or [], blobs[2 * len(steps):], strict=False))
        r = RunCodeResult(exit_code=-1, language=lang.name, sandbox_id=sandbox_id, files=files,
                          compile=exec_result(comp, comp_out) if comp else None)
        if run is not None:
            er = exec_result(run, run_out)
            r.exit_code, r.stdout, r.stderr = er.exit_code, er.stdout, er.stderr
            r.duration_s, r.timed_out, r.truncated, r.signal = er.duration_s, er.timed_out, er.truncated, er.signal
            r.cpu_time_s = float(run.get("cpu_ms", 0)) / 1000.0
            r.max_rss_kb = int(run.get("maxrss_kb", 0))
        if resp.get("error"):
            r.status, r.error = "error", str(resp["error"])
        elif comp is not None and comp["timed_out"]:
            r.status = "compile_timeout"
        elif comp is not None and (comp.get("spawn_error") or comp["exit_code"] != 0):
            r.status = "compile_error"
            if comp.get("spawn_error"):
                r.error = comp["spawn_error"]
        elif run is None or run.get("spawn_error"):
            r.status = "error"
            r.error = (run or {}).get("spawn_error") or "the code did not run"
        elif run["timed_out"]:
            r.status = "timeout"
        elif run["exit_code"] != 0:
            r.status = "failed"
        else:
            r.status = "success"
        return r

    async def run_code_many(self, items: Sequence[str | Mapping[str, Any]], *, concurrency: int | None = None,
                            **defaults: Any) -> list[RunCodeResult]:
        """Run many snippets concurrently; one result per item, in order, never an exception per item.

        Each item is a code string or a dict of `run_code` arguments (`code` required); `defaults`
        (e.g. language="cpp", timeout=5) apply to every item that does not set them. An item that
        cannot run (unknown language, oversized code ...) gets status "error" with the reason.
        """
        if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
            raise InvalidRequest("run_code_many takes a list of code strings or dicts of run_code arguments")
        known = {"code", "language", "stdin", "timeout", "compile_timeout", "memory_mb", "files", "fetch_files",
                 "env", "args", "image", "max_output", "cpus"}
        bad = set(defaults) - known
        if bad:
            raise InvalidRequest(f"unknown run_code option(s): {', '.join(sorted(bad))}")
        sem = asyncio.Semaphore(max(1, int(concurrency or self.config.many_concurrency)))

        async def one(item: Any) -> RunCodeResult:
            kw = dict(defaults)
            try:
                if isinstance(item, (str, bytes)):
                    kw["code"] = item
                elif isinstance(item, Mapping):
                    unknown = set(item) - known
                    if unknown:
                        raise InvalidRequest(f"unknown run_code option(s): {', '.join(sorted(unknown))}")
                    kw.update(item)
                else:
                    raise InvalidRequest(f"each item must be a code string or a dict, not {type(item).__name__}")
                if "code" not in kw:
                    raise InvalidRequest("item has no code")
                async with sem:
                    return await self.run_code(kw.pop("code"), kw.pop("language", "python"), **kw)
            except ShoalError as e:
                return RunCodeResult(exit_code=-1, status="error", error=e.message,
                                     language=str(kw.get("language", "")))

        return list(await asyncio.gather(*(one(it) for it in items)))


class FncallBackend(Backend):
    """The fncall backend: no sandboxes of its own, a node-owned service running code on warm pools of
    container sandboxes (made through the node's public API). `Node.fncall()` reaches its manager."""

    name = "fncall"
    capabilities = frozenset({Capability.RUN_CODE})
    instead = {Capability.SANDBOXES: "fncall runs code snippets on warm pools: use client.run_code(code) "
                                     "(or create a sandbox with backend='container')"}

    def __init__(self, ctx: NodeContext, name: str | None = None) -> None:
        super().__init__(ctx, name)
        self._manager: FncallManager | None = None

    def manager(self) -> FncallManager:
        """The node's fncall manager, created on first use (and again after close)."""
        if self._manager is None or self._manager.closed:
            self._manager = FncallManager(self.ctx.sandboxes, FncallConfig.from_settings(self.ctx.settings))
        return self._manager

    async def close(self) -> None:
        """Close every pool: pooled containers serve only this process, so they go with it."""
        if self._manager is not None:
            await self._manager.close()

    async def create(self, rec: SandboxRecord, spec: SandboxSpec, image: Image) -> None:
        """fncall hosts no sandboxes."""
        raise self.unsupported(Capability.SANDBOXES)

    async def connect(self, rec: SandboxRecord, timeout: float = AGENT_READY_TIMEOUT_S) -> AgentClient:
        """fncall hosts no sandboxes."""
        raise self.unsupported(Capability.SANDBOXES)

    async def destroy(self, rec: SandboxRecord) -> None:
        """fncall hosts no sandboxes (its pooled containers are container sandboxes)."""
        raise self.unsupported(Capability.SANDBOXES)
