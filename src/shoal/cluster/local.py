"""A Ray cluster of several nodes on this one machine, bound to 127.0.0.1 (tests, benchmarks, trying
cluster mode out): `ray.cluster_utils.Cluster` with a head and N worker nodes offering the `shoal` resource.

Every port is picked free (never Ray's default 6379), the Ray session lives in a private temp directory,
and a node that disappears is noticed in about 3 s (Ray's health check every second, dead after 3 misses)
instead of Ray's default of about 15-30 s.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any

from shoal.cluster.raylink import NODE_LABEL, RESOURCE, loopback_children

#: how fast Ray's control service declares a silent node dead (what bounds SandboxLost's delay)
FAST_NODE_FAILURE = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
                     "health_check_failure_threshold": 3}


def _free_port() -> int:
    from shoal.server.proc import free_port

    return free_port("127.0.0.1")


class LocalCluster:
    """Head (no sandboxes) + `workers` Ray nodes offering `shoal`, all on 127.0.0.1."""

    def __init__(self, workers: int = 3, *, head_cpus: int = 2, worker_cpus: int = 1,
                 labels: bool = False, system_config: dict[str, Any] | None = None, port: int | None = None,
                 detached: bool = False) -> None:
        self.n_workers = workers
        #: the head's GCS port (None: a free one)
        self.port = port
        #: True: the Ray processes outlive this Python process (`shoal cluster local`; `stop_session` ends them)
        self.detached = detached
        self.head_cpus = head_cpus
        self.worker_cpus = worker_cpus
        self.labels = labels
        self.system_config = {**FAST_NODE_FAILURE, **(system_config or {})}
        self.cluster: Any = None
        self.temp_dir = ""
        self.workers: list[Any] = []
        self._seq = 0

    @property
    def address(self) -> str:
        """The head's GCS address (`127.0.0.1:PORT`), as `ray.init` and `ray://` take it."""
        return str(self.cluster.address)

    @property
    def url(self) -> str:
        """`ray://127.0.0.1:PORT` for shoal.Client."""
        return f"ray://{self.address}"

    def start(self) -> LocalCluster:
        """Start the head and the worker nodes (a few seconds)."""
        from ray.cluster_utils import Cluster

        self.temp_dir = tempfile.mkdtemp(prefix="shray-", dir="/tmp")
        if self.detached:
            # Ray notes "the current cluster" in its default temp dir (/tmp/ray), shared by every cluster of the
            # host: a cluster started for the command line keeps that note in its own session directory
            os.environ["RAY_TMPDIR"] = self.temp_dir
        # Ray notes the head's address in its *default* temp dir whatever temp_dir says (/tmp/ray/ray_current_cluster)
        # and fails when that directory does not exist yet: on a fresh machine, where no Ray ran before
        from ray._common.utils import get_default_ray_temp_dir

        os.makedirs(get_default_ray_temp_dir(), exist_ok=True)
        head = dict(node_ip_address="127.0.0.1", gcs_server_port=self.port or _free_port(), include_dashboard=False,
                    # Ray's head defaults to fixed ports for these (52365 …): other clusters on this host may hold them
                    dashboard_agent_listen_port=_free_port(), metrics_export_port=_free_port(),
                    num_cpus=self.head_cpus, temp_dir=self.temp_dir, _system_config=self.system_config)
        with loopback_children():
            self.cluster = Cluster(initialize_head=True, shutdown_at_exit=not self.detached, head_node_args=head)
        for _ in range(self.n_workers):
            self.add_worker()
        return self

    def add_worker(self) -> Any:
        """One more Ray node offering `shoal`."""
        self._seq += 1
        kw: dict[str, Any] = {"labels": {NODE_LABEL: f"w{self._seq}"}} if self.labels else {}
        with loopback_children():
            node = self.cluster.add_node(node_ip_address="127.0.0.1", num_cpus=self.worker_cpus,
                                         resources={RESOURCE: 1}, **kw)
        self.workers.append(node)
        return node

    def remove_worker(self, node: Any) -> None:
        """Kill a worker node's Ray processes at once (as if its machine vanished)."""
        self.cluster.remove_node(node, allow_graceful=False)
        self.workers.remove(node)

    def worker_by_ray_id(self, ray_node_id: str) -> Any:
        """The worker node with this Ray node ID."""
        for w in self.workers:
            if w.node_id == ray_node_id:
                return w
        raise KeyError(ray_node_id)

    def shutdown(self) -> None:
        """Disconnect this process and stop every Ray process of the cluster."""
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.cluster is not None:
            with contextlib.suppress(Exception):
                self.cluster.shutdown()
            self.cluster = None
        if self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = ""

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def ray_processes_of(temp_dir: str) -> list[int]:
    """PIDs of live processes whose command line mentions this Ray session directory (leak checks)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if temp_dir.encode() in cmd:
            out.append(int(pid))
    return out


def stop_session(temp_dir: str, attempts: int = 10) -> int:
    """Kill every process of the Ray session under `temp_dir` (a detached LocalCluster) and remove the
    directory; the number of processes killed."""
    import signal
    import time

    killed: set[int] = set()
    me = os.getpid()
    for _ in range(attempts):
        left = [p for p in ray_processes_of(temp_dir) if p != me]
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.3)
    shutil.rmtree(temp_dir, ignore_errors=True)
    return len(killed)
