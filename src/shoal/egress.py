"""Egress allowlists: what `network=[...]` lets a sandbox reach (issue 19, item 10).

`network` is False (no network), True (the internet, except link-local/metadata addresses), or a list
of rules; with a list, everything else is dropped and counted. A rule is one of:

- a domain, `pypi.org`, or every name under one, `*.pythonhosted.org`; with a port, `pypi.org:443`
  (without one, any port);
- an IPv4 address or CIDR, `203.0.113.7`, `198.51.100.0/24`; with a port, `198.51.100.0/24:5432`;
- a named set from the settings (`egress_sets`), `pypi`, `npm`, `debian`, `github`.

Ports apply to TCP and UDP. Domains are resolved by the node's DNS proxy (shoal.node.dnsproxy), which
answers only allowed names and pins their addresses for the sandbox.

Protected destinations (issue 23): private ranges (RFC 1918, CGNAT, the sandboxes' own subnet),
link-local and metadata addresses, other reserved ranges, and the addresses of the cluster's own nodes
(`Ray` head and workers, learned by the node agent, plus the `egress_deny` setting). No sandbox reaches
them, neither with `network=True` nor with an allowlist, unless the operator's egress policy grants
them: the `egress_allow` setting (every sandbox of the node) and a project's grants (`shoal token
policy`), carried to the node in the spec's `egress_grants`. A CIDR rule that reaches into a protected
range the grants do not cover is refused with `EgressForbidden` (403) naming the rule; a domain that
resolves into one gets no address (no DNS rebinding into the host's network). The documentation and
benchmark ranges (192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24, 198.18.0.0/15) count as public: tests
use them as "the internet".

This module only parses and checks rules; the node turns them into nftables state
(shoal.node.network).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shoal.errors import EgressForbidden, InvalidRequest

#: the built-in named sets (the `egress_sets` setting adds to them or replaces one)
DEFAULT_SETS: dict[str, list[str]] = {
    "pypi": ["pypi.org:443", "files.pythonhosted.org:443"],
    "npm": ["registry.npmjs.org:443", "registry.yarnpkg.com:443"],
    "debian": ["deb.debian.org:80", "deb.debian.org:443", "security.debian.org:80", "security.debian.org:443"],
    "github": ["github.com:443", "api.github.com:443", "codeload.github.com:443",
               "objects.githubusercontent.com:443", "raw.githubusercontent.com:443"],
}
#: rules after expanding named sets; more is refused (each becomes nftables state and DNS policy)
MAX_RULES = 256
ALL_PORTS = (1, 65535)


def _nets(*names: str) -> tuple[ipaddress.IPv4Network, ...]:
    return tuple(ipaddress.IPv4Network(n) for n in names)


#: protected destinations by category (the keywords of an egress grant): no sandbox reaches them unless
#: the operator's policy grants them. `cluster` (the cluster's node addresses) is learned at run time.
PROTECTED: dict[str, tuple[ipaddress.IPv4Network, ...]] = {
    # link-local: where cloud metadata services answer (169.254.169.254)
    "metadata": _nets("169.254.0.0/16"),
    # RFC 1918, CGNAT (RFC 6598); the sandboxes' own 10.89.0.0/16 is inside 10.0.0.0/8
    "private": _nets("10.0.0.0/8", "100.64.0.0/10", "172.16.0.0/12", "192.168.0.0/16"),
    # "this network", loopback, IETF protocol assignments, multicast, class E and broadcast
    "reserved": _nets("0.0.0.0/8", "127.0.0.0/8", "192.0.0.0/24", "224.0.0.0/4", "240.0.0.0/4"),
}
#: every statically protected range (what a DNS answer never pins unless a CIDR rule names it)
NEVER: tuple[ipaddress.IPv4Network, ...] = tuple(n for nets in PROTECTED.values() for n in nets)
#: link-local, where cloud metadata services answer
LINK_LOCAL = PROTECTED["metadata"][0]
#: grant keywords: the categories above and `cluster` (the node addresses of the cluster)
GRANT_KEYWORDS = (*PROTECTED, "cluster")

_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")


@dataclass(frozen=True)
class DomainRule:
    """A name (or `*.` every name under it) and the ports it may be reached on."""

    name: str
    wildcard: bool = False
    ports: tuple[int, int] = ALL_PORTS

    def matches(self, qname: str) -> bool:
        """True when a queried name (lower case, no trailing dot) falls under this rule."""
        if self.wildcard:
            return qname.endswith("." + self.name)
        return qname == self.name


@dataclass(frozen=True)
class CidrRule:
    """An IPv4 network and the ports it may be reached on."""

    net: ipaddress.IPv4Network
    ports: tuple[int, int] = ALL_PORTS
    #: the rule as written (for messages; not compared)
    rule: str = field(default="", compare=False)


@dataclass
class EgressPolicy:
    """A parsed allowlist."""

    domains: list[DomainRule] = field(default_factory=list)
    cidrs: list[CidrRule] = field(default_factory=list)
    #: the rules as given (named sets kept by name), for the record and for messages
    source: list[str] = field(default_factory=list)

    def ports_for(self, qname: str) -> list[tuple[int, int]]:
        """Port ranges an address of `qname` may be reached on (empty: the name is not allowed)."""
        q = qname.lower().rstrip(".")
        return sorted({r.ports for r in self.domains if r.matches(q)})

    def allows_address(self, ip: str) -> bool:
        """True when a DNS answer may pin `ip`: outside the never-reachable ranges, or named by a CIDR rule."""
        addr = ipaddress.IPv4Address(ip)
        if any(addr in n for n in NEVER):
            return any(addr in r.net for r in self.cidrs)
        return True

    def to_dict(self) -> dict[str, object]:
        """JSON form (the lease file the DNS proxy reads)."""
        return {"domains": [[r.name, r.wildcard, list(r.ports)] for r in self.domains],
                "cidrs": [[str(r.net), list(r.ports)] for r in self.cidrs], "source": list(self.source)}

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> EgressPolicy:
        """Inverse of to_dict."""
        doms = [DomainRule(str(n), bool(w), (int(p[0]), int(p[1])))
                for n, w, p in d.get("domains") or []]  # type: ignore[misc, union-attr]
        cidrs = [CidrRule(ipaddress.IPv4Network(str(n)), (int(p[0]), int(p[1])))
                 for n, p in d.get("cidrs") or []]  # type: ignore[misc, union-attr]
        return cls(doms, cidrs, [str(x) for x in d.get("source") or []])  # type: ignore[union-attr]


def _port(text: str, rule: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise InvalidRequest(f"network rule {rule!r}: port {text!r} must be a number (1-65535) or a range "
                             "like 8000-8100") from None
    if not 1 <= a <= b <= 65535:
        raise InvalidRequest(f"network rule {rule!r}: ports must be within 1-65535")
    return (a, b)


def _domain(name: str, rule: str) -> tuple[str, bool]:
    wildcard = name.startswith("*.")
    if wildcard:
        name = name[2:]
    name = name.lower().rstrip(".")
    labels = name.split(".")
    if len(name) > 253 or len(labels) < 2 or not all(_LABEL.match(x) for x in labels) or labels[-1].isdigit():
        raise InvalidRequest(f"network rule {rule!r} is not a domain, an IPv4 address or CIDR, or a named set: "
                             "use e.g. pypi.org, *.example.com:443, 203.0.113.0/24:80, or pypi")
    return name, wildcard


def parse_rules(rules: Sequence[object], sets: Mapping[str, Sequence[str]] | None = None) -> EgressPolicy:
    """Parse and check `network=[...]` (InvalidRequest naming the bad rule); named sets are expanded."""
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise InvalidRequest("network must be true, false or a list of rules (domains, CIDRs, named sets)")
    known = {**DEFAULT_SETS, **(sets or {})}
    pol = EgressPolicy()
    seen_sets: set[str] = set()

    def add(rule: object, via: str | None) -> None:
        if not isinstance(rule, str) or not rule.strip():
            raise InvalidRequest(f"network rule {rule!r} must be a non-empty string")
        r = rule.strip()
        if r in known and via is None:
            if r not in seen_sets:
                seen_sets.add(r)
                for sub in known[r]:
                    add(sub, r)
            return
        host, ports = r, ALL_PORTS
        if r.count(":") == 1:
            host, p = r.rsplit(":", 1)
            ports = _port(p, rule)
        elif ":" in r:
            raise InvalidRequest(f"network rule {rule!r}: IPv6 is not supported (sandboxes have IPv4 only)")
        try:
            net = ipaddress.IPv4Network(host, strict=False)
        except ValueError:
            if "/" in host or host.replace(".", "").isdigit():
                raise InvalidRequest(f"network rule {rule!r}: {host!r} is not a valid IPv4 address or CIDR") \
                    from None
            name, wildcard = _domain(host, rule)
            pol.domains.append(DomainRule(name, wildcard, ports))
        else:
            pol.cidrs.append(CidrRule(net, ports, via or r))
        if len(pol.domains) + len(pol.cidrs) > MAX_RULES:
            raise InvalidRequest(f"network has more than {MAX_RULES} rules (named sets expanded)")

    for rule in rules:
        add(rule, None)
    pol.source = [str(r).strip() for r in rules]
    return pol


def check_network(network: object, sets: Mapping[str, Sequence[str]] | None = None) -> EgressPolicy | None:
    """The policy of a spec's `network` field: None for True/False, the parsed allowlist for a list."""
    if isinstance(network, bool):
        return None
    if isinstance(network, (list, tuple)):
        if not network:
            raise InvalidRequest("network=[] allows nothing: use network=False for no network")
        return parse_rules(network, sets)
    raise InvalidRequest(f"network={network!r} must be true, false or a list of rules")


