"""`shoal doctor`: what this host can run, and for everything it cannot, why and how to fix it."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shoal.config import Paths
from shoal.host import cgroups, syscalls


@dataclass
class Check:
    """One line of the doctor's report."""

    name: str
    ok: bool
    detail: str
    fix: str = ""


def _kernel_version() -> tuple[int, int]:
    rel = platform.release().split("-")[0].split(".")
    try:
        return int(rel[0]), int(rel[1])
    except (IndexError, ValueError):
        return (0, 0)


def check_erofs(paths: Paths) -> Check:
    """Can this kernel mount EROFS from a regular file (>= 6.12) or only through a loop device?"""
    if not shutil.which("mkfs.erofs"):
        return Check("erofs", False, "mkfs.erofs missing", "apt-get install erofs-utils")
    if "erofs" not in Path("/proc/filesystems").read_text():
        with contextlib.suppress(Exception):
            os.system("modprobe erofs >/dev/null 2>&1")
        if "erofs" not in Path("/proc/filesystems").read_text():
            return Check("erofs", False, "kernel has no EROFS support", "use a kernel with CONFIG_EROFS_FS")
    if os.geteuid() != 0:
        return Check("erofs", True, "kernel supports EROFS (mount test needs root)")
    from shoal.images.erofs import build_erofs

    paths.run.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=paths.run, prefix="erofs-probe-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        (src / "hello").write_text("hi")
        img = Path(tmp) / "t.erofs"
        build_erofs(src, img)
        mp = Path(tmp) / "mnt"
        mp.mkdir()
        try:
            syscalls.mount(str(img), str(mp), "erofs", syscalls.MS_RDONLY)
            syscalls.umount(str(mp))
            return Check("erofs", True, f"file-backed mounts (Linux {platform.release()}): no loop devices needed")
        except OSError as e:
            return Check("erofs", True, f"loop-device fallback (file-backed mount failed: {e.strerror}; "
                         "needs Linux >= 6.12)")


def check_overlay() -> Check:
    """Is overlayfs available?"""
    ok = "overlay" in Path("/proc/filesystems").read_text()
    return Check("overlayfs", ok, "available" if ok else "missing", "" if ok else "modprobe overlay")


def check_disk_limits() -> Check:
    """Can sandboxes' writable layers be size-limited (btrfs qgroups on the upper pool)?"""
    if "btrfs" not in Path("/proc/filesystems").read_text():
        return Check("disk limits", False, "kernel has no btrfs: disk_mb is not enforced",
                     "use a kernel with CONFIG_BTRFS_FS")
    if not shutil.which("mkfs.btrfs"):
        return Check("disk limits", False, "mkfs.btrfs missing: disk_mb is not enforced", "apt-get install btrfs-progs")
    return Check("disk limits", True, "btrfs qgroup per sandbox on a loop-mounted pool ($SHOAL_HOME/uppers)")


def check_swap() -> Check:
    """Is there swap for reclaiming paused sandboxes' anonymous memory?"""
    try:
        lines = Path("/proc/swaps").read_text().splitlines()[1:]
    except OSError:
        lines = []
    if not lines:
        return Check("swap", False, "no swap: pause reclaims only page cache, not anonymous memory",
                     "shoal node swap --zram 8G")
    devs = ", ".join(ln.split()[0] for ln in lines)
    return Check("swap", True, f"{devs}: paused sandboxes' memory can be reclaimed")


def check_oom_protection() -> Check:
    """Can the node keep itself and the host out of the OOM killer's reach (shoal.node.protect)?"""
    from shoal.host import oom
    from shoal.host.memory import psi

    mode = cgroups.cgroup_mode()
    parts = ["sandboxes' parent cgroup limited to RAM minus a reserve"]
    fix = ""
    if oom.can_lower():
        parts.append("node agent at oom_score_adj -1000")
    else:
        parts.append("no CAP_SYS_RESOURCE: the node agent cannot lower its OOM score (sandboxes run at 500)")
        fix = "run the node agent with CAP_SYS_RESOURCE (e.g. not inside a container that drops it)"
    parts.append("memory.min for the node's cgroup" if mode == "v2" else f"cgroup {mode}: no memory.min (v2 only)")
    parts.append("PSI memory pressure read" if psi("memory") is not None else "no PSI: pressure not measured")
    return Check("oom-protection", oom.can_lower(), "; ".join(parts), fix)


def check_ksm() -> Check:
    """Can identical pages of VM guests be merged (KSM)?"""
    from shoal.host import ksm

    if not ksm.available():
        return Check("ksm", False, "this kernel has no KSM: identical VM guest pages are stored once per VM",
                     "a kernel with CONFIG_KSM")
    st = ksm.stats()
    state = "on" if st.get("run") == 1 else "off until the node starts a VM (SHOAL_VM_KSM)"
    return Check("ksm", True, f"KSM {state}; {ksm.saved_bytes(st) >> 20} MiB saved now")


def check_kvm() -> Check:
    """Is KVM usable for the microvm/vm backends (not just present)?"""
    from shoal.host.kvm import kvm_status

    st = kvm_status()
    return Check("kvm", st.usable, st.detail, st.fix)


def run_checks(paths: Paths | None = None, fix: bool = False) -> list[Check]:
    """Every check, in report order. With `fix`, apply the safe fixes first (hugetlb for crun)."""
    paths = paths or Paths.from_env()
    out: list[Check] = []
    root = os.geteuid() == 0
    out.append(Check("root", root, "running as root" if root else f"running as uid {os.geteuid()}",
                     "" if root else "sandboxes need root: run shoal as root"))
    major, minor = _kernel_version()
    out.append(Check("kernel", (major, minor) >= (5, 10), f"Linux {platform.release()}",
                     "" if (major, minor) >= (5, 10) else "shoal needs Linux >= 5.10"))
    mode = cgroups.cgroup_mode()
    detail = {"v2": "cgroup v2 (unified)", "hybrid": "hybrid: v1 controllers + an empty v2 tree",
              "v1": "cgroup v1 (legacy)"}[mode]
    out.append(Check("cgroups", True, detail))
    if fix and root:
        from shoal.backends.container.runtime import fix_hybrid_cgroups_for_crun

        with contextlib.suppress(Exception):
            if fix_hybrid_cgroups_for_crun():
                out.append(Check("fix", True, "mounted the hugetlb v1 hierarchy so crun can run"))
    out.append(check_overlay())
    out.append(check_erofs(paths))
    try:
        from shoal.agentbin import find_agent_binary
        from shoal.backends.container.runtime import probe_runtimes

        agent = find_agent_binary()
        out.append(Check("agent", True, f"in-sandbox agent {agent}"))
        statuses = probe_runtimes(paths, agent, refresh=True)
        for name, st in statuses.items():
            detail = f"{st.binary} ({st.version})" if st.works else st.reason
            out.append(Check(f"runtime:{name}", st.works, detail, st.fix))
    except Exception as e:
        out.append(Check("agent", False, str(e), "make agent"))
    out.append(check_disk_limits())
    out.append(check_swap())
    out.append(check_oom_protection())
    out.append(check_ksm())
    out.append(check_kvm())
    for tool, pkg in [("mmdebstrap", "mmdebstrap"), ("qemu-system-x86_64", "qemu-system-x86"),
                      ("skopeo", "skopeo"), ("nft", "nftables"), ("ip", "iproute2")]:
        path = shutil.which(tool)
        out.append(Check(f"tool:{tool}", bool(path), path or "missing", "" if path else f"apt-get install {pkg}"))
    return out
