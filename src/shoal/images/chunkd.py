"""The node's layer reader: one shoal-chunkd daemon per SHOAL_HOME and store (chunkd/, C), driven from here.

    $SHOAL_HOME/chunkfs/<S>/<layer hex>.erofs   one read-only file per layer (FUSE), what EROFS mounts
    $SHOAL_HOME/chunkd/<S>/tables/<layer hex>   the chunk tables the daemon serves (written after checking
                                                them against the layer digest)
    $SHOAL_HOME/chunkd/<S>/{ctl.sock,events.jsonl,chunkd.pid,chunkd.log,store}
    $SHOAL_HOME/chunk-cache/<S>/<aa>/<hex>      verified chunks (SHOAL_CHUNK_CACHE_MB, LRU), kept across restarts

<S> names the store (12 hex of the sha256 of its real path): a node has one store, but tests and
benchmarks run nodes of several stores in one home.

The daemon fetches a chunk from the store the first time a read needs it, checks it against its digest,
keeps it in the cache, and serves reads from the cache; a chunk that fails its check is never served (the
read fails with EIO and the daemon reports an image_corrupt event, which LayerMounts turns into a node event).
It is a separate process so that a restarted node agent (or a CLI next to a server) finds the layers of
running sandboxes still served; the node stops it when no layer of the home is in use any more.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shoal.errors import BackendUnavailable, ShoalError
from shoal.fsutil import atomic_write, flocked
from shoal.host import syscalls
from shoal.images.chunking import ChunkTable

log = logging.getLogger(__name__)

_REPO_BUILD = Path(__file__).resolve().parents[3] / "build" / "shoal-chunkd"
_INSTALLED = Path("/usr/local/lib/shoal/shoal-chunkd")


def find_chunkd_binary() -> Path:
    """The repo's build/shoal-chunkd, or /usr/local/lib/shoal/shoal-chunkd."""
    for c in (_REPO_BUILD, _INSTALLED):
        if c.is_file() and os.access(c, os.X_OK):
            return c
    raise BackendUnavailable("the layer reader shoal-chunkd is missing: run `make chunkd` in the shoal repository "
                             "(it needs libssl-dev and libzstd-dev)")


def erofs_sources() -> list[str]:
    """The file behind every EROFS mount of this host: its source, or a loop device's backing file."""
    out = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            parts = line.decode("utf-8", "surrogateescape").split()
            try:
                sep = parts.index("-")
            except ValueError:
                continue
            if parts[sep + 1] != "erofs":
                continue
            src = syscalls._unescape(parts[sep + 2])
            if src.startswith("/dev/loop"):
                with contextlib.suppress(OSError):
                    src = Path(f"/sys/block/{os.path.basename(src)}/loop/backing_file").read_text().strip()
            out.append(src.removesuffix(" (deleted)"))
    return out


def store_key(store_root: Path) -> str:
    """12 hex naming a store within a home."""
    return hashlib.sha256(os.path.realpath(store_root).encode()).hexdigest()[:12]


def readers_of(home: Path) -> list[ChunkDaemon]:
    """Every reader a home has state for (whatever store it serves)."""
    out = []
    d = Path(home) / "chunkd"
    if d.is_dir():
        for sub in sorted(d.iterdir()):
            with contextlib.suppress(OSError):
                store = (sub / "store").read_text().strip()
                if store:
                    out.append(ChunkDaemon(Path(home), Path(store)))
    return out


def cache_limit_mb() -> int:
    """SHOAL_CHUNK_CACHE_MB."""
    from shoal.config import settings

    return int(settings().chunk_cache_mb)


def readahead_kb() -> int:
    """SHOAL_CHUNK_READAHEAD_KB."""
    from shoal.config import settings

    return int(settings().chunk_readahead_kb)


