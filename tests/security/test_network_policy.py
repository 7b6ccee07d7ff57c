"""Items 4, 5 and 6 of issue 23, on one host (the cluster's own addresses: test_cluster_network.py).

4. Allowlist rules with a port for addresses outside the usual public ones (documentation ranges, a
   private address the operator granted): exactly the named port opens; rules that overlap
   (`["198.51.100.0/24", "198.51.100.2:8080"]`) made the create fail.
5. A `network=True` sandbox had the host's /etc/resolv.conf bound in (the host's path and device in
   /proc/self/mountinfo, the host's resolver configuration): now it gets a file of the node's own naming
   the node's DNS proxy, which answers every name but never with a protected address.
6. The operator's egress policy: private ranges and link-local (metadata) closed to `network=True` and
   to client-chosen CIDR rules (`0.0.0.0/0`, `169.254.169.254/32:80`: 403 `egress_forbidden` naming the
   rule) unless the node's `SHOAL_EGRESS_ALLOW` or the project's grant allows them; `SHOAL_EGRESS_DENY`
   closes more; a project token cannot grant itself anything.

"The internet" and "the LAN" are network namespaces the test makes (netlab.Internet), with private and
link-local addresses routed to them only for the test (picked at random, so runs at once do not meet)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import shoal
from shoal.node.dnsproxy import stop_running
from shoal.server.tokens import ProjectPolicy, TokenStore
from tests.security.netlab import DNS_SERVER, HTTP_SERVER, Internet
from tests.security.test_cluster_network import probe

pytestmark = [pytest.mark.root, pytest.mark.timeout(600)]


class Lab:
    """An internet namespace with a DNS server, HTTP servers on 80, 8080 and 5432, and extra addresses:
    documentation ones, a private one, a link-local one."""

    def __init__(self, net: Internet, dns_log: Path) -> None:
        self.net = net
        self.dns_log = dns_log
        n = secrets.randbelow(200) + 20
        self.doc = "198.51.100.2"           # TEST-NET-2 (counts as public)
        self.doc2 = f"203.0.113.{n}"        # TEST-NET-3: the docs' "internal database" example
        self.private = f"10.123.{n}.2"      # RFC 1918
        self.link_local = f"169.254.{n}.7"  # link-local, where metadata services answer


@pytest.fixture
def lab(client: shoal.Client, tmp_path: Path) -> Iterator[Lab]:
    with Internet() as net:
        lab = Lab(net, tmp_path / "dns.log")
        for ip in (lab.doc, lab.doc2, lab.private, lab.link_local):
            net.add_address(ip)
        names = {"public.test": [net.ip], "lan.test": [lab.private], "meta.test": [lab.link_local],
                 "mixed.test": [lab.private, net.ip]}
        net.spawn(DNS_SERVER, net.ip, json.dumps(names), str(lab.dns_log), ready_file=lab.dns_log)
        for port in ("80", "8080", "5432"):
            net.spawn(HTTP_SERVER, "0.0.0.0", port)
        network = client.transport.node.network()
        network.upstream = f"{net.ip}:53"
        try:
            yield lab
        finally:
            network.upstream = None
            network.set_blocked(f"settings-{network.node_id}", [])  # what a SHOAL_EGRESS_DENY test left
            stop_running(Path(network.leases))


async def test_port_rules_for_non_public_addresses_open_exactly_that_port(client: shoal.Client, lab: Lab,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    doc, doc2, private = lab.doc, lab.doc2, lab.private
    cases: list[tuple[list[str], dict[str, str]]] = [
        ([f"{doc}:8080"], {f"{doc}:8080": "open", f"{doc}:80": "timeout"}),
        ([f"{doc}/32:8080"], {f"{doc}:8080": "open", f"{doc}:80": "timeout"}),
        ([f"{doc2.rsplit('.', 1)[0]}.0/24:5432"], {f"{doc2}:5432": "open", f"{doc2}:80": "timeout"}),
        ([f"{doc}:8000-8100", f"{doc}:5432"], {f"{doc}:8080": "open", f"{doc}:5432": "open", f"{doc}:80": "timeout"}),
        # overlapping rules: the create failed (nftables refuses overlapping elements in one set)
        (["198.51.100.0/24", f"{doc}:8080"], {f"{doc}:8080": "open", f"{doc}:80": "open", f"{doc2}:80": "timeout"}),
        ([f"{doc}:8080", "198.51.100.0/24:80"], {f"{doc}:8080": "open", f"{doc}:80": "open", f"{doc}:5432": "timeout"}),
        # a private address the operator granted, with a port
        ([f"{private}:8080"], {f"{private}:8080": "open", f"{private}:80": "timeout"}),
    ]
    monkeypatch.setenv("SHOAL_EGRESS_ALLOW", "private")
    # settings are resolved once, when a node starts (issue 27): a node started after the change sees it
    async with shoal.Client() as granted:

        async def check(rules: list[str], want: dict[str, str]) -> tuple[list[str], dict[str, str]]:
            sb = await granted.create("base", network=rules, memory_mb=128)
            try:
                return rules, await probe(sb, [(h, int(p)) for h, p in (k.split(":") for k in want)])
            finally:
                await sb.close()

        # the cases at once (each probe waits out its "timeout" ports): every sandbox has its own rules
        for (rules, got), (_, want) in zip(await asyncio.gather(*(check(r, w) for r, w in cases)), cases,
                                           strict=True):
            assert got == want, (rules, got)


async def test_a_networked_sandbox_resolves_through_the_node_not_the_host(client: shoal.Client, lab: Lab) -> None:
    sb = await client.create("base", network=True, memory_mb=128)
    conf = (await sb.read_file("/etc/resolv.conf")).decode()
    assert conf.split()[:2] == ["nameserver", "10.89.0.1"], conf
    host_conf = Path("/etc/resolv.conf").read_text() if Path("/etc/resolv.conf").exists() else ""
    assert conf != host_conf
    mi = (await sb.exec("grep ' /etc/resolv.conf ' /proc/self/mountinfo")).stdout.decode()
    assert mi and "/dev/vd" not in mi and "ext4" not in mi and " /etc/resolv.conf " in mi, mi
    assert "tmpfs" in mi, mi  # the node's own small tmpfs (shoal.backends.container.guestfs), not a host disk
    r = await sb.exec(["python3", "-c", """
