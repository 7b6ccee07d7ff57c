"""Outbound network for sandboxes that ask for it (network=True); none for the rest.

Each networked sandbox gets its own network namespace with one veth on the host bridge `shoal0`
(10.89.0.0/16). nftables masquerades its traffic out of the host's uplink, drops traffic from
sandboxes to the host itself, and bridge port isolation keeps sandboxes from reaching each other.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
from pathlib import Path

from shoal.config import Paths, settings
from shoal.errors import BackendUnavailable, CapacityExceeded, SandboxError
from shoal.host.spawn import run, run_sync
from shoal.node.records import SandboxRecord

BRIDGE = "shoal0"
SUBNET = ipaddress.ip_network("10.89.0.0/16")
GATEWAY = "10.89.0.1"
NFT_TABLE = "shoal"

_NFT_RULES = f"""
table inet {NFT_TABLE} {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {SUBNET} ip daddr != {SUBNET} masquerade
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{BRIDGE}" ct state established,related accept
    iifname "{BRIDGE}" drop
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "{BRIDGE}" oifname "{BRIDGE}" drop
    iifname "{BRIDGE}" accept
    oifname "{BRIDGE}" ct state established,related accept
    oifname "{BRIDGE}" drop
  }}
}}
"""


class NetworkManager:
    """Creates and removes per-sandbox network namespaces attached to the shoal bridge."""

    def __init__(self, paths: Paths) -> None:
        self.paths = paths
        # host-global (not per SHOAL_HOME): every node agent on this host shares the one bridge and subnet
        self.leases = settings().net_leases
        self._bridge_ready = False

    def resolv_conf(self) -> Path:
        """The resolv.conf bind-mounted into networked sandboxes (the host's)."""
        return Path("/etc/resolv.conf")

    def ensure_bridge(self) -> None:
        """Create the bridge, enable forwarding and install the nftables table (idempotent)."""
        if self._bridge_ready:
            return
        for tool in ("ip", "nft"):
            if not run_sync(["which", tool]).returncode == 0:
                raise BackendUnavailable(f"network=True needs `{tool}`: apt-get install iproute2 nftables")
        if run_sync(["ip", "link", "show", BRIDGE]).returncode != 0:
            run_sync(["ip", "link", "add", BRIDGE, "type", "bridge"], check=True)
            run_sync(["ip", "addr", "add", f"{GATEWAY}/{SUBNET.prefixlen}", "dev", BRIDGE], check=True)
        run_sync(["ip", "link", "set", BRIDGE, "up"], check=True)
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        if run_sync(["nft", "list", "table", "inet", NFT_TABLE]).returncode != 0:
            run_sync(["nft", "-f", "-"], stdin=_NFT_RULES.encode(), check=True)
        self.leases.mkdir(parents=True, exist_ok=True)
        self._bridge_ready = True

    def _lease(self, sandbox_id: str) -> str:
        hosts = SUBNET.num_addresses - 3
        for _ in range(64):
            n = 2 + secrets.randbelow(hosts)
            ip = str(SUBNET.network_address + n)
            try:
                fd = os.open(self.leases / ip, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            os.write(fd, sandbox_id.encode())
            os.close(fd)
            return ip
        raise CapacityExceeded("no free sandbox IP address in 10.89.0.0/16", retry_after_s=5.0)

    async def setup(self, rec: SandboxRecord) -> str:
        """Create the sandbox's netns + veth; returns the netns path for the OCI config."""
        self.ensure_bridge()
        short = rec.id.rsplit("-", 1)[1][:10]
        ns = f"shoal-{short}"
        host_if = f"sh{short}"[:15]
        ip = self._lease(rec.id)
        rec.netns = ns
        rec.extra["ip"] = ip
        rec.extra["veth"] = host_if
        rec.save()
        try:
            (await run(["ip", "netns", "add", ns])).check("ip netns add")
            host_cmds = (f"link add {host_if} type veth peer name eth0 netns {ns}\n"
                         f"link set {host_if} master {BRIDGE}\n"
                         f"link set {host_if} type bridge_slave isolated on\n"
                         f"link set {host_if} up\n")
            (await run(["ip", "-batch", "-"], stdin=host_cmds.encode())).check("ip (host side)")
            ns_cmds = (f"addr add {ip}/{SUBNET.prefixlen} dev eth0\nlink set eth0 up\nlink set lo up\n"
                       f"route add default via {GATEWAY}\n")
            (await run(["ip", "-n", ns, "-batch", "-"], stdin=ns_cmds.encode())).check("ip (sandbox side)")
        except Exception as e:
            await self.teardown(rec)
            raise SandboxError(f"could not set up the sandbox network: {e}") from e
        return f"/run/netns/{ns}"

    async def teardown(self, rec: SandboxRecord) -> None:
        """Remove the veth, the netns (and its bind mount) and the IP lease. Idempotent."""
        veth = rec.extra.get("veth")
        if veth:
            await run(["ip", "link", "del", veth])
        if rec.netns:
            await run(["ip", "netns", "del", rec.netns])
        ip = rec.extra.get("ip")
        if ip:
            with contextlib.suppress(FileNotFoundError):
                (self.leases / ip).unlink()
