"""Recipes without sandboxes: files, CLI step order, content hashes and cache keys."""

from __future__ import annotations

import os
from pathlib import Path

import click
import pytest

from shoal.cli.images import split_steps
from shoal.errors import InvalidRequest
from shoal.images.recipe import (
    Copy,
    Env,
    Recipe,
    Run,
    User,
    Workdir,
    content_digest,
    load_recipe,
    recipe_from_cli,
    step_key,
)
from shoal.images.store import ImageConfig


def test_recipe_file_round_trip(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("print(1)\n")
    f = tmp_path / "recipe.toml"
    f.write_text('''
name = "proj:v1"
from = "base"
network = false
workdir = "/work"
[env]
PIP_NO_CACHE_DIR = "1"

[[steps]]
copy = "src"
to = "/work/src"
exclude = ["__pycache__"]

[[steps]]
run = "python3 -m compileall -q /work/src"
timeout = 120

[[steps]]
env = { MODE = "test" }

[[steps]]
workdir = "/work/src"

[[steps]]
user = "1000"
''')
    r = load_recipe(f)
    assert r.ref == "proj:v1" and r.base == "base" and r.network is False and r.workdir == "/work"
    assert r.env == {"PIP_NO_CACHE_DIR": "1"}
    assert isinstance(r.steps[0], Copy) and r.steps[0].src == tmp_path / "src" and r.steps[0].exclude == ["__pycache__"]
    assert isinstance(r.steps[1], Run) and r.steps[1].timeout == 120
    assert isinstance(r.steps[2], Env) and r.steps[2].vars == {"MODE": "test"}
    assert isinstance(r.steps[3], Workdir) and isinstance(r.steps[4], User)
    assert load_recipe(f, ref="other:v2").ref == "other:v2"


@pytest.mark.parametrize("body,msg", [
    ('from = "base"\n[[steps]]\nrun = "x"\ncopy = "y"\n', "exactly one"),
    ('from = "base"\n[[steps]]\nrun = "x"\nbogus = 1\n', "unknown keys"),
    ('from = "base"\nbogus = 1\n', "unknown keys"),
    ('[[steps]]\nrun = "x"\n', "from"),
    ('from = "base"\n[[steps]]\ncopy = "nope"\nto = "/x"\n', "does not exist"),
    ('from = "base"\n[[steps]]\ncopy = "."\n', "to ="),
    ('from = "base"\n[[steps]]\nworkdir = "relative"\n', "absolute"),
    ('from = "base"\n[[steps]]\nrun = ""\n', "non-empty"),
    ('from = "Bad Name"\n', "bad image reference"),
    ('from = "base"\n[[steps]]\ncopy = "."\nto = "/x"\nowner = "root"\n', "uid:gid"),
    ("this is = not toml = at all", "TOML"),
])
def test_bad_recipe_files_name_the_problem(tmp_path: Path, body: str, msg: str) -> None:
    f = tmp_path / "r.toml"
    f.write_text(body)
    with pytest.raises(InvalidRequest, match=msg):
        load_recipe(f, ref="x:1")


def test_missing_recipe_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="does not exist"):
        load_recipe(tmp_path / "nope.toml", ref="x:1")


def test_cli_steps_keep_command_line_order(tmp_path: Path) -> None:
    argv = ["proj:v1", "--from", "base", "-e", "A=1", "--run", "echo --copy", "--copy", "src", "/dst",
            "--workdir=/w", "-eB=2", "--user", "1000", "--run=make", "--no-network"]
    steps, rest = split_steps(argv)
    assert steps == [("env", "A=1"), ("run", "echo --copy"), ("copy", ("src", "/dst")), ("workdir", "/w"),
                     ("env", "B=2"), ("user", "1000"), ("run", "make")]
    assert rest == ["proj:v1", "--from", "base", "--no-network"]
    with pytest.raises(click.UsageError):
        split_steps(["--copy", "only-one"])
    (tmp_path / "src").mkdir()
    r = recipe_from_cli("proj:v1", "base", steps, network=False, cwd=tmp_path)
    assert [type(s).__name__ for s in r.steps] == ["Env", "Run", "Copy", "Workdir", "Env", "User", "Run"]
    assert r.steps[2].src == tmp_path / "src"
    with pytest.raises(InvalidRequest, match="NAME=VALUE"):
        recipe_from_cli("p:1", "base", [("env", "novalue")])


def test_content_digest_follows_content_not_mtimes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_text("hello")
    os.symlink("d/f", src / "link")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "x.pyc").write_bytes(b"junk")
    d1 = content_digest(src, ["__pycache__"])
    os.utime(src / "d" / "f", (1, 1))
    assert content_digest(src, ["__pycache__"]) == d1, "mtimes must not change the cache key"
    (src / "__pycache__" / "x.pyc").write_bytes(b"other junk")
    assert content_digest(src, ["__pycache__"]) == d1, "excluded files must not change the cache key"
    (src / "d" / "f").write_text("hellO")
    d2 = content_digest(src, ["__pycache__"])
    assert d2 != d1
    os.chmod(src / "d" / "f", 0o755)
    assert content_digest(src, ["__pycache__"]) != d2
    os.unlink(src / "link")
    os.symlink("d", src / "link")
    assert content_digest(src, ["__pycache__"]) not in (d1, d2)


def test_step_keys_change_with_parent_config_and_step() -> None:
    cfg = ImageConfig()
    p = ["sha256:" + "1" * 64]
    k = step_key(p, cfg, Run("make"), True)
    assert k == step_key(p, ImageConfig(), Run("make", timeout=5), True), "timeouts do not change results"
    assert k != step_key(["sha256:" + "2" * 64], cfg, Run("make"), True)
    assert k != step_key(p, cfg, Run("make "), True)
    assert k != step_key(p, cfg, Run("make"), False)
    cfg2 = ImageConfig()
    cfg2.env["X"] = "1"
    assert k != step_key(p, cfg2, Run("make"), True)
    cfg3 = ImageConfig(workdir="/w")
    assert k != step_key(p, cfg3, Run("make"), True)


def test_recipe_validation() -> None:
    with pytest.raises(InvalidRequest, match="digest"):
        Recipe("x@sha256:" + "a" * 64, "base").validate()
    with pytest.raises(InvalidRequest, match="unknown step"):
        Recipe("x:1", "base", steps=["echo"]).validate()  # type: ignore[list-item]
    with pytest.raises(InvalidRequest, match="timeout"):
        Recipe("x:1", "base", steps=[Run("x", timeout=0)]).validate()
    with pytest.raises(InvalidRequest):
        Recipe("x:1", "base", env={"A=B": "1"}).validate()
    assert Env(A="1").vars == {"A": "1"} and Env({"B": "2"}, C="3").vars == {"B": "2", "C": "3"}


def test_recipe_from_a_dict_for_api_bodies(tmp_path: Path) -> None:
    from shoal.images.recipe import recipe_from_dict

    body = {"from": "base", "network": False, "env": {"A": "1"},
            "steps": [{"run": "make", "timeout": 60}, {"workdir": "/w"}]}
    r = recipe_from_dict(body, ref="api/proj:v1")
    assert r.ref == "api/proj:v1" and r.network is False and isinstance(r.steps[0], Run)
    with pytest.raises(InvalidRequest, match="not allowed"):
        recipe_from_dict({"from": "base", "steps": [{"copy": str(tmp_path), "to": "/x"}]}, ref="x:1",
                         allow_copy=False)
    with pytest.raises(InvalidRequest, match="table/object"):
        recipe_from_dict(["not", "a", "dict"], ref="x:1")  # type: ignore[arg-type]
