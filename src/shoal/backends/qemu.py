"""QEMU as a VMM: the command line of a sandbox VM, launching it detached, and a small QMP client.

A VM's QEMU is started through `setsid -f`, so it is nobody's child: a node agent that dies leaves its VMs
running, and the next one finds them by the pid in the record and reaches them again through the Unix
sockets in the sandbox directory (crash-only, like containers). QEMU runs under its own seccomp filter
(`-sandbox on,…,spawn=deny`): it cannot exec, setuid or change scheduling, so migrations go to file
descriptors handed over QMP rather than to `exec:` commands.

    $SANDBOX_DIR/agent.sock    virtio-serial port `shoal.agent` (the in-sandbox agent, one byte stream)
    $SANDBOX_DIR/qmp.sock      QMP (stop/cont, balloon, migration to a file)
    $SANDBOX_DIR/console.log   the guest's serial console (kernel and init messages; shown when boot fails)
    $SANDBOX_DIR/qemu.pid      QEMU's pid
    $SANDBOX_DIR/qemu.log      QEMU's own stderr (startup errors)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shoal.config import Settings
from shoal.errors import BackendUnavailable, SandboxError, Timeout
from shoal.host.oom import SANDBOX_OOM_SCORE_ADJ
from shoal.records import proc_starttime

QEMU_BIN = "qemu-system-x86_64"
_SUN_PATH_MAX = 107


def find_qemu(s: Settings) -> str:
    """The QEMU binary (setting qemu, else qemu-system-x86_64 on PATH); BackendUnavailable when missing."""
    given = s.qemu
    q = str(given) if given else shutil.which(QEMU_BIN)
    if not q or not os.access(q, os.X_OK):
        raise BackendUnavailable(
            "QEMU is not installed, so the microvm and vm backends cannot run: apt-get install qemu-system-x86 "
            "qemu-utils (scripts/setup.sh does it), or set SHOAL_QEMU to a qemu-system-x86_64 binary")
    return q


def qemu_usable(s: Settings) -> tuple[bool, str]:
    """(usable, why): a QEMU binary (the VMM registry's probe; QEMU runs without KVM too, under TCG)."""
    try:
        return True, f"qemu at {find_qemu(s)}"
    except BackendUnavailable as e:
        return False, str(e)


def host_tsc_khz() -> int | None:
    """The host's TSC frequency: under TCG the guest reads the host's TSC, and with no PIT calibration on
    the microvm machine the kernel must be told the rate (tsc_early_khz)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError, IndexError):
        pass
    return None


@dataclass
class Drive:
    """One virtio-blk disk."""

    id: str
    path: str
    format: str = "raw"
    readonly: bool = False
    serial: str = ""


@dataclass
class MachineConfig:
    """Everything that determines a VM's device model. Stored in the sandbox record; a memory snapshot
    can only be restored into a QEMU started from the same config (with other file paths)."""

    machine: str  # "microvm" | "q35"
    accel: str  # "kvm" | "tcg"
    cpus: int
    memory_mb: int
    kernel: str
    initrd: str | None
    cmdline: str
    drives: list[Drive] = field(default_factory=list)
    network: bool = False
    balloon: bool = True
    tb_mb: int = 0  # TCG translation cache (0 = QEMU's default)
    #: "memfd": guest RAM in a memfd (shmem: no transparent huge pages, so an idle guest's scattered pages
    #: are not rounded up to 2 MiB each); "anon": QEMU's default anonymous memory (THP where enabled);
    #: "ksm": private anonymous memory marked mergeable, so KSM stores identical guest pages once
    #: (shoal.host.ksm; it splits huge pages where it merges)
    ram: str = "memfd"

    def to_dict(self) -> dict[str, Any]:
        """JSON form for the record."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MachineConfig:
        """Inverse of to_dict."""
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        d["drives"] = [Drive(**x) for x in d.get("drives", [])]
        return cls(**d)


def sandbox_files(d: Path) -> dict[str, Path]:
    """The per-VM files in a sandbox directory."""
    return {"agent": d / "agent.sock", "qmp": d / "qmp.sock", "console": d / "console.log", "pid": d / "qemu.pid"}


def check_socket_paths(d: Path) -> None:
    """Unix socket paths are limited to 107 bytes: fail early with the fix."""
    from shoal.errors import InvalidRequest

    p = sandbox_files(d)["agent"]
    if len(str(p)) > _SUN_PATH_MAX:
        raise InvalidRequest(f"SHOAL_HOME path too long for a Unix socket ({p}); use a shorter one")


def qemu_argv(qemu: str, cfg: MachineConfig, d: Path, *, incoming: bool = False, seccomp: bool = True) -> list[str]:
    """The full QEMU command line of one sandbox VM (detached; sockets and console in `d`)."""
    f = sandbox_files(d)
    mmio = cfg.machine == "microvm"
    dev = (lambda name: f"{name}-device") if mmio else (lambda name: f"{name}-pci")
    # microvm: ACPI describes the virtio-mmio devices (Debian's kernel ignores them on the command line);
    # rtc on for a wall clock; no option ROMs, no PCI
    machine = "microvm,x-option-roms=off,rtc=on,isa-serial=on,acpi=on,pcie=off" if mmio else "q35"
    accel = "kvm" if cfg.accel == "kvm" else ("tcg" + (f",tb-size={cfg.tb_mb}" if cfg.tb_mb else ""))
    argv = [
        qemu, "-name", f"shoal-{d.name}", "-M", machine, "-accel", accel,
        "-cpu", "host" if cfg.accel == "kvm" else "max", "-smp", str(cfg.cpus), "-m", f"{cfg.memory_mb}M",
        "-nodefaults", "-no-user-config", "-display", "none", "-vga", "none", "-no-reboot",
        "-kernel", cfg.kernel, "-append", cfg.cmdline,
        "-chardev", f"file,id=console,path={f['console']}", "-serial", "chardev:console",
        "-chardev", f"socket,id=agent,path={f['agent']},server=on,wait=off",
        "-device", dev("virtio-serial"), "-device", "virtserialport,chardev=agent,name=shoal.agent",
        "-qmp", f"unix:{f['qmp']},server=on,wait=off",
    ]
    if seccomp:
        # QEMU runs as root and parses what the guest does: confine it with its seccomp filter (no exec,
        # no setuid, no scheduler/affinity changes, no obsolete syscalls). Migration therefore goes to a
        # file descriptor we pass in (migrate_fd), never to an `exec:` command.
        argv += ["-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]
    if cfg.ram == "memfd":
        argv += ["-object", f"memory-backend-memfd,id=ram0,size={cfg.memory_mb}M,share=on",
                 "-machine", "memory-backend=ram0"]
    elif cfg.ram == "ksm":
        argv += ["-object", f"memory-backend-ram,id=ram0,size={cfg.memory_mb}M,merge=on,share=off",
                 "-machine", "memory-backend=ram0"]
    if cfg.initrd:
        argv += ["-initrd", cfg.initrd]
    for drv in cfg.drives:
        opts = f"if=none,id={drv.id},file={drv.path},format={drv.format},cache=writeback,aio=threads"
        if drv.readonly:
            opts += ",readonly=on"
        else:
            opts += ",discard=unmap"
        argv += ["-drive", opts, "-device", f"{dev('virtio-blk')},drive={drv.id}" +
                 (f",serial={drv.serial}" if drv.serial else "")]
    if cfg.balloon:
        # free page reporting hands pages the guest frees back to the host while it runs; the balloon
        # itself is inflated on pause; deflate-on-oom lets a guest under pressure take memory back
        argv += ["-device", f"{dev('virtio-balloon')},id=balloon0,free-page-reporting=on,deflate-on-oom=on"]
    if cfg.network:
        argv += ["-netdev", "user,id=net0", "-device", f"{dev('virtio-net')},netdev=net0"]
    if incoming:
        argv += ["-incoming", "defer", "-S"]
    return argv


def console_tail(d: Path, nbytes: int = 3000) -> str:
    """The last lines of the guest's serial console, cleaned for an error message."""
    p = sandbox_files(d)["console"]
    try:
        with open(p, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - nbytes))
            data = fh.read()
    except OSError:
        return "(no console output)"
    text = data.decode(errors="replace").replace("\r", "")
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if size > nbytes and lines:
        lines = lines[1:]  # the first one is probably cut
    return "\n".join(lines[-25:]) or "(no console output)"


def console_fatal(d: Path) -> str | None:
    """The guest init's FATAL line, or a kernel panic line, if the console has one."""
    p = sandbox_files(d)["console"]
    try:
        data = p.read_bytes()[-20000:].decode(errors="replace")
    except OSError:
        return None
    for pat in (r"shoal-init: FATAL: [^\r\n]*", r"Kernel panic - [^\r\n]*"):
        m = re.search(pat, data)
        if m:
            return m.group(0)
    return None


# `setsid -f` forks, so QEMU is nobody's child (it outlives this process) and leads its own session; the
# shell records its own pid (which exec makes QEMU's) before anything can fail. QEMU's -daemonize is not
# used: its fork+setsid happen after the seccomp filter is installed, which then forbids them.
# (a VM is a sandbox: its QEMU runs at the sandboxes' OOM score, not the node agent's, see shoal.host.oom)
_LAUNCH = ('echo $$ > "$1"; log="$2"; echo "$3" > /proc/self/oom_score_adj 2>/dev/null; shift 3; '
           'exec "$@" >> "$log" 2>&1 < /dev/null')


async def launch(argv: list[str], d: Path, timeout: float = 60.0) -> tuple[int, int]:
    """Start QEMU detached; returns (pid, starttime) once its monitor answers (or raises with its stderr)."""
    from shoal.host.spawn import run

    f = sandbox_files(d)
    log = d / "qemu.log"
    r = await run(["setsid", "-f", "/bin/sh", "-c", _LAUNCH, "sh", str(f["pid"]), str(log),
                   str(SANDBOX_OOM_SCORE_ADJ), *argv], timeout=30)
    if r.returncode != 0:
        raise SandboxError(f"could not start QEMU: {r.stderr.decode(errors='replace').strip()[-500:]}")
    deadline = time.monotonic() + timeout
    pid = 0
    start: int | None = None
    while True:
        if not pid:
            with contextlib.suppress(OSError, ValueError):
                pid = int(f["pid"].read_text().strip())
                start = proc_starttime(pid)
        if pid and proc_starttime(pid) is None:
            msg = ""
            with contextlib.suppress(OSError):
                msg = log.read_text(errors="replace").strip()
            raise SandboxError(f"QEMU could not start the VM: {msg[-1500:] or 'it exited at once'}")
        if pid and start and f["qmp"].exists():
            try:
                q = await Qmp.connect(f["qmp"], timeout=max(1.0, deadline - time.monotonic()))
            except SandboxError:
                pass
            else:
                await q.close()
                return pid, start
        if time.monotonic() > deadline:
            if pid:
                await kill_and_wait(pid, start)
            raise Timeout(f"QEMU did not come up within {timeout:.0f}s")
        await asyncio.sleep(0.005)


def qemu_pid_for(d: Path) -> int | None:
    """The pid of a live QEMU whose pid file is in `d` and whose command line names `d` (crash leftovers)."""
    try:
        pid = int(sandbox_files(d)["pid"].read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if str(d).encode() in cmdline else None


async def kill_and_wait(pid: int, start: int | None, timeout: float = 10.0) -> bool:
    """SIGKILL a QEMU and wait until it is gone (it is not our child: poll /proc). True when gone."""
    if start is None:
        start = proc_starttime(pid)
        if start is None:
            return True
    if proc_starttime(pid) != start:
        return True
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc_starttime(pid) != start:
            return True
        await asyncio.sleep(0.01)
    return False


# ---- QMP -----------------------------------------------------------------------------------------
class QmpError(SandboxError):
    """QEMU answered a QMP command with an error."""


class Qmp:
    """A QMP connection (one command at a time). QEMU serves one client per socket: keep it short."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.events: list[dict[str, Any]] = []

    @classmethod
    async def connect(cls, path: Path, timeout: float = 10.0) -> Qmp:
        """Connect, read the greeting and enter command mode."""
        try:
            r, w = await asyncio.wait_for(asyncio.open_unix_connection(str(path), limit=1 << 22), timeout)
        except (OSError, TimeoutError) as e:
            raise SandboxError(f"cannot reach QEMU's monitor at {path}: {e or 'timeout'}") from e
        q = cls(r, w)
        try:
            await asyncio.wait_for(q._read(), timeout)  # greeting
            await q.execute("qmp_capabilities", timeout=timeout)
        except BaseException:
            await q.close()
            raise
        return q

    async def _read(self) -> dict[str, Any]:
        line = await self.reader.readline()
        if not line:
            raise SandboxError("QEMU closed its monitor connection (did the VM exit?)")
        return json.loads(line)

    async def execute(self, command: str, arguments: dict[str, Any] | None = None, timeout: float = 60.0) -> Any:
        """Run one QMP command; returns its `return` value or raises QmpError."""
        msg: dict[str, Any] = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        self.writer.write(json.dumps(msg).encode() + b"\r\n")
        await self.writer.drain()

        async def answer() -> Any:
            while True:
                m = await self._read()
                if "event" in m:
                    self.events.append(m)
                    continue
                if "error" in m:
                    err = m["error"]
                    raise QmpError(f"QEMU refused {command}: {err.get('desc', err)}")
                return m.get("return")

        try:
            return await asyncio.wait_for(answer(), timeout)
        except TimeoutError as e:
            raise Timeout(f"QEMU did not answer {command} within {timeout}s") from e

    async def close(self) -> None:
        """Close the connection."""
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


@contextlib.asynccontextmanager
async def qmp(d: Path, timeout: float = 10.0) -> AsyncIterator[Qmp]:
    """`async with qmp(sandbox_dir) as q: await q.execute(...)`."""
    q = await Qmp.connect(sandbox_files(d)["qmp"], timeout)
    try:
        yield q
    finally:
        await q.close()


def _qmp_line(f: Any) -> dict[str, Any]:
    line = f.readline()
    if not line:
        raise SandboxError("QEMU closed its monitor connection (did the VM exit?)")
    return json.loads(line)


def _qmp_sync(sock: socket.socket, f: Any, command: str, arguments: dict[str, Any] | None = None,
              fds: list[int] | None = None) -> Any:
    msg: dict[str, Any] = {"execute": command}
    if arguments:
        msg["arguments"] = arguments
    data = json.dumps(msg).encode() + b"\r\n"
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)
    while True:
        m = _qmp_line(f)
        if "event" in m:
            continue
        if "error" in m:
            raise QmpError(f"QEMU refused {command}: {m['error'].get('desc', m['error'])}")
        return m.get("return")


def migrate_fd(d: Path, file: Path, *, incoming: bool, timeout: float) -> dict[str, Any]:
    """Save the VM's state to `file` (or load it into a QEMU started with `-incoming defer`) through a file
    descriptor handed to QEMU over QMP (SCM_RIGHTS): works under QEMU's seccomp sandbox, which forbids the
    `exec:` migration transport. Blocking: run it in a thread; the VM must be stopped when saving."""
    fh = open(file, "rb" if incoming else "wb")  # noqa: SIM115 - closed below, after QEMU took its own copy
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(str(sandbox_files(d)["qmp"]))
        f = sock.makefile("rb")
        _qmp_line(f)  # greeting
        _qmp_sync(sock, f, "qmp_capabilities")
        _qmp_sync(sock, f, "getfd", {"fdname": "shoal-migration"}, fds=[fh.fileno()])
        if incoming:
            _qmp_sync(sock, f, "migrate-incoming", {"uri": "fd:shoal-migration"})
        else:
            _qmp_sync(sock, f, "migrate-set-parameters", {"max-bandwidth": 1 << 40})
            _qmp_sync(sock, f, "migrate", {"uri": "fd:shoal-migration"})
        deadline = time.monotonic() + timeout
        delay = 0.005
        what = "loading the VM's memory" if incoming else "saving the VM's memory"
        while True:
            info = _qmp_sync(sock, f, "query-migrate") or {}
            status = info.get("status")
            if status == "completed":
                return info
            if status in ("failed", "cancelled"):
                raise SandboxError(f"{what} failed: {info.get('error-desc', status)}")
            if time.monotonic() > deadline:
                with contextlib.suppress(Exception):
                    _qmp_sync(sock, f, "migrate_cancel")
                raise Timeout(f"{what} did not finish within {timeout:.0f}s (status {status})")
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
    except OSError as e:
        raise SandboxError(f"talking to QEMU's monitor in {d} failed: {e}") from e
    finally:
        sock.close()
        fh.close()


async def wait_until(pred: Callable[[], Any], timeout: float, interval: float = 0.05) -> bool:
    """Poll an async or sync predicate until true or timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return True
        await asyncio.sleep(interval)
    return False
