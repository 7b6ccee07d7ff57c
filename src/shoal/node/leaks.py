"""What a node has left on the host that no live sandbox accounts for (fault tests, soaks, diagnosis).

`find_leaks(paths, node_id)` lists, by kind, everything of the node with id `node_id` (its sandbox IDs
start with it) that is not part of a live sandbox of its SHOAL_HOME: half-made sandboxes (records and
directories), mounts, writable layers (btrfs subvolumes), cgroups, OCI runtime containers, layer users
and store leases; and, host-wide, network state that no address lease accounts for: network
namespaces, veths, bridge port registrations, allowlist and grant chains, and leases whose veth is gone. Every list
is empty on a clean host.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

from shoal.config import Paths
from shoal.records import list_records


def _run(argv: list[str]) -> str:
    if not shutil.which(argv[0]):
        return ""
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    return r.stdout if r.returncode == 0 else ""


def _ls(d: Path) -> list[str]:
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        return sorted(os.listdir(d))
    return []


def _cgroups(prefix: str) -> list[str]:
    # a sandbox's cgroups: /shoal/<id> in every hierarchy, and a batch-class one beside it (cpuclass)
    out = []
    root = Path("/sys/fs/cgroup")
    for parent in ("shoal", "shoal-batch"):
        for base in [root / parent, *(p / parent for p in root.iterdir() if p.is_dir())]:
            out += [str(base / n) for n in _ls(base) if n.startswith(prefix)]
    return sorted(set(out))


def _leased_veths(leases: Path) -> dict[str, str]:
    out = {}
    for name in _ls(leases):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads((leases / name).read_text())
            if isinstance(data, dict) and data.get("veth"):
                out[str(data["veth"])] = name
    return out


def network_leaks(leases: Path) -> dict[str, list[str]]:
    """Host-wide network state no address lease accounts for (every node on the host shares it)."""
    from shoal.node.network import grant_names

    leased = _leased_veths(leases)
    shorts = {v[2:] for v in leased}
    granted = {grant_names(ip)[0] for ip in leased.values()}
    netns = [n.split()[0] for n in _run(["ip", "netns", "list"]).splitlines() if n.startswith("shoal-")]
    links = re.findall(r"^\d+: (sh[a-z0-9]+)[@:]", _run(["ip", "-o", "link", "show"]), re.M)
    table = _run(["nft", "list", "table", "inet", "shoal"])
    bridge = _run(["nft", "list", "set", "bridge", "shoal", "ports"])
    return {
        "netns": [n for n in netns if n[len("shoal-"):] not in shorts and not n.startswith("shoal-mfs")],
        "veths": [v for v in links if v not in leased and v != "shoal0"],
        "bridge_ports": [p for p in re.findall(r'"(sh[a-z0-9]+)"', bridge) if p not in leased],
        "allowlist_chains": [c for c in re.findall(r"chain (e_[a-z0-9]+)", table) if c[2:] not in shorts],
        # grants are named after the address (shoal.node.network.grant_names): one without a lease is left over
        "grant_chains": [c for c in re.findall(r"chain (g_[0-9a-f]{4})\b", table) if c not in granted],
        "leases_without_veth": sorted(ip for v, ip in leased.items() if not Path(f"/sys/class/net/{v}").exists()),
    }


def find_leaks(paths: Paths, node_id: str, leases: Path | None = None) -> dict[str, list[str]]:
    """Everything of node `node_id` not accounted for by a live sandbox, by kind (see the module doc)."""
    live = {r.id for r in list_records(paths.sandboxes) if r.state in ("running", "paused")}
    prefix = f"{node_id}-"
    mine = lambda name: name.startswith(prefix) and name not in live  # noqa: E731
    with open("/proc/self/mountinfo") as f:
        mounts = [ln.split()[4] for ln in f]
    shared = {str(paths.home / x) for x in ("uppers", "volatile", "guestfs")}
    # the node's layer reader (shoal-chunkd's FUSE mount) is node state like the upper pool, not a sandbox's
    sandbox_mounts = [m for m in mounts if m.startswith(f"{paths.home}/") and m not in shared
                      and not m.startswith((f"{paths.home}/layers/", f"{paths.home}/chunkfs/"))]
    out = {
        "records": [r.id for r in list_records(paths.sandboxes) if r.id not in live],
        "sandbox_dirs": [n for n in _ls(paths.sandboxes) if mine(n)]
                        + [n for n in _ls(paths.home / "volatile" / "sandboxes") if mine(n)],
        "mounts": sandbox_mounts,
        "layer_mounts_unused": [] if live else [m for m in mounts if m.startswith(f"{paths.home}/layers/")],
        "subvolumes": [n for n in _ls(paths.home / "uppers") if mine(n)],
        "cgroups": [c for c in _cgroups(prefix) if Path(c).name not in live],
        "containers": [c for c in (_run(["crun", "list", "-q"]) + _run(["runc", "list", "-q"])).split()
                       if c.startswith(f"shoal-{prefix}") and c[len("shoal-"):] not in live],
        "layer_users": [f"{d}/{u}" for d in _ls(paths.home / "layers") if d.endswith(".users")
                        for u in _ls(paths.home / "layers" / d) if mine(u)],
        # (the upper pool's own loop device is the node's, not a sandbox's)
        "loop_devices": [ln for ln in _run(["losetup", "-a"]).splitlines()
                         if str(paths.home) in ln and "uppers.btrfs" not in ln],
    }
    if leases is not None:
        out.update(network_leaks(leases))
        out["leases"] = []
        for name in _ls(leases):
            with contextlib.suppress(OSError, ValueError):
                data = json.loads((leases / name).read_text())
                if isinstance(data, dict) and mine(str(data.get("sandbox", ""))):
                    out["leases"].append(name)
    return out
