"""A MooseFS cluster for development and tests: a master and N chunkservers, each in its own network
namespace, FUSE-mounted on this host — a real distributed filesystem to put SHOAL_STORE on.

Layout (instance NAME, subnet 10.<a>.<b>.0/24 picked free at `up`):

    host  mfh-<tag> 10.a.b.1/30  ──veth──  10.a.b.2/30 eth0   netns shoal-mfs-NAME-m  (mfsmaster)
                                            10.a.b.(4i+1)/30 cs<i> ──veth── eth0 10.a.b.(4i+2)/30
                                                                     netns shoal-mfs-NAME-cs<i> (mfschunkserver)

MooseFS refuses loopback addresses for the chunkserver→master link, hence the namespaces. The master's
namespace forwards between its veths (ip_forward there only; the host's own setting is untouched), and
the host routes the chunkservers' /30s through it: the FUSE client talks to the master for metadata and
straight to the chunkservers for data, over these veths only — never the host's uplink.

Everything lives under one base directory (default /var/lib/shoal-moosefs/NAME): configs, the master's
metadata, chunk storage, logs, the mountpoint and `state.json`. `down` stops the daemons, unmounts, deletes
the namespaces (their veths go with them) and removes the directory.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shoal.errors import BackendUnavailable, InvalidRequest

DEFAULT_BASE = Path("/var/lib/shoal-moosefs")
MASTER_CLIENT_PORT = 9421
PACKAGES = "moosefs-master moosefs-chunkserver moosefs-client"
_BINARIES = ("mfsmaster", "mfschunkserver", "mfsmount")


@dataclass
class ChunkServer:
    """One chunkserver: its namespace, address and data directory."""

    index: int
    netns: str
    ip: str
    gateway: str
    data: str


@dataclass
class MooseFsCluster:
    """State of one dev cluster (saved in `<base>/state.json`)."""

    name: str
    base: str
    subnet: str
    master_netns: str
    master_ip: str
    host_ip: str
    host_veth: str
    mountpoint: str
    chunkservers: list[ChunkServer] = field(default_factory=list)
    #: the FUSE client's I/O retries before an error (mfsioretries; MooseFS' default is 30, minutes)
    io_retries: int = 4
    #: and the most seconds an I/O may wait before it fails (mfstimeout; MooseFS' default: no limit)
    io_timeout_s: int = 10

    @property
    def base_dir(self) -> Path:
        """The instance's base directory."""
        return Path(self.base)

    def to_dict(self) -> dict[str, object]:
        """JSON form (what `status --json` prints)."""
        return asdict(self)

    @classmethod
    def load(cls, base: Path) -> MooseFsCluster:
        """Read `<base>/state.json`; InvalidRequest when there is no such instance."""
        try:
            d = json.loads((base / "state.json").read_text())
        except FileNotFoundError:
            raise InvalidRequest(f"no MooseFS dev cluster at {base}: run `shoal store dev-moosefs up`") from None
        d["chunkservers"] = [ChunkServer(**c) for c in d.get("chunkservers", [])]
        return cls(**d)

    def save(self) -> None:
        """Write `<base>/state.json` (atomically)."""
        p = self.base_dir / "state.json"
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, p)


