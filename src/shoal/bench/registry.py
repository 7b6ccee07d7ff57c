"""The scenario registry: name → async function taking a BenchContext and returning a ScenarioResult."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.bench.context import BenchContext
    from shoal.bench.results import ScenarioResult

ScenarioFn = Callable[["BenchContext"], Awaitable["ScenarioResult"]]


@dataclass
class Scenario:
    """One benchmark scenario."""

    name: str
    title: str
    fn: ScenarioFn
    #: whether the scenario compares with Docker (then it gets the private engine when there is one)
    uses_docker: bool = True


SCENARIOS: dict[str, Scenario] = {}
#: the order `shoal bench` runs them in when none are named
DEFAULT_ORDER = ["create", "exec", "density", "disk", "lazy", "fork", "pause", "fncall", "vm", "api"]


def scenario(name: str, title: str, uses_docker: bool = True) -> Callable[[ScenarioFn], ScenarioFn]:
    """Register an async scenario function under `name`."""
    def deco(fn: ScenarioFn) -> ScenarioFn:
        SCENARIOS[name] = Scenario(name, title, fn, uses_docker)
        return fn

    return deco


#: the modules that define scenarios (imported by name: they import this module to register themselves)
MODULES = ["create", "density", "disk", "exec_", "external"]


def load_all() -> dict[str, Scenario]:
    """Import the scenario modules (each registers itself) and return the registry."""
    import importlib

    for m in MODULES:
        importlib.import_module(f"shoal.bench.scenarios.{m}")
    return SCENARIOS
