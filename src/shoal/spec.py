"""The sandbox spec: one model with its validation, limits and defaults, used by the SDK, the HTTP API
(`shoal.server.schemas.SpecIn` derives from it), the CLI and the node.

    spec = SandboxSpec(image="base", memory_mb=512)        # InvalidRequest names a bad field
    SandboxSpec.from_options("base", cpus=2, colour="red")  # InvalidRequest: unknown sandbox option(s)

A spec is validated when it is built and when a field is assigned, so the node trusts a SandboxSpec it is
given (it never validates twice). The numbers live in shoal.limits; this module loads pydantic, so light
paths (`import shoal`, the CLI) import it only when they build a spec (`shoal.SandboxSpec` is lazy).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from shoal import limits as L
from shoal.backends.registry import backend_names, check_backend_name, check_runtime_name, runtime_names
from shoal.errors import InvalidRequest
from shoal.images.reference import NAME_LENGTH_PATTERN, NAME_MAX, NEW_NAME_PATTERN, REFERENCE_MAX, REFERENCE_PATTERN
from shoal.limits import CPU_CLASSES, DEFAULT_CPU_CLASS, check_cpu_class

# ---- field types (the HTTP schemas use them too)
#: environment variable names: no '=' and no NUL; values: no NUL
EnvName = Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^[^=\x00]+$")]
EnvValue = Annotated[str, StringConstraints(max_length=1 << 20, pattern=r"^[^\x00]*$")]
Env = dict[EnvName, EnvValue]
LabelKey = Annotated[str, StringConstraints(min_length=1, max_length=128)]
LabelValue = Annotated[str, StringConstraints(max_length=1024)]
#: a path inside the sandbox (absolute, or relative to the workdir); no NUL
SandboxPath = Annotated[str, StringConstraints(min_length=1, max_length=4096, pattern=r"^[^\x00]+$")]
#: an image reference as Docker writes it (`python:3.12`, `ghcr.io/org/img:tag@sha256:…`) or a shoal name;
#: the pattern is a first filter, shoal.images.reference.parse_reference has the last word. The schema holds both
#: patterns (the grammar, and the repository name's length) and validation checks both: a text the schema allows
#: is not refused for its length (schemathesis found 300-character names the schema allowed and the parser refused)
_NAME_LENGTH = re.compile(NAME_LENGTH_PATTERN)


def _name_fits(v: str) -> str:
    if not _NAME_LENGTH.match(v):
        raise ValueError(f"the repository name (before any :tag or @digest) must be at most {NAME_MAX} characters")
    return v


ImageRef = Annotated[str, StringConstraints(max_length=REFERENCE_MAX, pattern=REFERENCE_PATTERN),
                     AfterValidator(_name_fits),
                     WithJsonSchema({"type": "string", "maxLength": REFERENCE_MAX, "pattern": REFERENCE_PATTERN,
                                     "allOf": [{"pattern": NAME_LENGTH_PATTERN}]})]
#: the name of a new image: name[:tag]
NEW_IMAGE_RE = NEW_NAME_PATTERN
#: a user inside the sandbox (name or uid)
UserName = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=r"^[^\x00:]+$")]
Hostname = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9-]{1,63}$")]
#: a project: 1-63 lowercase letters, digits and '-'
PROJECT_RE = r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$"
ProjectName = Annotated[str, StringConstraints(pattern=PROJECT_RE)]
#: one egress rule: a domain (or *.domain), an IPv4 address or CIDR, each with an optional :port, or a named set
EgressRule = Annotated[str, StringConstraints(min_length=1, max_length=300)]
_NETWORK_DOC = ("false (no network), true (the internet, not link-local addresses), or an egress allowlist: "
                "domains (`pypi.org`, `*.example.com:443`), IPv4 CIDRs (`203.0.113.0/24:80`) and named sets "
                "(`pypi`, `npm`, `debian`, `github`); everything else is dropped and counted (docs/security.md)")


class SandboxSpec(BaseModel):
    """Everything needed to create a sandbox. Invalid values raise InvalidRequest naming the field."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    image: ImageRef = Field(L.DEFAULT_IMAGE, description="image reference as Docker writes it: name[:tag], "
                            "host[:port]/path:tag, name@sha256:…, name:tag@sha256:… (docs/images.md)")
    backend: str = Field(L.DEFAULT_BACKEND, description="where the sandbox runs (see docs/architecture.md)",
                         json_schema_extra={"enum": [*backend_names()]})
    runtime: str | None = Field(None, description="container runtime; null = the best that works here",
                                json_schema_extra={"enum": ["auto", *runtime_names(), None]})
    cpus: float = Field(L.DEFAULT_CPUS, ge=L.CPUS_RANGE[0], le=L.CPUS_RANGE[1])
    memory_mb: int = Field(L.DEFAULT_MEMORY_MB, ge=L.MEMORY_MB_RANGE[0], le=L.MEMORY_MB_RANGE[1])
    pids: int = Field(L.DEFAULT_PIDS, ge=L.PIDS_RANGE[0], le=L.PIDS_RANGE[1])
    disk_mb: int = Field(L.DEFAULT_DISK_MB, ge=L.DISK_MB_RANGE[0], le=L.DISK_MB_RANGE[1])
    max_output_bytes: int = Field(L.DEFAULT_MAX_OUTPUT_BYTES, ge=L.MAX_OUTPUT_BYTES_RANGE[0],
                                  le=L.MAX_OUTPUT_BYTES_RANGE[1], description="bytes of stdout+stderr kept per command")
    network: bool | Annotated[list[EgressRule], Field(max_length=256)] = Field(False, description=_NETWORK_DOC)
    egress_grants: Annotated[list[EgressRule], Field(max_length=256)] | None = Field(
        None, description="protected destinations (private, metadata, reserved, cluster, or CIDR[:port]) this "
        "sandbox may reach beyond the node's egress_allow: the operator's policy; the API server sets it from "
        "the caller's project (`shoal token policy`) and ignores what a project token sends (docs/security.md)")
    egress_mbps: float | None = Field(None, gt=0, le=100_000,
                                      description="shape what the sandbox sends to this many Mbit/s (needs a network)")
    ttl_s: float | None = Field(L.DEFAULT_TTL_S, gt=0, le=L.MAX_TTL_S,
                                description="seconds until auto-close; null = never")
    env: Env = Field(default_factory=dict, description="environment variables (names without '=' or NUL)")
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict)
    workdir: SandboxPath | None = None
    user: UserName | None = None
    hostname: Hostname | None = None
    project: ProjectName = L.DEFAULT_PROJECT
    cpu_class: str = Field(DEFAULT_CPU_CLASS, description="interactive: short steps whose latency matters; batch: "
                           "compiles and test suites, run on CPU time nobody else wants (docs/sandboxes.md)",
                           json_schema_extra={"enum": list(CPU_CLASSES)})

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise spec_error(e) from None

    @field_validator("image")
    @classmethod
    def _valid_reference(cls, v: str) -> str:
        from shoal.images.refs import parse_ref

        parse_ref(v)  # the pattern is a first filter; this names the bad part
        return v

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        return check_backend_name(v)

    @field_validator("runtime")
    @classmethod
    def _known_runtime(cls, v: str | None) -> str | None:
        return None if v is None else check_runtime_name(v)

    @field_validator("env")
    @classmethod
    def _env_fits(cls, v: dict[str, str]) -> dict[str, str]:
        L.check_env(v)  # the kernel's limits on one variable and on all of them (issue 19, item 5)
        return v

    @field_validator("labels")
    @classmethod
    def _labels_fit(cls, v: dict[str, str]) -> dict[str, str]:
        return L.check_labels(v)

    @field_validator("network")
    @classmethod
    def _network_rules(cls, v: bool | list[str]) -> bool | list[str]:
        if isinstance(v, list):
            from shoal.config import settings
            from shoal.egress import check_network

            check_network(v, settings().egress_sets)  # InvalidRequest names a bad rule (shoal.egress)
        return v

    @field_validator("egress_grants")
    @classmethod
    def _grants_parse(cls, v: list[str] | None) -> list[str] | None:
        if v:
            from shoal.egress import parse_grants

            parse_grants(v)  # InvalidRequest names a bad grant
        return v

    @model_validator(mode="after")
    def _output_fits_memory(self) -> SandboxSpec:
        # kept output is held in the node's memory: bounded by the sandbox's own (issue 19, item 6)
        L.check_output_bytes(self.max_output_bytes, self.memory_mb)
        if self.egress_mbps is not None and not self.network:
            raise InvalidRequest("egress_mbps needs a network: set network=True or a list of rules")
        return self

    @field_validator("cpu_class")
    @classmethod
    def _known_cpu_class(cls, v: str) -> str:
        return check_cpu_class(v)

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise spec_error(e) from None

    @classmethod
    def from_options(cls, image: str = L.DEFAULT_IMAGE, **options: Any) -> SandboxSpec:
        """A spec from keyword options (the SDK's `client.create(image, **options)`)."""
        unknown = set(options) - set(cls.model_fields)
        if unknown:
            raise InvalidRequest(f"unknown sandbox option(s): {', '.join(sorted(unknown))}; "
                                 f"known: {', '.join(sorted(set(cls.model_fields) - {'image'}))}",
                                 errors=[{"field": k, "message": "unknown option"} for k in sorted(unknown)])
        return cls(image=image, **options)

    @classmethod
    def from_record(cls, stored: Mapping[str, Any], **changes: Any) -> SandboxSpec:
        """A new spec, validated, from the JSON form of a stored one (a VM snapshot's) with `changes` applied;
        keys this version does not know are left out."""
        known = cls.model_fields
        return cls(**{**{k: v for k, v in stored.items() if k in known}, **changes})

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> SandboxSpec:
        """The one way in for a spec as JSON written by another shoal process or release: a sandbox's
        record.json, the cluster wire (agent ↔ gateway ↔ transport index), a SandboxInfo's `spec`. It is not
        validated again (it was when its sandbox was made): keys it lacks (a record from an older release, a
        partial index entry) take their defaults, and keys this version does not know (a field an earlier
        release had, a record from a newer one after a downgrade) are left out with one warning per new set
        of them — reconcile and adoption of live sandboxes never fail on them."""
        known = cls.model_fields
        unknown = [k for k in data if k not in known]
        if unknown:
            _warn_unknown(unknown)
            data = {k: v for k, v in data.items() if k in known}
        return cls.model_construct(**data)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (fresh dicts: changing it never changes the spec)."""
        return self.model_dump()


log = logging.getLogger(__name__)
_warned_unknown: set[frozenset[str]] = set()


def _warn_unknown(keys: list[str]) -> None:
    key = frozenset(keys)
    if key not in _warned_unknown and len(_warned_unknown) < 64:
        _warned_unknown.add(key)
        log.warning("sandbox spec keys this version does not know are ignored: %s", ", ".join(sorted(key)))


def spec_error(e: ValidationError) -> InvalidRequest:
    """A pydantic error about a spec as shoal's InvalidRequest: one line per bad field, with its value."""
    errors = []
    for err in e.errors(include_url=False):
        field = ".".join(str(p) for p in err["loc"]) or "spec"
        msg = str(err["msg"]).removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown option"
        errors.append({"field": field, "message": msg})
    text = "; ".join(f"{x['field']}: {x['message']}" for x in errors)
    details = e.errors(include_url=False)
    first = details[0] if details else None
    given = ""
    if len(errors) == 1 and first is not None and first["type"] != "extra_forbidden":
        shown = repr(first["input"])
        # (a refused value may be megabytes: an env of 2 MB, thousands of labels)
        given = f" (got {shown if len(shown) <= 200 else shown[:200] + '…'})"
    return InvalidRequest(f"invalid sandbox spec: {text}{given}", errors=errors)


def check_spec(spec: object) -> SandboxSpec:
    """The node's entry check: a SandboxSpec is valid by construction (built and assigned through its
    validation), so only its type is checked here."""
    if not isinstance(spec, SandboxSpec):
        raise InvalidRequest(f"a sandbox spec must be a shoal.SandboxSpec, not {type(spec).__name__} "
                             "(build one with SandboxSpec(image=..., ...))")
    return spec
