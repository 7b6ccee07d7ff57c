"""The one interface every benchmark scenario implements: a `Scenario` with declared parameters.

A scenario module defines its parameters as a dataclass whose fields are made with `param()` (default,
value under `--quick`, one line of help) and a module-level `SCENARIO = Scenario(...)`; `registry.py`
maps the scenario's name to the module (one line). `shoal bench NAME -p key=value` sets a parameter;
`shoal bench NAME --list` prints them. See docs/benchmarks.md, "Adding a scenario".
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from shoal.bench.context import BenchContext
    from shoal.bench.results import ScenarioResult

P = TypeVar("P")
_SAME: Any = object()


class ParamError(ValueError):
    """A parameter name or value that the scenario does not accept (the message says which it accepts)."""


def param(default: Any, *, help: str, quick: Any = _SAME) -> Any:
    """A declared scenario parameter: a dataclass field with its `--quick` value and one line of help."""
    return dataclasses.field(default=default, metadata={"help": help, "quick": quick})


@dataclass(frozen=True)
class NoParams:
    """The parameters of a scenario that has none."""


@dataclass(frozen=True)
class ParamInfo:
    """One parameter as `shoal bench NAME --list` shows it."""

    name: str
    type: str
    default: Any
    quick: Any
    help: str


def _types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(t: Any) -> str:
    if t is type(None):
        return "None"
    if typing.get_origin(t) in (types.UnionType, typing.Union):
        return " | ".join(_type_name(a) for a in typing.get_args(t))
    if typing.get_origin(t) is tuple:
        return f"{_type_name(typing.get_args(t)[0])},…"
    return getattr(t, "__name__", str(t))


def _parse(text: str, t: Any, name: str) -> Any:
    """A command-line string as a value of the annotated type `t` (int, float, str, bool, tuple[X, ...], X | None)."""
    args = typing.get_args(t)
    if typing.get_origin(t) in (types.UnionType, typing.Union):
        if text.lower() in ("", "none") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _parse(text, inner[0], name)
    if typing.get_origin(t) is tuple:
        return tuple(_parse(x.strip(), args[0], name) for x in text.split(",") if x.strip())
    if t is bool:
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ParamError(f"{name}: {text!r} is not a boolean (true/false)")
    try:
        return t(text)
    except (TypeError, ValueError):
        raise ParamError(f"{name}: {text!r} is not a valid {_type_name(t)}") from None


@dataclass(frozen=True)
class Scenario(Generic[P]):
    """One benchmark scenario: what `shoal bench NAME` runs."""

    #: the name on the command line and in the results
    name: str
    #: one line, shown by `shoal bench --list` and above the scenario's table
    title: str
    #: the scenario itself: it measures, and returns metric rows (shoal beside Docker) and raw data
    run: Callable[[BenchContext, P], Awaitable[ScenarioResult]]
    #: a (frozen) dataclass whose fields are made with `param()`; NoParams when there are none
    params: type[P] = NoParams  # type: ignore[assignment]
    #: whether the scenario compares with Docker (the runner then starts its private engine when it can)
    uses_docker: bool = True
    #: whether a plain `shoal bench` (no names) runs it
    default_run: bool = True

    def describe(self) -> list[ParamInfo]:
        """The declared parameters (name, type, default, --quick value, help)."""
        hints = _types(self.params)
        out = []
        for f in dataclasses.fields(self.params):  # type: ignore[arg-type]
            quick = f.metadata.get("quick", _SAME)
            out.append(ParamInfo(f.name, _type_name(hints[f.name]), f.default,
                                 f.default if quick is _SAME else quick, f.metadata.get("help", "")))
        return out

    def make_params(self, quick: bool = False, overrides: dict[str, Any] | None = None) -> P:
        """The parameters for one run: defaults, the --quick values when `quick`, then `overrides`
        (values, or strings from the command line, parsed by the field's type)."""
        hints = _types(self.params)
        fields = {f.name: f for f in dataclasses.fields(self.params)}  # type: ignore[arg-type]
        kw: dict[str, Any] = {}
        if quick:
            kw = {n: f.metadata["quick"] for n, f in fields.items() if f.metadata.get("quick", _SAME) is not _SAME}
        for k, v in (overrides or {}).items():
            if k not in fields:
                known = ", ".join(fields) or "none"
                raise ParamError(f"scenario {self.name!r} has no parameter {k!r} (its parameters: {known})")
            kw[k] = _parse(v, hints[k], f"{self.name}.{k}") if isinstance(v, str) else v
        return self.params(**kw)


def params_dict(p: Any) -> dict[str, Any]:
    """A parameters dataclass as a JSON-friendly dict (recorded with the scenario's results)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(p).items()}
