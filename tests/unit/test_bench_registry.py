"""The benchmark scenario interface (shoal.bench.scenario / registry) without running a benchmark: every
registered scenario loads and declares its parameters properly, `-p` values parse by type, a scenario is
one module plus one registry line, and `shoal bench --list` works without root."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys

import pytest

from shoal.bench import registry
from shoal.bench.runner import split_overrides
from shoal.bench.scenario import NoParams, ParamError, Scenario, param, params_dict


@pytest.mark.parametrize("name", list(registry.SCENARIOS))
def test_every_registered_scenario_declares_itself(name: str) -> None:
    s = registry.get(name)
    assert isinstance(s, Scenario) and s.name == name
    assert s.title and "\n" not in s.title and len(s.title) <= 100
    assert s.run.__doc__, f"{name}: the run function needs a docstring"
    assert dataclasses.is_dataclass(s.params) and s.params.__dataclass_params__.frozen  # type: ignore[attr-defined]
    for p in s.describe():
        assert p.help, f"{name}.{p.name} has no help"
    full, quick = s.make_params(False), s.make_params(True)
    for p in s.describe():  # the --quick value has the declared type (it is what CI runs)
        assert type(getattr(quick, p.name)) is type(getattr(full, p.name)) or getattr(full, p.name) is None, p


def test_no_benchmark_code_outside_shoal_bench() -> None:
    import pathlib

    import shoal

    root = pathlib.Path(shoal.__file__).parent
    assert not (root / "images" / "bench.py").exists()
    repo_scripts = list((root.parents[1] / "benchmarks").glob("*.py"))
    assert not repo_scripts, f"benchmark code belongs in shoal.bench.scenarios: {repo_scripts}"


def test_aliases_and_unknown_names() -> None:
    assert registry.resolve(["image", "lazy", "snapshot"]) == ["lazy", "fork"]
    assert registry.resolve([]) == registry.default_names() == [
        n for n in registry.SCENARIOS if registry.get(n).default_run]
    assert "store" not in registry.default_names()  # needs MooseFS and minutes: `shoal bench store` only
    with pytest.raises(registry.UnknownScenario, match=r"unknown scenario\(s\) nosuch; known: create"):
        registry.resolve(["create", "nosuch"])
    for alias, target in registry.ALIASES.items():
        assert target in registry.SCENARIOS, alias


def test_parameters_parse_by_declared_type() -> None:
    @dataclasses.dataclass(frozen=True)
    class P:
        n: int = param(5, quick=1, help="n")
        rate: float = param(0.5, help="r")
        levels: tuple[int, ...] = param((1, 2), quick=(1,), help="l")
        on: bool = param(True, help="b")
        where: str | None = param(None, help="w")

    async def run(ctx, p):  # pragma: no cover - never run
        """-"""

    s = Scenario("t", "t", run, P)
    assert s.make_params() == P()
    assert s.make_params(quick=True) == P(n=1, levels=(1,))
    got = s.make_params(True, {"n": "7", "rate": "2", "levels": "1, 8,32", "on": "no", "where": "/x"})
    assert got == P(n=7, rate=2.0, levels=(1, 8, 32), on=False, where="/x")
    assert s.make_params(False, {"where": "none", "n": 3}).where is None
    assert params_dict(got) == {"n": 7, "rate": 2.0, "levels": [1, 8, 32], "on": False, "where": "/x"}
    for bad, msg in [({"n": "x"}, "t.n: 'x' is not a valid int"), ({"on": "maybe"}, "not a boolean"),
                     ({"nope": "1"}, "has no parameter 'nope' .its parameters: n, rate, levels, on, where.")]:
        with pytest.raises(ParamError, match=msg):
            s.make_params(False, bad)
    assert [(i.name, i.type) for i in s.describe()] == [("n", "int"), ("rate", "float"), ("levels", "int,…"),
                                                        ("on", "bool"), ("where", "str | None")]
    assert Scenario("u", "u", run).make_params() == NoParams()


def test_cli_overrides_go_to_the_scenarios_that_declare_them() -> None:
    got = split_overrides(["n=5", "pause.swap=off", "stateful.file_mb=1", "snapshot_mb=3"], ["fork", "pause"])
    assert got == {"fork": {"n": "5", "snapshot_mb": "3"}, "pause": {"n": "5", "swap": "off", "file_mb": "1"}}
    with pytest.raises(ParamError, match="none of fork has a parameter 'swap'"):
        split_overrides(["swap=on"], ["fork"])
    with pytest.raises(ParamError, match="not among those run"):
        split_overrides(["api.levels=1"], ["fork"])
    with pytest.raises(ParamError, match="KEY=VALUE"):
        split_overrides(["n"], ["fork"])


def test_a_new_scenario_is_one_module_and_one_registry_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.SCENARIOS, "echo", "tests.unit.bench_example_scenario")
    s = registry.get("echo")
    assert "echo" not in registry.default_names()  # default_run=False
    p = s.make_params(True, split_overrides(["label=y"], ["echo"])["echo"])
    res = asyncio.run(s.run(None, p))  # type: ignore[arg-type]
    assert [(m.name, m.shoal) for m in res.metrics] == [("n for y", 10)]


def test_list_needs_no_root_and_shows_parameters() -> None:
    cmd = [sys.executable, "-m", "shoal.cli.main", "bench"]
    env = dict(os.environ, COLUMNS="200")
    r = subprocess.run([*cmd, "--list"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    for name in registry.SCENARIOS:
        assert f"│ {name} " in r.stdout
    r = subprocess.run([*cmd, "fork", "--list"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "snapshot_mb" in r.stdout and "children started from the snapshot" in r.stdout
    r = subprocess.run([*cmd, "fork", "-p", "n=many"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "fork.n: 'many' is not a valid int" in r.stderr
