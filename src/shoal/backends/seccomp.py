"""shoal's default seccomp profile: allow by default, deny what a sandboxed root must never do.

A denylist (like Docker's intent, far shorter than its allowlist) keeps every ordinary program working
while closing the kernel interfaces that let a container reconfigure or attack the host.
"""

from __future__ import annotations

from typing import Any

# Each of these returns EPERM inside a sandbox.
DENIED_SYSCALLS = [
    # loading code into the kernel, rebooting, swapping
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "acct",
    # filesystem and namespace surgery (also needs CAP_SYS_ADMIN, which sandboxes do not have)
    "mount", "umount", "umount2", "pivot_root", "setns", "unshare", "fsopen", "fsconfig", "fsmount",
    "fspick", "move_mount", "open_tree", "mount_setattr",
    # kernel keyrings are not namespaced
    "add_key", "request_key", "keyctl",
    # broad kernel attack surface, rarely needed by agents' workloads
    "bpf", "perf_event_open", "userfaultfd", "lookup_dcookie", "open_by_handle_at",
    "name_to_handle_at", "quotactl", "quotactl_fd", "nfsservctl", "vhangup", "iopl", "ioperm",
    # clocks and kernel log are host-wide
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "syslog",
    # raw ptrace of other processes is fine inside the pid namespace, but process_vm_* and kcmp are not needed
    "kcmp",
]


def default_profile() -> dict[str, Any]:
    """The OCI `linux.seccomp` object for the default profile (x86-64 and its 32-bit compat ABI)."""
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": [
            {"names": DENIED_SYSCALLS, "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
            # clone with CLONE_NEWUSER (0x10000000) would give a user namespace full of capabilities
            {"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1,
             "args": [{"index": 0, "value": 0x10000000, "valueTwo": 0x10000000, "op": "SCMP_CMP_MASKED_EQ"}]},
            # clone3 passes flags in memory that seccomp cannot inspect: make libc fall back to clone
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38},
        ],
    }
