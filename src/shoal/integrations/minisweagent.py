"""mini-swe-agent: a shoal sandbox as its execution environment.

In a mini-swe-agent YAML config (the agent SkyRL and others run for SWE tasks):

    environment:
      environment_class: shoal.integrations.minisweagent.ShoalEnvironment
      image: swe-task-17          # a shoal image (or a registry reference shoal pulls)
      cwd: /testbed
      timeout: 60
      env: {PAGER: cat}
      forward_env: [HF_TOKEN]
      memory_mb: 4096             # any sandbox spec field: cpus, network, ttl_s, backend, labels, ...
      url: http://127.0.0.1:8700  # a `shoal serve` (or $SHOAL_URL); none: an embedded node in this process
      token: shoal_...            # (or $SHOAL_TOKEN)

It takes the keys of mini-swe-agent's Docker environment — `image`, `cwd`, `env`, `forward_env`, `timeout`,
`interpreter` (`["bash", "-lc"]`), `container_timeout` (the sandbox's TTL) and `pull_timeout`; `executable`
and `run_args` are accepted and ignored, there is no docker CLI — so a Docker config moves over by changing
`environment_class`. Each `execute` is one shoal exec of `interpreter + [command]` in the sandbox, stdout and
stderr in one stream as Docker's `docker exec` gives them; its answer is the Docker environment's
(`output`, `returncode`, `exception_info`; a timeout is returncode -1 with the partial output), and a first
output line `COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` ends the run with the rest as the submission. `cleanup()`
(or garbage collection, as for Docker) closes the sandbox; `sandbox_id: <id>` attaches to an existing sandbox
instead and leaves it open.

Environments of one process share one client per (url, token) — the embedded node or the HTTP connection
pool — so a trainer's threads running many agents at once share it too.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import platform
import re
import threading
from typing import Any

# mini-swe-agent prints a banner to stdout on import unless told not to: a library import (this module imported
# by a trainer's rollout worker) must not write to the process's stdout; its `mini` CLI imports it first anyway
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel, ConfigDict, Field, model_validator

from shoal.config import settings
from shoal.errors import InvalidRequest, ShoalError
from shoal.sdk.sync import SyncClient, SyncSandbox, shared_client
from shoal.spec import SandboxSpec

log = logging.getLogger("shoal.integrations.minisweagent")

#: SandboxSpec fields a config may set at its top level (image, env: the environment's own meaning)
SPEC_FIELDS = frozenset(SandboxSpec.model_fields) - {"image", "env"}
#: the Docker environment's keys that have no meaning here
DOCKER_ONLY = ("executable", "run_args")
SUBMIT_LINE = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class ShoalEnvironmentConfig(BaseModel):
    """The Docker environment's keys, shoal's connection, and sandbox spec fields (`spec` collects those)."""

    model_config = ConfigDict(extra="allow")

    image: str = "base"
    cwd: str = "/"
    """Working directory of every command."""
    env: dict[str, str] = {}
    """Environment variables of every command."""
    forward_env: list[str] = []
    """Variables copied from this process's environment into every command (when set here; `env` wins)."""
    timeout: int = 30
    """Seconds a command may run; then it and its children are killed."""
    interpreter: list[str] = ["bash", "-lc"]
    """What runs a command: `interpreter + [command]`."""
    container_timeout: str = "2h"
    """How long the sandbox lives (sleep's format: 90, 30m, 2h, 1d) unless `ttl_s` is given."""
    pull_timeout: int = 120
    """Seconds to wait for the sandbox (and its image, when shoal pulls it from a registry)."""
    executable: str | None = None
    run_args: list[str] = []
    url: str | None = None
    """A `shoal serve` URL (default $SHOAL_URL); none: an embedded node in this process."""
    token: str | None = Field(None, repr=False)
    """A shoal token for `url` (default $SHOAL_TOKEN). Never written into trajectories."""
    sandbox_id: str | None = None
    """Use this existing sandbox instead of creating one (it is left open by cleanup)."""
    spec: dict[str, Any] = {}
    """Sandbox spec fields (memory_mb, cpus, network, backend, ttl_s, labels, ...); they may also be given at the
    top level of the config."""

    @model_validator(mode="after")
    def _collect_spec(self) -> ShoalEnvironmentConfig:
        extra = dict(self.model_extra or {})
        unknown = sorted(set(extra) - SPEC_FIELDS)
        if unknown:
            raise ValueError(f"unknown ShoalEnvironment option(s) {', '.join(unknown)}: it takes the Docker "
                             "environment's keys, url, token, sandbox_id and sandbox spec fields "
                             f"({', '.join(sorted(SPEC_FIELDS))})")
        bad = sorted(set(self.spec) - SPEC_FIELDS)
        if bad:
            raise ValueError(f"spec has unknown field(s) {', '.join(bad)} (sandbox spec fields: "
                             f"{', '.join(sorted(SPEC_FIELDS))})")
        self.spec = {**self.spec, **extra}
        for k in extra:
            self.__pydantic_extra__.pop(k, None)  # type: ignore[union-attr]
        return self

    def public(self) -> dict[str, Any]:
        """The config as trajectories and templates see it: without the token."""
        return self.model_dump(mode="json", exclude={"token"})


