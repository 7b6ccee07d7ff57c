"""The node's DNS proxy for networked sandboxes (`network=True` and `network=[rules]`, shoal.egress).

One process per host, listening on the bridge's address (10.89.0.1:53, UDP and TCP); every networked
sandbox's resolv.conf names it (no host resolver configuration is bound into a sandbox). A query is
answered only for a sandbox of the network leases (found by its source address). An allowlist sandbox
gets answers only for names its rules allow; anything else gets NXDOMAIN, counted per sandbox; an
allowed answer's addresses are pinned into the sandbox's nftables set with the rule's ports *before*
the answer is sent, so the connection that follows is allowed. Every answer, for either kind, loses the
addresses of protected destinations (private, link-local, reserved, the cluster's own nodes; shoal.egress)
the sandbox is not granted: no DNS rebinding into the host's network. Allowed queries go to the upstream
resolver recorded in the sandbox's lease. AAAA queries get an empty answer (sandboxes have no IPv6), so
resolvers fall back to A at once.

It is started by the first networked sandbox (`ensure_running`) and exits by itself once no lease has
been left for `IDLE_EXIT_S`, so nothing is left running after the last one.

    python -m shoal.node.dnsproxy --leases /run/shoal/net-leases [--listen 10.89.0.1:53]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from shoal.egress import NEVER, EgressPolicy, merge_ranges, read_blocked, subtract_ranges
from shoal.fsutil import flocked

log = logging.getLogger("shoal.dnsproxy")

LISTEN = ("10.89.0.1", 53)
IDLE_EXIT_S = 20.0
UPSTREAM_TIMEOUT_S = 4.0
#: addresses pinned per sandbox at most (each is nftables set elements)
MAX_PINS = 4096
_A, _AAAA, _CNAME = 1, 28, 5
_NXDOMAIN, _SERVFAIL, _REFUSED = 3, 2, 5


# ---- DNS wire format (just what a forwarding filter needs) -------------------------------------------
def _read_name(msg: bytes, off: int) -> tuple[str, int]:
    """A (possibly compressed) name at `off`; returns it (lower case, no trailing dot) and the offset after."""
    labels: list[str] = []
    end = None
    for _ in range(128):  # bounded: a pointer loop in a hostile message ends here
        n = msg[off]
        if n & 0xC0 == 0xC0:
            if end is None:
                end = off + 2
            off = struct.unpack_from(">H", msg, off)[0] & 0x3FFF
            continue
        off += 1
        if n == 0:
            return ".".join(labels).lower(), end if end is not None else off
        labels.append(msg[off:off + n].decode("ascii", "replace"))
        off += n
    raise ValueError("name too long or looping")


def parse_question(msg: bytes) -> tuple[int, str, int]:
    """(id, qname, qtype) of a query with one question; ValueError when it is not one."""
    if len(msg) < 12:
        raise ValueError("short message")
    qid, flags, qd = struct.unpack_from(">HHH", msg, 0)
    if flags & 0x8000 or qd != 1:
        raise ValueError("not a single-question query")
    name, off = _read_name(msg, 12)
    qtype = struct.unpack_from(">H", msg, off)[0]
    return qid, name, qtype


def reply(query: bytes, rcode: int) -> bytes:
    """An answer to `query` with no records and this rcode (question copied)."""
    _, name_end = _read_name(query, 12)
    question = query[12:name_end + 4]
    flags = 0x8000 | 0x0080 | (struct.unpack_from(">H", query, 2)[0] & 0x0100) | rcode  # QR, RA, RD copied
    return query[:2] + struct.pack(">HHHHH", flags, 1, 0, 0, 0) + question


def _name_bytes(name: str) -> bytes:
    return b"".join(bytes([len(x)]) + x.encode("ascii", "replace") for x in name.split(".") if x) + b"\0"


def filter_answer(resp: bytes, keep: Any) -> tuple[bytes, list[str]]:
    """The answer with its A records whose address `keep(ip)` refuses removed; returns the new message and
    the IPv4 addresses kept. Records are rewritten without name compression (a removed record could be
    what a later one points into); authority and additional sections go (a stub resolver needs neither)."""
    _qid, flags, qd, an, _ns, _ar = struct.unpack_from(">HHHHHH", resp, 0)
    off = 12
    for _ in range(qd):
        _, off = _read_name(resp, off)
        off += 4
    question = resp[12:off]
    kept: list[bytes] = []
    ips: list[str] = []
    for _ in range(an):
        owner, off = _read_name(resp, off)
        rtype, rclass, ttl, rdlen = struct.unpack_from(">HHIH", resp, off)
        off += 10
        rdata = resp[off:off + rdlen]
        if rtype == _A and rdlen == 4:
            ip = socket.inet_ntoa(rdata)
            if not keep(ip):
                off += rdlen
                continue
            ips.append(ip)
        elif rtype == _CNAME:
            rdata = _name_bytes(_read_name(resp, off)[0])
        else:
            off += rdlen
            continue
        off += rdlen
        kept.append(_name_bytes(owner) + struct.pack(">HHIH", rtype, rclass, ttl, len(rdata)) + rdata)
    body = resp[:2] + struct.pack(">HHHHH", flags, qd, len(kept), 0, 0) + question + b"".join(kept)
    return body, ips


# ---- policy and pins ----------------------------------------------------------------------------------
class Leases:
    """The network leases (one file per sandbox address), cached by modification time."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._cache: dict[str, tuple[float, dict[str, Any] | None]] = {}
        self._blocked: tuple[int, list[tuple[int, int]]] | None = None

    def get(self, ip: str) -> dict[str, Any] | None:
        """The lease of a sandbox address (None: no such sandbox)."""
        p = self.root / ip
        try:
            mtime = p.stat().st_mtime
        except OSError:
            self._cache.pop(ip, None)
            return None
        hit = self._cache.get(ip)
        if hit is not None and hit[0] == mtime:
            return hit[1]
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            data = None
        data = data if isinstance(data, dict) else None
        self._cache[ip] = (mtime, data)
        return data

    def any_egress(self) -> bool:
        """True when some live lease is a networked sandbox this proxy answers."""
        with contextlib.suppress(OSError), os.scandir(self.root) as it:
            for e in it:
                if e.name.count(".") == 3 and (lease := self.get(e.name)) and _answered(lease):
                    return True
        return False

    def blocked(self) -> list[tuple[int, int]]:
        """The @infra addresses (the cluster's nodes, egress_deny) as integer ranges, re-read when changed."""
        d = self.root.parent / "net-blocked"
        try:
            key = d.stat().st_mtime_ns
        except OSError:
            return []
        if self._blocked is None or self._blocked[0] != key:
            nets = read_blocked(d)
            self._blocked = (key, [(int(n.network_address), int(n.broadcast_address)) for n in nets])
        return self._blocked[1]


