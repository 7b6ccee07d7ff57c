"""Test helpers for registries: the loopback registry (shoal.bench.loopback_registry, shared with `shoal bench
pull`), a busybox image layer, and a proxy that misbehaves on purpose."""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
from pathlib import Path
from typing import Any

from shoal.bench.loopback_registry import (  # noqa: F401 - re-exported for the tests
    LoopbackRegistry,
    Request,
    available,
    free_port,
)


def busybox_layer(extra: list[tuple] | None = None) -> bytes:
    """A layer with Debian's static busybox as /bin/busybox and /bin/sh, cat, echo, ls links — an image with
    a POSIX shell and no bash (like alpine or busybox images)."""
    from shoal.images.archive import layer_tar

    exe = shutil.which("busybox")
    if not exe:
        raise RuntimeError("needs busybox (apt-get install busybox-static)")
    data = Path(exe).read_bytes()
    entries: list[tuple] = [("dir", "bin", 0o755), ("file", "bin/busybox", data, 0o755), ("dir", "tmp", 0o1777),
                            ("dir", "etc", 0o755), ("file", "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n", 0o644)]
    for tool in ("sh", "cat", "echo", "ls", "id", "pwd", "env", "true"):
        entries.append(("symlink", f"bin/{tool}", "busybox"))
    return layer_tar(entries + (extra or []), mtime=0)


class FaultProxy:
    """An HTTP proxy in front of a registry that misbehaves on purpose: cuts blob downloads in the middle
    (`cut_blobs` times), answers 503 to manifest requests (`fail_manifests` times), or holds blob answers
    until `hold_blobs` are in flight at once (to see parallel downloads). It records every request."""

    def __init__(self, upstream: str) -> None:
        import http.client

        self.upstream = upstream  # host:port
        self.cut_blobs = 0
        self.cut_min_bytes = 0  # only blobs at least this large are cut (layers, not configs)
        self.fail_manifests = 0
        self.hold_blobs = 0
        self.hold_timeout = 20.0
        self.in_flight = 0
        self.max_in_flight = 0
        self.seen: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self._cv = threading.Condition()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _forward(self, method: str) -> None:
                blob = "/blobs/sha256:" in self.path and method == "GET"
                with proxy._cv:
                    proxy.seen.append((method, self.path, self.headers.get("Range")))
                    if "/manifests/" in self.path and proxy.fail_manifests > 0:
                        proxy.fail_manifests -= 1
                        self.send_response(503)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    cut = blob and proxy.cut_blobs > 0
                    if blob:
                        proxy.in_flight += 1
                        proxy.max_in_flight = max(proxy.max_in_flight, proxy.in_flight)
                        proxy._cv.notify_all()
                        if proxy.hold_blobs:
                            # once that many were in flight together, the rest go through (a 4th layer
                            # of 4 at concurrency 3 would otherwise wait out the timeout alone)
                            proxy._cv.wait_for(lambda: proxy.max_in_flight >= proxy.hold_blobs, proxy.hold_timeout)
                try:
                    conn = http.client.HTTPConnection(proxy.upstream, timeout=60)
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                    length = int(self.headers.get("Content-Length") or 0)
                    body = self.rfile.read(length) if length else None
                    conn.request(method, self.path, body=body, headers=headers)
                    r = conn.getresponse()
                    data = r.read()
                    if cut:
                        with proxy._cv:
                            cut = proxy.cut_blobs > 0 and len(data) >= proxy.cut_min_bytes
                            if cut:
                                proxy.cut_blobs -= 1
                    self.send_response(r.status)
                    for k, v in r.getheaders():
                        if k.lower() not in ("connection", "transfer-encoding", "content-length"):
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if cut and len(data) > 1:
                        self.wfile.write(data[: len(data) // 2])
                        self.wfile.flush()
                        self.close_connection = True
                        with contextlib.suppress(OSError):
                            self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if method != "HEAD":
                        self.wfile.write(data)
                finally:
                    if blob:
                        with proxy._cv:
                            proxy.in_flight -= 1

            def do_GET(self) -> None:
                self._forward("GET")

            def do_HEAD(self) -> None:
                self._forward("HEAD")

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def blob_requests(self) -> list[tuple[str, str, str | None]]:
        return [s for s in self.seen if "/blobs/" in s[1] and s[0] == "GET"]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
