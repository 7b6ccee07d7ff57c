"""The Docker side of the `lazy` scenario: a private dockerd driven with the docker CLI, its data root on the
scenario's scratch filesystem, and the disk bytes written per `docker run` of the same image tree."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.bench.diskstats import ScratchFs, Writes, median
from shoal.errors import BackendUnavailable
from shoal.images.mounts import LayerMounts


class Dockerd:
    """A private dockerd (own data root, socket, no iptables/bridge) started and stopped by the benchmark."""

    def __init__(self, root: Path) -> None:
        self.root = root  # data root on the same disk as SHOAL_HOME (like /var/lib/docker)
        # runtime state on tmpfs, like Docker's default /var/run/docker
        self.exec_root = Path(tempfile.mkdtemp(prefix="shoal-bench-docker-", dir="/run"))
        self.sock = f"unix://{self.exec_root}/docker.sock"
        self.proc: subprocess.Popen | None = None

    def docker(self, *args: str, stdin: Any = None, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", "-H", self.sock, *args], stdin=stdin, capture_output=True, text=True,
                              timeout=timeout)

    def start(self) -> None:
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        with open(self.root / "dockerd.log", "wb") as logf:
            self.proc = subprocess.Popen(
                ["dockerd", "--iptables=false", "--ip-masq=false", "--bridge=none", "-H", self.sock,
                 "--data-root", str(self.root / "data"), "--exec-root", str(self.exec_root / "exec"),
                 "--pidfile", str(self.exec_root / "dockerd.pid"), "--storage-driver", "overlay2"],
                stdout=logf, stderr=subprocess.STDOUT)
        for _ in range(300):
            if self.proc.poll() is not None:
                raise BackendUnavailable("dockerd exited: " + (self.root / "dockerd.log").read_text()[-800:])
            with contextlib.suppress(subprocess.SubprocessError):
                if self.docker("info", timeout=5).returncode == 0:
                    return
            time.sleep(0.2)
        raise BackendUnavailable("dockerd did not come up: " + (self.root / "dockerd.log").read_text()[-800:])

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(Exception):
            ids = self.docker("ps", "-aq").stdout.split()
            if ids:
                self.docker("rm", "-f", *ids)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        from shoal.host import syscalls

        for base in (self.root, self.exec_root):
            for mp in syscalls.mounts_under(str(base)):
                with contextlib.suppress(OSError):
                    syscalls.umount(mp, detach=True)
        shutil.rmtree(self.exec_root, ignore_errors=True)


def ensure_docker(install: bool, log: Callable[[str], None]) -> None:
    if shutil.which("dockerd") and shutil.which("docker"):
        return
    if not install:
        raise BackendUnavailable("Docker is not installed (apt-get install docker.io)")
    log("installing docker.io for the side-by-side comparison (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    r = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "docker.io"],
                       capture_output=True, text=True, env=env, timeout=900)
    if r.returncode != 0 or not shutil.which("dockerd"):
        raise BackendUnavailable(f"could not install docker.io: {r.stderr[-500:]}")


def docker_writes(node: Any, img: Any, root: Path, scratch: ScratchFs, n: int, rounds: int, install: bool,
                   log: Callable[[str], None]) -> dict:
    ensure_docker(install, log)
    d = Dockerd(scratch.mnt / "docker")
    lm = LayerMounts(node.paths)
    d.start()
    try:
        # the same tree: the image's layers stacked read-only, tarred into `docker import`
        mps = lm.acquire(img.layers, "bench-docker-import")
        merged = root / "merged"
        merged.mkdir()
        from shoal.host import syscalls

        empty = root / "empty"
        empty.mkdir()
        # an empty bottom lower: a read-only overlay of a one-layer image still hides its whiteouts
        lowers = [*(str(p) for p in reversed(mps)), str(empty)]
        syscalls.mount("overlay", str(merged), "overlay", syscalls.MS_RDONLY, "lowerdir=" + ":".join(lowers))
        try:
            tar = subprocess.Popen(["tar", "-C", str(merged), "--numeric-owner", "-cf", "-", "."],
                                   stdout=subprocess.PIPE)
            r = d.docker("import", "-", "shoal-bench:latest", stdin=tar.stdout, timeout=900)
            tar.wait()
            if r.returncode != 0:
                raise BackendUnavailable(f"docker import failed: {r.stderr[-500:]}")
        finally:
            syscalls.umount(str(merged), detach=True)
            lm.release([lay.hex for lay in img.layers], "bench-docker-import")
        log("docker: imported the same tree as shoal-bench:latest")
        # warm-up, as for shoal
        r = d.docker("run", "-d", "--network", "none", "shoal-bench:latest", "sleep", "infinity")
        if r.returncode != 0:
            raise BackendUnavailable(f"docker run failed: {r.stderr[-500:]}")
        d.docker("rm", "-f", r.stdout.strip())
        data = d.root / "data"
        w = Writes(scratch.stat, [data], {"containers (config, hosts, logs)": data / "containers",
                                   "overlay2 (init + upper layers)": data / "overlay2",
                                   "containerd": data / "containerd"})
        t_run = []
        for _ in range(rounds):
            w.begin()
            ids = []
            for _ in range(n):
                t0 = time.perf_counter()
                r = d.docker("run", "-d", "--network", "none", "shoal-bench:latest", "sleep", "infinity")
                t_run.append(time.perf_counter() - t0)
                if r.returncode != 0:
                    raise BackendUnavailable(f"docker run failed: {r.stderr[-500:]}")
                ids.append(r.stdout.strip())
            w.end(n)
            d.docker("rm", "-f", *ids)
        res = w.summary()
        res["docker_run_s_median"] = median(t_run)
        res["docker_version"] = d.docker("version", "-f", "{{.Server.Version}}").stdout.strip()
        log(f"docker: {res['bytes_written'] / 1024:.1f} KiB written per container (raw "
            f"{res['bytes_written_raw'] / 1024:.1f} KiB); {res['allocated_bytes'] / 1024:.1f} KiB allocated; "
            f"docker run {res['docker_run_s_median'] * 1000:.0f} ms")
        return res
    finally:
        d.stop()