def _answered(lease: dict[str, Any]) -> bool:
    return bool(lease.get("egress") or lease.get("open"))


_NEVER = [(int(n.network_address), int(n.broadcast_address)) for n in NEVER]


def pin(set_name: str, ip: str, ports: list[tuple[int, int]]) -> bool:
    """Allow `ip` on `ports` (TCP and UDP) in the sandbox's nftables set. False when nft refused."""
    elems = ", ".join(f"{ip} . {proto} . {lo}-{hi}" for lo, hi in ports for proto in ("tcp", "udp"))
    r = subprocess.run(["nft", "add", "element", "inet", "shoal", set_name, f"{{ {elems} }}"],
                       capture_output=True, timeout=10)
    return r.returncode == 0


class Proxy:
    """Answers the queries of networked sandboxes (see the module docstring)."""

    def __init__(self, leases: Path) -> None:
        self.leases = Leases(leases)
        #: sandbox address -> pinned address -> port ranges pinned for it
        self.pinned: dict[str, dict[str, list[tuple[int, int]]]] = {}
        self.stats: dict[str, dict[str, int]] = {}

    def _count(self, src: str, lease: dict[str, Any] | None, what: str) -> None:
        st = self.stats.setdefault(src, {"answered": 0, "refused": 0})
        st[what] = st.get(what, 0) + 1
        if lease is not None:
            # beside the lease, for `info()` of the sandbox (written rarely enough: once per query)
            with contextlib.suppress(OSError):
                tmp = self.leases.root / f".{src}.dns.tmp"
                tmp.write_text(json.dumps(st))
                os.replace(tmp, self.leases.root / f"{src}.dns")

    def _reachable(self, lease: dict[str, Any]) -> Any:
        # an address may be given to the sandbox unless it is protected and not granted to it (an
        # allowlist's grants are its CIDR rules)
        grants = [(int(b[0]), int(b[1])) for b in lease.get("grants") or []]
        blocked = self.leases.blocked()

        def keep(ip: str) -> bool:
            a = int(ipaddress.IPv4Address(ip))
            if any(lo <= a <= hi for lo, hi in _NEVER) or any(lo <= a <= hi for lo, hi in blocked):
                return any(lo <= a <= hi for lo, hi in grants)
            return True

        return keep

    async def answer(self, query: bytes, src: str) -> bytes | None:
        """The reply to one query from sandbox address `src` (None: not even a DNS query)."""
        try:
            _qid, qname, qtype = parse_question(query)
        except (ValueError, IndexError, struct.error):
            return None
        lease = self.leases.get(src)
        if not lease or not _answered(lease):
            return reply(query, _REFUSED)  # not a networked sandbox: this server is not its resolver
        egress = lease.get("egress")
        policy = EgressPolicy.from_dict(egress) if egress else None
        ports = policy.ports_for(qname) if policy is not None else []
        if policy is not None and not ports:
            self._count(src, lease, "refused")
            return reply(query, _NXDOMAIN)
        if qtype != _A:
            return reply(query, 0)  # AAAA and the rest: no records (IPv4 only), the resolver asks for A
        upstream = str(lease.get("dns_upstream") or "")
        try:
            resp = await _forward(query, upstream)
            filtered, ips = filter_answer(resp, self._reachable(lease))
        except (OSError, TimeoutError, ValueError, IndexError, struct.error):
            return reply(query, _SERVFAIL)
        if policy is not None:
            await self._pin(src, lease, policy, ips, ports)
        self._count(src, lease, "answered")
        return filtered

    async def _pin(self, src: str, lease: dict[str, Any], policy: EgressPolicy, ips: list[str],
                   ports: list[tuple[int, int]]) -> None:
        set_name = str(lease.get("egress_set") or "")
        done = self.pinned.setdefault(src, {})
        for ip in ips:
            if ip not in done and len(done) >= MAX_PINS:
                continue
            a = ipaddress.IPv4Address(ip)
            # only what is not in the set yet: nftables refuses an element overlapping one already there
            # (a CIDR rule's, or an earlier pin with other ports)
            have = [c.ports for c in policy.cidrs if a in c.net] + done.get(ip, [])
            need = subtract_ranges(ports, have)
            if not need:
                continue
            if await asyncio.to_thread(pin, set_name, ip, need):
                done[ip] = merge_ranges(done.get(ip, []) + need)


