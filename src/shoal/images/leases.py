"""Leases: "node K has layer H mounted", as files in the (maybe shared) store that every node's gc reads.

    <store>/leases/<hex>/<host key>     {"host", "mountpoint", "users", "since", "pid"}; mtime = last heartbeat

A node writes a lease when it starts using a layer (a mount, or a VM drive reading the layer's file) and
removes it at the last release (shoal.images.mounts). A lease protects the layer's record, its chunk table
and, through the table, every chunk it names: gc keeps a chunk while any kept layer names it.
While the layer stays mounted the node agent renews the lease's mtime every SHOAL_LEASE_HEARTBEAT_S
(default 60 s). gc on any node keeps every layer with a live lease; a lease not renewed for
SHOAL_LEASE_TTL_S (default 900 s = 15 heartbeats) belongs to a node that died (or lost the store) and no
longer protects its layer. Ages are measured in the store's own clock (gc touches a file in the store
and reads its mtime), so nodes whose clocks disagree still agree on a lease's age.

A node that only runs short CLI commands renews nothing between them; `shoal gc` and every node
agent start renew the leases of their SHOAL_HOME, and a lease older than the TTL but whose layer is
still mounted on this host is renewed, never trusted as dead, by the host's own gc.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

from shoal.fsutil import atomic_write


def heartbeat_s() -> float:
    """How often a node agent renews its leases (SHOAL_LEASE_HEARTBEAT_S, default 60)."""
    from shoal.config import settings

    return float(settings().lease_heartbeat_s)


def ttl_s() -> float:
    """Age after which another node's lease no longer counts (SHOAL_LEASE_TTL_S, default 900)."""
    from shoal.config import settings

    return float(settings().lease_ttl_s)


def lease_path(store_root: Path, layer_hex: str, key: str) -> Path:
    """Where node `key`'s lease on a layer lives."""
    return Path(store_root) / "leases" / layer_hex / key


def write_lease(store_root: Path, layer_hex: str, key: str, mountpoint: Path, users: Path | None = None) -> Path:
    """Create (or replace) a lease; returns its path. `users`: the directory of the layer's users on this
    host (a VM drive uses a layer without a mount)."""
    p = lease_path(store_root, layer_hex, key)
    atomic_write(p, json.dumps({"host": socket.gethostname(), "mountpoint": str(mountpoint),
                                "users": str(users) if users else "", "since": time.time(),
                                "pid": os.getpid()}).encode(), fsync=False)
    return p


def renew(path: Path) -> bool:
    """Set a lease's mtime to now (the store's clock); False when the lease is gone."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False


def store_now(store_root: Path) -> float:
    """The store's idea of now: the mtime of a file just touched in it (falls back to this host's clock)."""
    p = Path(store_root) / "leases" / ".clock"
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "a"):
            pass
        os.utime(p)
        return p.stat().st_mtime
    except OSError:
        return time.time()


def age_s(path: Path, now: float) -> float | None:
    """Seconds since a lease was last renewed (None when it is gone)."""
    with contextlib.suppress(OSError):
        return max(0.0, now - path.stat().st_mtime)
    return None
