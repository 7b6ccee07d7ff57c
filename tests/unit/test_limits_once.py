"""Limits and timeouts are defined once, in shoal.limits (issue 27, item 5): the agent-connect timeouts, the
batch limits of each door, the default backend. The other modules name the constant, never the number."""

from __future__ import annotations

import ast
from pathlib import Path

from shoal import limits
from shoal.config import Settings
from tests import srcast

SRC = Path(__file__).resolve().parents[2] / "src" / "shoal"


def _py_files() -> list[Path]:
    return srcast.py_files(SRC)


def _literal_defaults(path: Path, param: str) -> list[tuple[int, object]]:
    """(line, value) of every literal default of a parameter or dataclass field called `param`."""
    out = []
    for node in srcast.nodes(path):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out += _literal_defaults_of(node, param)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == param \
                and isinstance(node.value, ast.Constant):
            out.append((node.lineno, node.value.value))
    return out


def test_agent_connect_timeouts_come_from_limits() -> None:
    # every `connect(rec, timeout=…)` of a backend, the node's connection cache and the agent client
    offenders = []
    for p in _py_files():
        if p.name == "limits.py":
            continue
        for node in srcast.nodes(p):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in {"connect", "connect_unix"}:
                if node.returns is None or "AgentClient" not in ast.unparse(node.returns):
                    continue  # e.g. a QMP socket: not the agent
                offenders += [f"{p.relative_to(SRC)}:{ln}" for ln, _ in _literal_defaults_of(node, "timeout")]
    assert not offenders, "agent connect timeouts written as numbers (use shoal.limits):\n" + "\n".join(offenders)
    assert limits.AGENT_READY_TIMEOUT_S == 30.0 and limits.AGENT_CONNECT_TIMEOUT_S == 10.0


def _literal_defaults_of(fn: ast.FunctionDef | ast.AsyncFunctionDef, param: str) -> list[tuple[int, object]]:
    a = fn.args
    pos = a.posonlyargs + a.args
    pairs = list(zip(pos[len(pos) - len(a.defaults):], a.defaults, strict=True))
    pairs += [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None]
    return [(d.lineno, d.value) for k, d in pairs if k.arg == param and isinstance(d, ast.Constant)]


def test_the_default_backend_is_named_once() -> None:
    offenders = [f"{p.relative_to(SRC)}:{ln}" for p in _py_files() if p.name != "limits.py"
                 for ln, v in _literal_defaults(p, "backend") if v == limits.DEFAULT_BACKEND]
    assert not offenders, "backend defaults written as a literal (use limits.DEFAULT_BACKEND):\n" + "\n".join(offenders)


def test_batch_limits_are_the_ones_in_limits() -> None:
    from shoal.server import fusion, schemas

    assert schemas.MAX_BATCH == limits.MAX_HTTP_BATCH
    assert fusion.MAX_BATCH == limits.MAX_RUN_CODE_BATCH
    assert Settings.load(env={}).api_max_batch == limits.MAX_HTTP_BATCH
    # the layers are ordered: an HTTP batch always fits a node's
    assert limits.MAX_HTTP_BATCH <= limits.MAX_BATCH
    # no module spells a batch bound as a number of its own
    numbers = {100_000, 4096, 10_000, 1000}
    offenders = []
    for p in _py_files():
        if p.name == "limits.py":
            continue
        for node in srcast.nodes(p):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "MAX_BATCH"
                                                    for t in node.targets) \
                    and isinstance(node.value, ast.Constant) and node.value.value in numbers:
                offenders.append(f"{p.relative_to(SRC)}:{node.lineno}")
    assert not offenders, "\n".join(offenders)


def test_the_scan_finds_literal_defaults(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f(a, backend='container'):\n    pass\n\nclass C:\n    backend: str = 'container'\n")
    assert _literal_defaults(bad, "backend") == [(1, "container"), (5, "container")]
