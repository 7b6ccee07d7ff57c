"""Connecting to a Ray cluster, and the names shoal uses in it.

Everything shoal puts into Ray lives in the namespace `shoal`: one detached actor per node agent, named
`shoal-node-<node id>` (the node id is the prefix of every sandbox ID that agent makes, so a client finds
the owner of a sandbox from its ID alone), and a few keys in Ray's internal key-value store (each agent's
index of its sandboxes, read when its node is gone).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from shoal.errors import BackendUnavailable, InvalidRequest

NAMESPACE = "shoal"
#: a Ray node offers to host a shoal node agent by having this custom resource (`ray start --resources`)
RESOURCE = "shoal"
#: a Ray node label (`ray start --labels`) that names its shoal node; stable across Ray restarts
NODE_LABEL = "shoal-node"
AGENT_PREFIX = "shoal-node-"
#: Ray's internal key-value store: one key per node agent holding its sandbox index
KV_NAMESPACE = "shoal"
KV_INDEX_PREFIX = "index/"

_NODE_ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")  # as SHOAL_NODE_ID
_lock = threading.Lock()
log = logging.getLogger(__name__)


def parse_ray_url(url: str) -> str:
    """`ray://ADDR` → ADDR as `ray.init(address=...)` takes it (`auto`, `127.0.0.1:6379`, `head:6379`)."""
    if not isinstance(url, str) or not url.startswith("ray://"):
        raise InvalidRequest(f"cluster address {url!r} must look like ray://ADDR (ray://auto, ray://HOST:PORT)")
    addr = url[len("ray://"):].strip().rstrip("/")
    if not addr:
        raise InvalidRequest("ray:// needs an address: ray://auto or ray://HOST:PORT (the GCS address of the head)")
    return addr


def is_loopback(address: str) -> bool:
    """True when a `HOST:PORT` Ray address points at this machine's loopback interface."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: Ray's switch (ray._private.ray_constants.ENABLE_RAY_CLUSTER, read from this variable at import; on by default
#: on Linux). On: Ray rewrites a loopback address (and a process's own node IP) into the host's outward address,
#: and `ray start` may add worker nodes. Off: loopback is kept, and `ray start` starts a head only (a worker
#: aborts: "Multi-node Ray clusters are not supported on Windows and OSX"). So it must be off for a cluster
#: whose nodes are all on 127.0.0.1 and on (Ray's default) for one on real addresses.
RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _ray_default_cluster_mode() -> bool:
    # what Ray decides by itself (the variable as the user set it, else on except on Windows and macOS);
    # shoal never writes the variable into its own environment, so this is the user's
    import ray._private.ray_constants as rc

    v = os.environ.get(RAY_CLUSTER_ENV)
    if v is None:
        return not rc.IS_WINDOWS_OR_OSX
    return v.strip().lower() in ("1", "true")


def set_cluster_mode(loopback: bool) -> None:
    """Set Ray's cluster switch in this process for a cluster on loopback (off) or on real addresses (Ray's
    own default): set per connection, since one process may meet both (tests, a driver that moves on)."""
    import ray._private.ray_constants as rc

    rc.ENABLE_RAY_CLUSTER = False if loopback else _ray_default_cluster_mode()


@contextlib.contextmanager
def loopback_children() -> Iterator[None]:
    """Ray processes started inside this block (a loopback LocalCluster's GCS, raylets and, through them, their
    workers and agents) keep 127.0.0.1: the variable is set for them and put back afterwards, so a `ray start`
    of a multi-node cluster on real addresses run later from this process is not refused."""
    set_cluster_mode(loopback=True)
    before = os.environ.get(RAY_CLUSTER_ENV)
    os.environ[RAY_CLUSTER_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(RAY_CLUSTER_ENV, None)
        else:
            os.environ[RAY_CLUSTER_ENV] = before


def connect(address: str) -> None:
    """Join the Ray cluster at `address` as a driver, unless this process already is part of one
    (inside a Ray task or actor, or after the caller's own `ray.init`)."""
    try:
        import ray
    except ImportError:
        raise BackendUnavailable("cluster mode needs Ray: pip install 'shoal[ray]'") from None
    with _lock:
        if ray.is_initialized():
            return
        kw: dict[str, Any] = {}
        if address != "auto":  # `auto` finds a cluster this process (or host) started: its mode stands
            set_cluster_mode(loopback=is_loopback(address))
            if is_loopback(address):
                kw["_node_ip_address"] = "127.0.0.1"
        try:
            ray.init(address=address, namespace=NAMESPACE, ignore_reinit_error=True, log_to_driver=False,
                     logging_level=logging.WARNING, **kw)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise BackendUnavailable(f"cannot connect to the Ray cluster at {address!r}: {e}; start one with "
                                     "`ray start --head` or pass its GCS address (HOST:PORT)") from None


def agent_name(node_id: str) -> str:
    """The Ray actor name of a node agent."""
    return f"{AGENT_PREFIX}{node_id}"


def check_node_id(node_id: str) -> str:
    """Node ids prefix sandbox IDs and name directories: short, lowercase."""
    if not isinstance(node_id, str) or not _NODE_ID_RE.match(node_id):
        raise InvalidRequest(f"bad shoal node id {node_id!r}: 1-32 lowercase letters, digits or '-', "
                             "starting with a letter or digit")
    return node_id


def node_id_for(ray_node: dict[str, Any]) -> str:
    """The shoal node id of a Ray node (an entry of `ray.nodes()`): its `shoal-node` label when set (give
    each machine a stable one, e.g. its hostname), else `r` + the first 8 hex digits of its Ray node ID
    (short: sandbox IDs and Unix socket paths carry it)."""
    label = (ray_node.get("Labels") or {}).get(NODE_LABEL)
    if label:
        return check_node_id(re.sub(r"[^a-z0-9-]", "-", str(label).lower())[:32])
    return "r" + str(ray_node["NodeID"])[:8]


def offers_shoal(ray_node: dict[str, Any], resource: str = RESOURCE) -> bool:
    """True when a live Ray node offers the `shoal` resource (or the given one)."""
    return bool(ray_node.get("Alive")) and float((ray_node.get("Resources") or {}).get(resource, 0)) > 0


def alive_ray_nodes() -> dict[str, dict[str, Any]]:
    """Ray's node table, alive nodes only, by Ray node ID."""
    import ray

    return {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}


def agent_names() -> list[str]:
    """Names of the node agents registered in the cluster (alive or restarting)."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a.get("namespace") == NAMESPACE and str(a.get("name", "")).startswith(AGENT_PREFIX))


def kv_put(key: str, value: bytes) -> None:
    """Store a value in Ray's internal key-value store (namespace `shoal`)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value, overwrite=True, namespace=KV_NAMESPACE)


def kv_get(key: str) -> bytes | None:
    """Read a value from Ray's internal key-value store."""
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)


def kv_keys(prefix: str) -> list[str]:
    """Keys under a prefix."""
    from ray.experimental import internal_kv

    out = internal_kv._internal_kv_list(prefix, namespace=KV_NAMESPACE) or []
    return [k.decode() if isinstance(k, bytes) else str(k) for k in out]


def kv_del(key: str) -> None:
    """Remove a key."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key, namespace=KV_NAMESPACE)
