"""The fake backend: sandboxes WITHOUT ANY ISOLATION, for unit tests of the node, SDK, server and RL logic.

Each sandbox is a directory on the host holding the image's files (its layers extracted with
`fsck.erofs --extract`), plus the real shoal agent run as an ordinary process of the calling user with
its working directory there. So exec, streams, shells, timeouts, output caps and exit codes are the real
agent's; paths of file operations and command working directories are mapped under the sandbox's
directory. Commands themselves see the whole host as the calling user: `cat /etc/passwd` reads the
host's, `rm -rf ~` removes the caller's home. Limits (cpus, memory, pids, disk) are recorded, not
enforced; pause is SIGSTOP of the agent and every process under it; there is no network.

It is registered as "fake" (shoal.backends.registry) and refused unless the node's config enables it
(`NodeConfig(fake_backend=True)`, or SHOAL_FAKE_BACKEND=1): never enable it where untrusted code runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import posixpath
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.agentproto.client import AgentClient
from shoal.backends.base import Backend, Capability
from shoal.errors import BackendUnavailable, SandboxError, Timeout
from shoal.limits import AGENT_READY_TIMEOUT_S
from shoal.records import proc_starttime

if TYPE_CHECKING:
    from shoal.agentproto.client import _Stream
    from shoal.backends.context import NodeContext
    from shoal.images.store import Image
    from shoal.records import SandboxRecord
    from shoal.spec import SandboxSpec

#: request fields that are paths inside the sandbox, by agent operation
_PATH_OPS = frozenset({"read_file", "write_file", "list_dir", "stat", "mkdir", "remove"})
_CWD_OPS = frozenset({"exec", "shell_open"})


class FakeAgentClient(AgentClient):
    """An AgentClient that maps sandbox paths (and working directories) under the sandbox's directory and
    runs everything as the agent's own user."""

    root: str = "/"

    def _map(self, path: str) -> str:
        # normpath of an absolute path never climbs above "/": the result stays under root
        return self.root + posixpath.normpath("/" + path) if path else path

    def _fields(self, op: str, fields: dict[str, Any]) -> dict[str, Any]:
        if op in _PATH_OPS and isinstance(fields.get("path"), str):
            fields["path"] = self._map(fields["path"])
        if op in _CWD_OPS:
            fields["cwd"] = self._map(fields.get("cwd") or "/")
        if "user" in fields:
            fields["user"] = None  # no user switching: the agent is not root here
        return fields

    async def _open(self, op: str, **fields: Any) -> _Stream:
        return await super()._open(op, **self._fields(op, fields))


def _socket_dir() -> Path:
    # Unix socket paths are limited to 107 bytes: a pytest tmp_path SHOAL_HOME may be too deep for them
    d = Path(tempfile.gettempdir()) / f"shoal-fake-{os.getuid()}"
    d.mkdir(mode=0o700, exist_ok=True)
    return d