def parse_duration(text: str) -> float:
    """Seconds of a `sleep`-style duration: 90, 90s, 30m, 2h, 1d."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not m:
        raise InvalidRequest(f"container_timeout={text!r} is not a duration like 90, 30m, 2h or 1d")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


_clients: dict[tuple[str, str | None], SyncClient] = {}
_clients_lock = threading.Lock()


def _close_clients() -> None:
    with _clients_lock:
        items = list(_clients.values())
        _clients.clear()
    for c in items:
        with contextlib.suppress(Exception):
            c.close(timeout=60)


def client_for(url: str | None, token: str | None) -> SyncClient:
    """The process's client for (url, token): the shared embedded node when `url` is empty."""
    if not url:
        return shared_client()
    with _clients_lock:
        c = _clients.get((url, token))
        if c is None:
            if not _clients:
                atexit.register(_close_clients)
            c = _clients[(url, token)] = SyncClient(url, token=token)
        return c


class ShoalEnvironment:
    """mini-swe-agent's Environment on a shoal sandbox (see the module docstring)."""

    def __init__(self, *, config_class: type = ShoalEnvironmentConfig, logger: logging.Logger | None = None,
                 **kwargs: Any) -> None:
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.sandbox: SyncSandbox | None = None
        self._owned = False
        self.config = config_class(**kwargs)
        c = self.config
        for key in DOCKER_ONLY:
            if getattr(c, key):
                self.logger.debug("ShoalEnvironment ignores the Docker option %s=%r", key, getattr(c, key))
        st = settings()  # $SHOAL_URL / $SHOAL_TOKEN (or the config file's client section)
        client = client_for(c.url or st.url, c.token or st.token)
        if c.sandbox_id:
            self.sandbox = client.get(c.sandbox_id)
            return
        spec = SandboxSpec.from_options(c.image, **{"ttl_s": parse_duration(c.container_timeout), **c.spec})
        spec.labels = {"shoal.client": "mini-swe-agent", **spec.labels}
        self.sandbox = client.bridge.run(_create(client, spec), timeout=float(c.pull_timeout) + 60)
        self._owned = True
        self.logger.info("Started shoal sandbox %s from %s", self.sandbox.id, c.image)

    @property
    def sandbox_id(self) -> str | None:
        """The sandbox the commands run in."""
        return self.sandbox.id if self.sandbox is not None else None

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run `action["command"]` through the interpreter in the sandbox; the Docker environment's answer."""
        command = action.get("command", "")
        cwd = cwd or self.config.cwd
        limit = timeout or self.config.timeout
        env = {k: v for k in self.config.forward_env if (v := os.getenv(k)) is not None}
        env.update(self.config.env)
        # one stream, as `docker exec` with stderr=STDOUT gives it: the interpreter's stderr joins its stdout
        argv = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *self.config.interpreter, command]
        assert self.sandbox is not None, "the sandbox was not created"
        try:
            r = self.sandbox.exec(argv, cwd=cwd, env=env or None, timeout=limit)
            text = r.stdout.decode("utf-8", "replace") if isinstance(r.stdout, bytes) else str(r.stdout)
            if r.truncated:
                text += "\n[shoal: output cut at the sandbox's max_output_bytes]\n"
            if r.timed_out:
                msg = f"Command {[*self.config.interpreter, command]!r} timed out after {limit} seconds"
                output = {"output": text, "returncode": -1,
                          "exception_info": f"An error occurred while executing the command: {msg}",
                          "extra": {"exception_type": "TimeoutExpired", "exception": msg}}
            else:
                output = {"output": text, "returncode": int(r.exit_code), "exception_info": ""}
        except ShoalError as e:
            output = {"output": "", "returncode": -1,
                      "exception_info": f"An error occurred while executing the command: {e.message}",
                      "extra": {"exception_type": type(e).__name__, "exception": e.message}}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        """Raise Submitted when the first output line is the submit marker and the command succeeded."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_LINE and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted({"role": "exit", "content": submission,
                             "extra": {"exit_status": "Submitted", "submission": submission}})

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """Variables for the agent's templates: the config (no token), the platform, `sandbox_id`."""
        return recursive_merge(self.config.public(), platform.uname()._asdict(),
                               {"sandbox_id": self.sandbox_id}, kwargs)

    def serialize(self) -> dict[str, Any]:
        """What mini-swe-agent saves in a trajectory about the environment (never the token)."""
        return {"info": {"config": {
            "environment": {**self.config.public(), "sandbox_id": self.sandbox_id},
            "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}"}}}

    def cleanup(self) -> None:
        """Close the sandbox (one given by `sandbox_id` stays open). Safe to call twice."""
        sb, self.sandbox = self.sandbox, None
        if sb is not None and self._owned:
            try:
                sb.close()
            except Exception as e:  # also runs from __del__: report, never raise
                log.warning("closing shoal sandbox %s failed: %s", sb.id, e)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.cleanup()


async def _create(client: SyncClient, spec: SandboxSpec) -> SyncSandbox:
    sb = await client.async_client.create(spec.image, **spec.model_dump(exclude={"image"}))
    return SyncSandbox(client.bridge, sb)
