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

_UNSET = object()
#: None (no faults), a probability (random:P) or step patterns; _UNSET until the first crash_point()
_config: float | list[str] | object | None = _UNSET


def _load() -> float | list[str] | None:
    from shoal.config import settings

    spec = settings().fault
    if not spec:
        return None
    if spec.startswith("random:"):
        return float(spec.split(":", 1)[1])
    return [p.strip() for p in spec.split(",") if p.strip()]


def crash_point(step: str) -> None:
    """SIGKILL this process if SHOAL_FAULT selects `step` (see the module docstring)."""
    global _config
    if _config is _UNSET:
        _config = _load()
    cfg = _config
    if isinstance(cfg, float):
        hit = random.random() < cfg
    elif isinstance(cfg, list):
        hit = any(fnmatch.fnmatchcase(step, pat) for pat in cfg)
    else:
        return
    if hit:
        os.kill(os.getpid(), signal.SIGKILL)


def reset() -> None:
    """Read SHOAL_FAULT again at the next step (tests that change it in-process)."""
    global _config
    _config = _UNSET