def descendants(pid: int) -> list[int]:
    """Every live process under `pid` (by parent links), parents before children."""
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        rest = data[data.rfind(b")") + 2:].split()
        kids.setdefault(int(rest[1]), []).append(int(name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for k in kids.get(todo.pop(0), []):
            out.append(k)
            todo.append(k)
    return out


def _state(pid: int) -> str:
    """The one-letter state of a process ("" when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return ""
    return data[data.rfind(b")") + 2:].split()[0].decode()


class FakeBackend(Backend):
    """Sandboxes as host directories and plain processes (no isolation; unit tests only)."""

    name = "fake"
    idle_close = True
    capabilities = frozenset({Capability.SANDBOXES, Capability.PAUSE, Capability.SNAPSHOT_FILES})
    instead = {
        Capability.NETWORK: "the fake backend has no network of its own; use backend='container'",
        Capability.RECLAIM: "the fake backend only stops processes; use backend='container'",
        Capability.SNAPSHOT_MEMORY: "use a VM backend",
        Capability.FORK_MEMORY: "fork(n) without memory=True forks the files; memory forks need a VM backend",
        Capability.RESTORE: "memory snapshots are restored by the VM backends",
    }

    def __init__(self, ctx: NodeContext, name: str | None = None) -> None:
        super().__init__(ctx, name)
        check_fake_usable()
        #: called with (spec, ordinal of this create) before each create; a test raises from it to make
        #: that create fail (the ordinal counts creates of this backend object, from 0)
        self.before_create: Any = None
        self.creates = 0

    @staticmethod
    def string_shell(rec: SandboxRecord) -> str:
        """Commands run host programs here (only paths are mapped): the host's bash runs string commands."""
        return "/bin/bash"

    @staticmethod
    def root(rec: SandboxRecord) -> Path:
        """The sandbox's directory tree (its "/")."""
        return rec.path / "root"

    @staticmethod
    def socket(rec: SandboxRecord) -> Path:
        """The agent's Unix socket."""
        return Path(rec.extra.get("socket") or _socket_dir() / f"{rec.id}.sock")

    async def create(self, rec: SandboxRecord, spec: SandboxSpec, image: Image) -> None:
        """Extract the image's layers into the sandbox's directory and start the agent there."""
        ordinal = self.creates
        self.creates += 1
        try:
            if self.before_create is not None:
                self.before_create(spec, ordinal)
            root = self.root(rec)
            root.mkdir()
            for layer in image.layers:
                src = layer.path
                if layer.chunked:  # a whole image of the layer (every chunk checked) for fsck.erofs
                    src = rec.path / f"layer-{layer.hex[:16]}.erofs"
                    await asyncio.to_thread(self.ctx.store.export_layer, layer.digest, src)
                try:
                    r = await asyncio.to_thread(
                        subprocess.run, ["fsck.erofs", f"--extract={root}", "--overwrite", "--no-preserve-owner",
                                         str(src)], capture_output=True, timeout=120)
                finally:
                    if layer.chunked:
                        src.unlink(missing_ok=True)
                if r.returncode != 0:
                    raise SandboxError(f"fake backend: extracting layer {layer.hex[:12]} failed: "
                                       f"{(r.stderr or r.stdout).decode(errors='replace').strip()[-500:]}")
            sock = _socket_dir() / f"{rec.id}.sock"
            rec.extra.update(socket=str(sock), root=str(root))
            rec.runtime = "fake"
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8"}
            env.update(image.config.env)
            env["HOME"] = str(root)  # the image's HOME is a path inside the sandbox: its root here
            env.update(spec.env)
            env.setdefault("HOSTNAME", spec.hostname or "sandbox")
            env["SHOAL_SANDBOX_ROOT"] = str(root)
            rec.save()
            log = rec.path / "agent.log"
            # the agent must outlive this process (crash-only, like a container): started by a shell that
            # exits at once, it belongs to nobody here
            script = '"$0" --listen "$1" </dev/null >>"$2" 2>&1 & echo $!'
            # (a blocking run in a thread, not an asyncio subprocess: those hang under uvloop off the main thread)
            launch = asyncio.ensure_future(asyncio.to_thread(
                subprocess.run, ["/bin/sh", "-c", script, str(self.ctx.agent_binary), str(sock), str(log)],
                cwd=str(root), env=env, stdout=subprocess.PIPE, start_new_session=True, timeout=30))
            try:
                r = await asyncio.shield(launch)
            except asyncio.CancelledError:
                # the thread starts the agent anyway: learn its pid, so the cleanup below can kill it
                with contextlib.suppress(Exception):
                    self._set_init(rec, (await launch).stdout)
                raise
            if not self._set_init(rec, r.stdout):
                raise SandboxError(f"fake backend: the agent did not start ({log.read_text()[-500:]})")
            rec.save()
        except BaseException:
            await self.destroy(rec)
            raise

    @staticmethod
    def _set_init(rec: SandboxRecord, pid_line: bytes) -> bool:
        pid = int(pid_line.strip() or 0)
        start = proc_starttime(pid) if pid else None
        if not pid or start is None:
            return False
        rec.init_pid, rec.init_start = pid, start
        return True

    async def connect(self, rec: SandboxRecord, timeout: float = AGENT_READY_TIMEOUT_S) -> AgentClient:
        """Connect to the agent's socket (waiting for it to listen)."""
        sock = str(self.socket(rec))
        deadline = time.monotonic() + timeout
        while True:
            if not rec.init_alive():
                raise SandboxError(f"fake sandbox {rec.id}: its agent exited")
            if os.path.exists(sock):
                try:
                    client = await FakeAgentClient.connect_unix(sock, timeout=max(0.1, deadline - time.monotonic()))
                    break
                except SandboxError:
                    if time.monotonic() > deadline:
                        raise
            if time.monotonic() > deadline:
                raise Timeout(f"fake sandbox {rec.id}: its agent did not listen within {timeout}s")
            await asyncio.sleep(0.005)
        assert isinstance(client, FakeAgentClient)
        client.root = str(self.root(rec))
        return client

    async def destroy(self, rec: SandboxRecord) -> None:
        """Kill the agent and every process under it, remove the directory and socket. Idempotent."""
        if rec.init_pid and rec.init_alive():
            for pid in [rec.init_pid, *descendants(rec.init_pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while rec.init_alive():
                if time.monotonic() > deadline:
                    raise SandboxError(f"fake sandbox {rec.id}: its agent {rec.init_pid} did not exit")
                await asyncio.sleep(0.005)
        with contextlib.suppress(FileNotFoundError):
            self.socket(rec).unlink()
        await asyncio.to_thread(shutil.rmtree, rec.path, True)

    async def pause(self, rec: SandboxRecord) -> None:
        """SIGSTOP the agent and every process under it, and wait until they are all stopped (a signal
        takes effect when the process next runs; a process may fork meanwhile: look again until none runs)."""
        if not rec.init_alive():
            raise SandboxError(f"fake sandbox {rec.id} has died")
        deadline = time.monotonic() + 10
        while True:
            running = [p for p in [rec.init_pid, *descendants(rec.init_pid)] if _state(p) not in ("T", "Z", "X", "")]
            if not running:
                return
            if time.monotonic() > deadline:
                raise SandboxError(f"fake sandbox {rec.id}: processes {running} did not stop")
            for pid in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(0.001)

    async def resume(self, rec: SandboxRecord) -> None:
        """SIGCONT them again (children first, so the agent never sees a stopped child it did not stop)."""
        if not rec.init_alive():
            raise SandboxError(f"fake sandbox {rec.id} has died")
        for pid in [*reversed(descendants(rec.init_pid)), rec.init_pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def upper_dir(self, rec: SandboxRecord) -> Path:
        """The whole sandbox directory is its writable layer (snapshots pack all of it)."""
        return self.root(rec)

    def info(self, rec: SandboxRecord) -> dict[str, Any]:
        """Where the sandbox lives on the host, and that it is not isolated."""
        return {"isolation": "none", "root": str(self.root(rec))}


def check_fake_usable() -> None:
    """BackendUnavailable unless the agent binary and fsck.erofs are here."""
    if shutil.which("fsck.erofs") is None:
        raise BackendUnavailable("the fake backend extracts image layers with fsck.erofs: apt-get install erofs-utils")
