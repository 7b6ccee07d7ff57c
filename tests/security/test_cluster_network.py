"""Item 1 of issue 23: a `network=True` sandbox reached the cluster's Ray (GCS, raylet, object manager)
and the other nodes, and through them every node.

The cluster is laid out the way it is deployed (netlab.RayMachines): the Ray head on a "machine" of its
own (a network namespace with an address in 198.18.0.0/15, which counts as public), one more worker with
its shoal node agent on another, and the host itself as the worker whose node agent makes the sandboxes.
An "office LAN" namespace holds servers on private addresses (RFC 1918, CGNAT), and a public server
shows the sandbox does have a network. From a network=True sandbox on the host worker, every address of
every node of the cluster answers nothing on any port (listening or not) nor to ping, and neither do the
private servers, unless the operator's policy grants them; a CIDR rule naming a cluster node or a private
range the policy does not grant is refused with a typed 403 naming the rule."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest

import shoal
from tests.security.netlab import HTTP_SERVER, Internet, RayMachines, listening_tcp

pytest.importorskip("ray")
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(900)]

#: the sandbox's probe: a non-blocking connect to every target at once; "timeout" means no packet came
#: back (an RST, "refused", means the packet reached the machine); then an ICMP echo to every address
PROBE = r"""
import errno, json, os, select, socket, struct, sys, time
targets, pings, wait = json.loads(sys.argv[1]), json.loads(sys.argv[2]), float(sys.argv[3])
res, pending = {}, {}
for ip, port in targets:
    s = socket.socket(); s.setblocking(False)
    s.connect_ex((ip, port))
    pending[s] = f"{ip}:{port}"
deadline = time.time() + wait
while pending and time.time() < deadline:
    _, w, _ = select.select([], list(pending), [], max(0.0, deadline - time.time()))
    for s in w:
        err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        res[pending.pop(s)] = "open" if err == 0 else errno.errorcode.get(err, str(err))
for s, key in pending.items():
    res[key] = "timeout"
def csum(b):
    b += b"\0" * (len(b) % 2); t = sum(struct.unpack(f"!{len(b) // 2}H", b)); t = (t >> 16) + (t & 0xffff)
    return ~(t + (t >> 16)) & 0xffff
icmp = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP); icmp.setblocking(False)
for i, ip in enumerate(pings):
    body = struct.pack("!BBHHH", 8, 0, 0, os.getpid() & 0xffff, i) + b"shoal"
    icmp.sendto(body[:2] + struct.pack("!H", csum(body)) + body[4:], (ip, 0))
answered = set()
deadline = time.time() + (2.0 if pings else 0.0)
while time.time() < deadline:
    r, _, _ = select.select([icmp], [], [], max(0.0, deadline - time.time()))
    if r:
        data, (src, _) = icmp.recvfrom(2048)
        if data[20] == 0:
            answered.add(src)
for ip in pings:
    res[f"ping {ip}"] = "answered" if ip in answered else "timeout"
