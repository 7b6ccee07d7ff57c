"""Outbound network for sandboxes that ask for it (network=True); none for the rest.

Each networked sandbox gets its own network namespace with one veth on the host bridge `shoal0`
(10.89.0.0/16). nftables masquerades its traffic out of the host's uplink, drops traffic from
sandboxes to the host itself, and bridge port isolation keeps sandboxes from reaching each other.

A networked sandbox has CAP_NET_RAW (ping, traceroute, packet tools work), so it can put any frame on
its veth. Two tables make that harmless (see docs/security.md):

- `bridge shoal` checks every frame a sandbox's port sends: its Ethernet source, the sender of an ARP
  packet and the source of an IP packet must be that port's own MAC and IP (a port is registered with
  them before its link comes up); nothing but IPv4 and ARP passes. No ARP spoofing of another
  sandbox's (or the gateway's) address, no forged source addresses, no MAC flooding of the bridge.
- `inet shoal` NATs, keeps sandboxes off the host, and drops (again) any source outside the subnet;
  strict reverse-path filtering on `shoal0` is a third layer.

Both tables carry a version in their comment; setup upgrades an older table in place (one atomic nft
transaction, re-registering the live ports from the leases) and never touches a newer one. The bridge,
its tables and the IP leases are host-global: every node agent on the host shares them.

Protected destinations (issue 23, shoal.egress): `@protected` (private, link-local, reserved ranges) and
`@infra` (the cluster's own node addresses and the `egress_deny` setting; each source — a node's settings,
a cluster node agent — keeps its list in a file of `net-blocked/`, and the set is their union) are
dropped for every sandbox in the chain `guard`, unless the sandbox's entry in `@grants` jumps to a chain
of its own (`g_<ip>`, named after its address so a crashed sandbox's leftovers are reset when the address
is leased again) whose set holds what the operator's policy grants it (`network=True`) or what its own
CIDR rules name (an allowlist whose rules passed `shoal.egress.check_policy`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import re
import secrets
from pathlib import Path
from typing import Any

from shoal.config import Paths, Settings
from shoal.egress import NEVER, Box, EgressPolicy, box, box_text, disjoint, read_blocked
from shoal.errors import BackendUnavailable, CapacityExceeded, SandboxError
from shoal.fsutil import flocked
from shoal.host.spawn import run, run_sync
from shoal.records import SandboxRecord

log = logging.getLogger(__name__)

BRIDGE = "shoal0"
SUBNET = ipaddress.ip_network("10.89.0.0/16")
GATEWAY = "10.89.0.1"
NFT_TABLE = "shoal"
#: bump when a table's rules change: setup replaces an older table, leaves a newer one alone
NFT_VERSION = 4
_COMMENT = f"shoal-net v{NFT_VERSION}"

# Sandboxes with an allowlist (network=[rules], shoal.egress) are in @egress: their forwarded packets
# jump to a chain of their own (see _egress_objects) that accepts what their set allows and counts and
# drops the rest. The others (network=True) reach anything but the protected destinations. Protected
# destinations go through `guard` first, for every sandbox: only what @grants lets a sandbox reach passes.
_INET_RULES = f"""
table inet {NFT_TABLE} {{
  comment "{_COMMENT}"
  map egress {{ type ipv4_addr : verdict; }}
  map grants {{ type ipv4_addr : verdict; }}
  set protected {{ type ipv4_addr; flags interval; elements = {{ {", ".join(str(n) for n in NEVER)} }}; }}
  set infra {{ type ipv4_addr; flags interval; }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {SUBNET} ip daddr != {SUBNET} masquerade
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{BRIDGE}" ct state established,related accept
    iifname "{BRIDGE}" ip daddr {GATEWAY} meta l4proto {{ tcp, udp }} th dport 53 accept
    iifname "{BRIDGE}" drop
  }}
  chain guard {{
    ip saddr vmap @grants
    counter drop
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "{BRIDGE}" oifname "{BRIDGE}" drop
    iifname "{BRIDGE}" ip saddr != {SUBNET} counter drop
    iifname "{BRIDGE}" meta nfproto != ipv4 counter drop
    iifname "{BRIDGE}" ip daddr @infra jump guard
    iifname "{BRIDGE}" ip daddr @protected jump guard
    iifname "{BRIDGE}" ip saddr vmap @egress
    iifname "{BRIDGE}" accept
    oifname "{BRIDGE}" ct state established,related accept
    oifname "{BRIDGE}" drop
  }}
}}
"""
# Ports not in @ports (made by a shoal from before this table) are left alone: a sandbox cannot add a
# port to the bridge, only the node agent can, and it registers each one before bringing it up.
_BRIDGE_RULES = f"""
table bridge {NFT_TABLE} {{
  comment "{_COMMENT}"
  set ports {{ type ifname; }}
  set port_mac {{ type ifname . ether_addr; }}
  set port_ip {{ type ifname . ipv4_addr; }}
  chain prerouting {{
    type filter hook prerouting priority -200; policy accept;
    iifname != @ports accept
    iifname . ether saddr != @port_mac counter drop
    ether type arp iifname . arp saddr ether != @port_mac counter drop
    ether type arp iifname . arp saddr ip != @port_ip counter drop
    ether type ip iifname . ip saddr != @port_ip counter drop
    ether type != {{ ip, arp }} counter drop
  }}
}}
"""

_VERSION_RE = re.compile(r'comment "shoal-net v(\d+)"')


def mac_for(ip: str) -> str:
    """The MAC a sandbox with this IP gets (locally administered, fixed by the IP: no lookup needed)."""
    b = ipaddress.ip_address(ip).packed
    return "02:73:68:{:02x}:{:02x}:{:02x}".format(*b[1:])


def _port_elements(veth: str, mac: str, ip: str) -> str:
    return (f'element bridge {NFT_TABLE} ports {{ "{veth}" }}\n'
            f'element bridge {NFT_TABLE} port_mac {{ "{veth}" . {mac} }}\n'
            f'element bridge {NFT_TABLE} port_ip {{ "{veth}" . {ip} }}\n')


def egress_names(veth: str) -> tuple[str, str, str]:
    """(chain, set, counter) of a sandbox's allowlist in the inet table, named after its veth."""
    tag = veth[2:]
    return f"e_{tag}", f"a_{tag}", f"d_{tag}"