class ChunkDaemon:
    """Start, reach and stop the shoal-chunkd of one SHOAL_HOME."""

    def __init__(self, home: Path, store_root: Path, *, cache_mb: int | None = None,
                 readahead_kb_: int | None = None) -> None:
        self.home = Path(home)
        self.store_root = Path(store_root)
        self.key = store_key(self.store_root)
        self.dir = self.home / "chunkd" / self.key
        self.tables = self.dir / "tables"
        self.mount = self.home / "chunkfs" / self.key
        self.cache = self.home / "chunk-cache" / self.key
        self.ctl_path = self.dir / "ctl.sock"
        self.events_path = self.dir / "events.jsonl"
        self.pidfile = self.dir / "chunkd.pid"
        self.logfile = self.dir / "chunkd.log"
        self.cache_mb = cache_limit_mb() if cache_mb is None else int(cache_mb)
        self.readahead_kb = readahead_kb() if readahead_kb_ is None else int(readahead_kb_)
        #: a file the daemon appends every read to (benchmarks set it before the daemon starts)
        self.trace: Path | None = None
        self._sub_thread: threading.Thread | None = None
        self._sub_stop = threading.Event()
        self._sub_sock: socket.socket | None = None

    # ---- paths --------------------------------------------------------------------------------
    def file(self, layer_hex: str) -> Path:
        """The FUSE file that serves a layer (its table must be exported first)."""
        return self.mount / f"{layer_hex}.erofs"

    def export(self, layer_hex: str, table: ChunkTable) -> None:
        """Hand a (checked) table to the daemon; idempotent."""
        p = self.tables / layer_hex
        data = table.to_node_binary()
        with contextlib.suppress(OSError):
            if p.stat().st_size == len(data) and p.read_bytes() == data:
                return
        atomic_write(p, data, mode=0o600, fsync=False)

    def exported(self, layer_hex: str) -> bool:
        """True when the daemon has the layer's table."""
        return (self.tables / layer_hex).exists()

    # ---- lifetime -----------------------------------------------------------------------------
    def pid(self) -> int | None:
        """The daemon's pid when it runs, else None."""
        try:
            pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return None
        return pid if comm.startswith("shoal-chunkd") else None

    def running(self) -> bool:
        """True when the daemon answers."""
        if self.pid() is None:
            return False
        try:
            return bool(self.request("ping", timeout=5).get("ok"))
        except (OSError, ShoalError):
            return False

    def _lock(self) -> contextlib.AbstractContextManager[int]:
        return flocked(self.dir / "lock")

    def using(self, exclusive: bool = False) -> contextlib.AbstractContextManager[int]:
        """Held (shared) while a layer is being put to use, so that a process that stops an unused reader
        (exclusive) never does it under a mount in progress in another process of the same home."""
        return flocked(self.dir / "use.lock", shared=not exclusive)

    def ensure(self) -> None:
        """Start the daemon unless it runs; BackendUnavailable when it cannot start."""
        if self.running():
            return
        with self._lock():
            if self.running():
                return
            self._clean_stale()
            self._start()

    def _clean_stale(self) -> None:
        """A daemon that died leaves a dead FUSE mount (ENOTCONN): take it away before a new one."""
        if syscalls.is_mountpoint(str(self.mount)):
            with contextlib.suppress(OSError):
                syscalls.umount(str(self.mount), detach=True)
        with contextlib.suppress(FileNotFoundError):
            self.ctl_path.unlink()

    def _start(self) -> None:
        exe = find_chunkd_binary()
        for d in (self.dir, self.tables, self.cache):
            d.mkdir(parents=True, exist_ok=True)
        self.mount.mkdir(parents=True, exist_ok=True)
        argv = [str(exe), "--mount", str(self.mount), "--tables", str(self.tables), "--store", str(self.store_root),
                "--cache", str(self.cache), "--cache-mb", str(self.cache_mb), "--ctl", str(self.ctl_path),
                "--events", str(self.events_path), "--pidfile", str(self.pidfile),
                "--readahead-kb", str(self.readahead_kb),
                # a first read waits for the store: enough request threads that cached reads never queue
                # behind fetches, and fetch workers to prefetch a start record in parallel
                "--threads", "16", "--fetchers", "16"]
        if self.trace is not None:  # measurements only: every read's layer, offset and size
            argv += ["--trace", str(self.trace)]
        with open(self.logfile, "ab") as logf:
            # the daemon forks; this returns once it is mounted and listening (or failed)
            r = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=logf,
                               timeout=60, close_fds=True, start_new_session=True)
        if r.returncode != 0:
            tail = ""
            with contextlib.suppress(OSError, IndexError):
                tail = self.logfile.read_text(errors="replace").strip().splitlines()[-1]
            raise BackendUnavailable(f"the node's layer reader (shoal-chunkd) did not start: {tail}")
        atomic_write(self.dir / "store", (str(self.store_root) + "\n").encode(), fsync=False)

    def mounted_files(self) -> set[str]:
        """Layer hexes whose file of this reader is mounted (file-backed, or through a loop device)."""
        prefix = str(self.mount) + "/"
        return {os.path.basename(src)[:64] for src in erofs_sources() if src.startswith(prefix)}

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the daemon and take its mount away (only when no layer of it is mounted: the caller's job).
        True when it was running."""
        self.close_subscription()
        with self._lock():
            pid = self.pid()
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline and self.pid() == pid:
                    time.sleep(0.02)
                if self.pid() == pid:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            if syscalls.is_mountpoint(str(self.mount)):
                with contextlib.suppress(OSError):
                    syscalls.umount(str(self.mount), detach=True)
            for p in (self.ctl_path, self.pidfile):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            with contextlib.suppress(OSError):
                self.mount.rmdir()
            return pid is not None

    # ---- control ------------------------------------------------------------------------------
    def request(self, line: str, timeout: float = 30.0) -> dict[str, Any]:
        """One control request; the daemon's JSON answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            try:
                s.connect(str(self.ctl_path))
            except OSError as e:
                raise BackendUnavailable(f"the node's layer reader does not answer ({e.strerror})") from None
            s.sendall(line.encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                part = s.recv(1 << 20)
                if not part:
                    break
                buf += part
        try:
            out = json.loads(buf)
        except ValueError:
            raise BackendUnavailable(f"the node's layer reader answered {buf[:200]!r}") from None
        return out if isinstance(out, dict) else {}

    def stats(self) -> dict[str, Any]:
        """Counters: reads, fetched/verified chunks and bytes, cache use, evictions, corrupt chunks."""
        return self.request("stats")

    def touched(self, layer_hex: str) -> list[int] | None:
        """Chunks read through a layer since its table was loaded, first-touch order (None: not loaded)."""
        r = self.request(f"touched {layer_hex}")
        return [int(i) for i in r["chunks"]] if r.get("ok") else None

    def prefetch(self, layer_hex: str, chunks: list[int]) -> int:
        """Queue chunks of a layer for a background fetch; how many were missing here."""
        if not chunks:
            return 0
        r = self.request(f"prefetch {layer_hex} {','.join(str(i) for i in chunks)}")
        return int(r.get("queued", 0))

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until no background fetch is queued or running; True when idle."""
        r = self.request(f"idle {int(timeout * 1000)}", timeout=timeout + 10)
        return bool(r.get("idle"))

    def set_limit(self, mb: int) -> None:
        """Resize the cache (evicts at once when it holds more)."""
        self.request(f"limit {int(mb) << 20}")

    # ---- events -------------------------------------------------------------------------------
    def subscribe(self, on_event: Callable[[dict[str, Any]], None]) -> None:
        """Call `on_event` (in a thread) for each event the daemon reports from now on; re-subscribes when the
        daemon restarts. Idempotent."""
        if self._sub_thread is not None and self._sub_thread.is_alive():
            return
        self._sub_stop.clear()

        def run() -> None:
            while not self._sub_stop.is_set():
                try:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                        s.connect(str(self.ctl_path))
                        self._sub_sock = s
                        s.sendall(b"subscribe\n")
                        f = s.makefile("rb")
                        first = f.readline()
                        if not first:
                            raise OSError("closed")
                        for line in f:
                            if self._sub_stop.is_set():
                                return
                            with contextlib.suppress(ValueError):
                                ev = json.loads(line)
                                if isinstance(ev, dict):
                                    try:
                                        on_event(ev)
                                    except Exception:  # a failing handler must not end the subscription
                                        log.exception("image_corrupt handler failed")
                except OSError:
                    pass
                finally:
                    self._sub_sock = None
                self._sub_stop.wait(0.5)

        self._sub_thread = threading.Thread(target=run, name="shoal-chunkd-events", daemon=True)
        self._sub_thread.start()

    def close_subscription(self) -> None:
        """End the event subscription (if any)."""
        self._sub_stop.set()
        s = self._sub_sock
        if s is not None:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        t = self._sub_thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
        self._sub_thread = None

    def read_events(self) -> list[dict[str, Any]]:
        """Every event the daemon of this home recorded (events.jsonl)."""
        out = []
        with contextlib.suppress(FileNotFoundError):
            for line in self.events_path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out
