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

# io_uring is a second system-call interface that seccomp cannot see into (each submission queue entry
# is a syscall the filter never checks) and a steady source of kernel privilege escalations. ENOSYS, not
# EPERM: runtimes that probe for it (libuv, tokio-uring, liburing users) fall back to plain syscalls.
IO_URING_SYSCALLS = ["io_uring_setup", "io_uring_enter", "io_uring_register"]
ENOSYS = 38

# Socket families a sandbox never gets. AF_VSOCK reaches the hypervisor (or the host's vsock services)
# and is not confined by network namespaces, so network=False would not hold for it.
AF_VSOCK = 40
DENIED_SOCKET_FAMILIES = {AF_VSOCK: "AF_VSOCK"}
EAFNOSUPPORT = 97


def default_profile() -> dict[str, Any]:
    """The OCI `linux.seccomp` object for the default profile (x86-64 and its 32-bit compat ABI)."""
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": [
            {"names": DENIED_SYSCALLS, "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
            {"names": IO_URING_SYSCALLS, "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
            # the family is socket()'s first argument (a value, so seccomp can compare it); socketcall(2),
            # the 32-bit multiplexer, passes it in memory where seccomp cannot look: it is refused whole
            # (32-bit programs use the direct socket syscalls on any kernel since 4.3)
            *({"names": ["socket", "socketpair"], "action": "SCMP_ACT_ERRNO", "errnoRet": EAFNOSUPPORT,
               "args": [{"index": 0, "value": fam, "op": "SCMP_CMP_EQ"}]} for fam in DENIED_SOCKET_FAMILIES),
            {"names": ["socketcall"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
            # clone with CLONE_NEWUSER (0x10000000) would give a user namespace full of capabilities
            {"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1,
             "args": [{"index": 0, "value": 0x10000000, "valueTwo": 0x10000000, "op": "SCMP_CMP_MASKED_EQ"}]},
            # clone3 passes flags in memory that seccomp cannot inspect: make libc fall back to clone
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38},
        ],
    }