def _ranges(ports: tuple[int, int]) -> str:
    lo, hi = ports
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _elements(boxes: list[Box], prefix: str = "") -> list[str]:
    # nft set elements `[prefix]addr . proto . ports` of non-overlapping boxes, for TCP and UDP
    return [f"{prefix}{box_text(b)} . {proto} . {_ranges((b[2], b[3]))}" for b in disjoint(boxes)
            for proto in ("tcp", "udp")]


def _egress_objects(veth: str, ip: str, policy: EgressPolicy) -> str:
    """nft commands making a sandbox's allowlist: its counter, its set (CIDR rules in it now, domains'
    addresses pinned by the DNS proxy later), its chain, and its entry in @egress."""
    chain, aset, counter = egress_names(veth)
    t = f"inet {NFT_TABLE}"
    out = [f"add counter {t} {counter}",
           f"add set {t} {aset} {{ type ipv4_addr . inet_proto . inet_service; flags interval; }}",
           f"add chain {t} {chain}",
           f"add rule {t} {chain} ct state established,related accept",
           f"add rule {t} {chain} ip daddr . meta l4proto . th dport @{aset} accept",
           f'add rule {t} {chain} counter name "{counter}" drop']
    # overlapping rules (`198.51.100.0/24` and `198.51.100.2:8080`) become disjoint elements: nftables
    # refuses overlapping ones in one interval set
    elems = _elements([box(r.net, r.ports) for r in policy.cidrs])
    if elems:
        out.append(f"add element {t} {aset} {{ {', '.join(elems)} }}")
    out.append(f"add element {t} egress {{ {ip} : jump {chain} }}")
    return "\n".join(out) + "\n"


def _egress_teardown(veth: str, ip: str) -> list[str]:
    chain, aset, counter = egress_names(veth)
    t = f"inet {NFT_TABLE}"
    # the map entry first: nothing jumps to the chain when it goes
    return [f"delete element {t} egress {{ {ip} }}", f"delete chain {t} {chain}", f"delete set {t} {aset}",
            f"delete counter {t} {counter}"]