async def _forward(query: bytes, upstream: str) -> bytes:
    host, _, port = upstream.rpartition(":")
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[bytes] = loop.create_future()

    class _P(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: Any) -> None:
            if not fut.done():
                fut.set_result(data)

        def error_received(self, exc: Exception) -> None:
            if not fut.done():
                fut.set_exception(exc)

    transport, _ = await loop.create_datagram_endpoint(_P, remote_addr=(host or upstream, int(port or 53)))
    try:
        transport.sendto(query)
        return await asyncio.wait_for(fut, UPSTREAM_TIMEOUT_S)
    finally:
        transport.close()


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.transport: asyncio.DatagramTransport | None = None
        self.pending: set[asyncio.Future[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: Any) -> None:
        async def go() -> None:
            out = await self.proxy.answer(data, addr[0])
            if out is not None and self.transport is not None:
                self.transport.sendto(out, addr)

        fut = asyncio.ensure_future(go())
        self.pending.add(fut)
        fut.add_done_callback(self.pending.discard)


async def _tcp(proxy: Proxy, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    src = writer.get_extra_info("peername")[0]
    try:
        while True:
            n = struct.unpack(">H", await asyncio.wait_for(reader.readexactly(2), 10))[0]
            q = await asyncio.wait_for(reader.readexactly(n), 10)
            out = await proxy.answer(q, src)
            if out is None:
                break
            writer.write(struct.pack(">H", len(out)) + out)
            await writer.drain()
    except (asyncio.IncompleteReadError, TimeoutError, OSError):
        pass
    finally:
        writer.close()


async def serve(leases: Path, listen: tuple[str, int] = LISTEN, idle_exit_s: float = IDLE_EXIT_S) -> None:
    """Serve until no lease has had an allowlist for `idle_exit_s` seconds."""
    proxy = Proxy(leases)
    loop = asyncio.get_running_loop()
    udp, _ = await loop.create_datagram_endpoint(lambda: _Udp(proxy), local_addr=listen)
    tcp = await asyncio.start_server(lambda r, w: _tcp(proxy, r, w), listen[0], listen[1])
    idle_since = time.monotonic()
    try:
        while True:
            await asyncio.sleep(1.0)
            if proxy.leases.any_egress():
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > idle_exit_s:
                return
            # forget pins and counts of sandboxes that are gone (their nftables set went with them)
            for src in list(proxy.pinned):
                if proxy.leases.get(src) is None:
                    proxy.pinned.pop(src, None)
                    proxy.stats.pop(src, None)
    finally:
        udp.close()
        tcp.close()


# ---- starting it ---------------------------------------------------------------------------------------
def ensure_running(leases: Path) -> None:
    """Start the host's proxy unless one runs (a pid file under a lock beside the leases)."""
    run = leases.parent
    with flocked(run / "dns-proxy.lock"):
        pid_file = run / "dns-proxy.pid"
        with contextlib.suppress(OSError, ValueError):
            pid = int(pid_file.read_text())
            if _is_proxy(pid):
                return
        logf = open(run / "dns-proxy.log", "ab")  # noqa: SIM115 (handed to the child)
        try:
            p = subprocess.Popen([sys.executable, "-m", "shoal.node.dnsproxy", "--leases", str(leases)],
                                 stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True,
                                 close_fds=True)
        finally:
            logf.close()
        pid_file.write_text(str(p.pid))
        # it is ready once it listens; a create must not race its first query against the bind
        for _ in range(100):
            if _listening():
                return
            if p.poll() is not None:
                raise OSError(f"the DNS proxy exited at once (exit {p.returncode}); see {run / 'dns-proxy.log'}")
            time.sleep(0.05)


def _is_proxy(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"shoal.node.dnsproxy" in cmd


def _listening() -> bool:
    with contextlib.suppress(OSError), open("/proc/net/udp") as f:
        addr = struct.unpack("<I", socket.inet_aton(LISTEN[0]))[0]
        want = f"{addr:08X}:{LISTEN[1]:04X}"
        return any(line.split()[1] == want for line in f.readlines()[1:])
    return False


def stop_running(leases: Path) -> bool:
    """Stop the host's proxy (tests, teardown). True when one was stopped."""
    pid_file = leases.parent / "dns-proxy.pid"
    with contextlib.suppress(OSError, ValueError):
        pid = int(pid_file.read_text())
        if _is_proxy(pid):
            os.kill(pid, 15)
            return True
    return False


def main(argv: list[str] | None = None) -> None:
    """Entry point of `python -m shoal.node.dnsproxy`."""
    ap = argparse.ArgumentParser(prog="shoal-dnsproxy")
    ap.add_argument("--leases", required=True)
    ap.add_argument("--listen", default=f"{LISTEN[0]}:{LISTEN[1]}")
    ap.add_argument("--idle-exit", type=float, default=IDLE_EXIT_S)
    a = ap.parse_args(argv)
    host, _, port = a.listen.rpartition(":")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s dnsproxy %(message)s")
    asyncio.run(serve(Path(a.leases), (host, int(port)), a.idle_exit))


if __name__ == "__main__":
    main()