def _run(argv: list[str], check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise BackendUnavailable(f"{' '.join(argv)} failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-600:]}")
    return r


def _ns(netns: str, argv: list[str], check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return _run(["ip", "netns", "exec", netns, *argv], check=check, timeout=timeout)


def check_installed() -> None:
    """BackendUnavailable (with the apt command) unless the MooseFS binaries are installed."""
    missing = [b for b in _BINARIES if shutil.which(b) is None]
    if missing:
        raise BackendUnavailable(f"MooseFS is not installed ({', '.join(missing)} missing): "
                                 f"apt-get install {PACKAGES}")
    if not Path("/dev/fuse").exists():
        raise BackendUnavailable("/dev/fuse is missing: the MooseFS client needs FUSE (modprobe fuse)")


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = []
    r = _run(["ip", "-4", "-o", "addr", "show"], check=False)
    for line in r.stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            with contextlib.suppress(ValueError):
                out.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    r = _run(["ip", "-4", "route", "show"], check=False)
    for line in r.stdout.splitlines():
        with contextlib.suppress(ValueError, IndexError):
            if line.split()[0] != "default":
                out.append(ipaddress.ip_network(line.split()[0], strict=False))
    return out


def _free_subnet() -> ipaddress.IPv4Network:
    used = _used_networks()
    for b in range(16, 256):
        net = ipaddress.ip_network(f"10.250.{b}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise BackendUnavailable("no free /24 in 10.250.16.0/20 for a MooseFS dev cluster")


def _short(name: str) -> str:
    # interface names are at most 15 bytes: 'mfh-' + up to 11
    return name.replace("-", "")[:11]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _daemon_pid(data_dir: Path, daemon: str) -> int | None:
    """PID of a running MooseFS daemon from its lock file in its data directory."""
    lock = data_dir / f".{daemon}.lock"
    try:
        pid = int(lock.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None if _gone(pid) else pid


def master_cfg(c: MooseFsCluster) -> Path:
    """Path of the master's config file."""
    return c.base_dir / "master" / "mfsmaster.cfg"


def chunkserver_cfg(c: MooseFsCluster, cs: ChunkServer) -> Path:
    """Path of one chunkserver's config file."""
    return c.base_dir / f"cs{cs.index}" / "mfschunkserver.cfg"


def _configure(c: MooseFsCluster) -> None:
    base = c.base_dir
    mdir = base / "master"
    mdata = mdir / "data"
    mdata.mkdir(parents=True, exist_ok=True)
    empty = Path("/var/lib/mfs/metadata.mfs.empty")
    if not (mdata / "metadata.mfs").exists():
        if not empty.exists():
            raise BackendUnavailable(f"{empty} is missing: reinstall moosefs-master")
        shutil.copy(empty, mdata / "metadata.mfs")
    _write(mdir / "mfsexports.cfg", "* / rw,alldirs,maproot=0\n* . rw\n")
    _write(mdir / "mfstopology.cfg", "")
    _write(master_cfg(c), "\n".join([
        "WORKING_USER = root", "WORKING_GROUP = root", f"SYSLOG_IDENT = mfsmaster-{c.name}",
        f"DATA_PATH = {mdata}", f"EXPORTS_FILENAME = {mdir / 'mfsexports.cfg'}",
        f"TOPOLOGY_FILENAME = {mdir / 'mfstopology.cfg'}",
        f"MATOML_LISTEN_HOST = {c.master_ip}", f"MATOCS_LISTEN_HOST = {c.master_ip}",
        f"MATOCL_LISTEN_HOST = {c.master_ip}", "BACK_LOGS = 5", "METADATA_SAVE_FREQ = 1",
        # chunkservers that vanish are noticed quickly (outage tests), and replication starts soon
        "MATOCS_TIMEOUT = 10", "REPLICATIONS_DELAY_INIT = 5", "",
    ]))
    for cs in c.chunkservers:
        d = Path(cs.data)
        (d / "chunks").mkdir(parents=True, exist_ok=True)
        _write(d / "mfshdd.cfg", f"{d / 'chunks'}\n")
        _write(chunkserver_cfg(c, cs), "\n".join([
            "WORKING_USER = root", "WORKING_GROUP = root", f"SYSLOG_IDENT = mfscs-{c.name}-{cs.index}",
            f"DATA_PATH = {d}", f"HDD_CONF_FILENAME = {d / 'mfshdd.cfg'}",
            f"MASTER_HOST = {c.master_ip}", f"BIND_HOST = {cs.ip}", f"CSSERV_LISTEN_HOST = {cs.ip}",
            # a dev machine's disk is small: keep only 64 MiB free per chunkserver instead of 256 MiB
            "HDD_LEAVE_SPACE_DEFAULT = 64MiB", "MASTER_TIMEOUT = 10", "",
        ]))


def _netns_up(c: MooseFsCluster) -> None:
    net = ipaddress.ip_network(c.subnet)
    _run(["ip", "netns", "add", c.master_netns])
    _ns(c.master_netns, ["ip", "link", "set", "lo", "up"])
    _run(["ip", "link", "add", c.host_veth, "type", "veth", "peer", "name", "eth0", "netns", c.master_netns])
    _run(["ip", "addr", "add", f"{c.host_ip}/30", "dev", c.host_veth])
    _run(["ip", "link", "set", c.host_veth, "up"])
    _ns(c.master_netns, ["ip", "addr", "add", f"{c.master_ip}/30", "dev", "eth0"])
    _ns(c.master_netns, ["ip", "link", "set", "eth0", "up"])
    _ns(c.master_netns, ["ip", "route", "add", "default", "via", c.host_ip])
    # forwarding inside the master's namespace only: host <-> chunkservers
    _ns(c.master_netns, ["sysctl", "-qw", "net.ipv4.ip_forward=1"])
    for cs in c.chunkservers:
        _run(["ip", "netns", "add", cs.netns])
        _ns(cs.netns, ["ip", "link", "set", "lo", "up"])
        _ns(c.master_netns, ["ip", "link", "add", f"cs{cs.index}", "type", "veth", "peer", "name", "eth0",
                             "netns", cs.netns])
        _ns(c.master_netns, ["ip", "addr", "add", f"{cs.gateway}/30", "dev", f"cs{cs.index}"])
        _ns(c.master_netns, ["ip", "link", "set", f"cs{cs.index}", "up"])
        _ns(cs.netns, ["ip", "addr", "add", f"{cs.ip}/30", "dev", "eth0"])
        _ns(cs.netns, ["ip", "link", "set", "eth0", "up"])
        _ns(cs.netns, ["ip", "route", "add", "default", "via", cs.gateway])
        cs_net = ipaddress.ip_network(f"{cs.ip}/30", strict=False)
        _run(["ip", "route", "add", str(cs_net), "via", c.master_ip, "dev", c.host_veth])
    del net


def start_master(c: MooseFsCluster) -> None:
    """Start (or restart) the master daemon in its namespace."""
    _ns(c.master_netns, ["mfsmaster", "-c", str(master_cfg(c)), "-a", "start"], timeout=60)


def start_chunkserver(c: MooseFsCluster, cs: ChunkServer) -> None:
    """Start one chunkserver daemon in its namespace (it registers with the master)."""
    _ns(cs.netns, ["mfschunkserver", "-c", str(chunkserver_cfg(c, cs)), "start"], timeout=60)


def stop_chunkserver(c: MooseFsCluster, cs: ChunkServer, kill: bool = False) -> None:
    """Stop one chunkserver (kill=True: SIGKILL, as a crash; otherwise its own clean stop)."""
    pid = _daemon_pid(Path(cs.data), "mfschunkserver")
    if pid is None:
        return
    if kill:
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, 10)
        return
    _ns(cs.netns, ["mfschunkserver", "-c", str(chunkserver_cfg(c, cs)), "stop"], check=False, timeout=60)
    if not _wait_gone(pid, 30):
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, 10)


def stop_master(c: MooseFsCluster, kill: bool = False) -> None:
    """Stop the master (it saves its metadata first; kill=True: SIGKILL, as a crash)."""
    pid = _daemon_pid(c.base_dir / "master" / "data", "mfsmaster")
    if pid is None:
        return
    if kill:
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, 10)
        return
    _ns(c.master_netns, ["mfsmaster", "-c", str(master_cfg(c)), "stop"], check=False, timeout=60)
    if not _wait_gone(pid, 30):
        os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, 10)


