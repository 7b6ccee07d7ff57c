"""Kernel samepage merging (KSM): identical pages of VM guests stored once.

Twenty microVMs booted from the same kernel and image hold largely the same pages (kernel text, page
cache of the same layers, zeroed memory). KSM's scanner (ksmd) finds identical pages in memory marked
mergeable and maps them copy-on-write to one copy. QEMU marks a guest's RAM mergeable when the RAM is
private anonymous memory with `merge=on` (shoal.backends.qemu, `SHOAL_VM_KSM`); memfd/shared RAM is never
merged. The node turns ksmd on when it starts the first VM (`enable`), with empty pages merged into the
kernel's zero page and, where the kernel has it (Linux ≥ 6.7), the scan-time advisor that sizes the scan
rate to the amount of mergeable memory. Only memory marked mergeable is scanned, so other processes
of the host are not touched.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

KSM = Path("/sys/kernel/mm/ksm")
#: pages ksmd scans per wake-up when the kernel has no advisor (4 MiB every 20 ms: ~200 MiB/s)
PAGES_TO_SCAN = 1000


def available(root: Path = KSM) -> bool:
    """True when the kernel has KSM."""
    return (root / "run").exists()


def _read(root: Path, name: str) -> str | None:
    try:
        return (root / name).read_text().strip()
    except OSError:
        return None


def _write(root: Path, name: str, value: str) -> bool:
    try:
        (root / name).write_text(value)
        return True
    except OSError:
        return False


def enable(root: Path = KSM) -> dict[str, Any]:
    """Turn ksmd on (run=1) with zero pages merged and a scan rate fit for VM guests. An admin's running
    setup (run already 1) is left as it is. Returns what was done; never raises."""
    out: dict[str, Any] = {"available": available(root)}
    if not out["available"]:
        out["why"] = "this kernel has no KSM (CONFIG_KSM)"
        return out
    if _read(root, "run") == "1":
        out["already_on"] = True
        return out
    # merging all-zero pages with the zero page costs no stable-tree node each (use_zero_pages: Linux >= 4.14)
    out["use_zero_pages"] = _write(root, "use_zero_pages", "1")
    # the advisor picks the scan rate from the mergeable memory (Linux >= 6.7); else a fixed, faster rate
    if (root / "advisor_mode").exists() and _write(root, "advisor_mode", "scan-time"):
        out["advisor"] = "scan-time"
    else:
        out["pages_to_scan"] = _write(root, "pages_to_scan", str(PAGES_TO_SCAN)) and PAGES_TO_SCAN
    out["run"] = _write(root, "run", "1")
    if not out["run"]:
        out["why"] = f"cannot write {root}/run (read-only sysfs?)"
    return out


def stats(root: Path = KSM) -> dict[str, int]:
    """ksmd's counters (pages): pages_shared (kept copies), pages_sharing (mappings saved),
    ksm_zero_pages, full_scans, ...; empty without KSM."""
    out: dict[str, int] = {}
    for name in ("run", "pages_shared", "pages_sharing", "pages_unshared", "pages_volatile", "ksm_zero_pages",
                 "full_scans", "general_profit", "pages_scanned"):
        v = _read(root, name)
        if v is not None:
            with contextlib.suppress(ValueError):
                out[name] = int(v)
    return out


def saved_bytes(st: dict[str, int], page: int = 4096) -> int:
    """Memory KSM saves now: every sharing mapping and every merged zero page is a page not stored."""
    return (st.get("pages_sharing", 0) + st.get("ksm_zero_pages", 0)) * page