print(json.dumps(res))
"""

#: private servers on the "office LAN": one per protected category a cluster's network would use
LAN = {"10.123.45.2": "private", "172.20.0.2": "private", "192.168.77.2": "private", "100.64.7.2": "cgnat"}


async def probe(sb: shoal.Sandbox, targets: list[tuple[str, int]], pings: list[str] = (),  # type: ignore[assignment]
                wait: float = 3.0) -> dict[str, str]:
    """What the sandbox reaches: {"ip:port": open|ECONNREFUSED|timeout|..., "ping ip": answered|timeout}."""
    await sb.write_file("/tmp/probe.py", PROBE.encode())
    r = await sb.exec(["python3", "/tmp/probe.py", json.dumps(targets), json.dumps(list(pings)), str(wait)],
                      timeout=120)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def _cluster_targets(rm: RayMachines) -> list[tuple[str, int]]:
    """Every listening TCP port of every node of the cluster on that node's address, plus ports nothing
    listens on (a machine that answers them with an RST was reached)."""
    out: set[tuple[str, int]] = set()
    for ip, ns in rm.machine_addresses():
        for host, port in listening_tcp(ns):
            if host in (ip, "*", "0.0.0.0"):
                out.add((ip, port))
        out.update((ip, p) for p in (1, 22, 80, 443, 6380, 8265, 10001, 65535))
    return sorted(out)


@pytest.fixture(scope="module")
def lab(shoal_home: Path, base_image: str):  # type: ignore[no-untyped-def]
    """The cluster (head + a worker on machines of their own, the host as a worker, node agents on both
    workers), an office LAN with private servers, a public server."""
    from shoal.cluster import control
    from shoal.config import Paths

    store = Paths.from_env().store
    home = shoal_home / "rc"
    with contextlib.ExitStack() as stack:
        public = stack.enter_context(Internet())
        public.spawn(HTTP_SERVER, "0.0.0.0", "8080")
        office = stack.enter_context(Internet())
        for ip in LAN:
            office.add_address(ip)
        for port in ("80", "8080"):
            office.spawn(HTTP_SERVER, "0.0.0.0", port)
        rm = stack.enter_context(RayMachines(workers=1))
        try:
            rep = control.up(rm.address, home=str(home), store=str(store), home_per_node=True)
            agents = {h["url"].split("//")[1].rsplit(":", 1)[0]: h for h in rep.started}
            assert set(agents) == {rm.host_ip, rm.machines[0].ip}, agents
            yield rm, agents[rm.host_ip], office, public
        finally:
            with contextlib.suppress(Exception):
                control.down(rm.address, force=True)
            import ray

            ray.shutdown()
            from shoal.node.teardown import teardown_home

            for d in sorted((home / "nodes").glob("*")) if (home / "nodes").exists() else []:
                with contextlib.suppress(Exception):
                    asyncio.run(teardown_home(Paths.from_env(d, store), close_sandboxes=True))


async def test_a_networked_sandbox_reaches_no_node_of_its_cluster(lab) -> None:  # type: ignore[no-untyped-def]
    rm, host_agent, _office, public = lab
    targets = _cluster_targets(rm)
    # the head's GCS and the other worker's node agent are among them (what the attack used)
    assert (rm.head.ip, RayMachines.GCS_PORT) in targets
    assert any(ip == rm.machines[0].ip for ip, _ in targets)
    async with shoal.Client(host_agent["url"], token=host_agent["token"]) as c:
        sb = await c.create("base", network=True, memory_mb=256)
        got = await probe(sb, [*targets, *((ip, 8080) for ip in LAN), (public.ip, 8080)],
                          [ip for ip, _ in rm.machine_addresses()] + list(LAN))
        assert got.pop(f"{public.ip}:8080") == "open"  # the sandbox has a network
        reached = {k: v for k, v in got.items() if v != "timeout"}
        assert not reached, f"a network=True sandbox reached {reached}"


async def test_the_operator_policy_decides_what_is_reachable(lab) -> None:  # type: ignore[no-untyped-def]
    rm, host_agent, _office, public = lab
    db = next(iter(LAN))
    async with shoal.Client(host_agent["url"], token=host_agent["token"]) as c:
        # a rule naming a cluster node or a private range outside the policy: a typed 403 naming the rule
        for rule in (f"{rm.head.ip}:{RayMachines.GCS_PORT}", f"{rm.machines[0].ip}/32", f"{db}:8080", "0.0.0.0/0",
                     "169.254.169.254/32:80"):
            with pytest.raises(shoal.EgressForbidden, match="network rule") as ei:
                await c.create("base", network=[rule], memory_mb=128)
            assert ei.value.details["rule"] == rule
        # granted (the agent's cluster token is an operator's: it passes egress_grants as they are)
        sb = await c.create("base", network=True, egress_grants=[f"{db}:8080"], memory_mb=256)
        got = await probe(sb, [(db, 8080), (db, 80), ("172.20.0.2", 8080), (rm.head.ip, RayMachines.GCS_PORT)])
        assert got == {f"{db}:8080": "open", f"{db}:80": "timeout", "172.20.0.2:8080": "timeout",
                       f"{rm.head.ip}:{RayMachines.GCS_PORT}": "timeout"}, got
        # an allowlist naming a granted private address with a port reaches exactly that port (item 4)
        al = await c.create("base", network=[f"{db}:8080"], egress_grants=["private"], memory_mb=256)
        got = await probe(al, [(db, 8080), (db, 80), (public.ip, 8080)])
        assert got == {f"{db}:8080": "open", f"{db}:80": "timeout", f"{public.ip}:8080": "timeout"}, got
