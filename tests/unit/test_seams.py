"""The seams hold: backends come from the registry and are routed by capability, nothing outside
shoal.node reaches into a Node's private state, and shoal's own imports are never guarded."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from shoal.backends.base import Backend, Capability
from shoal.backends.registry import (
    BACKENDS,
    RUNTIMES,
    auto_runtimes,
    backend_names,
    check_backend_name,
    check_runtime_name,
    make_runtime,
)
from shoal.errors import InvalidRequest
from tests import srcast

SRC = Path(__file__).resolve().parents[2] / "src" / "shoal"


def _py_files(under: Path) -> list[Path]:
    return srcast.py_files(under)


def test_nothing_outside_node_touches_private_node_attributes() -> None:
    # `node._x`, `self.node._x`, `n._x` on a Node: the node's parts talk through public methods only
    pattern = re.compile(r"\b(?:node|_node|self\.node|ctx\.node)\._[A-Za-z]")
    offenders = []
    for path in _py_files(SRC):
        if path.is_relative_to(SRC / "node"):
            continue
        for i, line in enumerate(srcast.source(path).splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(SRC)}:{i}: {line.strip()}")
    assert not offenders, "private Node attributes used outside shoal.node:\n" + "\n".join(offenders)


def test_node_parts_do_not_reach_into_the_node_either() -> None:
    # inside shoal.node, the parts (pool, recovery, snapshot, ...) use the Node's public API too
    pattern = re.compile(r"\b(?:node|self\.node)\._[A-Za-z]")
    offenders = []
    for path in _py_files(SRC / "node"):
        for i, line in enumerate(srcast.source(path).splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(SRC)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_capabilities_are_not_found_by_name() -> None:
    # the node asks backend.capabilities: no importlib/getattr lookups, no signature sniffing, no
    # `rec.backend == "container"` switches
    bad = re.compile(r"importlib|inspect\.signature|getattr\(backend|rec\.backend\s*[=!]=|spec\.backend\s*[=!]=")
    offenders = []
    for path in _py_files(SRC / "node"):
        for i, line in enumerate(srcast.source(path).splitlines(), 1):
            if bad.search(line):
                offenders.append(f"{path.relative_to(SRC)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_no_import_guards_around_shoals_own_modules() -> None:
    offenders = []
    for path in _py_files(SRC):
        for node in srcast.nodes(path):
            if not isinstance(node, ast.Try):
                continue
            guards_import = any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in node.handlers)
            if not guards_import:
                continue
            for stmt in node.body:
                for sub in ast.walk(stmt):
                    mod = sub.module if isinstance(sub, ast.ImportFrom) else None
                    names = [a.name for a in sub.names] if isinstance(sub, ast.Import) else []
                    if (mod or "").startswith("shoal") or any(n.startswith("shoal") for n in names):
                        offenders.append(f"{path.relative_to(SRC)}:{sub.lineno}")
    assert not offenders, "import errors of shoal's own modules must be loud: " + ", ".join(offenders)


def test_every_registered_backend_imports_and_declares_capabilities() -> None:
    import importlib

    for name, entry in BACKENDS.items():
        module, _, attr = entry.factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        assert callable(factory), name
        if isinstance(factory, type):
            assert issubclass(factory, Backend)
            assert all(isinstance(c, Capability) for c in factory.capabilities), name
    # the test-only backends are registered but not offered; every other one is (no list of names here:
    # adding a backend is one registry entry, not a test edit)
    assert "fake" in BACKENDS and "fake" not in backend_names()
    assert backend_names() == [n for n, e in BACKENDS.items() if not e.test_only]
    assert backend_names(include_test_only=True) == list(BACKENDS)


def test_backend_and_runtime_names_are_checked_against_the_registry() -> None:
    assert check_backend_name("container") == "container"
    with pytest.raises(InvalidRequest, match=f"unknown backend 'docker': choose {', '.join(backend_names())}$"):
        check_backend_name("docker")
    assert check_runtime_name("auto") == "auto" and check_runtime_name("gvisor") == "gvisor"
    with pytest.raises(InvalidRequest, match="unknown runtime 'kata'"):
        check_runtime_name("kata")
    assert auto_runtimes() == ["crun", "runc"]
    for name, entry in RUNTIMES.items():
        rt = make_runtime(name, f"/usr/bin/{entry.binary}")
        assert rt.name == name and rt.binary == f"/usr/bin/{entry.binary}"
    assert make_runtime("gvisor", "/x/runsc").global_args[0] == "--platform=ptrace"
    assert make_runtime("crun", "/x/crun").overlay_helper and not make_runtime("gvisor", "/x/runsc").overlay_helper
