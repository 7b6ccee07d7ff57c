"""The limits and defaults of a sandbox spec and of a command, in one place (plain constants, cheap to
import: the CLI and the SDK read them without loading the spec model, see shoal.spec)."""

from __future__ import annotations

#: how long a command may run when the caller does not say (seconds)
DEFAULT_EXEC_TIMEOUT_S = 300.0
#: longest command timeout a caller may ask for (seconds)
MAX_EXEC_TIMEOUT_S = 7 * 86400

# ---- sandbox spec: defaults
DEFAULT_IMAGE = "base"
DEFAULT_BACKEND = "container"
DEFAULT_CPUS = 1.0
DEFAULT_MEMORY_MB = 1024
DEFAULT_PIDS = 512
DEFAULT_DISK_MB = 4096
#: stdout+stderr bytes kept per command
DEFAULT_MAX_OUTPUT_BYTES = 1 << 20
#: seconds until a sandbox is closed by the reaper (None: never)
DEFAULT_TTL_S = 3600.0
DEFAULT_PROJECT = "default"

# ---- sandbox spec: ranges (inclusive)
CPUS_RANGE = (0.01, 256.0)
MEMORY_MB_RANGE = (16, 1 << 20)
PIDS_RANGE = (8, 1 << 22)
DISK_MB_RANGE = (1, 1 << 24)
MAX_OUTPUT_BYTES_RANGE = (0, 1 << 30)
#: the longest TTL (seconds); a TTL must be positive
MAX_TTL_S = 30 * 86400.0
