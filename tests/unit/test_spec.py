"""The one sandbox spec: defaults and limits from shoal.limits, typed errors naming fields, validated
assignment, the SDK's option errors, the HTTP schema agreeing with it on every input, a light `import shoal`."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import shoal
from shoal import limits
from shoal.backends.registry import backend_names
from shoal.errors import InvalidRequest
from shoal.server.schemas import SpecIn
from shoal.spec import SandboxSpec, check_spec


def test_defaults_come_from_limits() -> None:
    s = SandboxSpec()
    assert (s.image, s.backend, s.cpus, s.memory_mb, s.pids, s.disk_mb, s.max_output_bytes, s.ttl_s, s.project) == (
        limits.DEFAULT_IMAGE, limits.DEFAULT_BACKEND, limits.DEFAULT_CPUS, limits.DEFAULT_MEMORY_MB,
        limits.DEFAULT_PIDS, limits.DEFAULT_DISK_MB, limits.DEFAULT_MAX_OUTPUT_BYTES, limits.DEFAULT_TTL_S,
        limits.DEFAULT_PROJECT)
    assert shoal.SandboxSpec is SandboxSpec and shoal.models.SandboxSpec is SandboxSpec
    assert s.to_dict()["memory_mb"] == limits.DEFAULT_MEMORY_MB


@pytest.mark.parametrize(("field", "value", "words"), [
    ("memory_mb", 8, "memory_mb: Input should be greater than or equal to 16"),
    ("cpus", 0, "cpus"),
    ("ttl_s", 0, "ttl_s"),
    ("ttl_s", limits.MAX_TTL_S + 1, "ttl_s"),
    # the choices named are the registry's (a new backend needs no edit here)
    ("backend", "docker", f"unknown backend 'docker': choose {', '.join(backend_names())}"),
    ("runtime", "kata", "unknown runtime 'kata'"),
    ("env", {"A=B": "x"}, "env.A=B"),
    ("labels", {"k": "v" * 2000}, "labels.k"),
    ("hostname", "no spaces", "hostname"),
    ("image", "UPPER", "image"),
    ("project", "_pool", "project"),
])
def test_bad_values_are_invalid_requests_naming_the_field(field: str, value: Any, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words) as ei:
        SandboxSpec(**{field: value})
    assert ei.value.details["errors"][0]["field"].split(".")[0] == field
    s = SandboxSpec()
    with pytest.raises(InvalidRequest, match=field):
        setattr(s, field, value)  # assignment is validated too
    assert s == SandboxSpec()


def test_options_of_the_sdk() -> None:
    assert SandboxSpec.from_options("img:1", memory_mb=64).memory_mb == 64
    with pytest.raises(InvalidRequest,
                       match=r"unknown sandbox option\(s\): colour, size; known: backend, cpu_class, cpus"):
        SandboxSpec.from_options("base", colour="red", size=1)
    # a record from a newer version with a field this one does not know
    assert SandboxSpec.from_record({"image": "x", "memory_mb": 32, "future": 1}).memory_mb == 32
    with pytest.raises(InvalidRequest, match=r"spec must be a shoal\.SandboxSpec"):
        check_spec({"image": "base"})


_values = st.one_of(st.none(), st.booleans(), st.integers(-10, 1 << 31), st.floats(allow_nan=False),
                    st.text(max_size=20), st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from([*SandboxSpec.model_fields, "nope"]), _values, max_size=5))
def test_the_http_schema_accepts_exactly_what_the_spec_accepts(data: dict[str, Any]) -> None:
    data.pop("project", None)  # SpecIn's project means something else (admin-chosen, default none)
    try:
        spec: SandboxSpec | None = SandboxSpec(**data)
    except InvalidRequest:
        spec = None
    try:
        body: SpecIn | None = SpecIn.model_validate(data)
    except ValidationError:
        body = None
    assert (spec is None) == (body is None), data
    if spec is not None and body is not None:
        assert body.model_dump(exclude={"project"}) == spec.model_dump(exclude={"project"})


def test_import_shoal_does_not_load_the_spec_model() -> None:
    # the CLI starts on `import shoal`: pydantic (~0.2 s of CPU) loads only when a spec is built
    code = ("import sys, shoal, shoal.cli.main, shoal.sdk.client, shoal.node.node; "
            "assert 'pydantic' not in sys.modules, 'pydantic loaded'; shoal.SandboxSpec; "
            "assert 'pydantic' in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
