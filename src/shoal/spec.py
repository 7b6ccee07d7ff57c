"""The sandbox spec: its limits and defaults in one place (the exec timeout default included)."""

from __future__ import annotations

from shoal.errors import InvalidRequest
from shoal.models import SandboxSpec

#: how long a command may run when the caller does not say (seconds)
DEFAULT_EXEC_TIMEOUT_S = 300.0
#: longest command timeout a caller may ask for (seconds)
MAX_EXEC_TIMEOUT_S = 7 * 86400
#: stdout+stderr bytes kept per command unless the spec says otherwise
DEFAULT_MAX_OUTPUT_BYTES = 1 << 20


def check_spec(spec: SandboxSpec) -> SandboxSpec:
    """Reject impossible limits with a message naming the field."""
    from shoal.backends.registry import check_backend_name
    from shoal.node.records import validate_labels

    check_backend_name(spec.backend)
    checks = [
        ("cpus", 0.01 <= float(spec.cpus) <= 256, "between 0.01 and 256"),
        ("memory_mb", 16 <= int(spec.memory_mb) <= 1 << 20, "between 16 and 1048576"),
        ("pids", 8 <= int(spec.pids) <= 1 << 22, "between 8 and 4194304"),
        ("disk_mb", 1 <= int(spec.disk_mb) <= 1 << 24, "between 1 and 16777216"),
        ("max_output_bytes", 0 <= int(spec.max_output_bytes) <= 1 << 30, "between 0 and 1 GiB"),
    ]
    for name, ok, rng in checks:
        if not ok:
            raise InvalidRequest(f"{name}={getattr(spec, name)!r} is out of range: must be {rng}")
    if spec.ttl_s is not None and not (0 < float(spec.ttl_s) <= 30 * 86400):
        raise InvalidRequest(f"ttl_s={spec.ttl_s!r} must be positive and at most 30 days (or None)")
    if not isinstance(spec.env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
            for k, v in spec.env.items()):
        raise InvalidRequest("env must map non-empty names without '=' or NUL to strings")
    validate_labels(spec.labels)
    if spec.hostname is not None and not (0 < len(spec.hostname) <= 63 and all(
            c.isalnum() or c == "-" for c in spec.hostname)):
        raise InvalidRequest(f"hostname {spec.hostname!r} must be 1-63 letters, digits or '-'")
    return spec
