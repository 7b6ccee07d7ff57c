"""Egress allowlists: what `network=[...]` lets a sandbox reach (issue 19, item 10).

`network` is False (no network), True (the internet, except link-local/metadata addresses), or a list
of rules; with a list, everything else is dropped and counted. A rule is one of:

- a domain, `pypi.org`, or every name under one, `*.pythonhosted.org`; with a port, `pypi.org:443`
  (without one, any port);
- an IPv4 address or CIDR, `203.0.113.7`, `198.51.100.0/24`; with a port, `198.51.100.0/24:5432`;
- a named set from the settings (`egress_sets`), `pypi`, `npm`, `debian`, `github`.

Ports apply to TCP and UDP. Domains are resolved by the node's DNS proxy (shoal.node.dnsproxy), which
answers only allowed names and pins their addresses for the sandbox. Link-local and metadata addresses,
the host, other sandboxes and private ranges are never reachable unless a CIDR rule names them: a
domain that resolves into them gets no address (no DNS rebinding into the host's network).

This module only parses and checks rules; the node turns them into nftables state
(shoal.node.network).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from shoal.errors import InvalidRequest

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

#: never reachable unless a CIDR rule names them (and then only what it names)
NEVER: tuple[ipaddress.IPv4Network, ...] = tuple(ipaddress.IPv4Network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.168.0.0/16", "224.0.0.0/4", "240.0.0.0/4"))
#: never reachable even with network=True: link-local, where cloud metadata services answer
LINK_LOCAL = ipaddress.IPv4Network("169.254.0.0/16")

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
            pol.cidrs.append(CidrRule(net, ports))
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
