"""Records carry the typed spec (issue 27, item 5): `SandboxRecord.spec` is a shoal.spec.SandboxSpec, record.json
holds its JSON form, and a record.json of an earlier release (its spec a dict lacking later fields, or holding
fields this release does not know) still loads, and its live sandbox is adopted after an upgrade. No code in src
reads a spec as a dict (`spec.get(...)`, `spec[...]`) except at the allow-listed edges below."""

from __future__ import annotations

import ast
import json
import logging
import os
from pathlib import Path

import pytest

from shoal import records
from shoal.node.node import Node
from shoal.records import SandboxRecord, list_records
from shoal.spec import SandboxSpec
from tests.srcast import SRC, nodes, py_files, source
from tests.unit.conftest import add_image, fake_config

FIXTURES = Path(__file__).resolve().parent / "fixtures"
#: the spec's fields an older release's record lacks (the release this fixture comes from, 13d0a9b)
LATER_FIELDS = {"egress_grants", "egress_mbps", "cpu_class"}


def _place(fixture: str, parent: Path, sandbox_id: str = "n0-aaaaaaaaaaaaaaaaaaaaaaaaaa") -> Path:
    d = parent / sandbox_id
    d.mkdir(parents=True)
    data = json.loads((FIXTURES / fixture).read_text())
    data["dir"] = str(d)
    (d / "record.json").write_text(json.dumps(data, indent=1))
    return d


def test_a_record_of_an_earlier_release_loads_typed(tmp_path: Path) -> None:
    d = _place("record-13d0a9b.json", tmp_path)
    rec = SandboxRecord.load(d)
    spec = rec.spec
    assert isinstance(spec, SandboxSpec)
    assert (spec.cpus, spec.memory_mb, spec.project, spec.env, spec.labels, spec.workdir) == \
        (2.0, 512, "p1", {"A": "1"}, {"k": "v"}, "/work")
    # fields that release did not have take their defaults
    default = SandboxSpec()
    assert all(getattr(spec, f) == getattr(default, f) for f in LATER_FIELDS)
    # saved again, record.json holds the whole spec of this release
    rec.save()
    saved = json.loads((d / "record.json").read_text())["spec"]
    assert set(saved) == set(SandboxSpec.model_fields) and saved["memory_mb"] == 512
    assert SandboxRecord.load(d).spec == spec


def test_unknown_spec_keys_are_ignored_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = _place("record-13d0a9b.json", tmp_path)
    data = json.loads((d / "record.json").read_text())
    data["spec"]["gpus_from_a_newer_shoal"] = 1
    (d / "record.json").write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="shoal.spec"):
        assert SandboxRecord.load(d).spec.memory_mb == 512
        records.forget_record(d)  # parsed again: no second warning for the same keys
        assert [r.id for r in list_records(tmp_path)] == [d.name]
    warned = [r for r in caplog.records if "gpus_from_a_newer_shoal" in r.getMessage()]
    assert len(warned) == 1
    assert "gpus_from_a_newer_shoal" not in SandboxRecord.load(d).to_dict()["spec"]


def test_a_loaded_record_owns_its_spec(tmp_path: Path) -> None:
    d = tmp_path / "n0-bbbbbbbbbbbbbbbbbbbbbbbbbb"
    d.mkdir()
    spec = SandboxSpec(env={"A": "1"}, labels={"k": "v"}, network=["pypi.org"], egress_grants=["private"])
    SandboxRecord(id=d.name, backend="fake", image="t:1", image_digest="", layers=[], spec=spec, dir=str(d)).save()
    a, b = SandboxRecord.load(d), SandboxRecord.load(d)  # the second from the parsed-record cache
    # every dict or list of the spec is in the list spec_copy copies
    held = {k for k, v in a.spec.__dict__.items() if isinstance(v, (dict, list))}
    assert held == set(records._SPEC_CONTAINERS)
    a.spec.env["B"] = "2"
    a.spec.labels["x"] = "y"
    assert isinstance(a.spec.network, list) and a.spec.egress_grants is not None
    a.spec.network.append("npm")
    a.spec.egress_grants.append("metadata")
    a.spec.memory_mb = 2048
    assert SandboxRecord.load(d).spec == b.spec == spec