import socket, sys
for name in sys.argv[1:]:
    try:
        print(name, sorted({a[4][0] for a in socket.getaddrinfo(name, 80, socket.AF_INET)}))
    except OSError as e:
        print(name, "none")
""", "public.test", "lan.test", "meta.test", "mixed.test"])
    lines = dict(ln.split(" ", 1) for ln in r.stdout.decode().splitlines())
    assert lines == {"public.test": f"['{lab.net.ip}']", "lan.test": "none", "meta.test": "none",
                     "mixed.test": f"['{lab.net.ip}']"}, r.stdout  # protected addresses are never given out
    assert "public.test 1" in lab.dns_log.read_text()  # answered by the test's DNS, through the proxy


async def test_private_and_link_local_are_closed_unless_the_operator_allows(client: shoal.Client, lab: Lab,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    net = lab.net
    targets = [(lab.private, 8080), (lab.private, 80), (lab.link_local, 80), (net.ip, 80)]
    sb = await client.create("base", network=True, memory_mb=128)
    assert await probe(sb, targets) == {f"{lab.private}:8080": "timeout", f"{lab.private}:80": "timeout",
                                        f"{lab.link_local}:80": "timeout", f"{net.ip}:80": "open"}
    # the embedded client is the operator: CIDR rules into closed ranges need a grant too
    for rule in ("0.0.0.0/0", "169.254.169.254/32:80", f"{lab.private}:8080"):
        with pytest.raises(shoal.EgressForbidden, match="network rule"):
            await client.create("base", network=[rule], memory_mb=128)
    # the node's setting opens exactly what it names, for network=True and for rules
    # settings are resolved once, when a node starts (issue 27): nodes started after each change see it
    monkeypatch.setenv("SHOAL_EGRESS_ALLOW", f"{lab.private}:8080,{lab.link_local}/32:80")
    async with shoal.Client() as granted:
        sb = await granted.create("base", network=True, memory_mb=128)
        assert await probe(sb, targets) == {f"{lab.private}:8080": "open", f"{lab.private}:80": "timeout",
                                            f"{lab.link_local}:80": "open", f"{net.ip}:80": "open"}
        al = await granted.create("base", network=[f"{lab.link_local}:80"], memory_mb=128)
        assert (await probe(al, [(lab.link_local, 80), (net.ip, 80)])) == {f"{lab.link_local}:80": "open",
                                                                           f"{net.ip}:80": "timeout"}
    # SHOAL_EGRESS_DENY closes a public address (a store master, a cluster outside private ranges)
    monkeypatch.setenv("SHOAL_EGRESS_DENY", net.ip)
    async with shoal.Client() as denying:
        network = denying.transport.node.network()
        try:
            sb = await denying.create("base", network=True, memory_mb=128)
            assert (await probe(sb, [(net.ip, 80)])) == {f"{net.ip}:80": "timeout"}
        finally:
            network.set_blocked(f"settings-{network.node_id}", [])
    monkeypatch.delenv("SHOAL_EGRESS_DENY")
    async with shoal.Client() as plain:
        sb = await plain.create("base", network=True, memory_mb=128)
        assert (await probe(sb, [(net.ip, 80)])) == {f"{net.ip}:80": "open"}


async def test_the_egress_policy_over_http(api_server: Any, lab: Lab) -> None:
    """A project token: rules into closed ranges are 403 naming the rule, it cannot grant itself, and the
    project's policy (`shoal token policy`) opens what it grants."""
    store = TokenStore(Path(os.environ["SHOAL_HOME"]))
    project = f"eg-{secrets.token_hex(3)}"
    tok = store.create(project, name="egress policy test")
    h = {"Authorization": f"Bearer {tok}"}
    for rule in ("0.0.0.0/0", "169.254.169.254/32:80", f"{lab.link_local}:80", "10.0.0.0/8"):
        r = httpx.post(f"{api_server.url}/v1/sandboxes", json={"image": "base", "network": [rule], "memory_mb": 64},
                       headers=h, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 403 and err["code"] == "egress_forbidden", r.text
        assert err["details"]["rule"] == rule and rule in err["message"]
    r = httpx.post(f"{api_server.url}/v1/sandboxes", json={"image": "base", "network": True, "memory_mb": 64,
                                                          "egress_grants": ["metadata"]}, headers=h, timeout=60)
    assert r.status_code == 403 and "egress_grants" in r.json()["error"]["message"], r.text
    store.set_policy(project, ProjectPolicy(egress_allow=[f"{lab.link_local}/32:80"]))
    async with shoal.Client(api_server.url, token=tok) as c:
        sb = await c.create("base", network=[f"{lab.link_local}:80"], memory_mb=128)
        assert (await probe(sb, [(lab.link_local, 80), (lab.link_local, 8080)])) == {
            f"{lab.link_local}:80": "open", f"{lab.link_local}:8080": "timeout"}
        with pytest.raises(shoal.EgressForbidden):
            await c.create("base", network=["169.254.169.254/32:80"], memory_mb=128)  # not granted
        sb = await c.create("base", network=True, memory_mb=128)
        assert (await probe(sb, [(lab.link_local, 80), (lab.private, 80)])) == {
            f"{lab.link_local}:80": "open", f"{lab.private}:80": "timeout"}