def grant_names(ip: str) -> tuple[str, str]:
    """(chain, set) of a sandbox's grants, named after its address (10.89.a.b → g_aabb)."""
    b = ipaddress.ip_address(ip).packed
    tag = f"{b[2]:02x}{b[3]:02x}"
    return f"g_{tag}", f"gs_{tag}"


def _grant_objects(ip: str, boxes: list[Box]) -> str:
    """nft commands giving the sandbox at `ip` its way past `guard` to `boxes`. Made idempotently and
    flushed first: what a crashed sandbox with this address left behind is replaced, never inherited."""
    chain, gset = grant_names(ip)
    t = f"inet {NFT_TABLE}"
    out = [f"add set {t} {gset} {{ type ipv4_addr . inet_proto . inet_service; flags interval; }}",
           f"flush set {t} {gset}", f"add chain {t} {chain}", f"flush chain {t} {chain}",
           f"add rule {t} {chain} ip daddr . meta l4proto . th dport @{gset} accept"]
    elems = _elements(boxes)
    if elems:
        out.append(f"add element {t} {gset} {{ {', '.join(elems)} }}")
    out.append(f"add element {t} grants {{ {ip} : jump {chain} }}")
    return "\n".join(out) + "\n"


def _grant_teardown(ip: str) -> list[str]:
    chain, gset = grant_names(ip)
    t = f"inet {NFT_TABLE}"
    return [f"delete element {t} grants {{ {ip} }}", f"delete chain {t} {chain}", f"delete set {t} {gset}"]


def installed_version(family: str) -> int | None:
    """The version of shoal's table of `family` on this host (0: an unversioned one; None: none)."""
    r = run_sync(["nft", "-t", "list", "table", family, NFT_TABLE], timeout=30)
    if r.returncode != 0:
        return None
    m = _VERSION_RE.search(r.stdout.decode(errors="replace"))
    return int(m.group(1)) if m else 0


