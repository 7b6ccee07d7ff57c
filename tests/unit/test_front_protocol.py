"""One front protocol (issue 27, item 4): the embedded Node and the cluster gateway both implement every
operation of shoal.front.Front, with parameters a caller written against the protocol can pass; what the
gateway cannot do raises a typed error; the server tells them apart by `kind`, not by probing attributes."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from shoal.cluster.gateway import ClusterFront
from shoal.errors import Unsupported
from shoal.front import Front
from shoal.node.node import Node

SRC = Path(__file__).resolve().parents[2] / "src" / "shoal"
OPERATIONS = sorted(n for n, v in vars(Front).items() if inspect.isfunction(v) and not n.startswith("_"))


def _accepts(impl: inspect.Signature, proto: inspect.Signature) -> list[str]:
    """What a call written against `proto` would pass that `impl` refuses."""
    params = impl.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    problems = []
    for name, p in proto.parameters.items():
        if name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if name not in params and not var_kw:
            problems.append(f"no parameter {name!r}")
    # nothing the protocol does not pass may be required
    for name, p in params.items():
        if name != "self" and p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) \
                and name not in proto.parameters:
            problems.append(f"requires {name!r}, which the protocol does not pass")
    return problems


@pytest.mark.parametrize("impl", [Node, ClusterFront], ids=["node", "gateway"])
def test_both_fronts_implement_every_operation(impl: type) -> None:
    assert len(OPERATIONS) >= 25  # create, get, list, exec, stream, shells, files, pause, resume, snapshot …
    problems = []
    for name in OPERATIONS:
        mine = getattr(impl, name, None)
        if mine is None:
            problems.append(f"{name}: missing")
            continue
        proto = getattr(Front, name)
        if inspect.iscoroutinefunction(proto) != inspect.iscoroutinefunction(mine):
            problems.append(f"{name}: async in one, not the other")
        problems += [f"{name}: {p}" for p in _accepts(inspect.signature(mine), inspect.signature(proto))]
    assert not problems, "\n".join(problems)
    assert impl.kind in ("node", "cluster")


def test_the_check_can_fail() -> None:
    class Partial:
        kind = "node"

        async def get(self, sandbox_id: str, extra: int) -> None: ...

    assert _accepts(inspect.signature(Partial.get), inspect.signature(Front.get)) == [
        "requires 'extra', which the protocol does not pass"]


async def test_what_the_gateway_cannot_do_is_a_typed_error(tmp_path: Path) -> None:
    front = ClusterFront("ray://127.0.0.1:1", home=str(tmp_path / "h"), store=str(tmp_path / "s"))
    with pytest.raises(Unsupported, match="memory snapshot 'snap' needs the node that holds it"):
        await front.restore("snap")
    with pytest.raises(Unsupported, match="set_cpu_class"):
        await front.set_cpu_class("n0-x", "batch")
    assert front.kind == "cluster" and Node.kind == "node"


def test_the_server_does_not_probe_the_front() -> None:
    # the server and compat APIs use the protocol: no hasattr/getattr on the front object
    bad = re.compile(r"(hasattr|getattr)\((st\.node|node|self\.front|front)\b")
    offenders = []
    for path in [*sorted((SRC / "server").rglob("*.py")), SRC / "cluster" / "agent.py"]:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if bad.search(line) or "getattr(self.node" in line:
                offenders.append(f"{path.relative_to(SRC)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
