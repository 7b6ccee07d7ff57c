"""The layering of shoal.node and shoal.backends (docs/architecture.md), checked on the import graph.

* Backends see their node only through `shoal.backends.context` (protocols the node implements): no module
  under shoal.backends imports shoal.node, not even for annotations.
* The node's parts are given narrow protocols (`shoal.node.ports`), never the `Node`: shoal.node has no
  import circle, `if TYPE_CHECKING:` imports included (a circle closed only by annotations is still a part
  that knows the whole node).

The graph is the one tests/unit/test_import_cycles.py walks (module-level and deferred imports), here with
the TYPE_CHECKING imports added.
"""

from __future__ import annotations

import pytest

from tests.unit.test_import_cycles import Module, _describe, cycles, import_graph


@pytest.fixture(scope="module")
def graph() -> dict[str, Module]:
    """shoal's import graph, TYPE_CHECKING imports included."""
    return import_graph(type_checking=True)


def _edges(graph: dict[str, Module], src: str, dst: str) -> list[str]:
    return [f"{a} -> {b} (line {', '.join(str(ln) for ln, _ in where)})"
            for a, m in sorted(graph.items()) if a == src or a.startswith(src + ".")
            for b, where in sorted(m.imports.items()) if b == dst or b.startswith(dst + ".")]


def test_the_graph_sees_type_checking_imports(graph: dict[str, Module]) -> None:
    # base.py names NodeContext for annotations only: the walk must see that edge, or the tests below prove nothing
    assert "shoal.backends.context" in graph["shoal.backends.base"].imports
    assert "shoal.node.ports" in graph["shoal.node.recovery"].imports


def test_no_backend_imports_the_node(graph: dict[str, Module]) -> None:
    offenders = _edges(graph, "shoal.backends", "shoal.node")
    assert not offenders, ("backends see the node through shoal.backends.context only (records: shoal.records, "
                           "settings: shoal.config):\n  " + "\n  ".join(offenders))


def test_no_import_circle_inside_the_node_not_even_through_type_checking(graph: dict[str, Module]) -> None:
    node = {k: Module(v.name, v.path, v.is_pkg, {d: w for d, w in v.imports.items() if d.startswith("shoal.node")})
            for k, v in graph.items() if k.startswith("shoal.node")}
    found = cycles(node)
    assert not found, "import circles in shoal.node (give the part a protocol from shoal.node.ports):\n" + \
        "\n".join(_describe(c, node) for c in found)


def test_the_parts_of_the_node_do_not_import_node(graph: dict[str, Module]) -> None:
    # Node is the front; its parts get a protocol. Only code that drives a whole node (teardown: stop,
    # reconcile, close everything) names the class
    users = sorted(a for a, m in graph.items() if a.startswith("shoal.node.") and "shoal.node.node" in m.imports)
    assert users == ["shoal.node.teardown"], users


def test_the_node_never_reaches_into_the_container_backend(graph: dict[str, Module]) -> None:
    """Host machinery a backend keeps beside its sandboxes (zram swap, upper pool, CPU-class cgroups, runtime
    state and probe) is reached through the Backend's host hooks (host_start, host_reconcile, host_runtimes,
    host_teardown), never by importing the backend's modules — TYPE_CHECKING imports included."""
    found = sorted((a, b) for a, m in graph.items() if a.startswith("shoal.node")
                   for b in m.imports if b.startswith("shoal.backends.container"))
    assert not found, f"the node imports the container backend's machinery (give the backend a host hook): {found}"


def test_the_spec_imports_no_backend_module(graph: dict[str, Module]) -> None:
    """The spec validates CPU classes and limits from shoal.limits; what a backend does with them is its own."""
    found = sorted(b for b in graph["shoal.spec"].imports
                   if b.startswith("shoal.backends.") and b != "shoal.backends.registry")
    assert not found, found
