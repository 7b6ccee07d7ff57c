"""The task-set recipe: which PyPI projects, which versions, how to mutate them (a TOML file)."""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import InvalidRequest
from shoal.rl.taskgen.mutate import OPERATORS

DEFAULT_RECIPE = Path(__file__).with_name("projects.toml")
_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
_PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+$")


@dataclass
class Project:
    """One PyPI project: its sdist, the files to mutate, how to run its tests."""

    name: str
    version: str
    sources: list[str]
    summary: str = ""
    deps: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    test_args: list[str] = field(default_factory=list)

    @property
    def workdir(self) -> str:
        """Where the project lives in its images."""
        return f"/work/{self.name}"


@dataclass
class MutationConfig:
    """How many mutants to try and which to keep."""

    operators: list[str] = field(default_factory=lambda: list(OPERATORS))
    seed: int = 7
    tasks_per_project: int = 8
    max_candidates: int = 14
    min_fail_to_pass: int = 1
    max_fail_to_pass: int = 60
    max_pass_to_pass: int = 20
    test_timeout_s: float = 60.0
    hint: str = "file"


@dataclass
class TaskRecipe:
    """The whole recipe: the shared Python layer, the mutation settings, the projects."""

    projects: list[Project]
    mutations: MutationConfig = field(default_factory=MutationConfig)
    python_packages: list[str] = field(default_factory=list)
    apt: list[str] = field(default_factory=lambda: ["python3-pip"])
    source: str = ""

    def key(self) -> str:
        """A hash of everything that shapes the images and tasks (hex, 16 chars)."""
        d = asdict(self)
        d.pop("source", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def select(self, names: list[str] | None) -> TaskRecipe:
        """A copy with only the named projects (all when `names` is empty)."""
        if not names:
            return self
        known = {p.name for p in self.projects}
        bad = [n for n in names if n not in known]
        if bad:
            raise InvalidRequest(f"unknown project(s) {bad}; the recipe has {sorted(known)}")
        return TaskRecipe([p for p in self.projects if p.name in names], self.mutations, self.python_packages,
                          self.apt, self.source)


def _strs(v: Any, where: str) -> list[str]:
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise InvalidRequest(f"{where} must be a list of non-empty strings")
    return list(v)


def load_task_recipe(path: str | Path | None = None) -> TaskRecipe:
    """Read and validate a task recipe (default: the one shipped with shoal); errors name the field."""
    p = Path(path) if path else DEFAULT_RECIPE
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise InvalidRequest(f"task recipe {p} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"task recipe {p} is not valid TOML: {e}") from None
    where = str(p)
    py = data.get("python") or {}
    pkgs = _strs(py.get("packages", []), f"{where}: python.packages")
    for s in pkgs:
        if not _PIN.match(s):
            raise InvalidRequest(f"{where}: python.packages: {s!r} must be pinned as name==version")
    apt = _strs(py.get("apt", ["python3-pip"]), f"{where}: python.apt")
    m = data.get("mutations") or {}
    mc = MutationConfig()
    for k, v in m.items():
        if k not in MutationConfig.__dataclass_fields__:
            raise InvalidRequest(f"{where}: mutations.{k} is not a setting; known: "
                                 f"{sorted(MutationConfig.__dataclass_fields__)}")
        setattr(mc, k, v)
    bad = [o for o in mc.operators if o not in OPERATORS]
    if bad:
        raise InvalidRequest(f"{where}: mutations.operators: unknown {bad}; known: {list(OPERATORS)}")
    for k in ("tasks_per_project", "max_candidates", "min_fail_to_pass", "max_fail_to_pass"):
        v = getattr(mc, k)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidRequest(f"{where}: mutations.{k} must be a positive integer, got {v!r}")
    if mc.hint not in ("function", "file", "none"):
        raise InvalidRequest(f"{where}: mutations.hint must be 'function', 'file' or 'none'")
    projects = []
    raw = data.get("project") or []
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest(f"{where}: needs at least one [[project]]")
    for i, pr in enumerate(raw, 1):
        w = f"{where}: project {i}"
        name = pr.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequest(f"{w}: name must be a lowercase PyPI name, got {name!r}")
        w = f"{where}: project {name!r}"
        version = pr.get("version")
        if not isinstance(version, str) or not re.match(r"^[A-Za-z0-9.+!_-]+$", version):
            raise InvalidRequest(f"{w}: version must be an exact version string (the sdist to download)")
        sources = _strs(pr.get("sources"), f"{w}: sources")
        for s in sources:
            if s.startswith("/") or ".." in s.split("/") or not s.endswith(".py"):
                raise InvalidRequest(f"{w}: sources: {s!r} must be a relative path to a .py file in the sdist")
        env = pr.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise InvalidRequest(f"{w}: env must map names to strings")
        deps = _strs(pr.get("deps", []), f"{w}: deps")
        for s in deps:
            if not _PIN.match(s):
                raise InvalidRequest(f"{w}: deps: {s!r} must be pinned as name==version")
        unknown = set(pr) - {"name", "version", "summary", "sources", "deps", "env", "test_args"}
        if unknown:
            raise InvalidRequest(f"{w}: unknown keys {sorted(unknown)}")
        projects.append(Project(name=name, version=version, sources=sources, summary=str(pr.get("summary", "")),
                                deps=deps, env={str(k): v for k, v in env.items()},
                                test_args=_strs(pr.get("test_args", []), f"{w}: test_args")))
    names = [p.name for p in projects]
    if len(set(names)) != len(names):
        raise InvalidRequest(f"{where}: project names must be unique")
    return TaskRecipe(projects=projects, mutations=mc, python_packages=pkgs, apt=apt, source=str(p))
