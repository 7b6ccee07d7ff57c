"""Images of the task set: a shared Python layer, one workspace per project, one small layer per task.

    base ─┬─ rl/python:<key>    python3-pip (Debian) + pytest & co. (wheels from PyPI, pinned)
          └─── rl/ws-<project>:<key>   the project's sdist at /work/<project>, a git repo at one commit
                 └─ rl/task-<id>:<key>  the injected bug, hidden tests removed, a fresh one-commit history

Files from PyPI are downloaded on the host with `pip download` (into $SHOAL_HOME/rl/pypi, reused), then
copied into build sandboxes: builds work behind the TLS-intercepting proxies pip on the host is set
up for, and no build step needs the network except apt's. The Python and workspace images are recipes
(`shoal.images.recipe`), so each step is cached in the store; the tags carry a content key, so a warm
store answers without creating a single sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.config import Paths
from shoal.errors import ImageBuildError, ShoalError
from shoal.images.store import Image, ImageConfig

if TYPE_CHECKING:
    from shoal.node.node import Node
    from shoal.rl.taskgen.config import Project, TaskRecipe

PYTHON_VERSION = "3.11"  # Debian bookworm's python3, which the base image has
WHEELS_DIR = "/opt/shoal/wheels"
# a fixed identity and clock for generated commits: the same tree always gives the same commit id
GIT_ENV = ("GIT_AUTHOR_NAME=shoal GIT_AUTHOR_EMAIL=shoal@localhost GIT_COMMITTER_NAME=shoal "
           "GIT_COMMITTER_EMAIL=shoal@localhost GIT_AUTHOR_DATE='2024-01-01T00:00:00Z' "
           "GIT_COMMITTER_DATE='2024-01-01T00:00:00Z'")
GIT_EXCLUDES = "__pycache__/\n*.pyc\n.pytest_cache/\n*.egg-info/\n"
_BUILD_VERSION = 2

Log = Callable[[str], None]


def rl_home() -> Path:
    """Host-local scratch of the RL tooling ($SHOAL_HOME/rl): PyPI downloads, unpacked sources."""
    d = Paths.from_env().home / "rl"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps([_BUILD_VERSION, *parts], sort_keys=True, default=str).encode()).hexdigest()


def _pip(args: list[str], what: str) -> None:
    argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", *args]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        raise ImageBuildError(f"cannot run pip to download {what}: {sys.executable} not found") from None
    except subprocess.TimeoutExpired:
        raise ImageBuildError(f"pip download of {what} took more than 10 minutes (is PyPI reachable?)") from None
    if r.returncode != 0:
        out = r.stderr or r.stdout
        errors = [ln for ln in out.splitlines() if ln.startswith("ERROR:")]
        tail = "\n".join(errors)[-1500:] if errors else out[-1500:]
        hint = " (is pip installed for this Python? `python -m ensurepip`)" if "No module named pip" in tail else ""
        raise ImageBuildError(f"pip download of {what} failed{hint}: {tail}")


def fetch_wheels(packages: list[str], log: Log) -> Path:
    """Pinned wheels for the sandbox's Python, downloaded once into $SHOAL_HOME/rl/pypi/wheels-<key>."""
    d = rl_home() / "pypi" / f"wheels-{_key(packages, PYTHON_VERSION)[:16]}"
    if (d / ".complete").exists():
        return d
    log(f"downloading {len(packages)} wheels from PyPI: {' '.join(packages)}")
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".wheels-", dir=d.parent))
    try:
        _pip(["--only-binary", ":all:", "--no-deps", "--python-version", PYTHON_VERSION, "-d", str(tmp), *packages],
             "wheels " + " ".join(packages))
        (tmp / ".complete").write_text("\n".join(sorted(p.name for p in tmp.iterdir())) + "\n")
        with contextlib.suppress(OSError):
            shutil.rmtree(d)
        os.rename(tmp, d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return d


def fetch_sdist(name: str, version: str, log: Log) -> Path:
    """The project's sdist from PyPI (downloaded once into $SHOAL_HOME/rl/pypi/sdists)."""
    d = rl_home() / "pypi" / "sdists"
    d.mkdir(parents=True, exist_ok=True)
    norm = name.replace("-", "_").lower()
    for p in d.glob("*.tar.gz"):
        stem = p.name[: -len(".tar.gz")].lower().replace("-", "_")
        if stem == f"{norm}_{version}":
            return p
    log(f"downloading the {name} {version} sdist from PyPI")
    with tempfile.TemporaryDirectory(prefix=".sdist-", dir=d) as tmp:
        _pip(["--no-binary", ":all:", "--no-deps", "-d", tmp, f"{name}=={version}"], f"the {name} {version} sdist")
        got = [p for p in Path(tmp).iterdir() if p.name.endswith(".tar.gz")]
        if len(got) != 1:
            raise ImageBuildError(f"expected one .tar.gz sdist of {name} {version}, got {[p.name for p in got]}")
        final = d / got[0].name
        os.replace(got[0], final)
    return final


def unpack_sdist(sdist: Path) -> Path:
    """The sdist's files in a directory (its single top-level folder stripped), unpacked once."""
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    dest = rl_home() / "src" / f"{sdist.name[:-7]}-{digest[:12]}"
    if (dest / ".complete").exists():
        return dest / "tree"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".src-", dir=dest.parent))
    try:
        with tarfile.open(sdist) as tf:
            members = tf.getmembers()
            tops = {m.name.split("/", 1)[0] for m in members}
            if len(tops) != 1:
                raise ImageBuildError(f"{sdist.name}: expected one top-level directory, got {sorted(tops)[:5]}")
            tf.extractall(tmp, filter="data")  # refuses absolute paths, .. and device files
        top = tmp / tops.pop()
        for junk in list(top.rglob("__pycache__")) + list(top.rglob("*.pyc")):
            shutil.rmtree(junk, ignore_errors=True) if junk.is_dir() else junk.unlink(missing_ok=True)
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        os.rename(top, dest / "tree")
        (dest / ".complete").write_text(digest + "\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest / "tree"


async def _build(node: Node, recipe: Any, log: Log) -> Image:
    from shoal.images.recipe import build_recipe

    return await build_recipe(node, recipe, log=log)


async def ensure_python_image(node: Node, tr: TaskRecipe, log: Log) -> Image:
    """base + python3-pip + the pinned test tools: shared by every project's workspace."""
    from shoal.images.recipe import Copy, Env, Recipe, Run

    base = node.store.resolve("base")
    key = _key("python", base.digest, tr.python_packages, tr.apt)[:16]
    ref = f"rl/python:{key}"
    if node.store.exists(ref):
        return node.store.resolve(ref)
    wheels = await asyncio.to_thread(fetch_wheels, tr.python_packages, log)
    apt = " ".join(shlex.quote(p) for p in tr.apt)
    pkgs = " ".join(shlex.quote(p) for p in tr.python_packages)
    install = (
        "set -e; export DEBIAN_FRONTEND=noninteractive; "
        f"apt-get update -qq && apt-get install -y -qq --no-install-recommends {apt} >/dev/null; "
        "rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/log/apt "
        "/var/log/dpkg.log; "
        f"python3 -m pip install -q --no-index --find-links {WHEELS_DIR} --break-system-packages {pkgs}; "
        "rm -rf /root/.cache; python3 -m pytest --version")
    r = Recipe(ref=ref, base=base.ref, network=False, steps=[
        Copy(wheels, WHEELS_DIR, exclude=[".complete"]),
        Run(install, network=True, timeout=900),
        # no stray .pyc beside sources (they would show up in agents' diffs); pip may install offline
        Env({"PYTHONDONTWRITEBYTECODE": "1", "PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_NO_INDEX": "1",
             "PIP_FIND_LINKS": WHEELS_DIR}),
    ])
    return await _build(node, r, log)


async def ensure_workspace_image(node: Node, project: Project, python: Image, log: Log) -> Image:
    """The project's sdist at /work/<name> as a git repository at one commit, on the Python image."""
    from shoal.images.recipe import Copy, Env, Recipe, Run, Workdir

    key = _key("ws", python.digest, project.name, project.version, project.deps, project.env)[:16]
    ref = f"rl/ws-{project.name}:{key}"
    if node.store.exists(ref):
        return node.store.resolve(ref)
    sdist = await asyncio.to_thread(fetch_sdist, project.name, project.version, log)
    tree = await asyncio.to_thread(unpack_sdist, sdist)
    steps: list[Any] = [Copy(tree, project.workdir)]
    if project.deps:
        wheels = await asyncio.to_thread(fetch_wheels, project.deps, log)
        steps += [Copy(wheels, f"{WHEELS_DIR}/{project.name}", exclude=[".complete"]),
                  Run(f"python3 -m pip install -q --no-index --find-links {WHEELS_DIR}/{project.name} "
                      f"--break-system-packages {' '.join(shlex.quote(d) for d in project.deps)}")]
    steps += [
        Run(f"set -e; cd {shlex.quote(project.workdir)}; git init -q -b main; "
            f"printf {shlex.quote(GIT_EXCLUDES)} >> .git/info/exclude; git add -A; "
            f"{GIT_ENV} git commit -q -m {shlex.quote(f'{project.name} {project.version} from its PyPI sdist')}"),
        Workdir(project.workdir),
    ]
    if project.env:
        steps.append(Env(dict(project.env)))
    r = Recipe(ref=ref, base=python.ref, network=False, steps=steps)
    return await _build(node, r, log)


async def build_task_image(node: Node, ws: Image, ref: str, workdir: str, files: dict[str, str],
                           remove: list[str], message: str, lineage: dict[str, Any]) -> tuple[Image, str]:
    """One layer over the workspace: write `files`, delete `remove`, replace the git history with one
    commit of the result. Returns the image and that commit's id (the task's base_commit)."""
    from shoal.images.pack import pack_upper
    from shoal.models import SandboxSpec

    if node.store.exists(ref):
        img = node.store.resolve(ref)
        commit = str(img.lineage.get("base_commit", ""))
        if commit:
            return img, commit
    info = await node.create(SandboxSpec(image=ws.ref, network=False, memory_mb=512, ttl_s=900,
                                         labels={"shoal.build": ref[:1000]}))
    sid = info.id
    try:
        for rel, text in files.items():
            await node.write_file(sid, f"{workdir}/{rel}", text.encode())
        rm = " ".join(shlex.quote(p) for p in remove)
        # a fresh history: the original commit (and its objects) must not reveal what the bug changed
        script = (f"set -e; cd {shlex.quote(workdir)}; {'rm -rf -- ' + rm + ';' if rm else ''} rm -rf .git; "
                  f"git init -q -b main; printf {shlex.quote(GIT_EXCLUDES)} >> .git/info/exclude; git add -A; "
                  f"{GIT_ENV} git commit -q -m {shlex.quote(message)}; git rev-parse HEAD")
        r = (await node.exec(sid, ["/bin/sh", "-c", script], timeout=300)).text()
        if r.exit_code != 0:
            raise ImageBuildError(f"building {ref} failed: {str(r.stderr)[-1500:]}")
        commit = str(r.stdout).strip().splitlines()[-1]
        try:
            await node.pause(sid, reclaim=False)
        except TypeError:
            await node.pause(sid)
        rec = node.record(sid)
        upper = node.backend(rec.backend).upper_dir(rec)
        layer = await asyncio.to_thread(pack_upper, node.store, Path(upper),
                                        {"type": "rl-task", "image": ref, **{k: lineage[k] for k in ("task",)
                                                                            if k in lineage}}, None, clean=True)
        cfg: ImageConfig = ws.config.copy()
        img = node.store.put_image(ref, [lay.digest for lay in ws.layers] + [layer.digest], cfg,
                                   lineage={"built_by": "shoal.rl.taskgen", "base": ws.ref, "base_digest": ws.digest,
                                            "base_commit": commit, "created_at": time.time(), **lineage})
        return img, commit
    finally:
        with contextlib.suppress(ShoalError):
            await node.close(sid)
