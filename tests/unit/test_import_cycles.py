"""No import cycles among shoal's modules, and every module imports on its own.

1. A static walk over every module's AST: an edge for each `import`/`from … import` of a shoal module, at
   module level *or inside a function* (a deferred import still ties the two modules together: it hides a
   cycle from the interpreter, not from the reader), except under `if TYPE_CHECKING:`. Strongly connected
   components of that graph are cycles; a new one fails the test with the modules and the lines to look at.
2. A dynamic check: each module is imported *first* in a fresh process (forked from one that pre-imported
   the third-party packages only), so a cycle that breaks only for one entry point shows up as the
   ImportError it would be for a user.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import srcast

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "shoal"

#: cycles tolerated for now (none today): an entry names a cycle someone is already breaking. The test below
#: fails on a stale entry, so this list only ever shrinks; a cycle not listed fails test_no_new_import_cycles.
KNOWN_CYCLES: set[frozenset[str]] = set()


@dataclass
class Module:
    name: str
    path: Path
    is_pkg: bool
    #: imported shoal module -> [(line, "deferred"|"top")]
    imports: dict[str, list[tuple[int, str]]] = field(default_factory=dict)


def _modules() -> dict[str, Module]:
    mods = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = Module(".".join(parts), p, is_pkg)
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return any(isinstance(n, (ast.Name, ast.Attribute)) and (getattr(n, "id", None) == "TYPE_CHECKING"
                                                            or getattr(n, "attr", None) == "TYPE_CHECKING")
               for n in ast.walk(test))


def _walk(node: ast.AST, deferred: bool = False, type_checking: bool = False
          ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Import statements under `node`, with whether each runs later than module import; skips the body of
    `if TYPE_CHECKING:` unless `type_checking`."""
    for child in ast.iter_child_nodes(node):
        if not type_checking and isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _walk_stmt(stmt, deferred, type_checking)
            continue
        yield from _walk_stmt(child, deferred, type_checking)


def _walk_stmt(node: ast.AST, deferred: bool, type_checking: bool = False
               ) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node, deferred
        return
    yield from _walk(node, deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
                     type_checking)


