"""A network namespace made by a test, standing in for "the internet" (so no packet leaves the host).

`Internet()` makes a namespace joined to the host by a veth pair on a /24 picked at random from
198.18.0.0/15 (RFC 2544's benchmarking range: never routed on the real internet; random, so tests
running at once do not collide). Processes inside it: a UDP sink, an HTTP server, a DNS server. Processes started with
`spawn()` run inside it (a UDP sink, an HTTP server, a DNS server); `close()` stops them and removes the
namespace and the veth. Sandboxes reach it through the node's NAT exactly as they would reach a public
address.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shoal.cluster.raylink import RAY_CLUSTER_ENV

# a UDP sink: one line per datagram, "<source ip> <payload>", into the file argv[2]
UDP_SINK = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
with open(sys.argv[2], "a", buffering=1) as out:
    out.write("ready\n")
    while True:
        data, (src, _) = s.recvfrom(2048)
        out.write(f"{src} {data.decode(errors='replace')}\n")
"""

# an HTTP server answering every GET with "hello from <address it was asked on>"
HTTP_SERVER = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = f"hello from {self.server.server_address[0]}".encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()
"""


# a DNS server answering A queries from a JSON map {name: [ip, ...]} (argv[2]) on argv[1]:53; NXDOMAIN
# for other names; every question it gets is appended to argv[3]
DNS_SERVER = r"""
import json, socket, struct, sys
names = json.loads(sys.argv[2])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 53))
log = open(sys.argv[3], "a", buffering=1); log.write("ready\n")
while True:
    q, addr = s.recvfrom(4096)
    qid, flags = struct.unpack(">HH", q[:4]); off = 12; labels = []
    while q[off]:
        labels.append(q[off + 1:off + 1 + q[off]].decode()); off += 1 + q[off]
    name = ".".join(labels).lower(); qtype = struct.unpack(">H", q[off + 1:off + 3])[0]
    question = q[12:off + 5]; log.write(f"{name} {qtype}\n")
    ips = names.get(name)
    if ips is None:
        s.sendto(q[:2] + struct.pack(">HHHHH", 0x8183, 1, 0, 0, 0) + question, addr); continue
    ans = b"".join(b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 60, 4) + socket.inet_aton(ip) for ip in ips) \
        if qtype == 1 else b""
    n = len(ips) if qtype == 1 else 0
    s.sendto(q[:2] + struct.pack(">HHHHH", 0x8180, 1, n, 0, 0) + question + ans, addr)
