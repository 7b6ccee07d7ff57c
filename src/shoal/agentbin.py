"""Locate the in-sandbox agent binary (built by `make` into build/shoal-agent)."""

from __future__ import annotations

import os
from pathlib import Path

from shoal.config import settings
from shoal.errors import BackendUnavailable

_REPO_BUILD = Path(__file__).resolve().parents[2] / "build" / "shoal-agent"


def find_agent_binary() -> Path:
    """SHOAL_AGENT_BIN, the repo's build/shoal-agent, or /usr/local/lib/shoal/shoal-agent."""
    given = settings().agent_bin
    candidates = [str(given) if given else None, str(_REPO_BUILD), "/usr/local/lib/shoal/shoal-agent"]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    raise BackendUnavailable(
        "the in-sandbox agent binary is missing: run `make agent` in the shoal repository "
        "(or set SHOAL_AGENT_BIN to a built shoal-agent)")