class NetworkManager:
    """Creates and removes per-sandbox network namespaces attached to the shoal bridge."""

    #: the bridge's address: every sandbox's router and DNS proxy (backends read it here, not from this module)
    gateway = GATEWAY

    def __init__(self, paths: Paths, node_id: str, s: Settings) -> None:
        self.paths = paths
        self.node_id = node_id
        self.settings = s
        # host-global (not per SHOAL_HOME): every node agent on this host shares the one bridge and subnet
        self.leases = s.net_leases
        #: one file per source of @infra addresses (a node's egress_deny, a cluster agent's Ray nodes)
        self.blocked_dir = self.leases.parent / "net-blocked"
        self._bridge_ready = False

    #: where the DNS proxy sends allowed queries ("host:port"); None: the host's first nameserver
    upstream: str | None = None

    def dns_upstream(self) -> str:
        """The resolver networked sandboxes' allowed queries go to (the DNS proxy forwards to it)."""
        if self.upstream:
            return self.upstream if ":" in self.upstream else f"{self.upstream}:53"
        up = self.settings.dns_upstream
        if up:
            return up if ":" in up else f"{up}:53"
        with contextlib.suppress(OSError):
            for line in Path("/etc/resolv.conf").read_text().splitlines():
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver" and "." in parts[1]:
                    return f"{parts[1]}:53"
        return "127.0.0.53:53"

    def _host_lock(self) -> contextlib.AbstractContextManager[int]:
        # node agents of every SHOAL_HOME on this host set up the same bridge and tables
        return flocked(self.leases.parent / "net.lock")

    def ensure_bridge(self) -> None:
        """Create the bridge, enable forwarding, install or upgrade the nftables tables (idempotent)."""
        if self._bridge_ready:
            return
        for tool in ("ip", "nft"):
            if not run_sync(["which", tool]).returncode == 0:
                raise BackendUnavailable(f"network=True needs `{tool}`: apt-get install iproute2 nftables")
        with self._host_lock():
            if run_sync(["ip", "link", "show", BRIDGE]).returncode != 0:
                run_sync(["ip", "link", "add", BRIDGE, "type", "bridge"], check=True)
                run_sync(["ip", "addr", "add", f"{GATEWAY}/{SUBNET.prefixlen}", "dev", BRIDGE], check=True)
            # the bridge's own MAC is fixed: left to the kernel it is the lowest of its ports' and changes when
            # that sandbox goes, and every other sandbox's cached gateway MAC goes stale (its traffic to the
            # host and out is lost until its neighbour entry is revalidated). 3: NET_ADDR_SET
            with contextlib.suppress(OSError):
                if Path(f"/sys/class/net/{BRIDGE}/addr_assign_type").read_text().strip() != "3":
                    run_sync(["ip", "link", "set", BRIDGE, "address", mac_for(GATEWAY)], check=True)
            run_sync(["ip", "link", "set", BRIDGE, "up"], check=True)
            Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
            # strict reverse-path filter: a source address that would not be routed back out of shoal0 is dropped
            with contextlib.suppress(OSError):
                Path(f"/proc/sys/net/ipv4/conf/{BRIDGE}/rp_filter").write_text("1")
            self.leases.mkdir(parents=True, exist_ok=True)
            self._write_blocked(f"settings-{self.node_id}", [str(n) for n in _networks(self.settings.egress_deny)])
            self._install_tables()
            self._sync_infra()
        self._bridge_ready = True

    # ---- @infra: the cluster's own addresses and the operator's egress_deny --------------------------
    def set_blocked(self, source: str, nets: list[str]) -> None:
        """Make `nets` (addresses or CIDRs) unreachable from every sandbox on this host unless granted; one
        list per `source` (e.g. `cluster-<node id>`), replacing its previous one. @infra is the union."""
        with self._host_lock():
            if self._write_blocked(source, nets) and installed_version("inet") == NFT_VERSION:
                self._sync_infra()

    def _write_blocked(self, source: str, nets: list[str]) -> bool:
        # True when the list changed
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", source):
            raise ValueError(f"bad blocked-address source {source!r}")
        clean = sorted({str(n) for n in _networks(nets)})
        p = self.blocked_dir / f"{source}.json"
        if not clean:
            # nothing from this source (any more): no file, so sources that come and go leave none behind
            try:
                p.unlink()
                return True
            except FileNotFoundError:
                return False
        with contextlib.suppress(OSError, ValueError):
            if sorted(json.loads(p.read_text())) == clean:
                return False
        self.blocked_dir.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}")
        tmp.write_text(json.dumps(clean))
        os.replace(tmp, p)
        return True

    def blocked_nets(self) -> list[ipaddress.IPv4Network]:
        """Every address in @infra (the union of every source's list)."""
        return read_blocked(self.blocked_dir)

    def _sync_infra(self) -> None:
        # the whole set in one transaction: never a moment without it
        t = f"inet {NFT_TABLE}"
        elems = [box_text(b) for b in disjoint([box(n) for n in self.blocked_nets()])]
        script = f"flush set {t} infra\n" + (f"add element {t} infra {{ {', '.join(elems)} }}\n" if elems else "")
        run_sync(["nft", "-f", "-"], stdin=script.encode(), check=True, timeout=60)

    def _install_tables(self) -> None:
        script = ""
        for family, rules in (("inet", _INET_RULES), ("bridge", _BRIDGE_RULES)):
            have = installed_version(family)
            if have is not None and have >= NFT_VERSION:
                if have > NFT_VERSION:
                    log.warning("a newer shoal (v%d) set up the %s table; leaving it as it is", have, family)
                continue
            if have is not None:
                # replace in one transaction: no moment without rules (conntrack and NAT state survive)
                script += f"table {family} {NFT_TABLE} {{}}\ndelete table {family} {NFT_TABLE}\n"
                log.info("upgrading nftables table %s %s from v%d to v%d", family, NFT_TABLE, have, NFT_VERSION)
            script += rules
            if family == "bridge":
                script += "".join("add " + line for line in self._live_port_elements().splitlines(True))
            else:
                script += self._live_egress_objects() + self._live_grant_objects()
        if script:
            run_sync(["nft", "-f", "-"], stdin=script.encode(), check=True, timeout=60)

    def _live_port_elements(self) -> str:
        # ports of sandboxes made before this table (an upgrade): registered again from their leases
        out = ""
        for lease in self._leases():
            veth, ip = lease.get("veth"), lease.get("ip")
            if veth and ip and Path(f"/sys/class/net/{veth}").exists():
                out += _port_elements(veth, lease.get("mac") or mac_for(ip), ip)
        return out

    def _live_egress_objects(self) -> str:
        # allowlists of sandboxes made before this table (an upgrade); their pinned addresses come back
        # with their next DNS lookups
        out = ""
        for lease in self._leases():
            veth, ip, egress = lease.get("veth"), lease.get("ip"), lease.get("egress")
            if veth and ip and egress and Path(f"/sys/class/net/{veth}").exists():
                out += _egress_objects(veth, ip, EgressPolicy.from_dict(egress))
        return out

    def _live_grant_objects(self) -> str:
        # grants of sandboxes made before this table (an upgrade)
        out = ""
        for lease in self._leases():
            veth, ip, grants = lease.get("veth"), lease.get("ip"), lease.get("grants")
            if veth and ip and grants and Path(f"/sys/class/net/{veth}").exists():
                out += _grant_objects(ip, [tuple(b) for b in grants])  # type: ignore[misc]
        return out

    def _leases(self) -> list[dict[str, Any]]:
        out = []
        with contextlib.suppress(FileNotFoundError), os.scandir(self.leases) as it:
            for e in it:
                try:
                    data = json.loads(Path(e.path).read_text())
                except (OSError, ValueError):
                    continue  # a plain sandbox id: an older shoal's lease, nothing to register
                if isinstance(data, dict):
                    out.append(dict(data, ip=e.name))
        return out

    def _lease(self, sandbox_id: str, veth: str, policy: EgressPolicy | None, grants: list[Box]) -> str:
        hosts = SUBNET.num_addresses - 3
        for _ in range(64):
            n = 2 + secrets.randbelow(hosts)
            ip = str(SUBNET.network_address + n)
            try:
                fd = os.open(self.leases / ip, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue
            # what the DNS proxy needs to answer this sandbox (shoal.node.dnsproxy): every networked
            # sandbox asks it (no host resolv.conf is bound into a sandbox)
            lease: dict[str, Any] = {"sandbox": sandbox_id, "veth": veth, "mac": mac_for(ip),
                                     "dns_upstream": self.dns_upstream(), "grants": [list(b) for b in grants]}
            if policy is not None:
                lease.update(egress=policy.to_dict(), egress_set=egress_names(veth)[1])
            else:
                lease["open"] = True
            os.write(fd, json.dumps(lease).encode())
            os.close(fd)
            return ip
        raise CapacityExceeded("no free sandbox IP address in 10.89.0.0/16", retry_after_s=5.0)

    async def setup(self, rec: SandboxRecord, policy: EgressPolicy | None = None,
                    egress_mbps: float | None = None, grants: list[Box] | None = None) -> str:
        """Create the sandbox's netns + veth; returns the netns path for the OCI config. With `policy`
        (network=[rules]) only what it allows is reachable; `egress_mbps` shapes what the sandbox sends.
        Protected destinations (shoal.egress) stay unreachable except `grants` (network=True: what the
        operator's policy grants) or, for an allowlist, what its CIDR rules name (already checked)."""
        self.ensure_bridge()
        short = rec.id.rsplit("-", 1)[1][:10]
        ns = f"shoal-{short}"
        host_if = f"sh{short}"[:15]
        boxes = [box(c.net, c.ports) for c in policy.cidrs] if policy is not None else list(grants or [])
        ip = self._lease(rec.id, host_if, policy, boxes)
        mac = mac_for(ip)
        rec.netns = ns
        rec.extra["ip"] = ip
        rec.extra["veth"] = host_if
        if policy is not None:
            rec.extra["egress"] = True
        if boxes:
            rec.extra["grants"] = True
        rec.save()
        try:
            (await run(["ip", "netns", "add", ns])).check("ip netns add")
            # the port is registered (its MAC and IP) before its link comes up: no frame passes unchecked
            host_cmds = (f"link add {host_if} type veth peer name eth0 address {mac} netns {ns}\n"
                         f"link set {host_if} master {BRIDGE}\n"
                         f"link set {host_if} type bridge_slave isolated on\n")
            (await run(["ip", "-batch", "-"], stdin=host_cmds.encode())).check("ip (host side)")
            add = "".join("add " + line for line in _port_elements(host_if, mac, ip).splitlines(True))
            if policy is not None:
                add += _egress_objects(host_if, ip, policy)
            if boxes:
                add += _grant_objects(ip, boxes)
            (await run(["nft", "-f", "-"], stdin=add.encode())).check("nft (register the port)")
            (await run(["ip", "link", "set", host_if, "up"])).check("ip link set up")
            ns_cmds = (f"addr add {ip}/{SUBNET.prefixlen} dev eth0\nlink set eth0 up\nlink set lo up\n"
                       f"route add default via {GATEWAY}\n")
            (await run(["ip", "-n", ns, "-batch", "-"], stdin=ns_cmds.encode())).check("ip (sandbox side)")
            if egress_mbps:
                # shaped on the sandbox's side of the veth (it has no CAP_NET_ADMIN to undo it); a token
                # bucket: bursts up to ~64 KiB, then the rate
                rate = f"{int(egress_mbps * 1000)}kbit"
                (await run(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
                            "burst", "64kb", "latency", "200ms"])).check("tc (egress limit)")
            from shoal.node.dnsproxy import ensure_running

            await asyncio.to_thread(ensure_running, self.leases)
        except Exception as e:
            await self.teardown(rec)
            raise SandboxError(f"could not set up the sandbox network: {e}") from e
        return f"/run/netns/{ns}"

    def egress_stats(self, rec: SandboxRecord) -> dict[str, int]:
        """What a sandbox's allowlist dropped (packets, bytes) and how its DNS queries went."""
        veth, ip = rec.extra.get("veth"), rec.extra.get("ip")
        out: dict[str, int] = {}
        if not veth or not ip:
            return out
        r = run_sync(["nft", "-j", "list", "counter", "inet", NFT_TABLE, egress_names(veth)[2]], timeout=10)
        with contextlib.suppress(ValueError, KeyError, TypeError):
            for item in json.loads(r.stdout)["nftables"]:
                if "counter" in item:
                    out["dropped_packets"] = int(item["counter"]["packets"])
                    out["dropped_bytes"] = int(item["counter"]["bytes"])
        with contextlib.suppress(OSError, ValueError):
            dns = json.loads((self.leases / f"{ip}.dns").read_text())
            out["dns_answered"], out["dns_refused"] = int(dns.get("answered", 0)), int(dns.get("refused", 0))
        return out

    async def teardown(self, rec: SandboxRecord) -> None:
        """Remove the veth, its port registration, the netns (and its bind mount) and the IP lease. Idempotent."""
        veth = rec.extra.get("veth")
        ip = rec.extra.get("ip")
        if veth:
            await run(["ip", "link", "del", veth])
            if ip:
                await self._unregister(veth, ip, bool(rec.extra.get("egress")), bool(rec.extra.get("grants")))
        if rec.netns:
            await run(["ip", "netns", "del", rec.netns])
        if ip:
            for name in (ip, f"{ip}.dns"):
                with contextlib.suppress(FileNotFoundError):
                    (self.leases / name).unlink()

    async def _unregister(self, veth: str, ip: str, egress: bool = False, grants: bool = False) -> None:
        lines = _port_elements(veth, mac_for(ip), ip).splitlines(True)
        if egress:
            lines += [ln[len("delete "):] + "\n" for ln in _egress_teardown(veth, ip)]
        if grants:
            lines += [ln[len("delete "):] + "\n" for ln in _grant_teardown(ip)]
        r = await run(["nft", "-f", "-"], stdin="".join("delete " + ln for ln in lines).encode())
        if r.returncode != 0:
            # some were never added (a setup that failed half-way): delete what is there, one by one
            for ln in lines:
                await run(["nft", "-f", "-"], stdin=("delete " + ln).encode())


def _networks(items: Any) -> list[ipaddress.IPv4Network]:
    out = []
    for n in items or ():
        with contextlib.suppress(ValueError):
            out.append(ipaddress.IPv4Network(str(n), strict=False))
    return out