"""


class Internet:
    """A test-made network namespace with a veth to the host and servers inside it."""

    def __init__(self, subnet: str | None = None) -> None:
        tag = secrets.token_hex(3)
        subnet = subnet or f"198.{18 + secrets.randbelow(2)}.{secrets.randbelow(256)}"
        self.ns = f"shtest-{tag}"
        self.host_if = f"shti{tag}"
        self.subnet = subnet
        self.host_ip = f"{subnet}.254"
        self.ip = f"{subnet}.1"
        self._procs: list[subprocess.Popen] = []
        try:
            self._sh(f"ip netns add {self.ns}")
            self._sh(f"ip link add {self.host_if} type veth peer name eth0 netns {self.ns}")
            self._sh(f"ip addr add {self.host_ip}/24 dev {self.host_if}")
            self._sh(f"ip link set {self.host_if} up")
            self._sh(f"ip -n {self.ns} addr add {self.ip}/24 dev eth0")
            self._sh(f"ip -n {self.ns} link set eth0 up")
            self._sh(f"ip -n {self.ns} link set lo up")
            self._sh(f"ip -n {self.ns} route add default via {self.host_ip}")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _sh(cmd: str) -> None:
        subprocess.run(cmd.split(), check=True, capture_output=True, timeout=30)

    def add_address(self, ip: str) -> None:
        """One more address inside the namespace (on its eth0, routed from the host through the veth)."""
        self._sh(f"ip -n {self.ns} addr add {ip}/32 dev eth0")
        self._sh(f"ip route add {ip}/32 via {self.ip} dev {self.host_if}")

    def spawn(self, code: str, *args: str, ready_file: Path | None = None) -> subprocess.Popen:
        """Run a Python program inside the namespace; with `ready_file`, wait until it has content."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns, sys.executable, "-c", code, *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self._procs.append(p)
        if ready_file is not None:
            for _ in range(200):
                if ready_file.exists() and ready_file.stat().st_size:
                    break
                if p.poll() is not None:
                    raise RuntimeError(f"server exited: {p.stderr.read().decode() if p.stderr else ''}")
                time.sleep(0.05)
        return p

    def close(self) -> None:
        """Stop the servers, remove the namespace and the veth (idempotent)."""
        for p in self._procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        self._procs.clear()
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)

    def __enter__(self) -> Internet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def listening_tcp(ns: str | None = None) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket listening in a network namespace (None: this one)."""
    argv = ["ss", "-ltnH"]
    if ns:
        argv = ["ip", "netns", "exec", ns, *argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    found = []
    for line in out.splitlines():
        local = line.split()[3]
        host, _, port = local.rpartition(":")
        found.append((host.strip("[]"), int(port)))
    return found


class RayMachines:
    """A Ray cluster laid out the way it is deployed: its nodes on "machines" of their own.

    The head runs in one network namespace (an `Internet` on 198.18.0.0/15), each of `workers` more Ray
    nodes (offering the `shoal` resource) in one more, and the host itself is one more worker, at its
    address on the head's veth (sandboxes run there, behind the node's bridge and nftables). Every Ray
    process runs in a session of its own started here (`ray start --block`) and is killed at `close()`,
    with the namespaces and veths."""

    GCS_PORT = 6379  # free: the head has a network namespace of its own

    def __init__(self, workers: int = 1) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="shray-", dir="/tmp")
        self.head = Internet()
        self.machines: list[Internet] = []
        self._procs: list[subprocess.Popen] = []
        self._args: list[tuple[str | None, tuple[str, ...]]] = []
        self._retries: dict[int, int] = {}  # per node: a loaded host can time out several of them
        try:
            self.machines = [Internet() for _ in range(workers)]
            # the other machines reach the head (and each other) through the host, like through a switch
            for m in self.machines:
                self.head._sh(f"ip -n {self.head.ns} route add {m.subnet}.0/24 via {self.head.host_ip}")
            self._ray(self.head.ns, "--head", f"--node-ip-address={self.head.ip}", f"--port={self.GCS_PORT}",
                      "--include-dashboard=false", f"--temp-dir={self.temp_dir}", "--num-cpus=1")
            for m in self.machines:
                self._ray(m.ns, f"--address={self.address}", f"--node-ip-address={m.ip}", "--num-cpus=1",
                          '--resources={"shoal": 1}')
            from shoal.server.proc import free_port

            ports = [free_port(self.host_ip) for _ in range(4)]
            self._ray(None, f"--address={self.address}", f"--node-ip-address={self.host_ip}", "--num-cpus=1",
                      '--resources={"shoal": 1}', f"--dashboard-agent-listen-port={ports[0]}",
                      f"--dashboard-agent-grpc-port={ports[1]}", f"--metrics-export-port={ports[2]}",
                      f"--runtime-env-agent-port={ports[3]}")
            self._wait_for_nodes(2 + workers)
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        """The GCS address of the head (`HOST:PORT`)."""
        return f"{self.head.ip}:{self.GCS_PORT}"

    @property
    def host_ip(self) -> str:
        """The host worker's node address (its end of the head's veth)."""
        return self.head.host_ip

    def _ray(self, ns: str | None, *args: str, slot: int | None = None) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        argv = [ray, "start", "--block", "--disable-usage-stats", *args]
        if ns:
            argv = ["ip", "netns", "exec", ns, *argv]
        # nodes on real addresses: Ray's cluster mode on, whatever this process holds (a loopback cluster
        # started here earlier, or a user's RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, makes a worker's `ray start` abort)
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **{RAY_CLUSTER_ENV: "1"})
        i = len(self._procs) if slot is None else slot
        log = open(self._log(i), "ab")  # noqa: SIM115
        p = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()
        if slot is None:
            self._procs.append(p)
            self._args.append((ns, args))
        else:
            self._procs[slot] = p

    def _log(self, i: int) -> Path:
        return Path(self.temp_dir) / f"start-{i}.log"

    def _wait_for_nodes(self, n: int, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        script = ("import ray, sys; ray.init(address=sys.argv[1], logging_level=40); "
                  "print(sum(1 for x in ray.nodes() if x['Alive']))")
        while time.monotonic() < deadline:
            for i, p in enumerate(self._procs):
                if p.poll() is not None:
                    tail = self._log(i).read_text(errors="replace")[-3000:]
                    # Ray gives a raylet 30 s (fixed) to register; on a loaded 2-core host that can pass
                    if "timed out during startup" in tail and self._retries.get(i, 0) < 3:
                        self._retries[i] = self._retries.get(i, 0) + 1
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(p.pid, signal.SIGKILL)  # what it started before giving up
                        self._ray(self._args[i][0], *self._args[i][1], slot=i)
                        continue
                    raise RuntimeError(f"ray start #{i} exited ({p.returncode}): {tail}")
            r = subprocess.run(["ip", "netns", "exec", self.head.ns, sys.executable, "-c", script, self.address],
                               capture_output=True, text=True, timeout=120,
                               env=dict(os.environ, **{RAY_CLUSTER_ENV: "1"}))
            if r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            time.sleep(1.0)
        logs = "\n".join(self._log(i).read_text(errors="replace")[-1500:] for i in range(len(self._procs)))
        raise RuntimeError(f"the Ray cluster did not reach {n} nodes: {logs}")

    def machine_addresses(self) -> list[tuple[str, str | None]]:
        """(address, namespace) of every node of the cluster: the head, the other machines, the host."""
        return [(self.head.ip, self.head.ns), *((m.ip, m.ns) for m in self.machines), (self.host_ip, None)]

    def close(self) -> None:
        """Stop every Ray process of this cluster, remove the machines (idempotent)."""
        from shoal.cluster.local import ray_processes_of

        for p in self._procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
        self._procs.clear()
        for _ in range(3):  # the raylets' workers (new sessions of their own) named by the session directory
            left = ray_processes_of(self.temp_dir)
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        for m in (*self.machines, self.head):
            m.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> RayMachines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
