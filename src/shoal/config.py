"""Where shoal keeps its state, and the knobs a host operator can turn (all from the environment)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


def _env_path(name: str, default: str | Path) -> Path:
    return Path(os.environ.get(name) or default)


@dataclass
class Paths:
    """Filesystem layout of one node. `store` may be a shared filesystem; everything else is local."""

    home: Path
    store: Path

    @classmethod
    def from_env(cls, home: str | Path | None = None, store: str | Path | None = None) -> Paths:
        """Resolve SHOAL_HOME (default /var/lib/shoal) and SHOAL_STORE (default $SHOAL_HOME/store)."""
        h = Path(home) if home else _env_path("SHOAL_HOME", "/var/lib/shoal")
        s = Path(store) if store else _env_path("SHOAL_STORE", h / "store")
        return cls(home=h, store=s)

    @property
    def sandboxes(self) -> Path:
        """One directory per sandbox: record, bundle, upper layer, agent socket."""
        return self.home / "sandboxes"

    @property
    def layer_mounts(self) -> Path:
        """Host-local mountpoints of EROFS layers, one per layer, shared by all sandboxes."""
        return self.home / "layers"

    @property
    def locks(self) -> Path:
        """Host-local lock files (flock)."""
        return self.home / "locks"

    @property
    def run(self) -> Path:
        """Host-local runtime scratch (runtime state root, probes)."""
        return self.home / "run"


@dataclass
class NodeConfig:
    """Tunables of a node agent. Defaults are safe for a 2-core development machine."""

    paths: Paths = field(default_factory=Paths.from_env)
    #: node name encoded in sandbox IDs (short, [a-z0-9])
    node_id: str = field(default_factory=lambda: os.environ.get("SHOAL_NODE_ID", "n0"))
    #: preferred container runtime: "auto" | "crun" | "runc" | "gvisor"
    runtime: str = field(default_factory=lambda: os.environ.get("SHOAL_RUNTIME", "auto"))
    #: max sandboxes created at once by one create_many (bounded parallelism)
    create_concurrency: int = 32
    #: refuse new sandboxes when committed memory exceeds this multiple of host RAM
    memory_overcommit: float = float(os.environ.get("SHOAL_MEMORY_OVERCOMMIT", "4.0"))
    #: refuse new sandboxes when the host's available memory falls below this (MiB)
    min_free_memory_mb: int = int(os.environ.get("SHOAL_MIN_FREE_MB", "512"))
    #: how often the reaper looks for expired or dead sandboxes (seconds)
    reap_interval_s: float = 2.0
    #: largest file read_file returns in one call (bytes)
    max_file_bytes: int = 256 << 20
    #: reclaim a sandbox's memory after pausing it (page cache always; anonymous memory when swap is on)
    reclaim_on_pause: bool = field(default_factory=lambda: os.environ.get("SHOAL_RECLAIM", "1") != "0")
    #: record the working set at pause and read it back before the thaw (faster first request)
    prefetch_on_resume: bool = field(default_factory=lambda: os.environ.get("SHOAL_PREFETCH", "1") != "0")
    #: set up compressed swap in RAM (zram) of this size when the node starts, e.g. "8G" (None: leave swap alone)
    zram_swap: str | None = field(default_factory=lambda: os.environ.get("SHOAL_ZRAM_SWAP") or None)
