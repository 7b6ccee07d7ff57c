"""The unmodified modules of frameworks that need torch to import (verl, OpenRLHF, TRL), loaded by path from
their PyPI wheels (`make setup` unpacks them under build/frameworks, never installs them), as those
projects' own test suites load single modules without their GPU stacks."""

from __future__ import annotations

import ast
import importlib.util
import logging
import sys
import types
from pathlib import Path
from typing import Any

import pytest

FRAMEWORKS = Path(__file__).resolve().parents[1] / "build" / "frameworks"


def framework_file(name: str, rel: str) -> Path:
    """`rel` inside the unpacked wheel of `name` (its purelib data dir or its top level); skip if absent."""
    root = FRAMEWORKS / name
    for cand in [root / rel, *root.glob(f"*.data/purelib/{rel}")]:
        if cand.is_file():
            return cand
    pytest.skip(f"{name}'s wheel is not unpacked under {root}: run `make setup`")


def wheel_version(name: str) -> str:
    """The version of the unpacked wheel (from its dist-info directory's name)."""
    [info] = list((FRAMEWORKS / name).glob(f"{name}-*.dist-info"))
    return info.name[len(name) + 1:-len(".dist-info")]


def load_module(fullname: str, path: Path, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Execute `path` as module `fullname` (parent packages become empty namespaces), undone after the test."""
    parts = fullname.split(".")
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if pkg not in sys.modules:
            mod = types.ModuleType(pkg)
            mod.__path__ = []
            monkeypatch.setitem(sys.modules, pkg, mod)
    spec = importlib.util.spec_from_file_location(fullname, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, fullname, mod)
    spec.loader.exec_module(mod)
    return mod


def stub_logger_module(fullname: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module whose `init_logger` is logging.getLogger (OpenRLHF's tests stub its logging_utils the same way)."""
    mod = types.ModuleType(fullname)
    mod.init_logger = logging.getLogger  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, fullname, mod)


def function_from_source(path: Path, name: str, namespace: dict[str, Any]) -> Any:
    """One top-level function of a framework's source file, compiled unmodified in `namespace` (for a module
    whose other imports need GPU stacks: e.g. OpenRLHF's `_load_agent_executor` beside vLLM and Ray)."""
    tree = ast.parse(path.read_text(), str(path))
    [fn] = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    code = compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec")
    exec(code, namespace)
    return namespace[name]


def method_from_source(path: Path, class_name: str, name: str, namespace: dict[str, Any]) -> Any:
    """One method of a class in a framework's source file, compiled unmodified as a plain function in
    `namespace` (call it with the object standing for `self`)."""
    tree = ast.parse(path.read_text(), str(path))
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name]
    [fn] = [n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    fn.decorator_list = []
    code = compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec")
    exec(code, namespace)
    return namespace[name]