# ---- the operator's policy: which protected destinations a sandbox may reach (issue 23) -------------
#: an address range and a port range: (first address, last address, first port, last port), as integers
Box = tuple[int, int, int, int]


def box(net: ipaddress.IPv4Network, ports: tuple[int, int] = ALL_PORTS) -> Box:
    """The box of a network and a port range."""
    return (int(net.network_address), int(net.broadcast_address), ports[0], ports[1])


def disjoint(boxes: Sequence[Box]) -> list[Box]:
    """The same addresses and ports as `boxes`, as boxes that do not overlap (nftables refuses overlapping
    elements in one interval set: `["198.51.100.0/24", "198.51.100.2:8080"]` failed the create).

    The address line is cut at every box edge; each piece gets the union of the port ranges of the boxes
    over it; neighbouring pieces with the same ports are joined again."""
    if not boxes:
        return []
    cuts = sorted({b[0] for b in boxes} | {b[1] + 1 for b in boxes})
    pieces: list[tuple[int, int, list[tuple[int, int]]]] = []
    for lo, nxt in itertools.pairwise(cuts):
        ports = merge_ranges([(b[2], b[3]) for b in boxes if b[0] <= lo and b[1] >= nxt - 1])
        if not ports:
            continue
        if pieces and pieces[-1][1] == lo - 1 and pieces[-1][2] == ports:
            pieces[-1] = (pieces[-1][0], nxt - 1, ports)
        else:
            pieces.append((lo, nxt - 1, ports))
    return [(a, b, p, q) for a, b, ports in pieces for p, q in ports]


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping, non-adjacent ranges covering the same integers."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def subtract_ranges(want: Sequence[tuple[int, int]], have: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of `want` outside `have`."""
    out: list[tuple[int, int]] = []
    have = merge_ranges(have)
    for lo, hi in merge_ranges(want):
        cur = lo
        for a, b in have:
            if b < cur or a > hi:
                continue
            if a > cur:
                out.append((cur, a - 1))
            cur = max(cur, b + 1)
            if cur > hi:
                break
        if cur <= hi:
            out.append((cur, hi))
    return out


