"""Item 10 of issue 19: egress allowlists (`network=[rules]`), the DNS proxy, and egress_mbps.

"The internet" is a network namespace the test makes (tests/security/netlab.py): a DNS server and
HTTP servers on addresses in 198.18.0.0/15. The node's DNS proxy is pointed at that DNS server, so no
packet leaves the host. An allowlist sandbox reaches exactly what its rules name; everything else is
dropped and counted; names outside the rules get NXDOMAIN; names that resolve into link-local,
private or the sandboxes' own ranges get no address; the host and other sandboxes are unreachable."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import shoal
from shoal.node.dnsproxy import stop_running
from tests.security.netlab import DNS_SERVER, HTTP_SERVER, UDP_SINK, Internet

pytestmark = [pytest.mark.root, pytest.mark.timeout(600)]

PROBE = r"""
import socket, sys, urllib.request
for url in sys.argv[1:]:
    try:
        body = urllib.request.urlopen(url, timeout=1.5).read().decode()
        print("ok", url, body)
    except Exception as e:
        reason = getattr(e, "reason", e)
        kind = "dns" if isinstance(reason, socket.gaierror) else "blocked"
        print(kind, url)
"""


def _probe_lines(out: bytes) -> dict[str, str]:
    res = {}
    for line in out.decode().splitlines():
        parts = line.split(" ", 2)
        res[parts[1]] = parts[0] if parts[0] != "ok" else "ok:" + parts[2]
    return res


@pytest.fixture
def internet(tmp_path: Path, client: shoal.Client):  # type: ignore[no-untyped-def]
    with Internet() as net:
        other, third = f"{net.subnet}.2", f"{net.subnet}.3"
        net.add_address(other)
        net.add_address(third)
        names = {"allowed.test": [net.ip], "other.test": [other], "api.svc.test": [third],
                 "meta.test": ["169.254.169.254"], "lan.test": ["10.1.2.3", net.ip]}
        log = tmp_path / "dns.log"
        net.spawn(DNS_SERVER, net.ip, json.dumps(names), str(log), ready_file=log)
        for port in ("80", "8080"):
            net.spawn(HTTP_SERVER, "0.0.0.0", port)
        node = client.transport.node
        node.network().upstream = f"{net.ip}:53"
        net.other = other  # type: ignore[attr-defined]
        net.dns_log = log  # type: ignore[attr-defined]
        try:
            yield net
        finally:
            node.network().upstream = None
    stop_running(Path(node.network().leases))


async def test_allowlist_reaches_what_it_names_and_nothing_else(client: shoal.Client, internet: Internet) -> None:
    net = internet
    other = net.other  # type: ignore[attr-defined]
    peer = await client.create("base", network=True)  # another sandbox, serving on 8000
    await peer.exec("nohup python3 -m http.server 8000 >/dev/null 2>&1 &")
    peer_ip = client.transport.node.record(peer.id).extra["ip"]
    sb = await client.create("base", network=["allowed.test:80", "*.svc.test", f"{other}/32:8080",
                                              "meta.test", "lan.test"])
    await sb.write_file("/tmp/probe.py", PROBE.encode())
    urls = {
        "http://allowed.test/": "ok",            # a domain on its port
        "http://allowed.test:8080/": "blocked",  # ... not on another
        "http://api.svc.test:8080/": "ok",       # a wildcard, any port
        "http://other.test/": "dns",             # a name no rule names: NXDOMAIN
        f"http://{other}:8080/": "ok",           # a CIDR rule with its port
        f"http://{other}/": "blocked",
        f"http://{net.ip}:8080/": "blocked",     # an allowed name's address, but not its port
        "http://meta.test/": "dns",              # resolves to link-local only: no address given
        "http://169.254.169.254/": "blocked",    # metadata, directly
        "http://lan.test/": "ok",                # private addresses removed from the answer, public kept
        "http://10.89.0.1:8000/": "blocked",     # the host
        f"http://{peer_ip}:8000/": "blocked",    # another sandbox
    }
    r = await sb.exec(["python3", "/tmp/probe.py", *urls], timeout=120)
    got = _probe_lines(r.stdout)
    assert {u: got[u].split(":")[0] for u in urls} == urls, got
    stats = (await client.get(sb.id)).info.extra["egress"]
    assert stats["dropped_packets"] >= 6 and stats["dns_refused"] >= 1, stats
    # a sandbox with network=True reaches the test's internet, but never link-local addresses
    await peer.write_file("/tmp/probe.py", PROBE.encode())
    r = await peer.exec(["python3", "/tmp/probe.py", f"http://{net.ip}/", "http://169.254.169.254/"], timeout=60)
    assert _probe_lines(r.stdout) == {f"http://{net.ip}/": "ok:hello from 0.0.0.0",
                                      "http://169.254.169.254/": "blocked"}, r.stdout
    # closing the sandbox removes its nftables state
    veth = client.transport.node.record(sb.id).extra["veth"]
    await sb.close()
    table = subprocess.run(["nft", "list", "table", "inet", "shoal"], capture_output=True, text=True).stdout
    assert f"e_{veth[2:]}" not in table and f"a_{veth[2:]}" not in table


async def test_egress_bandwidth_is_shaped(client: shoal.Client, tmp_path: Path) -> None:
    with Internet() as net:
        log = tmp_path / "sink.log"
        net.spawn(UDP_SINK, "9000", str(log), ready_file=log)
        sb = await client.create("base", network=True, egress_mbps=1.0)
        ns = client.transport.node.record(sb.id).netns
        shown = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
        assert "tbf" in shown and "rate 1Mbit" in shown, shown
        # 2 MB at once: far over what a 1 Mbit/s bucket passes, so the shaper holds packets back
        send = (f"import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"for i in range(2000): s.sendto(b'x'*1000, ('{net.ip}', 9000))")
        await sb.exec(["python3", "-c", send])
        stats = subprocess.run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", "eth0"], capture_output=True,
                               text=True).stdout
        overlimits = int(stats.split("overlimits")[1].split()[0])
        assert overlimits > 0, stats
        with pytest.raises(shoal.InvalidRequest, match="needs a network"):
            await client.create("base", egress_mbps=1.0)


async def test_allowlists_over_both_transports(any_client: shoal.Client) -> None:
    """The API takes a list of rules for `network` (CIDR rules need no DNS) and refuses bad ones; the VM
    backends say they cannot enforce them."""
    with pytest.raises(shoal.InvalidRequest, match="not a domain"):
        await any_client.create("base", network=["not a rule!"])
    with pytest.raises(shoal.InvalidRequest, match="allows nothing"):
        await any_client.create("base", network=[])
    with Internet() as net:
        net.spawn(HTTP_SERVER, "0.0.0.0", "80")
        sb = await any_client.create("base", network=[f"{net.ip}/32:80"], memory_mb=128)
        await sb.write_file("/tmp/probe.py", PROBE.encode())
        r = await sb.exec(["python3", "/tmp/probe.py", f"http://{net.ip}/", f"http://{net.ip}:81/"], timeout=60)
        assert _probe_lines(r.stdout) == {f"http://{net.ip}/": "ok:hello from 0.0.0.0",
                                          f"http://{net.ip}:81/": "blocked"}, r.stdout
        assert (await any_client.get(sb.id)).info.extra["egress"]["dropped_packets"] >= 1
        await sb.close()
    with pytest.raises(shoal.ShoalError, match="egress allowlists"):
        await any_client.create("base", backend="microvm", network=["pypi"])
