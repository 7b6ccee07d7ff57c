"""The limits and defaults of a sandbox spec and of a command, in one place (plain constants, cheap to
import: the CLI and the SDK read them without loading the spec model, see shoal.spec)."""

from __future__ import annotations

from shoal.errors import InvalidRequest

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
#: CPU classes a sandbox may be in (what each means on the host: shoal.backends.container.cpuclass)
INTERACTIVE = "interactive"
BATCH = "batch"
CPU_CLASSES = (INTERACTIVE, BATCH)
DEFAULT_CPU_CLASS = INTERACTIVE

# ---- batches: the largest `n` of one create_many / fork / restore, per door (each defined here only)
#: on a node, and through the cluster gateway (the SDK's embedded and cluster transports)
MAX_BATCH = 100_000
#: in one HTTP request (the api_max_batch setting may lower it; the server schema's upper bound)
MAX_HTTP_BATCH = 4096
#: run_code requests in one batch request of the SandboxFusion-style API (shoal.server.fusion)
MAX_RUN_CODE_BATCH = 10_000
#: VMs resumed from one memory snapshot or fork at once (each copies the VM's disks)
MAX_VM_BATCH = 1000

# ---- the in-sandbox agent's connection
#: how long a new (or restored) sandbox's agent may take to answer after its start (boot, first exec)
AGENT_READY_TIMEOUT_S = 30.0
#: how long (re)connecting to a running sandbox's agent may take
AGENT_CONNECT_TIMEOUT_S = 10.0

# ---- sandbox spec: ranges (inclusive)
CPUS_RANGE = (0.01, 256.0)
MEMORY_MB_RANGE = (16, 1 << 20)
PIDS_RANGE = (8, 1 << 22)
DISK_MB_RANGE = (1, 1 << 24)
MAX_OUTPUT_BYTES_RANGE = (0, 1 << 30)
#: the longest TTL (seconds); a TTL must be positive
MAX_TTL_S = 30 * 86400.0

# ---- what a command may cost the node (issue 19, items 5 and 6)
#: a command's output is held in the node (and the API server) until it ends: per stream at most an
#: eighth of the sandbox's memory (so both streams of one command take at most a quarter of it), at
#: least 1 MiB, at most 256 MiB. Streams (stream(), WebSocket) are not held: they are bounded by
#: backpressure instead (shoal.agentproto.client)
MAX_OUTPUT_FRACTION = 8
MAX_OUTPUT_CEILING = 256 << 20
#: the kernel refuses one environment string longer than this at exec (MAX_ARG_STRLEN, with its NUL)
MAX_ENV_STRING = (128 << 10) - 1
#: all of a sandbox's (or a command's) environment, in bytes of NAME=VALUE strings
MAX_ENV_BYTES = 512 << 10
#: labels of one sandbox: how many, and their characters in all (every record and listing carries them)
MAX_LABELS = 64
MAX_LABEL_BYTES = 16 << 10


def output_limit(memory_mb: int) -> int:
    """The most output bytes per stream a sandbox of `memory_mb` may keep for one command."""
    return max(1 << 20, min(MAX_OUTPUT_CEILING, (int(memory_mb) << 20) // MAX_OUTPUT_FRACTION))


def check_env(env: object, what: str = "env") -> None:
    """Names without '=' or NUL, string values, each NAME=VALUE and the whole set within the kernel's and
    the agent's limits (a larger one fails at exec with E2BIG, or overflows a protocol frame)."""
    if env is None:
        return
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
            for k, v in env.items()):
        raise InvalidRequest(f"{what} must map non-empty names without '=' or NUL to strings")
    total = 0
    for k, v in env.items():
        n = len(k.encode("utf-8", "surrogateescape")) + len(v.encode("utf-8", "surrogateescape")) + 1
        if n > MAX_ENV_STRING:
            raise InvalidRequest(f"{what} variable {k[:60]!r} is {n} bytes; one variable may have at most "
                                 f"{MAX_ENV_STRING} (the kernel's limit): pass big data as a file or stdin",
                                 field=what, limit_bytes=MAX_ENV_STRING)
        total += n + 1
    if total > MAX_ENV_BYTES:
        raise InvalidRequest(f"{what} is {total} bytes in all, over the limit of {MAX_ENV_BYTES}: pass big data "
                             "as a file or stdin", field=what, limit_bytes=MAX_ENV_BYTES)


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    """At most MAX_LABELS labels of at most MAX_LABEL_BYTES characters in all."""
    if len(labels) > MAX_LABELS:
        raise InvalidRequest(f"{len(labels)} labels: at most {MAX_LABELS} per sandbox")
    total = sum(len(k) + len(v) for k, v in labels.items())
    if total > MAX_LABEL_BYTES:
        raise InvalidRequest(f"labels take {total} characters in all, over the limit of {MAX_LABEL_BYTES}")
    return labels


def check_output_bytes(max_output_bytes: int, memory_mb: int) -> None:
    """max_output_bytes within what a sandbox of `memory_mb` may keep (0: that much)."""
    out_max = output_limit(memory_mb)
    if not 0 <= int(max_output_bytes) <= out_max:
        raise InvalidRequest(
            f"max_output_bytes={max_output_bytes!r} is out of range: with memory_mb={memory_mb} it may be at "
            f"most {out_max} (an eighth of the memory, at most 256 MiB; 0 = that much). Stream the command "
            "(stream()) to see more output", limit_bytes=out_max)


def check_cpu_class(name: str) -> str:
    """The CPU class name, or InvalidRequest naming the choices."""
    if name not in CPU_CLASSES:
        raise InvalidRequest(f"cpu_class={name!r} is not a CPU class: choose {' or '.join(CPU_CLASSES)} "
                             f"(default {DEFAULT_CPU_CLASS}; see docs/sandboxes.md#cpu-classes)")
    return name

#: how often a node gives its malloc heap's free pages back to the kernel (shoal.host.heap.trim): churn
#: scatters freed memory over the arenas of its threads, which RSS otherwise keeps (issue 24's soak)
HEAP_TRIM_INTERVAL_S = 60.0
