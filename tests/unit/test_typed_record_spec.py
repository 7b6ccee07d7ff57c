"""Records give their spec typed (issue 27, item 5): `SandboxRecord.typed_spec` is a shoal.spec.SandboxSpec,
and the node, its backends and the server's record readers use it instead of `rec.spec.get(...)`."""

from __future__ import annotations

import re
from pathlib import Path

from shoal.records import SandboxRecord
from shoal.spec import SandboxSpec

SRC = Path(__file__).resolve().parents[2] / "src" / "shoal"


def _rec(spec: dict) -> SandboxRecord:
    return SandboxRecord(id="n0-x", backend="fake", image="t:1", image_digest="", layers=[], spec=spec, dir="/nx")


def test_typed_spec_reads_the_record_and_follows_a_replaced_spec() -> None:
    made = SandboxSpec(image="base", memory_mb=64, cpus=0.5, workdir="/w").model_dump()
    rec = _rec({**made, "from_a_newer_shoal": 1})
    t = rec.typed_spec
    assert isinstance(t, SandboxSpec) and (t.memory_mb, t.cpus, t.workdir) == (64, 0.5, "/w")
    assert rec.typed_spec is t  # cached while the spec is the same dict
    rec.spec = {**rec.spec, "cpu_class": "batch"}
    assert rec.typed_spec.cpu_class == "batch" and rec.typed_spec.memory_mb == 64
    assert "_typed_spec" not in rec.to_dict()  # the cache is not part of the saved record


def test_node_and_backends_read_records_typed() -> None:
    bad = re.compile(r"\brec\.spec\.get\(|\brec\.spec\[")
    offenders = [f"{p.relative_to(SRC)}:{i}: {line.strip()}"
                 for d in ("node", "backends") for p in sorted((SRC / d).rglob("*.py"))
                 for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert not offenders, "read rec.typed_spec instead:\n" + "\n".join(offenders)