def _resolve(name: str, mods: dict[str, Module]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(*, type_checking: bool = False) -> dict[str, Module]:
    """Every shoal module with the shoal modules it imports (module level and deferred; the imports under
    `if TYPE_CHECKING:` too when `type_checking`)."""
    mods = _modules()
    for m in mods.values():
        for node, deferred in _walk(srcast.tree(m.path), type_checking=type_checking):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    base = m.name if m.is_pkg else m.name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    mod = f"{base}.{node.module}" if node.module else base
                else:
                    mod = node.module or ""
                # `from pkg import sub` imports the submodule; `from mod import name` imports mod
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            for t in targets:
                r = _resolve(t, mods) if t.startswith("shoal") else None
                if r and r != m.name:
                    m.imports.setdefault(r, []).append((node.lineno, "deferred" if deferred else "top"))
    return mods


def cycles(mods: dict[str, Module]) -> list[frozenset[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []
    counter = 0
    for root in mods:
        if root in index:
            continue
        work = [(root, iter(mods[root].imports))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(mods[w].imports)))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def _describe(comp: frozenset[str], mods: dict[str, Module]) -> str:
    lines = []
    for a in sorted(comp):
        for b, where in sorted(mods[a].imports.items()):
            if b in comp:
                at = ", ".join(f"line {ln} ({kind})" for ln, kind in where)
                lines.append(f"    {a} -> {b}: {mods[a].path.relative_to(SRC.parent)} {at}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def graph() -> dict[str, Module]:
    """shoal's import graph (walked once for the tests that read it)."""
    return import_graph()


def test_no_new_import_cycles(graph: dict[str, Module]) -> None:
    mods = graph
    assert len(mods) > 50 and "shoal.sdk.client" in mods["shoal"].imports  # the walk sees imports at all
    new = [c for c in cycles(mods) if c not in KNOWN_CYCLES]
    assert not new, "import cycles (break them: move the shared part into a module both can import, or import " \
        "under TYPE_CHECKING for annotations only):\n" + "\n".join(_describe(c, mods) for c in new)


def test_known_cycles_still_exist(graph: dict[str, Module]) -> None:
    """KNOWN_CYCLES only shrinks: an entry whose cycle is gone must be removed from it."""
    found = set(cycles(graph))
    stale = [sorted(c) for c in KNOWN_CYCLES if c not in found]
    assert not stale, f"these cycles are gone: remove them from KNOWN_CYCLES in {__file__}: {stale}"


def test_the_walk_finds_a_cycle_and_ignores_type_checking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checker itself: a deferred-import cycle is found; a TYPE_CHECKING-only one is not."""
    pkg = tmp_path / "shoal"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from shoal import b\n")
    (pkg / "b.py").write_text("def f():\n    from shoal.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nfrom .sub import d\n")
    (pkg / "sub" / "d.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from shoal.c import y\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
    mods = import_graph()
    assert cycles(mods) == [frozenset({"shoal.a", "shoal.b"})]
    assert mods["shoal.b"].imports == {"shoal.a": [(2, "deferred")]}
    assert mods["shoal.c"].imports == {"shoal.sub.d": [(2, "top")]}
    # asked to, the walk follows TYPE_CHECKING imports too (tests/unit/test_architecture.py does for shoal.node)
    with_tc = import_graph(type_checking=True)
    assert sorted(map(sorted, cycles(with_tc))) == [["shoal.a", "shoal.b"], ["shoal.c", "shoal.sub.d"]]


# A child per module, forked from a parent that imported only third-party packages and the `shoal` package
# itself (which `import shoal.x.y` always runs first): each child imports its module first, as a user would.
_CHILD = r"""
import importlib, json, os, sys
for pre in sys.argv[2:]:
    try:
        importlib.import_module(pre)
    except Exception:
        pass
results = {}
for name in json.loads(sys.argv[1]):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        msg = ""
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            msg = ("optional:" if e.name and not e.name.startswith("shoal") else "error:") + f"{type(e).__name__}: {e}"
        except BaseException as e:
            msg = f"error:{type(e).__name__}: {e}"
        os.write(w, msg.encode()[:4000])
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = f.read().decode()
    os.waitpid(pid, 0)
    results[name] = out
print(json.dumps(results))
"""
# third-party packages shoal imports at module level (pre-imported once: the children stay fast)
_PRELOAD = ["pydantic", "fastapi", "fastapi.routing", "starlette", "httpx", "rich", "typer", "prometheus_client",
            "uvicorn", "websockets", "zstandard", "anyio", "shoal"]


#: the environment the modules are imported in: a setting with a bad value and no config file, so a module that
#: reads settings at import fails here as it would for a user (tests/unit/test_config.py uses the same run)
BAD_SETTINGS_ENV = {"SHOAL_MEMORY_OVERCOMMIT": "lots", "SHOAL_CONFIG": "/dev/null"}


@functools.cache
def fresh_import_results() -> dict[str, str]:
    """Module name -> "" (imported), "optional:…" (a third-party package missing) or "error:…", each module
    imported first in a fresh process under BAD_SETTINGS_ENV; run once per test session."""
    names = sorted(set(_modules()) - {"shoal"})
    # one forking parent per CPU (up to 4), each with a share of the modules: the children are independent
    par = max(1, min(4, os.cpu_count() or 1))
    shares = [names[i::par] for i in range(par)]
    env = {**os.environ, **BAD_SETTINGS_ENV}
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(share), *_PRELOAD], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=SRC.parent, env=env) for share in shares if share]
    results: dict[str, str] = {}
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        results.update(json.loads(out))
    assert set(results) == set(names)
    return results


def test_every_module_imports_first_in_a_fresh_process() -> None:
    results = fresh_import_results()
    broken = {n: msg.removeprefix("error:") for n, msg in results.items() if msg.startswith("error:")}
    assert not broken, "modules that fail to import on their own:\n" + "\n".join(f"  {n}: {m}"
                                                                                  for n, m in broken.items())
