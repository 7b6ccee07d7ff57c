"""Crash the node process at named steps of create and close (fault injection for tests and soaks).

`SHOAL_FAULT` names where: one step (`create.mount`), several (`create.mount,close.runtime`), a glob
(`close.*`), or `random:P` — each step crashes with probability P (`random:0.005`; the soak). A crash
is SIGKILL to the node process itself: no `finally`, no cleanup, exactly what a power cut or the OOM
killer would leave. Whatever is left must be cleaned up by `shoal gc` (Node.reconcile) or by the next
node process that starts on the same SHOAL_HOME: zero half-made sandboxes, mounts, cgroups, network
namespaces, veths, address leases, nftables state, writable layers or layer leases
(tests/security/test_faults.py, `python -m shoal.bench.faultsoak`).

Unset (the normal case) each step costs one comparison.
"""

from __future__ import annotations

import fnmatch
import os
import random
import signal

#: the steps, in the order a create and a close pass them
STEPS = (
    "create.record",     # the sandbox's record is saved (state "creating"), nothing else made yet
    "create.upper",      # its writable layer (a btrfs subvolume) exists
    "create.mount",      # its image's layers are mounted and its overlay is named (or mounted)
    "create.network",    # its network namespace, veth, address lease and nftables state exist
    "create.runtime",    # the OCI runtime started it (its cgroup and processes exist)
    "create.connected",  # its agent answered; the record still says "creating"
    "close.stopping",    # the record says "stopping"; nothing torn down yet
    "close.runtime",     # its processes and cgroup are gone (the runtime deleted it)
    "close.unmounted",   # its overlay is unmounted and its layers released
    "close.network",     # its writable layer and network are gone; its directory is not
)

#: None (no faults), a probability (random:P) or step patterns; set by configure() (a Node does it from its
#: settings' `fault` when it is made: the process's one node decides)
_config: float | list[str] | None = None


def configure(spec: str | None) -> None:
    """Select the crash steps (the `fault` setting's value; None or "" turns fault injection off)."""
    global _config
    if not spec:
        _config = None
    elif spec.startswith("random:"):
        _config = float(spec.split(":", 1)[1])
    else:
        _config = [p.strip() for p in spec.split(",") if p.strip()]


def crash_point(step: str) -> None:
    """SIGKILL this process if the configured `fault` setting selects `step` (see the module docstring)."""
    cfg = _config
    if isinstance(cfg, float):
        hit = random.random() < cfg
    elif isinstance(cfg, list):
        hit = any(fnmatch.fnmatchcase(step, pat) for pat in cfg)
    else:
        return
    if hit:
        os.kill(os.getpid(), signal.SIGKILL)