def _gone(pid: int) -> bool:
    """True when `pid` has exited (a zombie waiting for its parent to reap it counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _wait_gone(pid: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _gone(pid):
            return True
        time.sleep(0.02)
    return False


def _wait_chunkservers(c: MooseFsCluster, want: int, timeout: float = 30.0) -> None:
    """Wait until `want` chunkservers hold a connection to the master (counted from the master's
    namespace); a chunkserver that exited meanwhile is started again (right after a crash the master
    may still hold its old session and turn the new one away)."""
    end = time.monotonic() + timeout
    up = 0
    while time.monotonic() < end:
        r = _ns(c.master_netns, ["ss", "-Htn", "state", "established", "( sport = :9420 )"], check=False)
        up = len([line for line in r.stdout.splitlines() if line.strip()])
        if up >= want:
            return
        for cs in c.chunkservers:
            if _daemon_pid(Path(cs.data), "mfschunkserver") is None:
                with contextlib.suppress(BackendUnavailable):
                    start_chunkserver(c, cs)
        time.sleep(0.2)
    raise BackendUnavailable(f"only {up} of {want} MooseFS chunkservers registered with the master "
                             f"within {timeout:.0f} s; see {c.base_dir}/*/")


def mount(c: MooseFsCluster) -> None:
    """FUSE-mount the cluster at its mountpoint (via the host's veth into the master's namespace)."""
    mp = Path(c.mountpoint)
    if is_mounted(mp):
        return  # (a stat of it could fail while the master restarts)
    mp.mkdir(parents=True, exist_ok=True)
    _run(["mfsmount", str(mp), "-H", c.master_ip, "-P", str(MASTER_CLIENT_PORT),
          # bounded retries: a read while the chunkservers are gone fails after a few seconds, not minutes
          "-o", f"mfsioretries={c.io_retries}", "-o", f"mfstimeout={c.io_timeout_s}",
          "-o", "mfsmkdircopysgid=0"], timeout=60)


def wait_space(c: MooseFsCluster, timeout: float = 30.0) -> None:
    """Wait until the chunkservers have reported free space to the master (until then writes get ENOSPC)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(OSError):
            st = os.statvfs(c.mountpoint)
            if st.f_bavail * st.f_frsize > 64 << 20:
                return
        time.sleep(0.1)
    raise BackendUnavailable(f"the MooseFS chunkservers of '{c.name}' reported no free space within {timeout:.0f} s")


