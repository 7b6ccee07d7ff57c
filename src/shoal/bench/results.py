"""What a scenario returns: metric rows (shoal beside Docker, with the ratio and the target) and raw data."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from shoal.bench.stats import ratio


@dataclass
class Metric:
    """One row of the results table."""

    name: str
    shoal: float | None
    docker: float | None = None
    unit: str = ""
    #: "lower" or "higher": which direction is better (decides how the ratio is read); "neither": no ratio
    #: (a slope near zero, where either sign is as good)
    better: str = "lower"
    #: the issue's target as text, e.g. "≤ 15 ms"; `met` is whether shoal's value meets it
    target: str = ""
    met: bool | None = None
    note: str = ""

    @property
    def advantage(self) -> float | None:
        """How many times better shoal is than Docker (>1: shoal better); None when a ratio says nothing."""
        if self.better == "neither":
            return None
        if self.better == "higher":
            return ratio(self.shoal, self.docker)
        return ratio(self.docker, self.shoal)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form, with the ratio."""
        d = asdict(self)
        adv = self.advantage
        d["shoal_vs_docker"] = round(adv, 2) if adv is not None else None
        return d


def at_most(value: float | None, limit: float) -> bool | None:
    """Target check `value ≤ limit` (None when there is no value)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value <= limit


def at_least(value: float | None, limit: float) -> bool | None:
    """Target check `value ≥ limit` (None when there is no value)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return value >= limit


@dataclass
class ScenarioResult:
    """Everything one scenario measured."""

    name: str
    title: str = ""
    metrics: list[Metric] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    figures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: "ran", "absent: <why>", "skipped: <why>" or "not applicable"
    docker: str = "not applicable"
    error: str | None = None
    seconds: float = 0.0
    #: the parameters the scenario ran with (filled in by the runner)
    params: dict[str, Any] = field(default_factory=dict)

    def add(self, *metrics: Metric) -> None:
        """Append metric rows."""
        self.metrics.extend(metrics)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {"name": self.name, "title": self.title, "metrics": [m.to_dict() for m in self.metrics],
                "data": self.data, "figures": self.figures, "notes": self.notes, "docker": self.docker,
                "error": self.error, "seconds": round(self.seconds, 2), "params": self.params}


def fmt_value(v: float | None, unit: str = "") -> str:
    """A compact human form of a number with its unit."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, bool):
        return str(v)
    a = abs(v)
    if a >= 1000:
        s = f"{v:,.0f}"
    elif a >= 100:
        s = f"{v:.0f}"
    elif a >= 10:
        s = f"{v:.1f}"
    elif a >= 1:
        s = f"{v:.2f}"
    else:
        s = f"{v:.3g}"
    return f"{s} {unit}".strip()


def fmt_ratio(adv: float | None) -> str:
    """'12.3× better' / '0.5× (worse)' / '—'."""
    if adv is None:
        return "—"
    if adv >= 1:
        return f"{adv:.1f}× better" if adv < 100 else f"{adv:.0f}× better"
    return f"{adv:.2f}× (worse)"