def covered(target: Box, boxes: Sequence[Box]) -> bool:
    """True when every address and port of `target` lies in some box of `boxes`."""
    a0, a1, p0, p1 = target
    return all(not subtract_ranges([(p0, p1)], ports) for _lo, _hi, ports in _pieces(boxes, a0, a1))


def _pieces(boxes: Sequence[Box], a0: int, a1: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    # every piece of [a0, a1] between box edges, with the port ranges over it (gaps get none)
    cuts = sorted({a0, a1 + 1} | {b[0] for b in boxes} | {b[1] + 1 for b in boxes})
    return [(lo, nxt - 1, [(b[2], b[3]) for b in boxes if b[0] <= lo and b[1] >= nxt - 1])
            for lo, nxt in itertools.pairwise(cuts) if a0 <= lo <= a1]


def ip_text(n: int) -> str:
    """An address as text."""
    return str(ipaddress.IPv4Address(n))


def box_text(b: Box) -> str:
    """The address part of a box as nftables writes it (`10.0.0.0/8`, `10.0.0.1`, `10.0.0.1-10.0.0.9`)."""
    if b[0] == b[1]:
        return ip_text(b[0])
    nets = list(ipaddress.summarize_address_range(ipaddress.IPv4Address(b[0]), ipaddress.IPv4Address(b[1])))
    return str(nets[0]) if len(nets) == 1 else f"{ip_text(b[0])}-{ip_text(b[1])}"


@dataclass(frozen=True)
class Grants:
    """Protected destinations a sandbox may reach: categories (`private`, `metadata`, `reserved`,
    `cluster`) and CIDR rules with optional ports, as the operator wrote them."""

    keywords: frozenset[str] = frozenset()
    cidrs: tuple[CidrRule, ...] = ()

    def boxes(self, cluster: Sequence[ipaddress.IPv4Network] = ()) -> list[Box]:
        """What the grants cover, as boxes (`cluster` expands to the given node addresses)."""
        out = [box(n) for k in self.keywords if k in PROTECTED for n in PROTECTED[k]]
        if "cluster" in self.keywords:
            out += [box(n) for n in cluster]
        return out + [box(c.net, c.ports) for c in self.cidrs]

    def union(self, other: Grants) -> Grants:
        """Both grants."""
        return Grants(self.keywords | other.keywords, self.cidrs + other.cidrs)

    def to_list(self) -> list[str]:
        """The grants as rule strings (what `parse_grants` reads back)."""
        return sorted(self.keywords) + [c.rule or f"{c.net}:{c.ports[0]}-{c.ports[1]}" for c in self.cidrs]


def parse_grants(items: Sequence[object] | None) -> Grants:
    """Parse an egress grant list: keywords (`private`, `metadata`, `reserved`, `cluster`) and IPv4
    addresses or CIDRs with an optional `:port` or `:lo-hi` (InvalidRequest naming a bad one)."""
    if not items:
        return Grants()
    if isinstance(items, (str, bytes)):
        raise InvalidRequest("egress grants must be a list (keywords private, metadata, reserved, cluster, or CIDRs)")
    kws: set[str] = set()
    cidrs: list[CidrRule] = []
    for it in items:
        if not isinstance(it, str) or not it.strip():
            raise InvalidRequest(f"egress grant {it!r} must be a non-empty string")
        g = it.strip()
        if g in GRANT_KEYWORDS:
            kws.add(g)
            continue
        host, sep, p = g.partition(":")
        try:
            net = ipaddress.IPv4Network(host, strict=False)
        except ValueError:
            raise InvalidRequest(f"egress grant {g!r} is neither a keyword ({', '.join(GRANT_KEYWORDS)}) nor an "
                                 "IPv4 address or CIDR with an optional :port") from None
        cidrs.append(CidrRule(net, _port(p, g) if sep else ALL_PORTS, g))
    return Grants(frozenset(kws), tuple(cidrs))


def protected_ranges(cluster: Sequence[ipaddress.IPv4Network] = ()) -> list[tuple[str, ipaddress.IPv4Network]]:
    """(category, network) of every protected destination: the static ranges and the cluster's nodes."""
    out = [(k, n) for k, nets in PROTECTED.items() for n in nets]
    return out + [("cluster", n) for n in cluster]


def check_policy(policy: EgressPolicy, grants: Grants, cluster: Sequence[ipaddress.IPv4Network] = (),
                 who: str = "this sandbox") -> None:
    """Refuse (EgressForbidden, 403, naming the rule) a CIDR rule that reaches a protected destination the
    grants do not cover. Domain rules always pass: their answers are filtered by the DNS proxy."""
    allowed = grants.boxes(cluster)
    for rule in policy.cidrs:
        for kind, net in protected_ranges(cluster):
            if not rule.net.overlaps(net):
                continue
            inside = rule.net if rule.net.prefixlen >= net.prefixlen else net
            if not covered(box(inside, rule.ports), allowed):
                raise EgressForbidden(
                    f"network rule {rule.rule or str(rule.net)!r} reaches {inside} ({_KIND_DOC[kind]}), which the "
                    f"operator's egress policy does not allow {who}: ask the operator to grant it (the "
                    "egress_allow setting, or `shoal token policy PROJECT --egress-allow ...`), or name only "
                    "public destinations", rule=rule.rule or str(rule.net), range=str(inside), kind=kind)


_KIND_DOC = {"metadata": "link-local: cloud metadata", "private": "a private range",
             "reserved": "a reserved range", "cluster": "an address of the cluster's own nodes"}


def grants_for(spec_grants: Sequence[str] | None, node_allow: Sequence[str] = ()) -> Grants:
    """What a sandbox may reach of the protected destinations: the node's `egress_allow` setting plus the
    grants its spec carries (set by the API server from the caller's project policy)."""
    return parse_grants(node_allow).union(parse_grants(spec_grants))


def read_blocked(blocked_dir: Path) -> list[ipaddress.IPv4Network]:
    """The union of the @infra address lists in `blocked_dir` (one JSON list per source; shoal.node.network
    writes them, the DNS proxy reads them too)."""
    out: set[ipaddress.IPv4Network] = set()
    with contextlib.suppress(OSError), os.scandir(blocked_dir) as it:
        for e in it:
            if e.name.endswith(".json") and not e.name.startswith("."):
                with contextlib.suppress(OSError, ValueError, TypeError):
                    for n in json.loads(Path(e.path).read_text()):
                        with contextlib.suppress(ValueError):
                            out.add(ipaddress.IPv4Network(str(n), strict=False))
    return sorted(out)