async def test_node_adopts_a_sandbox_whose_record_is_in_the_old_form(fake_home: Path) -> None:
    from tests.unit.conftest import AGENT_BUILT

    if not AGENT_BUILT:
        pytest.skip("the agent is not built: run `make agent`")
    first = Node(fake_config(fake_home))
    add_image(first.store, "t:1", {"/work/x": "x"})
    await first.start(reap=False)
    info = await first.create(SandboxSpec(image="t:1", backend="fake", memory_mb=96, labels={"k": "v"}))
    await first.connections.close_all()  # the node "crashes"; then shoal is upgraded
    # record.json as the release before the spec model wrote it: indented, its spec a dict without the fields
    # added since, and one this release does not know
    path = first.record(info.id).path / "record.json"
    data = json.loads(path.read_text())
    data["spec"] = {k: v for k, v in data["spec"].items() if k not in LATER_FIELDS} | {"retired_option": True}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
    second = Node(fake_config(fake_home))
    await second.start(reap=False)
    try:
        assert [(i.id, i.state) for i in await second.list()] == [(info.id, "running")]
        assert second.admission.snapshot().committed_mb == 96
        assert (await second.exec(info.id, "echo adopted")).stdout == b"adopted\n"
        rec = second.record(info.id)
        assert isinstance(rec.spec, SandboxSpec) and rec.spec.memory_mb == 96 and rec.spec.labels == {"k": "v"}
        assert (await second.get(info.id)).spec["memory_mb"] == 96  # the SDK's view: the JSON form
    finally:
        await second.close_all()
        await second.stop()
    assert not list_records(second.paths.sandboxes)


# ---- no untyped spec reads ---------------------------------------------------------------------------------

#: a line may read a spec as a dict only at an edge that says so with this marker (and why, next to it)
ALLOW = "untyped-spec-read: allowed"


def _specish(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "spec") or (isinstance(node, ast.Attribute)
                                                                  and node.attr == "spec")


def untyped_spec_reads(source: str, walked: tuple[ast.AST, ...] | None = None) -> list[tuple[int, str]]:
    """(line, code) of each `spec.get(...)`, `spec[...]`, `x.spec.get(...)`, `x.spec[...]` (and `.items()`,
    `.keys()`, `.values()`, `.setdefault()`, `.pop()`) in a module, but those on lines marked ALLOW."""
    lines = source.splitlines()
    out = []
    for node in walked if walked is not None else tuple(ast.walk(ast.parse(source))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("get", "items", "keys", "values", "setdefault", "pop"):
            target: ast.expr = node.func.value
        elif isinstance(node, ast.Subscript):
            target = node.value
        else:
            continue
        if _specish(target) and ALLOW not in lines[node.lineno - 1]:
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_the_scan_finds_dict_reads_of_a_spec() -> None:
    code = ("a = spec.get('cpus')\nb = rec.spec['memory_mb']\nc = rec.spec.get('x')  # " + ALLOW + "\n"
            "d = spec.cpus\ne = info.spec.items()\nf = rec.extra.get('workdir')\n")
    assert [n for n, _ in untyped_spec_reads(code)] == [1, 2, 5]


def test_no_untyped_spec_reads_in_src() -> None:
    offenders = [f"{p.relative_to(SRC)}:{n}: {code}" for p in py_files()
                 for n, code in untyped_spec_reads(source(p), nodes(p))]
    assert not offenders, ("read the typed spec (record.spec.cpus; JSON from another process through "
                           "SandboxSpec.from_wire) instead of:\n" + "\n".join(offenders))
    allowed = [f"{p.relative_to(SRC)}" for p in py_files() if ALLOW in source(p)]
    assert allowed == ["cli/main.py"], allowed  # a new exception is a decision: name it here


# ---- the cluster wire: JSON between processes, typed at its edges ------------------------------------------

async def test_the_gateway_reads_wire_specs_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.cluster.gateway import ClusterFront
    from shoal.models import SandboxInfo

    front = ClusterFront("ray://nowhere:1", home=str(tmp_path / "home"), store=str(tmp_path / "store"))
    sid, other = "r1-" + "a" * 26, "r1-" + "b" * 26
    # an agent's usage row (its spec as JSON, from a newer release: one key this one does not know)
    row = (sid, "p", 2.0, 256, "running", {**SandboxSpec(cpus=2, memory_mb=256, project="p").to_dict(), "new": 1})

    async def states(max_age_s: float = 0.0) -> list[dict]:
        return [{"node_id": "r1"}]

    async def usage_of(node_id: str) -> list[tuple]:
        return [row]

    async def get(sandbox_id: str) -> SandboxInfo:
        return SandboxInfo(id=sandbox_id, image="base", backend="container", state="running", created_at=1.0,
                           spec={"project": "q", "memory_mb": 64})  # a partial spec: the rest defaults

    monkeypatch.setattr(front.transport, "states", states)
    monkeypatch.setattr(front, "_usage_of", usage_of)
    monkeypatch.setattr(front.transport, "get", get)
    await front.refresh_usage()
    own = front.record(sid)
    assert isinstance(own.spec, SandboxSpec) and (own.spec.cpus, own.spec.memory_mb, own.project) == (2.0, 256, "p")
    own = await front.record_async(other)
    assert isinstance(own.spec, SandboxSpec) and (own.project, own.spec.memory_mb) == ("q", 64)
    assert own.spec.max_output_bytes == SandboxSpec().max_output_bytes
