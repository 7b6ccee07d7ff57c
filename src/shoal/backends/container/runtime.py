"""OCI runtimes (crun, runc, runsc/gVisor): which ones work on this host, and how to drive them.

crun is preferred (a C program: starts a container several times faster than runc), but refuses hosts
with hybrid cgroups unless the hugetlb v1 hierarchy is mounted; runc works there. Whether a runtime
works is *probed* (a real tiny sandbox, started the way a create starts one), never assumed, and cached
per boot.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import socket
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shoal.backends.base import RuntimeStatus as RuntimeStatus
from shoal.config import Paths
from shoal.errors import BackendUnavailable, SandboxError
from shoal.host import cgroups
from shoal.host.spawn import Completed, run, run_sync

# crun and runc re-execute themselves from a private copy at every start (their defence against
# CVE-2019-5736: a container overwriting the host binary through /proc/self/exe) unless they already
# run from a sealed memfd. One sealed copy per node process saves that second exec, plus a bind mount
# and a lazy unmount, on every runtime call: `crun state` costs 2.0 ms of CPU instead of 4.3 ms here.
# The sealed_runtime setting (SHOAL_SEALED_RUNTIME=0) turns it off: a Node passes its settings' value to
# use_sealed() when it is made. (A host upgrade of the binary is picked up by a node restart.)
_MEMFD_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
_sealed: dict[tuple[int, str], str] = {}
_use_sealed = True


def use_sealed(enabled: bool) -> None:
    """Run crun/runc from a sealed in-memory copy (True, the default) or from the host binary."""
    global _use_sealed
    _use_sealed = bool(enabled)


_LINK_DIR = "/run/shoal-exec"


def _named_link(target: str, name: str) -> str:
    """A symlink `<dir>/<pid>/<name>` to `target`: exec'd through it, the process is called `name` in ps
    and perf (exec'd through /proc/<pid>/fd/N it would be called "N"). Links of dead pids are removed."""
    with contextlib.suppress(OSError):
        os.makedirs(_LINK_DIR, mode=0o700, exist_ok=True)
        for entry in os.scandir(_LINK_DIR):
            if entry.name.isdigit() and not os.path.exists(f"/proc/{entry.name}"):
                shutil.rmtree(entry.path, ignore_errors=True)
        d = os.path.join(_LINK_DIR, str(os.getpid()))
        os.makedirs(d, exist_ok=True)
        link = os.path.join(d, name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(link)
        os.symlink(target, link)
        return link
    return target


def sealed_executable(binary: str) -> str:
    """Path of a sealed in-memory copy of `binary` (/proc/<pid>/fd/N), or `binary` when that cannot work."""
    if not _use_sealed:
        return binary
    key = (os.getpid(), os.path.realpath(binary))
    path = _sealed.get(key)
    if path is not None:
        return path
    path = binary
    fd = -1
    try:
        fd = os.memfd_create(f"{os.path.basename(key[1])}_cloned:/proc/self/exe",
                             os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        with open(key[1], "rb") as src:
            size = os.fstat(src.fileno()).st_size
            off = 0
            while off < size:
                off += os.sendfile(fd, src.fileno(), off, size - off)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _MEMFD_SEALS)
        # the parent's fd table, not the child's: file actions of a spawn may reuse low fd numbers
        candidate = _named_link(f"/proc/{os.getpid()}/fd/{fd}", os.path.basename(key[1]))
        # memfds may be non-executable on this host (vm.memfd_noexec): check before relying on it
        ok = subprocess.run([os.path.basename(binary), "--version"], executable=candidate, capture_output=True,
                            timeout=10).returncode == 0
        if ok:
            path, fd = candidate, -1
    except (OSError, subprocess.SubprocessError):
        pass
    finally:
        if fd >= 0:
            os.close(fd)
    _sealed[key] = path
    return path


class OciRuntime:
    """Commands of one OCI runtime binary, run without blocking the event loop. Subclasses (one per
    registry entry, see shoal.backends.registry) say how their binary differs."""

    #: exec a sealed in-memory copy of the binary (see sealed_executable)
    sealed = False
    #: can run inside shoal's mount-namespace helper, which mounts the overlay (see shoal.host.mntns)
    overlay_helper = False
    #: `run --preserve-fds` hands the agent its listening socket (else the agent listens on a path in a
    #: directory bound into the sandbox, see ContainerBackend.create)
    passes_fds = True
    #: `kill --all` exists
    kill_all = True
    #: `pause` freezes the container's cgroup (the host's freezer), so the node can check it is frozen
    freezes_cgroup = True
    #: the /proc entries a bind mount may cover (None: any); the node masks the others with the runtime's
    #: own maskedPaths instead (see shoal.backends.container.oci.build_config)
    proc_binds: frozenset[str] | None = None
    #: mounts a tmpfs of its own at an empty /tmp unless the config mounts something there (see
    #: shoal.backends.container.oci.build_config's bind_tmp)
    own_tmp = False
    #: where the runtime keeps a container's state (root's default `--root`); None: only `delete` may remove it
    state_root: Path | None = None
    #: host tasks and memory (MiB) the runtime's own processes take inside the sandbox's cgroups (a
    #: user-space kernel's threads and heap): added to the cgroup limits so the sandbox keeps its own
    pids_overhead = 0
    memory_overhead_mb = 0
    #: the runtime enforces `pids` itself (as RLIMIT_NPROC in its own kernel); the host's pids cgroup is
    #: then only the backstop (see host_pids)
    own_pids_limit = False

    def host_pids(self, pids: int) -> int:
        """The host pids cgroup limit for a sandbox of `pids` processes."""
        return pids + self.pids_overhead

    def __init__(self, name: str, binary: str) -> None:
        self.name = name
        self.binary = binary
        self.global_args: list[str] = self.default_global_args()

    def default_global_args(self) -> list[str]:
        """Arguments this runtime needs before every subcommand."""
        return []

    def _argv(self, *args: str) -> list[str]:
        return [self.binary, *self.global_args, *args]

    @property
    def executable(self) -> str | None:
        """What to exec for this runtime: a sealed in-memory copy for crun/runc (see sealed_executable)."""
        if self.sealed and os.path.isabs(self.binary):
            return sealed_executable(self.binary)
        return None

    async def run_detached(self, bundle: Path, cid: str, listen_fd: int | None,
                           pid_file: Path | None = None,
                           overlay: tuple[str, str, str] | None = None, network: bool = False) -> Completed:
        """Start the container in the background, handing `listen_fd` to it as fd 3. With `overlay` =
        (mntns helper, rootfs, mount options), the runtime runs in a fresh mount namespace holding that
        overlay on the rootfs (shoal.host.mntns)."""
        args = ["run", "-d", "--bundle", str(bundle)]
        if pid_file is not None:
            args += ["--pid-file", str(pid_file)]
        fds = {}
        if listen_fd is not None:
            args += ["--preserve-fds", "1"]
            fds[3] = listen_fd
        args.append(cid)
        if overlay is not None:
            from shoal.host.mntns import wrap

            program = self.executable or shutil.which(self.binary) or self.binary
            exe, argv = wrap(*overlay, program, self._argv(*args))
            return await run(argv, fds=fds, timeout=60, executable=exe)
        return await run(self._argv(*args), fds=fds, timeout=60, executable=self.executable)

    async def kill(self, cid: str, sig: str = "KILL", all_procs: bool = False) -> Completed:
        """Send a signal to the container's init (or to every process with all_procs)."""
        args = ["kill"] + (["--all"] if all_procs and self.kill_all else []) + [cid, sig]
        return await run(self._argv(*args), timeout=30, executable=self.executable)

    async def delete(self, cid: str, force: bool = True) -> Completed:
        """Delete the container (and its cgroup); force kills it first."""
        return await run(self._argv("delete", *(["--force"] if force else []), cid), timeout=30,
                         executable=self.executable)

    async def state(self, cid: str) -> dict | None:
        """The runtime's state JSON, or None when the container does not exist."""
        r = await run(self._argv("state", cid), timeout=30, executable=self.executable)
        if r.returncode != 0:
            return None
        try:
            return json.loads(r.stdout)
        except ValueError:
            return None

    async def pause(self, cid: str) -> None:
        """Freeze every process of the container (cgroup freezer)."""
        (await run(self._argv("pause", cid), timeout=30, executable=self.executable)).check(f"{self.name} pause")

    async def resume(self, cid: str) -> None:
        """Thaw a paused container."""
        (await run(self._argv("resume", cid), timeout=30, executable=self.executable)).check(f"{self.name} resume")

    def list_ids(self) -> list[str]:
        """IDs of every container this runtime knows on the host."""
        r = run_sync(self._argv("list", "-q"), timeout=30)
        return [x for x in r.stdout.decode().split() if x] if r.returncode == 0 else []


class CrunRuntime(OciRuntime):
    """crun: a C runtime, the fastest to start a container; refuses hybrid cgroup hosts without hugetlb."""

    sealed = True
    overlay_helper = True
    state_root = Path("/run/crun")


class RuncRuntime(OciRuntime):
    """runc: the reference runtime (Go); works on hybrid cgroup hosts."""

    sealed = True
    overlay_helper = True
    # runc refuses a mount whose destination is inside /proc ("cannot be mounted because it is inside
    # /proc") except over the files LXCFS emulates. The other /proc masks go to maskedPaths, which runc
    # fills from the sandbox's own /dev/null (a node on its /dev tmpfs: no host facts in mountinfo, unlike
    # crun's bind of the host's devtmpfs one) and a read-only tmpfs per directory (one more superblock
    # per sandbox for each masked /proc directory the host has; crun shares one bound empty directory).
    # (Checked on runc 1.1.5; /proc/net/dev, also on runc's list, is refused: it resolves through /proc/net.)
    proc_binds = frozenset({"/proc/cpuinfo", "/proc/diskstats", "/proc/meminfo", "/proc/stat", "/proc/swaps",
                            "/proc/uptime", "/proc/loadavg", "/proc/slabinfo"})
    state_root = Path("/run/runc")


class GvisorRuntime(OciRuntime):
    """runsc (gVisor): a user-space kernel between the sandbox and the host, on the ptrace platform.

    Debian 12's runsc (a 2022 build) has no `--preserve-fds`: the agent listens on a path in a host
    directory bound into the sandbox, which `--host-uds=create` lets it create (the sandbox may create
    host sockets there, never open one). Its network is none, or the host kernel's sockets inside the
    sandbox's network namespace (see run_detached).

    runsc puts its sandbox (the sentry and, on ptrace, one stub process per address space) and its gofer
    into the container's cgroups and sets their limits from the config, on cgroup v1, hybrid and v2 hosts
    alike (issue 23: it used to run with `--ignore-cgroups` on hybrid hosts, and memory_mb=256 took 2.6 GiB,
    pids=128 ran 2,000 processes). Its own threads and heap count there too: `memory_overhead_mb` is added
    to the memory limit (an idle sandbox's sentry and gofer: 14-34 MiB), and `pids` is enforced inside
    gVisor as RLIMIT_NPROC with the host cgroup as a backstop (host_pids)."""

    kill_all = False
    freezes_cgroup = False  # pauses inside its own kernel
    passes_fds = False
    own_tmp = True
    pids_overhead = 256
    memory_overhead_mb = 64
    own_pids_limit = True

    def host_pids(self, pids: int) -> int:
        """On ptrace every process of the sandbox costs the host about 7-8 tasks (its stub process's
        threads and the sentry's tracers: 126 processes took 990 host tasks, measured), and the sentry
        and gofer hold 110-150 threads of their own. So the sandbox's `pids` is enforced inside gVisor
        (RLIMIT_NPROC: fork answers EAGAIN, as under crun's pids cgroup), and the host cgroup, sized for
        that, is the backstop (a sentry refused a thread dies: Go cannot survive it)."""
        return 8 * pids + self.pids_overhead

    def default_global_args(self) -> list[str]:
        """The platform on every call (ptrace works without KVM). shoal's seccomp profile is not applied
        inside the sentry (--oci-seccomp broke a local HTTP server in the suite): what it denies is
        host-kernel surface, and a gVisor sandbox's syscalls never reach the host kernel (its io_uring,
        for one, is the sentry's own); the sentry runs under gVisor's own host filter."""
        return ["--platform=ptrace", "--network=none"]

    async def run_detached(self, bundle: Path, cid: str, listen_fd: int | None,
                           pid_file: Path | None = None,
                           overlay: tuple[str, str, str] | None = None, network: bool = False) -> Completed:
        """`runsc run --detach`; its output goes to `bundle/runsc.log` (the sandbox keeps the runtime's
        stdio open: a pipe read to its end would wait for the sandbox to exit)."""
        # (a flag given twice: the last one counts) This runsc's own network stack cannot be used here: it
        # takes any namespace where /proc/sys/net/core/rmem_default exists for the host's, and Linux >= 5.x
        # shows it in every namespace ("cannot run with network enabled in root network namespace"). So it
        # runs inside the sandbox's namespace (nsenter) with --network=host: the host kernel's sockets, in
        # that namespace, behind the same bridge and nftables rules as crun's sandboxes.
        args = [*self.global_args, "--host-uds=create", *(["--network=host"] if network else []),
                "run", "--detach", "--bundle", str(bundle)]
        if pid_file is not None:
            args += ["--pid-file", str(pid_file)]
        args.append(cid)
        argv = [self.binary, *args]
        if network:
            ns = _netns_path(bundle)
            if ns:
                argv = ["nsenter", f"--net={ns}", "--", *argv]
        log = bundle / "runsc.log"
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            r = await run(argv, fds={1: fd, 2: fd}, timeout=60)
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            r.stderr = log.read_bytes()[-4000:]
            log.unlink()
        return r


def _netns_path(bundle: Path) -> str | None:
    """The network namespace path in a bundle's config.json (None: a new, empty one)."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        for ns in json.loads((bundle / "config.json").read_text())["linux"]["namespaces"]:
            if ns.get("type") == "network":
                return ns.get("path")
    return None


#: what a probe checks; a cached result of an older probe is not trusted (probed again)
_PROBE_VERSION = 3  # 3: gVisor without --ignore-cgroups (issue 23)


def _probe_key() -> str:
    # a probe stays valid until reboot, until the cgroup mounts change or a runtime is (un)installed
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    from shoal.backends.registry import RUNTIMES

    # an installed (or removed) runtime binary is probed again
    found = ",".join(shutil.which(e.binary) or "-" for e in RUNTIMES.values())
    return f"v{_PROBE_VERSION}|{boot}|{cgroups.cgroup_mode()}|{','.join(sorted(cgroups.v1_controllers()))}|{found}"


def probe_runtimes(paths: Paths, agent_bin: Path, refresh: bool = False) -> dict[str, RuntimeStatus]:
    """Probe crun, runc and runsc with a real minimal sandbox; cached in $SHOAL_HOME/run."""
    cache = paths.run / "runtime-probe.json"
    key = _probe_key()
    if not refresh:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            data = json.loads(cache.read_text())
            if data.get("key") == key:
                return {k: RuntimeStatus(**v) for k, v in data["runtimes"].items()}
    from shoal.backends.registry import RUNTIMES

    out = {name: _probe_one(name, paths, agent_bin) for name in RUNTIMES}
    paths.run.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        cache.write_text(json.dumps({"key": key, "runtimes": {k: asdict(v) for k, v in out.items()}}))
    return out


def _probe_one(name: str, paths: Paths, agent_bin: Path) -> RuntimeStatus:
    from shoal.backends.registry import RUNTIMES, make_runtime

    entry = RUNTIMES[name]
    binary = shutil.which(entry.binary)
    if not binary:
        return RuntimeStatus(name, None, False, reason=f"{entry.binary} not found on PATH", fix=entry.install,
                             host_ok=False)
    ver = run_sync([binary, "--version"], timeout=10).stdout.decode(errors="replace").splitlines()
    version = ver[0] if ver else ""
    if os.geteuid() != 0:
        return RuntimeStatus(name, binary, False, version, "not root", "run shoal as root", host_ok=False)
    if not agent_bin.exists():
        return RuntimeStatus(name, binary, False, version, f"agent binary {agent_bin} missing", "make agent",
                             host_ok=False)
    rt = make_runtime(name, binary)
    err = _probe_sandbox(rt, paths, agent_bin)
    if err is None:
        return RuntimeStatus(name, binary, True, version)
    # the runtime cannot start a sandbox as shoal makes them: does it run a plain container here at all?
    plain = _probe_plain(rt, paths, agent_bin)
    if plain is None:
        return RuntimeStatus(name, binary, False, version, f"runs a plain container but not shoal's sandbox: {err}",
                             "a shoal bug (the sandbox config or the way shoal runs this runtime): please "
                             "report it with this reason", host_ok=True)
    fix = ""
    if name == "crun" and cgroups.cgroup_mode() == "hybrid":
        fix = ("mount the hugetlb v1 hierarchy: `shoal doctor --fix` (runs "
               "mkdir -p /sys/fs/cgroup/hugetlb && mount -t cgroup -o hugetlb cgroup /sys/fs/cgroup/hugetlb)")
    return RuntimeStatus(name, binary, False, version, plain, fix, host_ok=False)


def _error_line(out: bytes, returncode: int) -> str:
    # the line that says what went wrong: runc and crun end with it, runsc puts it before its usage text
    lines = [ln.strip() for ln in out.decode(errors="replace").splitlines() if ln.strip()]
    marked = [ln for ln in lines if "error" in ln.lower() or "not defined" in ln or "cannot" in ln]
    return (marked or lines or [f"exit {returncode}"])[-1]


def _run_on_own_loop(coro: Any) -> Any:
    # the probe is synchronous and may be called on an event loop's thread (the first create): the runtime
    # call runs on a loop of its own in another thread
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _probe_sandbox(rt: OciRuntime, paths: Paths, agent_bin: Path) -> str | None:
    """Start a sandbox the way ContainerBackend.create does (same config builder, masks and /proc files,
    a bundle reached through a symlink, `run_detached` with a socket as fd 3); the agent only prints its
    version. None when it started, else the runtime's error."""
    from shoal.backends.container.guestfs import GuestFiles
    from shoal.backends.container.oci import build_config, render_config

    paths.run.mkdir(parents=True, exist_ok=True)
    cid = f"shoal-probe-{os.getpid()}-{rt.name}"
    cg_parent = f"/shoal-probe-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="probe-", dir=paths.run) as tmp:
        # sandbox directories are symlinks into a tmpfs (volatile.py): the bundle is reached the same way
        bundle = Path(tmp) / "link"
        (Path(tmp) / "dir").mkdir()
        os.symlink("dir", bundle)
        (bundle / "rootfs" / ".shoal").mkdir(parents=True)
        gf = GuestFiles(paths, agent_bin, root=Path(tmp) / "guest", tmpfs=False)
        gf.ensure()
        cfg = build_config(rootfs=str(bundle / "rootfs"), hostname="probe", env={"PATH": "/"}, cwd="/",
                           cgroups_path=f"{cg_parent}/{rt.name}", cpus=1, memory_mb=64 + rt.memory_overhead_mb,
                           pids=rt.host_pids(16),
                           proc_binds=rt.proc_binds, **gf.config_args(64))
        cfg["process"]["args"] = ["/.shoal/shoal-agent", "--version"]
        (bundle / "config.json").write_text(render_config(cfg))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            r = _run_on_own_loop(rt.run_detached(bundle, cid, sock.fileno(), pid_file=bundle / "init.pid"))
        finally:
            sock.close()
            run_sync([rt.binary, *rt.global_args, "delete", "--force", cid], timeout=30)
            # a cgroup parent of this process's own: node agents starting together (a cluster's, on one host)
            # probe at the same moment, and removing a shared parent may pull another's probe cgroup away
            # before its container joins it (that runtime would then look unusable to that node)
            cgroups.remove_tree(cg_parent)
    return None if r.returncode == 0 else _error_line(r.stderr or r.stdout, r.returncode)


def _probe_plain(rt: OciRuntime, paths: Paths, agent_bin: Path) -> str | None:
    """Run a plain container (no masks, no /proc files, the runtime's own `run`): None when the runtime
    works on this host at all, else its error."""
    from shoal.backends.container.oci import build_config

    paths.run.mkdir(parents=True, exist_ok=True)
    cid = f"shoal-probe-{os.getpid()}-{rt.name}"
    cg_parent = f"/shoal-probe-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="probe-", dir=paths.run) as tmp:
        bundle = Path(tmp)
        rootfs = bundle / "rootfs"
        (rootfs / ".shoal").mkdir(parents=True)
        guest = bundle / "guest"
        guest.mkdir()
        shutil.copy2(agent_bin, guest / "shoal-agent")
        cfg = build_config(rootfs=str(rootfs), guest_dir=str(guest), hostname="probe", env={"PATH": "/"},
                           cwd="/", cgroups_path=f"{cg_parent}/{rt.name}", cpus=1,
                           memory_mb=64 + rt.memory_overhead_mb, pids=rt.host_pids(16))
        cfg["process"]["args"] = ["/.shoal/shoal-agent", "--version"]
        (bundle / "config.json").write_text(json.dumps(cfg))
        r = run_sync([rt.binary, *rt.global_args, "run", "--bundle", str(bundle), cid], timeout=60)
        run_sync([rt.binary, *rt.global_args, "delete", "--force", cid], timeout=30)
        cgroups.remove_tree(cg_parent)
    return None if r.returncode == 0 else _error_line(r.stderr or r.stdout, r.returncode)


def pick_runtime(statuses: dict[str, RuntimeStatus], preference: str | None) -> OciRuntime:
    """The runtime to use for `preference` ('auto'/None: the first that works of the registry's auto
    order, crun then runc). Raises BackendUnavailable."""
    from shoal.backends.registry import auto_runtimes, make_runtime, runtime_names

    pref = preference or "auto"
    if pref == "auto":
        order = auto_runtimes()
        for name in order:
            st = statuses.get(name)
            if st and st.works and st.binary:
                return make_runtime(name, st.binary)
        reasons = "; ".join(f"{s.name}: {s.reason}" for s in statuses.values() if s.name in order)
        raise BackendUnavailable(f"no container runtime works on this host ({reasons}); run `shoal doctor`")
    st = statuses.get(pref)
    if st is None:
        raise BackendUnavailable(f"unknown runtime {pref!r}: choose {', '.join(runtime_names())}")
    if not st.works or not st.binary:
        raise BackendUnavailable(f"runtime {pref} does not work here: {st.reason}. {st.fix}".strip())
    return make_runtime(pref, st.binary)


def fix_hybrid_cgroups_for_crun() -> bool:
    """Mount the hugetlb v1 hierarchy crun needs on hybrid hosts. True when something was mounted."""
    if cgroups.cgroup_mode() != "hybrid" or "hugetlb" in cgroups.v1_controllers():
        return False
    if "hugetlb" not in cgroups.v1_available_controllers():
        raise SandboxError("the kernel has no hugetlb cgroup controller; crun cannot run here, runc can")
    target = Path("/sys/fs/cgroup/hugetlb")
    run_sync(["mount", "-o", "remount,rw", "/sys/fs/cgroup"], timeout=10)
    target.mkdir(exist_ok=True)
    run_sync(["mount", "-t", "cgroup", "-o", "hugetlb", "cgroup", str(target)], timeout=10, check=True)
    return True
