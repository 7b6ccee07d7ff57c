"""Items 1 and 2 of issue 19: a networked sandbox (it has CAP_NET_RAW) forges ARP and IP packets.

1. ARP spoofing: the attacker claims the victim's IP with its own MAC. Before the fix the host's
   neighbour entry moved to the attacker and it captured the victim's traffic.
2. Source-IP spoofing: the attacker sends raw UDP from 203.0.113.7 and from the victim's IP. Before the
   fix the first left the host un-NATed and the second was NATed as if the victim had sent it.

The defence is the `bridge shoal` nftables table (each port may only send its own MAC and IP), with
the `inet` table's source check and strict rp_filter behind it (shoal.node.network)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from pathlib import Path

import pytest

import shoal
from shoal.node.network import BRIDGE, GATEWAY, mac_for
from tests.security.netlab import UDP_SINK, Internet

pytestmark = [pytest.mark.root]

# Run in the attacker: forge ARP replies/requests "VICTIM_IP is at MY_MAC" to the gateway for 4 s while
# sniffing every frame for UDP datagrams to the victim's port; print how many it caught.
ARP_ATTACK = r"""
import socket, struct, sys, time
victim_ip, port = sys.argv[1], int(sys.argv[2])
gw_ip = "10.89.0.1"
# learn the gateway's MAC: any datagram to it makes the kernel resolve it
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.sendto(b"x", (gw_ip, 9)); time.sleep(0.3)
gw_mac = next(bytes.fromhex(l.split()[3].replace(":", "")) for l in open("/proc/net/arp") if l.startswith(gw_ip + " "))
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
s.bind(("eth0", 0))
me = s.getsockname()[4]
def arp(op, dst_mac):
    return (dst_mac + me + struct.pack("!H", 0x0806) + struct.pack("!HHBBH", 1, 0x0800, 6, 4, op)
            + me + socket.inet_aton(victim_ip) + dst_mac + socket.inet_aton(gw_ip))
s.settimeout(0.05)
caught, end, nxt = 0, time.time() + 4.0, 0.0
while time.time() < end:
    if time.time() >= nxt:
        s.send(arp(2, gw_mac)); s.send(arp(1, b"\xff" * 6)); nxt = time.time() + 0.25
    try:
        f = s.recv(2048)
    except socket.timeout:
        continue
    if f[12:14] == b"\x08\x00" and f[23] == 17 and f[30:34] == socket.inet_aton(victim_ip):
        ihl = (f[14] & 15) * 4
        if struct.unpack("!H", f[14 + ihl + 2:14 + ihl + 4])[0] == port:
            caught += 1
print("caught", caught)
"""

# Run in the attacker: raw IPv4/UDP (IP_HDRINCL) with a chosen source address.
RAW_UDP = r"""
import socket, struct, sys
src, dst, port, payload = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].encode()
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
udp = struct.pack("!HHHH", 40000, port, 8 + len(payload), 0) + payload
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 1, 0, 64, 17, 0, socket.inet_aton(src), socket.inet_aton(dst))
for _ in range(3):
    s.sendto(ip + udp, (dst, 0))
print("sent")
"""

VICTIM_SINK = r"""
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 9999))
n = 0
while True:
    s.recvfrom(2048); n += 1
    open("/tmp/got", "w").write(str(n))
"""


def _neigh_mac(ip: str) -> str:
    out = subprocess.run(["ip", "neigh", "show", ip, "dev", "shoal0"], capture_output=True, text=True).stdout
    parts = out.split()
    return parts[parts.index("lladdr") + 1] if "lladdr" in parts else ""


async def test_arp_spoofing_cannot_steal_another_sandboxes_traffic(client: shoal.Client) -> None:
    victim = await client.create("base", network=True)
    attacker = await client.create("base", network=True)
    node = client.transport.node
    vip = node.record(victim.id).extra["ip"]
    vmac = (await victim.exec("cat /sys/class/net/eth0/address")).stdout.decode().strip()
    await victim.write_file("/tmp/sink.py", VICTIM_SINK.encode())
    await victim.exec("nohup python3 /tmp/sink.py >/dev/null 2>&1 &")
    host = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for _ in range(50):  # the sink is up and the host knows the victim's MAC
        host.sendto(b"hello", (vip, 9999))
        await asyncio.sleep(0.1)
        if (await victim.exec("cat /tmp/got 2>/dev/null")).stdout:
            break
    assert _neigh_mac(vip) == vmac
    before = int((await victim.exec("cat /tmp/got")).stdout)
    await attacker.write_file("/tmp/arp.py", ARP_ATTACK.encode())
    attack = asyncio.ensure_future(attacker.exec(["python3", "/tmp/arp.py", vip, "9999"], timeout=30))
    await asyncio.sleep(1.5)  # the forged ARP is flowing; the host's entry would have moved by now
    sent = 17
    for _ in range(sent):
        host.sendto(b"for the victim", (vip, 9999))
        await asyncio.sleep(0.1)
    r = await attack
    host.close()
    assert r.exit_code == 0, r.stderr
    assert r.stdout.decode().split() == ["caught", "0"]
    assert _neigh_mac(vip) == vmac
    for _ in range(20):
        got = int((await victim.exec("cat /tmp/got")).stdout) - before
        if got == sent:
            break
        await asyncio.sleep(0.1)
    assert got == sent


async def test_forged_source_addresses_never_leave_the_host(client: shoal.Client, tmp_path: Path) -> None:
    victim = await client.create("base", network=True)
    attacker = await client.create("base", network=True)
    vip = client.transport.node.record(victim.id).extra["ip"]
    aip = client.transport.node.record(attacker.id).extra["ip"]
    log = tmp_path / "sink.log"
    with Internet() as net:
        net.spawn(UDP_SINK, "5353", str(log), ready_file=log)
        await attacker.write_file("/tmp/raw.py", RAW_UDP.encode())
        for src, tag in (("203.0.113.7", "outsider"), (vip, "as-victim"), (aip, "honest")):
            r = await attacker.exec(["python3", "/tmp/raw.py", src, net.ip, "5353", tag])
            assert r.stdout == b"sent\n", r.stderr
        deadline = time.monotonic() + 5
        while "honest" not in log.read_text() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        got = log.read_text().splitlines()[1:]
    # the honest packet arrived, NATed to the host's address on the way out: the path works...
    assert [ln.split()[1] for ln in got].count("honest") == 3, got
    assert all(ln.split()[0] == net.host_ip for ln in got), got
    # ...and neither forged source got through (under its own address or NATed as the victim's)
    assert not [ln for ln in got if "outsider" in ln or "as-victim" in ln], got


async def test_the_gateway_mac_outlives_other_sandboxes(client: shoal.Client) -> None:
    """The bridge's MAC is fixed (mac_for(GATEWAY)): left to the kernel it follows the lowest port MAC and
    changed whenever that sandbox went, leaving every other sandbox's cached gateway MAC stale (this
    session saw it flip three times in a few minutes while other sandboxes came and went)."""
    a = await client.create("base", network=True)
    for _ in range(3):
        b = await client.create("base", network=True)
        await b.close()
    assert Path(f"/sys/class/net/{BRIDGE}/addr_assign_type").read_text().strip() == "3"  # set, not random
    mac = Path(f"/sys/class/net/{BRIDGE}/address").read_text().strip()
    assert mac == mac_for(GATEWAY)
    probe = (f"import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('{GATEWAY}', 9)); "
             "print(open('/proc/net/arp').read())")
    r = await a.exec(["python3", "-c", probe])
    assert mac in r.stdout.decode(), r.stdout
    await a.close()
