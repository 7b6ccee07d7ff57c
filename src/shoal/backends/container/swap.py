"""Swap for sandboxes, set up by the node (issue 24, item 6): a fresh machine gets what pause needs.

Pausing a sandbox returns its memory to the host (shoal.backends.container.reclaim), but anonymous memory — heaps,
stacks, /dev/shm — can only go to swap, and a fresh Debian machine has none: there a paused sandbox
gives back its page cache only, the pressure response (pause idle sandboxes before refusing a create)
frees almost nothing, and density is what RAM holds. So the node decides for its users:

* `SHOAL_ZRAM_SWAP=auto` (the default): when the host has **no swap at all**, the node sets up
  compressed swap in RAM (zram, no disk) of **half the RAM, at most 8 GiB** when it starts. A host with
  swap of its own (a swap file, a partition, zram set up by the distribution or an earlier node) is left
  as it is.
* a size (`SHOAL_ZRAM_SWAP=16G`): the same with that size.
* `off`: leave swap alone (pause then reclaims page cache only).

`shoal node swap` shows it and changes it (`--zram 16G`, `--auto`, `--off`). A zram device is memory,
gone at reboot like /run: the node that made it notes so in `/run/shoal/zram-swap.json`, and every node
process that relies on swap registers itself in `/run/shoal/swap-users/` (one file per process, no
descriptor held), so `release_unused()` — the test suite's end, `.ci/run` — can turn off the swap a node
made once no live node process uses it. A node never turns swap off by itself: sandboxes outlive it
(crash-only) with pages in swap.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shoal.errors import BackendUnavailable, InvalidRequest, ShoalError
from shoal.fsutil import flocked

log = logging.getLogger(__name__)

#: the largest zram device `auto` makes (bytes)
AUTO_MAX = 8 << 30
#: host-wide state, on a tmpfs that a reboot clears together with the zram devices
STATE_DIR = Path("/run/shoal")


def _marker() -> Path:
    return STATE_DIR / "zram-swap.json"


def _users_dir() -> Path:
    return STATE_DIR / "swap-users"


def auto_size(total_bytes: int | None = None) -> int:
    """The zram size `auto` picks: half the RAM, at most AUTO_MAX, in whole MiB."""
    if total_bytes is None:
        from shoal.host.memory import meminfo

        total_bytes = meminfo().get("MemTotal", 0) * 1024
    return (min(total_bytes // 2, AUTO_MAX) >> 20) << 20


def parse_setting(value: str | None) -> str | None:
    """The normalized setting: "auto", a size, or None for off."""
    if value is None:
        return None
    v = str(value).strip().lower()
    if v in ("", "off", "0", "no", "none"):
        return None
    return "auto" if v == "auto" else str(value).strip()


@dataclass
class SwapDecision:
    """What a node start did about swap."""

    #: "made" (a zram device now), "kept" (the host had swap), "off" (the setting), "unavailable"
    action: str
    #: the active swap areas afterwards (paths)
    areas: list[str]
    #: the zram device made, and its size (bytes)
    device: str | None = None
    size: int = 0
    #: why nothing was made (unavailable)
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


def _setup_lock() -> contextlib.AbstractContextManager[int]:
    # two node processes starting at once on a host without swap must make one device, not two
    return flocked(STATE_DIR / "swap.lock")


def ensure(setting: str | None, *, setup: Callable[..., Any] | None = None) -> SwapDecision:
    """Apply the node's swap setting (see the module docstring): make zram swap when the host has none.
    BackendUnavailable when it cannot (no root, no zram in the kernel). Registers this process as a user
    of the swap either way (unless the setting is off)."""
    from shoal.backends.container import reclaim

    want = parse_setting(setting)
    if want is None:
        return SwapDecision("off", [s.path for s in reclaim.swap_devices()])
    if os.geteuid() != 0:
        raise BackendUnavailable("setting up swap needs root")
    with _setup_lock():
        register_user()
        areas = reclaim.swap_devices()
        if areas:
            return SwapDecision("kept", [s.path for s in areas])
        size = auto_size() if want == "auto" else reclaim.parse_size(want)
        z = (setup or reclaim.setup_zram_swap)(size)
        _marker().write_text(json.dumps({"device": z.name, "size": z.disksize, "made_at": time.time(),
                                         "pid": os.getpid(), "setting": want}))
        log.info("no swap on this host: made zram swap /dev/%s of %d MiB (SHOAL_ZRAM_SWAP=%s)",
                 z.name, z.disksize >> 20, want)
        return SwapDecision("made", [s.path for s in reclaim.swap_devices()], device=z.name, size=z.disksize)


def made_by_node() -> dict[str, Any] | None:
    """The zram device a node made (device, size, made_at, pid), while its swap is on."""
    from shoal.backends.container import reclaim

    try:
        m = json.loads(_marker().read_text())
    except (OSError, ValueError):
        return None
    on = {s.path for s in reclaim.swap_devices()}
    return m if f"/dev/{m.get('device')}" in on else None


# ---- who relies on the swap -------------------------------------------------------------------------
def _starttime(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def register_user(pid: int | None = None) -> None:
    """Note that process `pid` (this one) runs a node relying on swap (idempotent; dead ones are pruned)."""
    pid = pid or os.getpid()
    d = _users_dir()
    d.mkdir(parents=True, exist_ok=True)
    st = _starttime(pid)
    if st is None:
        return
    f = d / str(pid)
    with contextlib.suppress(OSError):
        if f.read_text() == st:
            return
    f.write_text(st)
    live_users(prune=True)


def live_users(*, prune: bool = False) -> list[int]:
    """Processes registered as relying on swap that still run (the same process: its start time matches)."""
    out = []
    with contextlib.suppress(OSError), os.scandir(_users_dir()) as it:
        for e in it:
            try:
                pid = int(e.name)
                alive = _starttime(pid) == Path(e.path).read_text()
            except (ValueError, OSError):
                alive = False
            if alive:
                out.append(pid)
            elif prune:
                with contextlib.suppress(OSError):
                    os.unlink(e.path)
    return out


def release_unused(*, ignore_pid: int | None = None) -> list[str]:
    """Turn off the zram swap a node made when no live node process (other than `ignore_pid`) relies on
    it; returns the devices turned off. Swap the host had of its own is never touched."""
    from shoal.backends.container import reclaim

    with _setup_lock():
        m = made_by_node()
        if m is None:
            return []
        others = [p for p in live_users(prune=True) if p != ignore_pid]
        if others:
            log.info("zram swap /dev/%s kept: node processes %s still use it", m["device"], others[:5])
            return []
        done = reclaim.teardown_zram_swap(devices=[m["device"]])
        with contextlib.suppress(OSError):
            _marker().unlink()
        return done


def resize(size: str | int, *, algorithm: str | None = None) -> SwapDecision:
    """`shoal node swap --zram SIZE` / `--auto`: make the zram swap this size, turning off (and reading
    back) a zram swap of another size first. Swap the host has on a disk stays as it is."""
    from shoal.backends.container import reclaim

    if os.geteuid() != 0:
        raise BackendUnavailable("setting up swap needs root")
    size_b = auto_size() if size == "auto" else reclaim.parse_size(size)
    if size_b <= 0:
        raise InvalidRequest(f"size {size!r} must be positive")
    with _setup_lock():
        for z in reclaim.zram_devices():
            if z.swap and z.disksize != size_b:
                reclaim.teardown_zram_swap(devices=[z.name])
        z = reclaim.setup_zram_swap(size_b, algorithm=algorithm)
        _marker().write_text(json.dumps({"device": z.name, "size": z.disksize, "made_at": time.time(),
                                         "pid": os.getpid(), "setting": str(size)}))
        return SwapDecision("made", [s.path for s in reclaim.swap_devices()], device=z.name, size=z.disksize)


def turn_off() -> list[str]:
    """`shoal node swap --off`: turn off every zram swap (reading its pages back first)."""
    from shoal.backends.container import reclaim

    with _setup_lock():
        done = reclaim.teardown_zram_swap()
        with contextlib.suppress(OSError):
            _marker().unlink()
        return done


def start_for_node(setting: str | None) -> SwapDecision:
    """What Node.start() calls: `ensure`, where a failure of `auto` is a warning, not a failed start."""
    try:
        return ensure(setting)
    except ShoalError as e:
        if parse_setting(setting) != "auto":
            raise
        from shoal.backends.container import reclaim

        log.warning("no swap for paused sandboxes: %s (pause reclaims page cache only)", e.message)
        return SwapDecision("unavailable", [s.path for s in reclaim.swap_devices()], reason=e.message)
