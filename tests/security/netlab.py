"""A network namespace made by a test, standing in for "the internet" (so no packet leaves the host).

`Internet()` makes a namespace joined to the host by a veth pair on a /24 picked at random from
198.18.0.0/15 (RFC 2544's benchmarking range: never routed on the real internet; random, so tests
running at once do not collide). Processes inside it: a UDP sink, an HTTP server, a DNS server. Processes started with
`spawn()` run inside it (a UDP sink, an HTTP server, a DNS server); `close()` stops them and removes the
namespace and the veth. Sandboxes reach it through the node's NAT exactly as they would reach a public
address.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

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
