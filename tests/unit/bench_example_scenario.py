"""A scenario defined outside shoal, the way a new one is written (test_bench_registry registers it):
one module with a parameters dataclass and `SCENARIO`."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult
from shoal.bench.scenario import Scenario, param


@dataclass(frozen=True)
class EchoParams:
    """Parameters of the example."""

    n: int = param(1000, quick=10, help="how many")
    label: str = param("x", help="a name")


async def run(ctx: BenchContext, p: EchoParams) -> ScenarioResult:
    """Reports its parameters as a metric (no sandboxes)."""
    res = ScenarioResult("echo")
    res.add(Metric(f"n for {p.label}", p.n, None, ""))
    return res


SCENARIO = Scenario("echo", "an example scenario", run, EchoParams, uses_docker=False, default_run=False)
