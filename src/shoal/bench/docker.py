"""A private Docker engine for side-by-side runs: started by the benchmark, stopped and removed after.

Docker is never a dependency of shoal. When `dockerd` is installed (Debian: `apt-get install docker.io`),
the benchmark starts its own daemon with a data root, exec root and socket in a temporary directory
(no bridge, no iptables: the host stays as it was), imports the same base tree shoal uses, and talks
to it through the Engine API over the Unix socket — the path docker-py and the harnesses built on it
(SWE-ReX, OpenHands, ROCK) take, and Docker's best case (no CLI process per call).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from shoal.host import syscalls
from shoal.host.spawn import run_sync

API = "v1.41"  # Docker 20.10 (Debian 12's docker.io); newer daemons accept it too
INSTALL_HINT = "apt-get install docker.io (the benchmark starts and stops its own dockerd)"


def find_dockerd() -> tuple[str | None, str]:
    """(path of dockerd, '') or (None, why Docker cannot be used here)."""
    path = shutil.which("dockerd")
    if not path:
        return None, f"dockerd is not installed ({INSTALL_HINT})"
    if os.geteuid() != 0:
        return None, "dockerd needs root"
    return path, ""


class DockerError(RuntimeError):
    """The private Docker engine failed to start or to do what was asked."""


class DockerEngine:
    """One private dockerd, driven through its Engine API."""

    def __init__(self, workdir: Path | None = None) -> None:
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="sbd-", dir="/tmp"))
        self.sock = self.dir / "docker.sock"
        self.proc_pid: int | None = None
        self.version = ""
        self._client: Any = None
        self.image = "shoal-bench-base:latest"
        self._log = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout: float = 90.0) -> None:
        """Start dockerd (with its own containerd) in the private directory and wait for its API."""
        dockerd, why = find_dockerd()
        if not dockerd:
            raise DockerError(why)
        for d in ("data", "exec"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        self._log = open(self.dir / "dockerd.log", "wb")  # noqa: SIM115 - lives as long as the daemon
        argv = [dockerd, "--data-root", str(self.dir / "data"), "--exec-root", str(self.dir / "exec"),
                "--pidfile", str(self.dir / "docker.pid"), "-H", f"unix://{self.sock}",
                "--iptables=false", "--ip6tables=false", "--ip-masq=false", "--bridge=none",
                "--userland-proxy=false", "--log-level=warn", "--storage-driver=overlay2"]
        env = dict(os.environ)
        # dockerd looks for containerd/runc on PATH; keep the system's
        env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        self.proc_pid = os.posix_spawn(dockerd, argv, env, file_actions=[
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, self._log.fileno(), 1), (os.POSIX_SPAWN_DUP2, self._log.fileno(), 2)],
            setsid=True)
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if _exited(self.proc_pid):
                raise DockerError(f"dockerd exited at start: {self.log_tail()}")
            if self.sock.exists():
                try:
                    info = self._get_sync("/version")
                    self.version = info.get("Version", "")
                    return
                except Exception as e:  # not listening yet
                    last = str(e)
            time.sleep(0.2)
        raise DockerError(f"dockerd did not answer within {timeout}s ({last}): {self.log_tail()}")

    def log_tail(self, n: int = 1500) -> str:
        """The end of dockerd's log (for error messages)."""
        with contextlib.suppress(OSError):
            return (self.dir / "dockerd.log").read_bytes()[-n:].decode(errors="replace")
        return ""

    def _get_sync(self, path: str) -> Any:
        import httpx

        with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.sock)), timeout=5.0) as c:
            r = c.get(f"http://docker/{API}{path}")
            r.raise_for_status()
            return r.json()

    @property
    def client(self) -> Any:
        """An httpx.AsyncClient on the daemon's socket (created on first use, per event loop)."""
        import httpx

        if self._client is None:
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
            self._client = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(self.sock), limits=limits),
                                             base_url=f"http://docker/{API}", timeout=300.0)
        return self._client

    async def aclose_client(self) -> None:
        """Close the HTTP client (before the event loop ends)."""
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
            self._client = None

    def stop(self) -> None:
        """Remove every container, stop dockerd and its containerd, unmount and delete the private directory."""
        if self.proc_pid and not _exited(self.proc_pid):
            with contextlib.suppress(Exception):
                ids = [c["Id"] for c in self._get_sync("/containers/json?all=1")]
                if ids:
                    run_sync(["docker", "-H", f"unix://{self.sock}", "rm", "-f", *ids], timeout=600)
            os.kill(self.proc_pid, signal.SIGTERM)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not _exited(self.proc_pid):
                time.sleep(0.2)
            if not _exited(self.proc_pid):
                os.kill(self.proc_pid, signal.SIGKILL)
                while not _exited(self.proc_pid):
                    time.sleep(0.1)
        # containerd and shims started by this daemon live under our exec root; none may outlive it
        for pid in _pids_mentioning(str(self.dir)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for mp in syscalls.mounts_under(str(self.dir)):
            try:
                syscalls.umount(mp)
            except OSError as e:
                if e.errno in (errno.EBUSY,):
                    syscalls.umount(mp, detach=True)
        if self._log is not None:
            self._log.close()
            self._log = None
        shutil.rmtree(self.dir, ignore_errors=True)
        self.proc_pid = None

    # ---- images ------------------------------------------------------------------------------
    def import_tree(self, tree: Path, tag: str | None = None) -> None:
        """`tar -C tree -c . | docker import - tag`: the same files shoal's base image has."""
        tag = tag or self.image
        docker = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else "docker"
        r = run_sync(["bash", "-c", f"tar --numeric-owner -C '{tree}' -c . | "
                      f"{docker} -H 'unix://{self.sock}' import - '{tag}'"], timeout=1800)
        if r.returncode != 0:
            raise DockerError(f"docker import failed: {r.stderr.decode(errors='replace')[-1000:]}")
        self.image = tag

    # ---- containers --------------------------------------------------------------------------
    async def create_start(self, cmd: list[str] | None = None, memory_mb: int = 1024, cpus: float = 1.0,
                           pids: int = 512, image: str | None = None) -> str:
        """`docker run -d` through the API (create + start): returns the container id once it runs."""
        body = {"Image": image or self.image, "Cmd": cmd or ["sleep", "infinity"], "WorkingDir": "/root",
                "HostConfig": {"NetworkMode": "none", "Memory": memory_mb << 20, "NanoCpus": int(cpus * 1e9),
                               "PidsLimit": pids}}
        r = await self.client.post("/containers/create", json=body)
        if r.status_code != 201:
            raise DockerError(f"create: {r.status_code} {r.text[:300]}")
        cid = r.json()["Id"]
        r = await self.client.post(f"/containers/{cid}/start")
        if r.status_code not in (204, 304):
            with contextlib.suppress(Exception):
                await self.remove(cid)
            raise DockerError(f"start: {r.status_code} {r.text[:300]}")
        return cid

    async def exec(self, cid: str, argv: list[str]) -> tuple[int, bytes]:
        """`docker exec` through the API (exec create, start attached until EOF, inspect): exit code and output."""
        r = await self.client.post(f"/containers/{cid}/exec",
                                   json={"Cmd": argv, "AttachStdout": True, "AttachStderr": True})
        if r.status_code != 201:
            raise DockerError(f"exec create: {r.status_code} {r.text[:300]}")
        eid = r.json()["Id"]
        r = await self.client.post(f"/exec/{eid}/start", json={"Detach": False, "Tty": False})
        out = r.content
        r = await self.client.get(f"/exec/{eid}/json")
        return int(r.json().get("ExitCode") or 0), _demux(out)

    async def remove(self, cid: str) -> None:
        """`docker rm -f`."""
        r = await self.client.delete(f"/containers/{cid}", params={"force": "1"})
        if r.status_code not in (204, 404):
            raise DockerError(f"rm: {r.status_code} {r.text[:300]}")

    async def remove_many(self, cids: list[str], concurrency: int = 16) -> None:
        """Remove containers with bounded parallelism (errors ignored; stop() sweeps the rest)."""
        sem = asyncio.Semaphore(concurrency)

        async def one(c: str) -> None:
            async with sem:
                with contextlib.suppress(Exception):
                    await self.remove(c)

        await asyncio.gather(*(one(c) for c in cids))

    def shim_pids(self) -> list[int]:
        """PIDs of containerd-shim processes of this daemon (one per running container)."""
        return [p for p in _pids_mentioning(str(self.dir)) if b"containerd-shim" in _cmdline(p)]

    def daemon_pids(self) -> list[int]:
        """dockerd + containerd + shims of this engine."""
        out = [self.proc_pid] if self.proc_pid else []
        return out + [p for p in _pids_mentioning(str(self.dir)) if p not in out]

    def info(self) -> dict[str, Any]:
        """Version and storage driver (for the results)."""
        with contextlib.suppress(Exception):
            i = self._get_sync("/info")
            return {"version": self.version, "storage_driver": i.get("Driver"), "cgroup_driver": i.get("CgroupDriver"),
                    "runtime": i.get("DefaultRuntime"), "data_root": str(self.dir / "data")}
        return {"version": self.version}


def _demux(raw: bytes) -> bytes:
    # Docker's multiplexed stream: 8-byte headers (stream, 0, 0, 0, size BE32) before each chunk
    out, i = [], 0
    while i + 8 <= len(raw):
        size = int.from_bytes(raw[i + 4 : i + 8], "big")
        out.append(raw[i + 8 : i + 8 + size])
        i += 8 + size
    return b"".join(out)


def _exited(pid: int) -> bool:
    try:
        wpid, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return not os.path.exists(f"/proc/{pid}")
    return wpid == pid


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _pids_mentioning(text: str) -> list[int]:
    needle = text.encode()
    out = []
    for e in os.scandir("/proc"):
        if e.name.isdigit() and needle in _cmdline(int(e.name)):
            out.append(int(e.name))
    return out


def process_tree_rss(pids: list[int]) -> int:
    """Sum of the proportional set size (PSS) of processes, in bytes (smaps_rollup; RSS when unreadable)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
    return total


def dump(obj: Any) -> str:
    """JSON for logs."""
    return json.dumps(obj, default=str)
