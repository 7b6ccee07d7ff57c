"""shoal's own sources, read and parsed once per test session, for the tests that check rules over the code
(architecture, seams, limits, settings, import cycles). Each of them walked the whole tree on its own: about
a dozen parses of ~60,000 lines, a third of the unit suite's CPU time. Callers must not modify the trees."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "shoal"


def py_files(under: Path = SRC) -> list[Path]:
    """Every .py file under `under`, sorted."""
    return sorted(p for p in under.rglob("*.py") if "__pycache__" not in p.parts)


@functools.cache
def source(path: Path) -> str:
    """The text of `path`."""
    return path.read_text()


@functools.cache
def tree(path: Path) -> ast.Module:
    """The parsed module at `path` (shared: do not modify)."""
    return ast.parse(source(path), str(path))


@functools.cache
def nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of `tree(path)`, in `ast.walk` order."""
    return tuple(ast.walk(tree(path)))
