"""Bug injection by AST mutation: find sites in real functions, rewrite one expression or drop one branch.

Each mutation edits a single-line expression in place (or deletes whole lines for a dropped branch), so
the injected bug — and the gold patch that reverts it — is a small, readable diff. Operators:

    flip_compare        <  ↔ <=, >  ↔ >=, == ↔ !=, is ↔ is not, in ↔ not in
    off_by_one          an integer constant n becomes n+1 or n-1 (in indexes, slices, ranges, arithmetic, comparisons)
    swap_operands       a - b → b - a (non-commutative operators), a < b → b < a
    arith_op            + ↔ -, * ↔ //, / → *, % → //
    bool_op             and ↔ or
    negate_condition    if c: / while c: / ternary c → not c
    drop_return_branch  remove an `if ...: return ...` guard
    swap_args           f(a, b) → f(b, a)
    flip_bool           True ↔ False
"""

from __future__ import annotations

import ast
import copy
import hashlib
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass

OPERATORS = ("flip_compare", "off_by_one", "swap_operands", "arith_op", "bool_op", "negate_condition",
             "drop_return_branch", "swap_args", "flip_bool")

_CMP_FLIP: dict[type, type] = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
                               ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
                               ast.In: ast.NotIn, ast.NotIn: ast.In}
_ARITH: dict[type, type] = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult,
                            ast.Div: ast.Mult, ast.Mod: ast.FloorDiv}
_DUNDERS_KEPT = ("__init__", "__call__", "__getitem__", "__contains__", "__len__", "__iter__", "__setitem__",
                 "__delitem__", "__eq__", "__lt__")
_NONCOMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.LShift, ast.RShift)


@dataclass(frozen=True)
class Mutation:
    """One bug: replace lines[lineno-1][col:end_col] with `replacement` (or delete lines when `delete_lines`)."""

    file: str
    operator: str
    function: str
    lineno: int
    end_lineno: int
    col: int
    end_col: int
    original: str
    replacement: str
    delete_lines: bool = False

    @property
    def key(self) -> str:
        """A short stable id of this mutation."""
        h = hashlib.sha256(f"{self.file}:{self.lineno}:{self.col}:{self.operator}:{self.replacement}".encode())
        return h.hexdigest()[:8]

    def apply(self, source: str) -> str:
        """The mutated source; ValueError when `source` is not the text this mutation was found in."""
        lines = source.splitlines(keepends=True)
        if self.delete_lines:
            seg = "".join(lines[self.lineno - 1:self.end_lineno])
            if seg != self.original:
                raise ValueError(f"{self.file}:{self.lineno}: source changed since the mutation was found")
            return "".join(lines[:self.lineno - 1] + lines[self.end_lineno:])
        line = lines[self.lineno - 1]
        b = line.encode()
        seg = b[self.col:self.end_col].decode()
        if seg != self.original:
            raise ValueError(f"{self.file}:{self.lineno}: source changed since the mutation was found")
        new = (b[:self.col] + self.replacement.encode() + b[self.end_col:]).decode()
        return "".join([*lines[:self.lineno - 1], new, *lines[self.lineno:]])

    def to_dict(self) -> dict:
        """JSON-friendly form."""
        return asdict(self)


def _is_docstring(node: ast.AST, parent: ast.AST) -> bool:
    body = getattr(parent, "body", None)
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str) and bool(body) and body[0] is node)


def _walk_functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function and method, outermost first."""
    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                q = f"{prefix}{child.name}"
                yield q, child
                yield from visit(child, q + ".")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, f"{prefix}{child.name}.")
    yield from visit(tree, "")


def _own_nodes(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[tuple[ast.AST, ast.AST]]:
    """(node, parent) pairs in the function's body, not descending into nested functions or classes."""
    stack: list[tuple[ast.AST, ast.AST]] = [(s, fn) for s in fn.body]
    while stack:
        node, parent = stack.pop()
        if _is_docstring(node, parent):
            continue
        yield node, parent
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                stack.append((child, node))


