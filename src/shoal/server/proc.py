"""Start and stop `shoal serve` as a child process (for tests, benchmarks and scripts).

The child inherits SHOAL_HOME/SHOAL_STORE from the environment given, listens on a free loopback port,
and is ready when `/healthz` answers.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One `shoal serve` child process."""

    def __init__(self, *, port: int | None = None, host: str = "127.0.0.1", args: list[str] | None = None,
                 env: dict[str, str] | None = None, log_path: str | Path | None = None,
                 token: str | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.args = list(args or [])
        self.env = dict(os.environ if env is None else env)
        self.log_path = Path(log_path) if log_path else None
        self.token = token
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = None

    @property
    def url(self) -> str:
        """Base URL of the server."""
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerProcess:
        """Spawn the server and wait until /healthz answers (RuntimeError with its log if it dies)."""
        argv = [sys.executable, "-m", "shoal.cli.main", "serve", "--host", self.host, "--port", str(self.port),
                *self.args]
        if self.log_path:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL,
                                     stdout=self._log or subprocess.DEVNULL, stderr=self._log or subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"shoal serve exited with {self.proc.returncode}: {self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/healthz", timeout=1.0).status_code == 200:
                    return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"shoal serve did not answer /healthz within {timeout}s: {self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        """The end of the server's log (when it logs to a file)."""
        if not self.log_path or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Send `sig` (graceful by default) and wait for the process to end; returns its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self._log:
            self._log.close()
            self._log = None
        return self.proc.returncode

    def kill(self) -> int | None:
        """SIGKILL: the crash the server must survive (sandboxes keep running)."""
        return self.stop(signal.SIGKILL)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
