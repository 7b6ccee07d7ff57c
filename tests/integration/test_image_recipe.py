"""Recipes in real sandboxes: layers per step, cache hits and invalidation, failures leave nothing; the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from shoal.config import NodeConfig, Paths
from shoal.errors import ImageBuildError, ImageNotFound
from shoal.host import syscalls
from shoal.images.archive import layer_tar, write_docker_archive
from shoal.images.recipe import STEP_CACHE, Copy, Env, Recipe, Run, User, Workdir, build_recipe
from shoal.images.store import ImageStore

pytestmark = pytest.mark.root
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path, base_image: str) -> ImageStore:
    st = ImageStore(tmp_path / "store")
    st.copy_image_from(ImageStore(Path(os.environ["SHOAL_STORE"])), "base:latest")
    return st


@pytest.fixture
async def node(shoal_home: Path, store: ImageStore) -> AsyncIterator:
    from shoal.node.node import Node

    n = Node(NodeConfig(paths=Paths(home=shoal_home, store=store.root)))
    await n.start(reap=False, reconcile=False)
    n.creates = 0  # type: ignore[attr-defined]
    real = n.create

    async def counting(spec):  # type: ignore[no-untyped-def]
        n.creates += 1  # type: ignore[attr-defined]
        return await real(spec)

    n.create = counting  # type: ignore[method-assign]
    yield n
    ours = [i.id for i in await n.list() if i.labels.get("shoal.build")]
    for sid in ours:
        await n.close(sid)
    await n.stop()
    assert ours == [], f"build sandboxes left behind: {ours}"


def _ctx(tmp_path: Path) -> Path:
    src = tmp_path / "ctx" / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    (src / "run.sh").write_text("#!/bin/sh\necho run\n")
    os.chmod(src / "run.sh", 0o755)
    os.symlink("run.sh", src / "link.sh")
    return src


def _recipe(src: Path, marker: str = "one") -> Recipe:
    return Recipe("proj:v1", base="base", network=False, env={"PROJ": "1"}, steps=[
        Workdir("/work"),
        Copy(src, "/work/src"),
        Run(f"echo {marker} > /work/marker && rm /etc/issue && python3 -c 'import sys; print(sys.version)'"),
        Env(MODE="test"),
        Run("echo $MODE $PROJ > mode.txt"),
        Run("true"),  # changes nothing: no layer
    ])


async def _sh(node, image: str, cmd: str) -> str:  # type: ignore[no-untyped-def]
    from shoal.models import SandboxSpec

    info = await node.create(SandboxSpec(image=image))
    try:
        r = await node.exec(info.id, cmd)
        assert r.exit_code == 0, r
        return r.stdout.decode()
    finally:
        await node.close(info.id)


async def test_recipe_layers_cache_and_invalidation(node, store: ImageStore, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = _ctx(tmp_path)
    logs: list[str] = []
    img = await build_recipe(node, _recipe(src), log=logs.append)
    base = store.resolve("base")
    assert [x.digest for x in img.layers[:1]] == [x.digest for x in base.layers]
    assert len(img.layers) == 1 + 3, "copy + two runs make layers; `true` changes nothing"
    assert img.config.workdir == "/work" and img.config.env["MODE"] == "test" and img.config.env["PROJ"] == "1"
    assert node.creates == 4
    out = await _sh(node, "proj:v1", "cat marker mode.txt; ls -l src/run.sh | cut -c1-10; readlink src/link.sh; "
                                     "cat src/pkg/__init__.py; test -e /etc/issue || echo gone; stat -c %U src/run.sh")
    assert out.split("\n")[:7] == ["one", "test 1", "-rwxr-xr-x", "run.sh", "VALUE = 1", "gone", "root"]
    for lay in img.layers[1:]:
        assert lay.source["type"] == "recipe-step"
        assert str(tmp_path) not in json.dumps(lay.source)
    assert str(tmp_path) not in json.dumps(img.lineage)

    # unchanged rebuild: no sandbox at all, same layers
    node.creates = 0
    again = await build_recipe(node, _recipe(src), log=logs.append)
    assert node.creates == 0 and [x.digest for x in again.layers] == [x.digest for x in img.layers]

    # change step 3: steps 1-2 hit the cache, 3 and later rebuild
    node.creates = 0
    logs.clear()
    changed = await build_recipe(node, _recipe(src, marker="two"), log=logs.append)
    assert node.creates == 3
    assert changed.layers[1].digest == img.layers[1].digest, "the copy step stays cached"
    assert changed.layers[2].digest != img.layers[2].digest
    assert [line for line in logs if "(cached" in line] == [l_ for l_ in logs if "COPY" in l_]

    # change the copied content: the copy step and everything after it rebuild
    (src / "pkg" / "__init__.py").write_text("VALUE = 2\n")
    node.creates = 0
    v2 = await build_recipe(node, _recipe(src, marker="two"))
    assert node.creates == 4 and v2.layers[1].digest != changed.layers[1].digest
    assert "VALUE = 2" in await _sh(node, "proj:v1", "cat /work/src/pkg/__init__.py")

    # no_cache rebuilds everything
    node.creates = 0
    await build_recipe(node, _recipe(src, marker="two"), no_cache=True)
    assert node.creates == 4


async def test_failing_step_leaves_nothing_behind(node, store: ImageStore, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    r = Recipe("broken:v1", base="base", network=False, steps=[
        Run("echo fine > /ok"),
        Run("echo about to fail; echo 'the real reason' >&2; touch /half-made; exit 7")])
    layers_before = set(store.chunks.list_hexes())
    with pytest.raises(ImageBuildError) as ei:
        await build_recipe(node, r)
    e = ei.value
    assert e.details["step"] == 2 and e.details["exit_code"] == 7
    assert "the real reason" in e.message and "the real reason" in e.details["output_tail"]
    assert "step 2" in e.message and "exit code 7" in e.message
    with pytest.raises(ImageNotFound):
        store.resolve("broken:v1")
    live = await node.list()
    assert not [i for i in live if i.labels.get("shoal.build")], "the failed step's sandbox is gone"
    left = [m for m in syscalls.mounts_under(str(node.paths.sandboxes)) if not any(i.id in m for i in live)]
    assert left == [], f"mounts left behind: {left}"
    new = set(store.chunks.list_hexes()) - layers_before
    assert len(new) == 1, "only the first step's layer was stored"
    assert list(store.tmp_dir.iterdir()) == []
    # the successful first step is cached: fixing step 2 reruns only step 2
    node.creates = 0
    r.steps[1] = Run("echo fixed > /fixed")
    img = await build_recipe(node, r)
    assert node.creates == 1 and len(img.layers) == 3

    with pytest.raises(ImageBuildError, match="timed out"):
        await build_recipe(node, Recipe("slow:v1", base="base", network=False, steps=[Run("sleep 30", timeout=1)]))
    with pytest.raises(ImageNotFound):
        await build_recipe(node, Recipe("x:v1", base="no-such-image", steps=[Run("true")]))


async def test_user_and_copy_owner(node, store: ImageStore, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = tmp_path / "one.txt"
    src.write_text("payload\n")
    r = Recipe("owned:v1", base="base", network=False, steps=[
        Run("useradd -m -u 1234 agent"),
        Copy(src, "/home/agent/", owner="1234:1234"),
        User("agent"),
        Run("id -u > /home/agent/uid && touch /home/agent/mine")])
    with pytest.raises(ImageBuildError, match=r"step 4 .* could not run: .*Permission denied"):
        await build_recipe(node, r)  # the base's workdir, /root, is closed to the new user
    r.steps.insert(3, Workdir("/home/agent"))
    img = await build_recipe(node, r)
    assert img.config.user == "agent"
    out = await _sh(node, "owned:v1", "cat /home/agent/uid; stat -c '%u %n' /home/agent/one.txt /home/agent/mine")
    assert out.split("\n")[:3] == ["1234", "1234 /home/agent/one.txt", "1234 /home/agent/mine"]


async def test_network_step(node, store: ImageStore) -> None:  # type: ignore[no-untyped-def]
    """A Run step with the network on reaches the outside (here: PyPI's DNS name resolves)."""
    r = Recipe("net:v1", base="base", network=True, steps=[Run("getent hosts pypi.org > /resolved")])
    try:
        img = await build_recipe(node, r)
    except ImageBuildError as e:
        pytest.skip(f"no outbound network from sandboxes here: {e.message[:200]}")
    assert "pypi" in await _sh(node, img.ref, "cat /resolved")


def _cli(args: list[str], store: ImageStore, home: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, SHOAL_HOME=str(home), SHOAL_STORE=str(store.root), COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "shoal.cli.main", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600)


def test_cli_end_to_end(store: ImageStore, shoal_home: Path, tmp_path: Path) -> None:
    src = _ctx(tmp_path)
    (tmp_path / "ctx" / "recipe.toml").write_text('''
name = "cli/proj:v1"
from = "base"
network = false
[[steps]]
copy = "src"
to = "/work"
[[steps]]
run = "cat /work/pkg/__init__.py"
''')
    r = _cli(["image", "build", "-f", "recipe.toml"], store, shoal_home, cwd=tmp_path / "ctx")
    assert r.returncode == 0, r.stderr
    assert "built cli/proj:v1" in r.stdout and "VALUE = 1" in r.stderr
    r = _cli(["image", "build", "-f", "recipe.toml", "--quiet"], store, shoal_home, cwd=tmp_path / "ctx")
    assert r.returncode == 0 and r.stderr.strip() == ""
    # steps from options, in command-line order
    r = _cli(["image", "build", "cli/opts:v1", "--from", "cli/proj:v1", "--no-network", "-e", "A=1",
              "--run", "echo $A > /a", "--workdir", "/w", "--copy", str(src / "run.sh"), "tool.sh",
              "--run", "./tool.sh > out", "--json"], store, shoal_home)
    assert r.returncode == 0, r.stderr
    built = json.loads(r.stdout)
    assert built["config"]["workdir"] == "/w" and built["config"]["env"]["A"] == "1"
    r = _cli(["image", "build", "x:1", "--from", "nope", "--run", "true"], store, shoal_home)
    assert r.returncode == 1 and "not found" in r.stderr
    r = _cli(["image", "build", "x:1", "--run", "true"], store, shoal_home)
    assert r.returncode == 2 and "--from" in r.stderr
    r = _cli(["image", "build", "x:1", "--from", "base", "--run", "exit 3", "--no-network"], store, shoal_home)
    assert r.returncode == 1 and "exit code 3" in r.stderr
    # import, compose, tag, layers, inspect, ls, rm, gc
    arch = write_docker_archive(tmp_path / "tk.tar", [layer_tar([("dir", "opt", 0o755),
                                                                 ("file", "opt/tool", b"#!/bin/sh\n", 0o755)])])
    r = _cli(["image", "import", str(arch), "toolkit:v2"], store, shoal_home)
    assert r.returncode == 0 and "imported toolkit:v2" in r.stdout, r.stderr
    r = _cli(["image", "compose", "env:v1", "base", "cli/proj:v1", "toolkit:v2", "--workdir", "/work",
              "-e", "X=1", "--json"], store, shoal_home)
    assert r.returncode == 0, r.stderr
    composed = json.loads(r.stdout)
    assert len(composed["layers"]) == 3 and composed["config"]["workdir"] == "/work"
    assert _cli(["image", "tag", "env:v1", "env:latest"], store, shoal_home).returncode == 0
    r = _cli(["image", "layers", "env:latest"], store, shoal_home)
    assert r.returncode == 0 and "oci-layer" in r.stdout and "recipe-step" in r.stdout
    r = _cli(["image", "inspect", "env:v1"], store, shoal_home)
    assert json.loads(r.stdout)["layers"][2]["source"]["type"] == "oci-layer"
    r = _cli(["image", "ls", "--json"], store, shoal_home)
    assert {"env:v1", "env:latest", "toolkit:v2", "cli/proj:v1"} <= {f"{i['name']}:{i['tag']}" for i in
                                                                     json.loads(r.stdout)}
    assert _cli(["image", "rm", "env:latest", "nope:1"], store, shoal_home).returncode == 1
    r = _cli(["image", "gc", "--dry-run", "--json", "--grace", "0"], store, shoal_home)
    assert r.returncode == 0 and json.loads(r.stdout)["dry_run"] is True
    r = _cli(["image", "import", str(tmp_path / "missing.tar"), "x:1"], store, shoal_home)
    assert r.returncode == 1 and "no such file" in r.stderr
    r = _cli(["image", "layers", "Bad Name"], store, shoal_home)
    assert r.returncode == 1 and "bad image" in r.stderr
    assert store.cache_entries(STEP_CACHE), "the CLI builds used the step cache"