def unmount(c: MooseFsCluster) -> None:
    """Unmount the FUSE client (lazily when busy) and wait for mfsmount to exit."""
    mp = Path(c.mountpoint)
    if is_mounted(mp):
        r = _run(["umount", str(mp)], check=False)
        if r.returncode != 0:
            _run(["umount", "-l", str(mp)], check=False)
    for pid in _mfsmount_pids(mp):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not _wait_gone(pid, 10):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 5)


def _mfsmount_pids(mp: Path) -> list[int]:
    out = []
    target = str(mp).encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # mfsmount rewrites its command line to "mfsmount (mounted on: PATH)"
        if argv and argv[0].split(b" ")[0].endswith(b"mfsmount") and \
                (target in argv or argv[0].endswith(b"(mounted on: " + target + b")")):
            out.append(int(d.name))
    return out


def is_mounted(mp: Path) -> bool:
    """True when `mp` is a mountpoint (from /proc/self/mountinfo, without touching the FUSE mount)."""
    p = os.path.realpath(mp)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == p for line in f)


def up(name: str = "dev", base: Path | None = None, chunkservers: int = 2, io_retries: int = 4) -> MooseFsCluster:
    """Start a cluster named `name` (or return the running one): namespaces, daemons, FUSE mount."""
    check_installed()
    if not 1 <= chunkservers <= 16:
        raise InvalidRequest(f"chunkservers={chunkservers} must be between 1 and 16")
    if not name.replace("-", "").isalnum() or len(name) > 16:
        raise InvalidRequest(f"cluster name {name!r}: use up to 16 letters, digits or '-'")
    basedir = (base or DEFAULT_BASE) / name
    if (basedir / "state.json").exists():
        c = MooseFsCluster.load(basedir)
        if Path(f"/run/netns/{c.master_netns}").exists():
            ensure_running(c)
            return c
        down(name, base)  # left over by a crashed run: start clean
    basedir.mkdir(parents=True, exist_ok=True)
    net = _free_subnet()
    hosts = list(net.hosts())  # .1 ... .254
    tag = _short(name)
    c = MooseFsCluster(
        name=name, base=str(basedir), subnet=str(net), master_netns=f"shoal-mfs-{name}-m",
        master_ip=str(hosts[1]), host_ip=str(hosts[0]), host_veth=f"mfh-{tag}",
        mountpoint=str(basedir / "mnt"), io_retries=io_retries)
    for i in range(1, chunkservers + 1):
        c.chunkservers.append(ChunkServer(index=i, netns=f"shoal-mfs-{name}-cs{i}", ip=str(hosts[4 * i]),
                                          gateway=str(hosts[4 * i - 1]), data=str(basedir / f"cs{i}")))
    c.save()
    try:
        _configure(c)
        _netns_up(c)
        start_master(c)
        for cs in c.chunkservers:
            start_chunkserver(c, cs)
        _wait_chunkservers(c, len(c.chunkservers))
        mount(c)
        wait_space(c)
    except BaseException:
        down(name, base)
        raise
    return c


