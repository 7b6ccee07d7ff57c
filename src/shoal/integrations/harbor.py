"""Harbor: shoal sandboxes as a Harbor environment (`harbor.environments.base.BaseEnvironment`).

    harbor run -p examples/harbor-fizzbuzz -a oracle -k 8 -n 8 \\
        --env shoal.integrations.harbor:ShoalEnvironment [--ek url=http://host:8700 --ek token=...]

Harbor loads the class by import path and builds one per trial. `start()` makes the trial's image — the
task's `[environment] docker_image` names an image (a registry reference or a shoal image); an
`environment/Dockerfile` is built with BuildKit's semantics and shoal's step cache (`shoal.images.dockerbuild`;
against a server, `url=`, the context is uploaded and built there), so N trials of a task build it once
and a rerun builds nothing — then creates the sandbox and the directories Harbor writes to (`/logs/agent`,
`/logs/verifier`, `/logs/artifacts`). `exec` runs `bash -c` (or `sh -c`) as Harbor's user; uploads and
downloads stream tar archives through the sandbox's agent. `stop()` closes the sandbox.

Environment kwargs (`--ek key=value`): `url`/`token` (a `shoal serve`; default: an embedded node in the
harbor process, which needs root), `backend` ("container"), `runtime`, `from_map` (JSON: Dockerfile FROM
names → shoal images, e.g. `{"debian:bookworm": "base"}`), `build_args` (JSON), `ttl_s` (a sandbox
outlives a crashed harbor process by at most this; default 6 h), `build_network` (RUN steps get a network;
default true).

Harbor needs Python >= 3.12; this module imports it, so it is only importable where Harbor is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import shlex
import tarfile
import tempfile
import uuid
from pathlib import Path, PurePosixPath
from typing import Any

try:
    from harbor.environments.base import BaseEnvironment, ExecResult, transfer_tar_filter
    from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
    from harbor.environments.definition import require_agent_environment_definition
    from harbor.models.task.config import NetworkMode
    from harbor.models.trial.paths import EnvironmentPaths
except ModuleNotFoundError as e:  # pragma: no cover - depends on the interpreter
    raise ModuleNotFoundError("shoal.integrations.harbor runs inside Harbor (Python >= 3.12): "
                              f"pip install 'shoal[harbor]' ({e})", name=e.name) from e

from shoal.errors import InvalidRequest, ShoalError
from shoal.limits import DEFAULT_BACKEND

log = logging.getLogger(__name__)

_clients: dict[tuple[int, str | None], Any] = {}


def _client(url: str | None, token: str | None) -> Any:
    """One shoal client per event loop and endpoint, shared by every trial of the harbor process."""
    from shoal.sdk.client import Client

    key = (id(asyncio.get_running_loop()), url)
    c = _clients.get(key)
    if c is None:
        c = Client(url, token=token) if url else Client()
        _clients[key] = c
    return c


class ShoalEnvironment(BaseEnvironment):
    """One Harbor trial environment = one shoal sandbox."""

    def __init__(self, environment_dir: Path, environment_name: str, session_id: str, trial_paths: Any,
                 task_env_config: Any, *args: Any, url: str | None = None, token: str | None = None,
                 backend: str = DEFAULT_BACKEND, runtime: str | None = None,
                 from_map: dict[str, str] | None = None, build_args: dict[str, str] | None = None,
                 ttl_s: float = 6 * 3600, build_network: bool = True, **kwargs: Any) -> None:
        super().__init__(environment_dir, environment_name, session_id, trial_paths, task_env_config,
                         *args, **kwargs)
        if from_map is not None and not (isinstance(from_map, dict)
                                         and all(isinstance(v, str) for v in from_map.values())):
            raise ValueError('from_map must be a JSON object of image names, e.g. --ek from_map=\'{"a:1": "base"}\'')
        self._url, self._token = url, token
        self._backend, self._runtime = backend, runtime
        self._from_map = {str(k): str(v) for k, v in (from_map or {}).items()}
        self._build_args = {str(k): str(v) for k, v in (build_args or {}).items()}
        self._ttl_s = float(ttl_s)
        self._build_network = bool(build_network)
        self._sandbox: Any = None
        self._shell = "bash"
        self.image: str | None = None
        self._workdir: str | None = None

    @staticmethod
    def type() -> str:
        """Harbor's name for this environment type."""
        return "shoal"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        """No GPUs or host mounts; a sandbox runs with or without a network."""
        return EnvironmentCapabilities(disable_internet=True)

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        """CPU and memory are cgroup limits, fractional CPUs allowed."""
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True, fractional_cpus=True)

    def _validate_definition(self) -> None:
        require_agent_environment_definition(self.environment_dir, docker_image=self.task_env_config.docker_image)

    @property
    def _dockerfile(self) -> Path:
        return self.environment_dir / "Dockerfile"

    # ---- lifecycle ----------------------------------------------------------------------------------
    async def _image(self, force_build: bool) -> str:
        """The shoal image of this trial: docker_image as named, or the Dockerfile built as a recipe."""
        cfg = self.task_env_config
        if cfg.docker_image and not (force_build and self._dockerfile.exists()):
            return self._from_map.get(cfg.docker_image, cfg.docker_image)
        if (self.environment_dir / "docker-compose.yaml").exists() and not self._dockerfile.exists():
            raise InvalidRequest(f"{self.environment_dir}: docker-compose environments are not supported by shoal; "
                                 "give the task an environment/Dockerfile or a docker_image")
        client = _client(self._url, self._token)
        node = getattr(await client._ensure(), "node", None)
        debug = lambda s: self.logger.debug(f"shoal build: {s}")  # noqa: E731
        if node is not None:
            from shoal.images.dockerfile import ensure_dockerfile_image

            # trials of one task start together: one builds, the others wait and find the image
            built = await ensure_dockerfile_image(node, self.environment_dir, self.environment_name,
                                                  from_map=self._from_map, build_args=self._build_args,
                                                  network=self._build_network, force=force_build, log=debug)
            ref, config, warnings = built.ref, built.image.config.to_dict(), built.warnings
        else:
            # a shoal server builds it: the context goes up as a tarball; every step is cached on the server,
            # so the trials after the first (and reruns) build nothing
            from shoal.images.dockerfile import dockerfile_digest, dockerfile_image_ref

            if self._from_map:
                raise InvalidRequest("from_map applies to the embedded node only: against a server, FROM names "
                                     "are the server's images (import or pull them there)")
            digest = await asyncio.to_thread(dockerfile_digest, self.environment_dir)
            ref = dockerfile_image_ref(self.environment_name, digest)
            out = await client.build_image(ref, str(self.environment_dir), build_args=self._build_args,
                                           no_cache=force_build, network=self._build_network)
            img = out["image"]
            ref = f"{img['name']}:{img['tag']}" if img.get("tag") else ref
            config, warnings = img.get("config") or {}, out.get("warnings") or []
        for w in warnings:
            self.logger.debug(f"shoal: {w}")
        self._workdir = config.get("workdir") or None
        return ref

    async def start(self, force_build: bool) -> None:
        """Build or find the image, create the sandbox, make Harbor's log directories."""
        self.image = await self._image(force_build)
        cfg = self.task_env_config
        networked = self.network_policy.network_mode != NetworkMode.NO_NETWORK
        kw: dict[str, Any] = {"backend": self._backend, "network": networked,
                              "ttl_s": self._ttl_s, "env": self._startup_env(),
                              "labels": {"harbor.session": self.session_id[:200]}}
        if self._runtime:
            kw["runtime"] = self._runtime
        if self._effective_cpus:
            kw["cpus"] = float(self._effective_cpus)
        if self._effective_memory_mb:
            kw["memory_mb"] = int(self._effective_memory_mb)
        if cfg.workdir:
            kw["workdir"] = cfg.workdir
        client = _client(self._url, self._token)
        self._sandbox = await client.create(self.image, **kw)
        probe = await self._sandbox.exec(["/bin/sh", "-c", "command -v bash >/dev/null && echo bash || echo sh"],
                                         timeout=30)
        self._shell = "bash" if probe.stdout.strip() == b"bash" else "sh"
        paths = EnvironmentPaths.for_os(self.os)
        dirs = [str(paths.agent_dir), str(paths.verifier_dir), str(paths.artifacts_dir),
                *self._mount_targets(writable_only=True)]
        res = await self.ensure_dirs(list(dict.fromkeys(dirs)))
        if res is not None and res.return_code != 0:
            raise RuntimeError(f"shoal: could not create {dirs} in the sandbox: {res.stderr or res.stdout}")
        await self._upload_environment_dir_after_start()

    async def stop(self, delete: bool) -> None:
        """Close the sandbox (shoal sandboxes are never kept: `delete` makes no difference)."""
        sb, self._sandbox = self._sandbox, None
        if sb is not None:
            try:
                await sb.close()
            except ShoalError as e:
                self.logger.warning(f"shoal: closing sandbox {sb.id}: {e}")

    def _sb(self) -> Any:
        if self._sandbox is None:
            raise RuntimeError("the shoal sandbox is not running: call start() first")
        return self._sandbox

    # ---- commands -----------------------------------------------------------------------------------
    async def exec(self, command: str, cwd: str | None = None, env: dict[str, str] | None = None,
                   timeout_sec: int | None = None, user: str | int | None = None) -> ExecResult:
        """Run `command` with bash -c (sh -c where the image has no bash); a timeout raises, as in Docker."""
        sb = self._sb()
        u = self._resolve_user(user)
        merged = self._merge_env(env)
        cwd = cwd or self.task_env_config.workdir or self._workdir
        r = await sb.exec([self._shell, "-c", command], timeout=float(timeout_sec) if timeout_sec else None,
                          cwd=cwd, env=merged or None, user=str(u) if u is not None else None)
        if r.timed_out:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        return ExecResult(stdout=r.stdout.decode("utf-8", "replace"), stderr=r.stderr.decode("utf-8", "replace"),
                          return_code=r.exit_code)

    async def _root(self, argv: list[str], what: str, stdin: bytes | None = None, timeout: float = 600) -> Any:
        r = await self._sb().exec(argv, timeout=timeout, user="0", stdin=stdin)
        if r.timed_out or r.exit_code != 0:
            raise RuntimeError(f"shoal: {what} failed (exit {r.exit_code}): "
                               f"{r.stderr.decode('utf-8', 'replace')[-2000:]}")
        return r

    # ---- files ----------------------------------------------------------------------------------------
    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        """Copy one host file into the sandbox (parent directories are created)."""
        src = Path(source_path)
        data = await asyncio.to_thread(src.read_bytes)
        parent = str(PurePosixPath(target_path).parent)
        await self._root(["mkdir", "-p", parent], f"mkdir {parent}")
        mode = src.stat().st_mode & 0o777
        await self._sb().write_file(target_path, data, mode=mode)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        """Copy a host directory's contents into `target_dir` (one tar stream; modes kept)."""
        src = Path(source_dir)

        def pack() -> bytes:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w:gz") as tf:
                for p in sorted(src.rglob("*")):
                    tf.add(p, arcname=p.relative_to(src).as_posix(), recursive=False)
            return buf.getvalue()

        data = await asyncio.to_thread(pack)
        await self._root(["/bin/sh", "-c", f"mkdir -p {shlex.quote(target_dir)} && "
                          f"tar -xzf - --no-same-owner -C {shlex.quote(target_dir)}"],
                         f"upload of {src} to {target_dir}", stdin=data)

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        """Copy one sandbox file to the host."""
        data = await self._sb().read_file(source_path)
        dst = Path(target_path)
        dst.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(dst.write_bytes, data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        """Copy a sandbox directory's contents to the host (overwriting files there)."""
        tmp = f"/tmp/.shoal-dl-{uuid.uuid4().hex}.tgz"
        await self._root(["/bin/sh", "-c", f"tar -czf {tmp} -C {shlex.quote(source_dir)} ."],
                         f"packing {source_dir}")
        try:
            data = await self._sb().read_file(tmp)
        finally:
            with contextlib.suppress(ShoalError, RuntimeError):
                await self._root(["rm", "-f", tmp], "cleanup")
        dst = Path(target_dir)

        def unpack() -> None:
            dst.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile() as f:
                f.write(data)
                f.seek(0)
                with tarfile.open(fileobj=f, mode="r:gz") as tf:
                    tf.extractall(dst, filter=transfer_tar_filter)

        await asyncio.to_thread(unpack)
