"""Bug injection: every operator yields a valid, different program; mutations are small and reversible."""

from __future__ import annotations

import ast
import textwrap

import pytest

from shoal.rl.taskgen.config import load_task_recipe
from shoal.rl.taskgen.mutate import OPERATORS, check_mutant, find_mutations, sample_mutations

SRC = textwrap.dedent('''
    """A module."""

    def window(seq, n=2):
        """Docstrings are never mutated."""
        if n < 1:
            return []
        out = []
        done = False
        for i in range(len(seq) - n + 1):
            out.append(tuple(seq[i:i + n]))
        return out if not done else []

    def pick(a, b, flag=True):
        if a is None and b:
            return b
        total = a * 2 - b
        return max(a, b) if flag else total

    class Box:
        def __repr__(self):
            return "Box(" + str(1 + 2) + ")"

        def size(self, x):
            while x > 10:
                x //= 2
            return x % 3 == 0
''')


def test_every_operator_finds_sites_and_yields_valid_distinct_programs() -> None:
    muts = find_mutations("m.py", SRC)
    ops = {m.operator for m in muts}
    assert ops == set(OPERATORS), set(OPERATORS) - ops
    for m in muts:
        new = m.apply(SRC)
        assert check_mutant(SRC, new), m
        ast.parse(new)
        # a mutation touches one line, or deletes the lines of one statement
        changed = [i for i, (a, b) in enumerate(zip(SRC.splitlines(), new.splitlines(), strict=False)) if a != b]
        assert m.delete_lines or len(changed) == 1, (m, changed)
        assert m.function in ("window", "pick", "Box.size")


def test_docstrings_and_repr_are_left_alone() -> None:
    muts = find_mutations("m.py", SRC)
    assert not any("Docstrings" in m.original for m in muts)
    assert not any(m.function == "Box.__repr__" for m in muts)


def test_drop_return_branch_never_empties_a_block() -> None:
    src = "def f(x):\n    if x:\n        return 1\n\ndef g(x):\n    if x:\n        return 1\n    return 2\n"
    drops = [m for m in find_mutations("m.py", src) if m.operator == "drop_return_branch"]
    assert [m.function for m in drops] == ["g"]
    assert drops[0].apply(src).endswith("def g(x):\n    return 2\n")


def test_apply_refuses_changed_source() -> None:
    m = find_mutations("m.py", SRC)[0]
    with pytest.raises(ValueError, match="source changed"):
        m.apply(SRC.replace(m.original, "Z" + m.original[1:]))


def test_sampling_is_deterministic_and_spreads_over_functions() -> None:
    muts = find_mutations("m.py", SRC)
    a = sample_mutations(muts, 3, seed=1)
    assert a == sample_mutations(muts, 3, seed=1)
    assert len({m.function for m in a}) == 3
    assert len(sample_mutations(muts, 1000, seed=1)) == len(muts)


def test_unicode_columns_are_bytes() -> None:
    src = 'def f(s):\n    return "héllo" if s < 3 else s\n'
    for m in find_mutations("m.py", src):
        assert check_mutant(src, m.apply(src))


def test_shipped_recipe_is_valid() -> None:
    r = load_task_recipe()
    assert {p.name for p in r.projects} >= {"inflection", "toolz", "cachetools"}
    assert all(p.version for p in r.projects) and r.python_packages
    assert r.key() == load_task_recipe().key()
    assert r.select(["toolz"]).projects[0].name == "toolz"


def test_recipe_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from shoal.errors import InvalidRequest

    p = tmp_path / "r.toml"
    for text, words in [
        ("[[project]]\nname='X Y'\nversion='1'\nsources=['a.py']\n", "lowercase"),
        ("[[project]]\nname='x'\nversion='1'\nsources=['../a.py']\n", "relative path"),
        ("[python]\npackages=['pytest']\n[[project]]\nname='x'\nversion='1'\nsources=['a.py']\n", "pinned"),
        ("[mutations]\noperators=['nope']\n[[project]]\nname='x'\nversion='1'\nsources=['a.py']\n", "unknown"),
        ("[mutations]\nbogus=1\n[[project]]\nname='x'\nversion='1'\nsources=['a.py']\n", "not a setting"),
        ("version = 1\n", "at least one"),
    ]:
        p.write_text(text)
        with pytest.raises(InvalidRequest, match=words):
            load_task_recipe(p)
    with pytest.raises(InvalidRequest, match="unknown project"):
        load_task_recipe().select(["nope"])
