"""docs/architecture.md agrees with the code: the capability table with `Capability` and with each backend
class's `capabilities`, its columns with the backend and VMM registries, and every module path it names
with the source tree. Nothing here lists the backends: a new backend, VMM or capability needs a docs edit
(its column or row), never an edit of this test."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from shoal.backends.base import Backend, Capability
from shoal.backends.registry import BACKENDS, VMMS, vmm_names

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def _load(target: str) -> object:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def backend_columns() -> list[tuple[str, type[Backend]]]:
    """The table's columns as the registries define them: one per backend, one per VMM for a backend built
    on the VMM registry's choice (`microvm (qemu)`), in registry order."""
    cols: list[tuple[str, type[Backend]]] = []
    for name, entry in BACKENDS.items():
        if entry.on_vmm:
            for vmm in vmm_names():
                cls = _load(VMMS[vmm].factory)
                assert isinstance(cls, type) and issubclass(cls, Backend), VMMS[vmm].factory
                cols.append((f"{name} ({vmm})", cls))
        else:
            cls = _load(entry.factory)
            assert isinstance(cls, type) and issubclass(cls, Backend), (
                f"{entry.factory}: a registry factory that is not a Backend class must be marked on_vmm")
            cols.append((name, cls))
    return cols


def capability_table(text: str) -> tuple[list[str], dict[str, list[str]]]:
    """(column names, {capability name: cells}) of the markdown table whose header starts `| capability |`."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| capability | operations |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows: dict[str, list[str]] = {}
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        m = re.fullmatch(r"`([A-Z_]+)`", cells[0])
        assert m, f"a row of the capability table must start with a `CAPABILITY`: {ln}"
        assert len(cells) == len(header), f"{len(cells)} cells, {len(header)} columns: {ln}"
        rows[m.group(1)] = cells[2:]
    return header[2:], rows


def test_the_table_reader_reads_a_table() -> None:
    cols, rows = capability_table("x\n| capability | operations | a | b |\n| --- | --- | --- | --- |\n"
                                  "| `PAUSE` | `pause` | ✓ (SIGSTOP) | — |\n\nafter")
    assert cols == ["a", "b"] and rows == {"PAUSE": ["✓ (SIGSTOP)", "—"]}


def test_capability_rows_are_the_enum() -> None:
    _, rows = capability_table(DOC.read_text())
    assert list(rows) == [c.name for c in Capability], "docs/architecture.md's capability table: one row per " \
        "Capability, in the enum's order"


def test_columns_are_the_registered_backends() -> None:
    cols, _ = capability_table(DOC.read_text())
    assert cols == [name for name, _ in backend_columns()], "docs/architecture.md's capability table: one column " \
        "per registered backend (per VMM for microvm), in registry order"


def test_every_cell_matches_the_backend_class() -> None:
    cols, rows = capability_table(DOC.read_text())
    classes = dict(backend_columns())
    wrong = []
    for cap in Capability:
        for col, cell in zip(cols, rows[cap.name], strict=True):
            assert cell.startswith(("✓", "—")), f"{cap.name}/{col}: a cell is ✓ or — (then a note): {cell!r}"
            if cell.startswith("✓") != (cap in classes[col].capabilities):
                wrong.append(f"{cap.name} / {col}: docs say {cell[0]}, {classes[col].__name__}.capabilities "
                             f"{'has' if cap in classes[col].capabilities else 'lacks'} it")
    assert not wrong, "docs/architecture.md's capability table is wrong:\n" + "\n".join(wrong)


def test_module_paths_named_in_the_docs_exist() -> None:
    # `node/admission.py`, `backends/container/`, `tests/unit/test_seams.py`: under src/shoal or the repo root
    text = DOC.read_text()
    paths = set(re.findall(r"`((?:[a-z_]+/)+(?:[a-z_]+\.py)?|[a-z_]+\.py)`", text))
    assert len(paths) > 30, paths  # the pattern finds the page's paths at all
    missing = sorted(p for p in paths if not (ROOT / "src" / "shoal" / p).exists() and not (ROOT / p).exists())
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"