def ensure_running(c: MooseFsCluster) -> None:
    """Start whatever part of an existing cluster is not running (master, chunkservers, mount)."""
    if _daemon_pid(c.base_dir / "master" / "data", "mfsmaster") is None:
        start_master(c)
    started = False
    for cs in c.chunkservers:
        if _daemon_pid(Path(cs.data), "mfschunkserver") is None:
            start_chunkserver(c, cs)
            started = True
    if started:
        _wait_chunkservers(c, len(c.chunkservers))
    mount(c)
    wait_space(c)


def status(name: str = "dev", base: Path | None = None) -> dict[str, object]:
    """What runs of cluster `name`: daemons' PIDs, the mount, and the addresses."""
    c = MooseFsCluster.load((base or DEFAULT_BASE) / name)
    return {
        "name": c.name, "mountpoint": c.mountpoint, "mounted": is_mounted(Path(c.mountpoint)),
        "master": {"netns": c.master_netns, "ip": c.master_ip,
                   "pid": _daemon_pid(c.base_dir / "master" / "data", "mfsmaster")},
        "chunkservers": [{"netns": cs.netns, "ip": cs.ip, "pid": _daemon_pid(Path(cs.data), "mfschunkserver")}
                         for cs in c.chunkservers],
        "host_veth": c.host_veth, "subnet": c.subnet,
    }


def down(name: str = "dev", base: Path | None = None) -> None:
    """Tear a cluster down completely: mount, daemons, routes, namespaces (and their veths), files."""
    basedir = (base or DEFAULT_BASE) / name
    try:
        c = MooseFsCluster.load(basedir)
    except InvalidRequest:
        shutil.rmtree(basedir, ignore_errors=True)
        return
    unmount(c)
    for cs in c.chunkservers:
        with contextlib.suppress(Exception):
            stop_chunkserver(c, cs, kill=True)
    with contextlib.suppress(Exception):
        stop_master(c, kill=True)  # its metadata is deleted below: no need to save it
    for cs in c.chunkservers:
        _run(["ip", "netns", "del", cs.netns], check=False)
    _run(["ip", "netns", "del", c.master_netns], check=False)  # its veth pairs (host side too) go with it
    _run(["ip", "link", "del", c.host_veth], check=False)
    if not is_mounted(Path(c.mountpoint)):
        shutil.rmtree(basedir, ignore_errors=True)


def chunkserver_tx_bytes(c: MooseFsCluster) -> int:
    """Bytes the chunkservers have sent so far (their veths' counters): what clients fetched from them."""
    total = 0
    for cs in c.chunkservers:
        r = _ns(cs.netns, ["cat", "/sys/class/net/eth0/statistics/tx_bytes"], check=False)
        with contextlib.suppress(ValueError):
            total += int(r.stdout.strip())
    return total
