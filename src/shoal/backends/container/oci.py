"""Build the OCI runtime-spec config.json of a container sandbox, secure by default."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from shoal.backends.container.seccomp import default_profile
from shoal.host.oom import SANDBOX_OOM_SCORE_ADJ

# The capability set Docker grants by default; nothing beyond it (no SYS_ADMIN, SYS_PTRACE, NET_ADMIN).
DEFAULT_CAPS = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
]

# /proc files that leak host information or can hurt the host; kpage* crashed a DSec kernel under `grep -r /`.
MASKED_PATHS = [
    "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/proc/kpagecgroup",
    "/proc/kpageflags", "/proc/kpagecount", "/proc/kmsg", "/proc/config.gz", "/sys/firmware",
    "/sys/devices/virtual/powercap", "/proc/interrupts",
    # the host's block devices, partitions and swap devices (names, sizes, I/O counters)
    "/proc/partitions", "/proc/diskstats", "/proc/swaps", "/sys/block", "/sys/class/block", "/sys/dev/block",
]
# /proc files replaced by the node's own (shoal.backends.container.guestfs): the host kernel's command line, and a
# meminfo that reports the sandbox's memory limit instead of the host's RAM
VIRTUAL_PROC_FILES = ("/proc/cmdline", "/proc/meminfo")
READONLY_PATHS = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]

AGENT_DIR_IN_SANDBOX = "/.shoal"
AGENT_PATH_IN_SANDBOX = "/.shoal/shoal-agent"
#: where the agent listens when the runtime cannot pass it a socket (gVisor)
AGENT_RUN_IN_SANDBOX = "/.shoal-run"
AGENT_SOCKET_IN_SANDBOX = "/.shoal-run/agent.sock"


def _nofile() -> int:
    # a runtime cannot raise the hard limit above its own; stay within what we were given
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)


@functools.cache
def _masked_dirs() -> list[str]:
    # which masked paths are directories is a property of the host's kernel: look once
    return [p for p in MASKED_PATHS if os.path.isdir(p) and not os.path.islink(p)]


@functools.cache
def _masked_files() -> list[str]:
    return [p for p in MASKED_PATHS if os.path.isfile(p) and not os.path.islink(p)]


_SECCOMP_MARK = "@@shoal-seccomp@@"


@functools.cache
def _default_seccomp() -> tuple[dict[str, Any], str]:
    prof = default_profile()
    return prof, json.dumps(prof)


def render_config(cfg: dict[str, Any]) -> str:
    """config.json text of `cfg` (from build_config), encoding the constant seccomp profile only once."""
    linux = cfg.get("linux", {})
    prof, encoded = _default_seccomp()
    if linux.get("seccomp") == prof:
        linux = dict(linux, seccomp=_SECCOMP_MARK)
        text = json.dumps(dict(cfg, linux=linux))
        return text.replace(f'"{_SECCOMP_MARK}"', encoded, 1)
    return json.dumps(cfg)


def build_config(*, rootfs: str, guest_dir: str, hostname: str, env: dict[str, str], cwd: str,
                 cgroups_path: str, cpus: float, memory_mb: int, pids: int, shm_mb: int = 64,
                 netns_path: str | None = None, resolv_conf: str | None = None,
                 agent_args: list[str] | None = None, seccomp: bool = True,
                 swap_mb: int | None = None, mntns_path: str | None = None, nproc: int | None = None,
                 empty_dir: str | None = None, empty_file: str | None = None,
                 proc_files: dict[str, str] | None = None,
                 proc_binds: frozenset[str] | None = None,
                 agent_run_dir: str | None = None, bind_tmp: bool = False,
                 extra_mounts: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Return config.json for a sandbox whose PID 1 is the shoal agent listening on fd 3.

    `empty_dir`/`empty_file` mask paths by a read-only bind instead of the runtime's own masks (a tmpfs
    per directory, /dev/null per file); `proc_files` binds files over /proc entries (VIRTUAL_PROC_FILES).
    `proc_binds` names the /proc entries the runtime lets a bind cover (None: any; see
    OciRuntime.proc_binds): the other /proc masks are left to the runtime's own maskedPaths, and an
    empty `proc_files` entry it refuses is masked the same way (its content is the same: nothing).
    With `agent_run_dir` (a host directory, bound read-write at AGENT_RUN_IN_SANDBOX) the agent listens on a
    socket there instead of fd 3 (runtimes that cannot hand it an fd). `bind_tmp` binds the rootfs's own /tmp
    at /tmp (gVisor mounts a tmpfs of its own kernel at an empty /tmp unless the spec mounts something there:
    files in it would miss the writable layer, snapshots and disk_mb). `extra_mounts` (OCI mount entries) are
    added last: a Dockerfile build's RUN --mount cache, bind, secret and tmpfs mounts (never user-given). `nproc`
    sets RLIMIT_NPROC (for a runtime that enforces the process limit in its own kernel: gVisor)."""
    mem = memory_mb * 1024 * 1024
    period = 100_000
    resources: dict[str, Any] = {
        "memory": {"limit": mem, "reservation": min(mem, 64 << 20)},
        "cpu": {"quota": max(1000, int(cpus * period)), "period": period,
                "shares": max(2, int(cpus * 1024))},
        "pids": {"limit": pids},
        "devices": [{"allow": False, "access": "rwm"}] + [
            {"allow": True, "type": "c", "major": ma, "minor": mi, "access": "rwm"}
            for ma, mi in [(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 1), (5, 2), (136, -1)]
        ],
    }
    if swap_mb is not None:
        resources["memory"]["swap"] = mem + swap_mb * 1024 * 1024
    # a device rule with minor -1 means "all minors" in the spec; runtimes want it absent instead
    for rule in resources["devices"]:
        if rule.get("minor") == -1:
            del rule["minor"]
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount", "cgroup")]
    if mntns_path:
        # join the namespace holding the sandbox's overlay (shoal.host.mntns) instead of a copy of the host's
        namespaces[3] = {"type": "mount", "path": mntns_path}
    namespaces.append({"type": "network", "path": netns_path} if netns_path else {"type": "network"})
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={shm_mb}m"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": AGENT_DIR_IN_SANDBOX, "type": "bind", "source": guest_dir,
         "options": ["rbind", "ro", "nosuid", "nodev"]},
    ]
    if resolv_conf:
        mounts.append({"destination": "/etc/resolv.conf", "type": "bind", "source": resolv_conf,
                       "options": ["bind", "ro", "nosuid", "nodev", "noexec"]})
    def bindable(p: str) -> bool:
        return proc_binds is None or not p.startswith("/proc/") or p in proc_binds

    masked = list(MASKED_PATHS)
    if empty_dir:
        # Runtimes mask a directory with a fresh read-only tmpfs: one more superblock per sandbox, and the
        # kernel gives every memory cgroup per-superblock shrinker state for the most superblocks the host
        # ever had at once (~1 KiB per 64 of them, per cgroup): O(n^2) memory for n sandboxes. A read-only
        # bind of an empty directory hides it the same way without a superblock.
        dirs = [p for p in _masked_dirs() if bindable(p)]
        mounts += [{"destination": p, "type": "bind", "source": empty_dir,
                    "options": ["rbind", "ro", "nosuid", "nodev", "noexec"]} for p in dirs]
        masked = [p for p in MASKED_PATHS if p not in dirs]
    if empty_file:
        # (the runtime binds the host's /dev/null, whose devtmpfs mount options show the host's RAM)
        files = [p for p in masked if p in _masked_files() and bindable(p)]
        mounts += [{"destination": p, "type": "bind", "source": empty_file,
                    "options": ["bind", "ro", "nosuid", "nodev", "noexec"]} for p in files]
        masked = [p for p in masked if p not in files]
    if bind_tmp:
        mounts.append({"destination": "/tmp", "type": "bind", "source": os.path.join(rootfs, "tmp"),
                       "options": ["rbind", "rw", "nosuid", "nodev"]})
    if agent_run_dir:
        mounts.append({"destination": AGENT_RUN_IN_SANDBOX, "type": "bind", "source": agent_run_dir,
                       "options": ["rbind", "rw", "nosuid", "nodev", "noexec"]})
    for dst, src in (proc_files or {}).items():
        if not bindable(dst):
            if os.path.getsize(src):
                raise ValueError(f"the runtime cannot bind {dst}, and {src} is not empty: no mask can replace it")
            masked.append(dst)
            continue
        mounts.append({"destination": dst, "type": "bind", "source": src,
                       "options": ["bind", "ro", "nosuid", "nodev", "noexec"]})
    mounts += list(extra_mounts or [])
    # raw sockets are for networked sandboxes (ping, traceroute, packet tools); with only a loopback
    # device they serve nothing, so a sandbox without network does not get them
    caps = DEFAULT_CAPS if netns_path else [c for c in DEFAULT_CAPS if c != "CAP_NET_RAW"]
    process: dict[str, Any] = {
        "terminal": False,
        "user": {"uid": 0, "gid": 0},
        "args": [AGENT_PATH_IN_SANDBOX,
                 *(["--listen", AGENT_SOCKET_IN_SANDBOX] if agent_run_dir else ["--listen-fd", "3"]),
                 "--child-oom-score-adj", str(SANDBOX_OOM_SCORE_ADJ), *(agent_args or [])],
        "env": [f"{k}={v}" for k, v in env.items()],
        "cwd": "/",
        "capabilities": {k: list(caps) for k in ("bounding", "effective", "permitted")},
        "rlimits": [{"type": "RLIMIT_NOFILE", "hard": _nofile(), "soft": _nofile()}]
        # a runtime that counts the sandbox's processes in its own kernel (gVisor) enforces `pids` there
        + ([{"type": "RLIMIT_NPROC", "hard": nproc, "soft": nproc}] if nproc else []),
        "noNewPrivileges": True,
    }
    # Every process of the sandbox starts at 500: in an OOM shared with the host, sandbox processes go
    # first. The runtime's (privileged) write also makes 500 their floor, so none can lower itself. The
    # node lowers the agent alone after start; the agent puts what it runs back at 500 (shoal.host.oom).
    process["oomScoreAdj"] = SANDBOX_OOM_SCORE_ADJ
    linux: dict[str, Any] = {
        "cgroupsPath": cgroups_path,
        "resources": resources,
        "namespaces": namespaces,
        "maskedPaths": masked,
        "readonlyPaths": READONLY_PATHS,
    }
    if seccomp:
        linux["seccomp"] = default_profile()
    return {
        "ociVersion": "1.0.2",
        "process": process,
        # a real path: runc refuses a root with a symlink in it (sandbox directories are links to a tmpfs)
        "root": {"path": os.path.realpath(rootfs), "readonly": False},
        "hostname": hostname,
        "mounts": mounts,
        "linux": linux,
    }