class _Finder:
    def __init__(self, path: str, source: str) -> None:
        self.path = path
        self.source = source
        self.lines = source.splitlines(keepends=True)
        self.out: list[Mutation] = []

    def _single(self, node: ast.AST) -> bool:
        return (getattr(node, "lineno", None) is not None and node.lineno == node.end_lineno  # type: ignore[attr-defined]
                and node.end_col_offset is not None)  # type: ignore[attr-defined]

    def _seg(self, node: ast.AST) -> str:
        b = self.lines[node.lineno - 1].encode()  # type: ignore[attr-defined]
        return b[node.col_offset:node.end_col_offset].decode()  # type: ignore[attr-defined]

    def add(self, op: str, fn: str, node: ast.AST, replacement: str) -> None:
        if not self._single(node):
            return
        original = self._seg(node)
        if replacement == original:
            return
        self.out.append(Mutation(self.path, op, fn, node.lineno, node.end_lineno, node.col_offset,  # type: ignore[attr-defined]
                                 node.end_col_offset, original, replacement))  # type: ignore[attr-defined]

    def swap_node(self, op: str, fn: str, node: ast.AST, new: ast.AST) -> None:
        try:
            text = ast.unparse(new)
        except Exception:
            return
        self.add(op, fn, node, text)


def find_mutations(path: str, source: str, operators: tuple[str, ...] | list[str] = OPERATORS,
                   skip_functions: tuple[str, ...] | list[str] = ()) -> list[Mutation]:
    """Every mutation site of the given operators in the functions of `source` (deterministic order)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    f = _Finder(path, source)
    ops = set(operators)
    for qual, fn in _walk_functions(tree):
        if any(qual == s or qual.endswith("." + s) for s in skip_functions):
            continue
        if fn.name.startswith("__") and fn.name not in _DUNDERS_KEPT:
            continue  # __repr__ and friends: bugs there rarely break behaviour tests
        for node, parent in _own_nodes(fn):
            _mutations_of(f, ops, qual, node, parent)
    # a stable order independent of traversal details
    f.out.sort(key=lambda m: (m.lineno, m.col, m.operator, m.replacement))
    seen, uniq = set(), []
    for m in f.out:
        k = (m.lineno, m.col, m.end_col, m.replacement, m.delete_lines)
        if k not in seen:
            seen.add(k)
            uniq.append(m)
    return uniq


def _mutations_of(f: _Finder, ops: set[str], fn: str, node: ast.AST, parent: ast.AST) -> None:
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        if "flip_compare" in ops and type(node.ops[0]) in _CMP_FLIP:
            new = copy.deepcopy(node)
            new.ops = [_CMP_FLIP[type(node.ops[0])]()]
            f.swap_node("flip_compare", fn, node, new)
        if "swap_operands" in ops and isinstance(node.ops[0], (ast.Lt, ast.LtE, ast.Gt, ast.GtE)):
            new = copy.deepcopy(node)
            new.left, new.comparators = node.comparators[0], [node.left]
            f.swap_node("swap_operands", fn, node, new)
    elif isinstance(node, ast.BinOp):
        if "arith_op" in ops and type(node.op) in _ARITH and not _is_string_format(node):
            new = copy.deepcopy(node)
            new.op = _ARITH[type(node.op)]()
            f.swap_node("arith_op", fn, node, new)
        if "swap_operands" in ops and isinstance(node.op, _NONCOMMUTATIVE) and not _is_string_format(node):
            new = copy.deepcopy(node)
            new.left, new.right = node.right, node.left
            f.swap_node("swap_operands", fn, node, new)
    elif isinstance(node, ast.BoolOp) and len(node.values) == 2 and "bool_op" in ops:
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        f.swap_node("bool_op", fn, node, new)
    elif isinstance(node, ast.Constant) and "off_by_one" in ops and type(node.value) is int \
            and _numeric_context(parent):
        for delta in (1, -1):
            v = node.value + delta
            if v >= 0 or node.value < 0:
                f.add("off_by_one", fn, node, repr(v))
    elif isinstance(node, ast.Constant) and "flip_bool" in ops and isinstance(node.value, bool):
        f.add("flip_bool", fn, node, repr(not node.value))
    elif isinstance(node, ast.Call) and "swap_args" in ops and len(node.args) == 2 and not node.keywords \
            and not any(isinstance(a, ast.Starred) for a in node.args):
        a, b = node.args
        if f._single(a) and f._single(b) and a.lineno == b.lineno and ast.dump(a) != ast.dump(b):
            new = copy.deepcopy(node)
            new.args = [b, a]
            f.swap_node("swap_args", fn, node, new)
    if isinstance(node, (ast.If, ast.While, ast.IfExp)) and "negate_condition" in ops:
        test = node.test
        if f._single(test) and not (isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)):
            seg = f._seg(test)
            simple = isinstance(test, (ast.Name, ast.Attribute, ast.Call, ast.Subscript))
            f.add("negate_condition", fn, test, f"not {seg}" if simple else f"not ({seg})")
    if isinstance(node, ast.If) and "drop_return_branch" in ops:
        _drop_return(f, fn, node, parent)


def _is_string_format(node: ast.BinOp) -> bool:
    return isinstance(node.op, (ast.Mod, ast.Add)) and any(
        isinstance(x, (ast.Constant, ast.JoinedStr)) and isinstance(getattr(x, "value", ""), str)
        for x in (node.left, node.right))


def _numeric_context(parent: ast.AST) -> bool:
    if isinstance(parent, (ast.Subscript, ast.Slice, ast.BinOp, ast.Compare, ast.AugAssign, ast.UnaryOp)):
        return True
    return isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name) and parent.func.id in (
        "range", "islice", "enumerate", "pow", "round")


def _drop_return(f: _Finder, fn: str, node: ast.If, parent: ast.AST) -> None:
    if node.orelse or not node.body or not isinstance(node.body[-1], ast.Return):
        return
    siblings = None
    for name in ("body", "orelse", "finalbody"):
        block = getattr(parent, name, None)
        if isinstance(block, list) and node in block:
            siblings = block
    if not siblings or len(siblings) < 2:
        return  # removing the only statement would leave an empty block
    first, last = node.lineno, node.end_lineno or node.lineno
    lines = f.lines
    indent = len(lines[first - 1]) - len(lines[first - 1].lstrip())
    if node.col_offset != indent or lines[last - 1].rstrip("\r\n").rstrip()[-1:] in ("\\", ","):
        return
    # the statement must own its lines (no `x = 1; if ...` sharing a line)
    for s in siblings:
        if s is not node and (first <= s.lineno <= last or first <= (s.end_lineno or s.lineno) <= last):
            return
    original = "".join(lines[first - 1:last])
    f.out.append(Mutation(f.path, "drop_return_branch", fn, first, last, 0, 0, original, "", delete_lines=True))


def sample_mutations(candidates: list[Mutation], n: int, seed: int | str) -> list[Mutation]:
    """Up to `n` candidates, spread over functions and operators first (deterministic for a seed)."""
    rng = random.Random(str(seed))
    pool = list(candidates)
    rng.shuffle(pool)
    chosen: list[Mutation] = []
    seen_fn: set[tuple[str, str]] = set()
    seen_op_fn: set[tuple[str, str, str]] = set()
    # pass 1: one per function; pass 2: one per (function, operator); pass 3: anything left
    for key in (lambda m: (m.file, m.function), lambda m: (m.file, m.function, m.operator), None):
        for m in pool:
            if len(chosen) >= n:
                return chosen
            if m in chosen:
                continue
            if key is None:
                chosen.append(m)
                continue
            k = key(m)
            bucket = seen_fn if len(k) == 2 else seen_op_fn
            if k in bucket:
                continue
            bucket.add(k)  # type: ignore[arg-type]
            chosen.append(m)
    return chosen


def check_mutant(source: str, mutated: str) -> bool:
    """True when the mutant parses and differs from the original in its AST (not just in formatting)."""
    try:
        return ast.dump(ast.parse(source)) != ast.dump(ast.parse(mutated))
    except SyntaxError:
        return False
