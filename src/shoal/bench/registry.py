"""Which scenarios exist: name → the module that defines its `SCENARIO` (one line each).

Adding a scenario is a module under `shoal/bench/scenarios/` with a `SCENARIO = Scenario(...)` and one line
in `SCENARIOS` below (its place there is its place in a plain `shoal bench` run). Modules are imported only
when a scenario is run or listed, so a scenario's dependencies cost nothing to the others.
"""

from __future__ import annotations

import importlib
from typing import Any

from shoal.bench.scenario import Scenario

SCENARIOS: dict[str, str] = {
    "create": "shoal.bench.scenarios.create",
    "exec": "shoal.bench.scenarios.exec_",
    "density": "shoal.bench.scenarios.density",
    "qos": "shoal.bench.scenarios.qos",
    "sharing": "shoal.bench.scenarios.sharing",
    "disk": "shoal.bench.scenarios.disk",
    "lazy": "shoal.bench.scenarios.lazy",
    "fork": "shoal.bench.scenarios.fork",
    "pause": "shoal.bench.scenarios.pause",
    "tides": "shoal.bench.scenarios.tides",
    "fncall": "shoal.bench.scenarios.fncall",
    "vm": "shoal.bench.scenarios.vm",
    "api": "shoal.bench.scenarios.api",
    "compat": "shoal.bench.scenarios.compat",
    "cluster": "shoal.bench.scenarios.cluster",
    "store": "shoal.bench.scenarios.store",
    "chunkread": "shoal.bench.scenarios.chunkread",
    "build": "shoal.bench.scenarios.build",
    "pull": "shoal.bench.scenarios.pull",
    "gvisor": "shoal.bench.scenarios.gvisor",
    "dashboard": "shoal.bench.scenarios.dashboard",
    "soak": "shoal.bench.scenarios.soak",
}

#: other names users reach for (the image issue speaks of `shoal bench image`)
ALIASES: dict[str, str] = {"ksm": "sharing", "image": "lazy", "images": "lazy", "snapshot": "fork", "stateful": "pause",
                           "api-server": "api", "ui": "dashboard", "events": "dashboard",
                           "e2b": "compat", "swerex": "compat", "ray": "cluster",
                           "dockerfile": "build", "churn": "soak", "registry": "pull", "registries": "pull"}


class UnknownScenario(ValueError):
    """A scenario name that is neither registered nor an alias."""


def get(name: str) -> Scenario[Any]:
    """The scenario registered as `name` (or an alias of it)."""
    name = ALIASES.get(name, name)
    if name not in SCENARIOS:
        raise UnknownScenario(f"unknown scenario(s) {name}; known: {', '.join(SCENARIOS)}")
    scen = importlib.import_module(SCENARIOS[name]).SCENARIO
    if not isinstance(scen, Scenario) or scen.name != name:
        raise TypeError(f"{SCENARIOS[name]}.SCENARIO must be a Scenario named {name!r}")
    return scen


def resolve(names: list[str] | None) -> list[str]:
    """Canonical names for `names` (aliases resolved, duplicates dropped); the default run when empty."""
    if not names:
        return default_names()
    out: list[str] = []
    bad = []
    for n in names:
        c = ALIASES.get(n, n)
        if c not in SCENARIOS:
            bad.append(n)
        elif c not in out:
            out.append(c)
    if bad:
        raise UnknownScenario(f"unknown scenario(s) {', '.join(bad)}; known: {', '.join(SCENARIOS)}")
    return out


def default_names() -> list[str]:
    """The scenarios a plain `shoal bench` runs, in order."""
    return [n for n in SCENARIOS if get(n).default_run]


def load_all() -> dict[str, Scenario[Any]]:
    """Every registered scenario (imports every scenario module)."""
    return {n: get(n) for n in SCENARIOS}
