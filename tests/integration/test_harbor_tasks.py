"""Public-task-shaped Harbor tasks, unmodified, through `harbor run --env shoal.integrations.harbor:ShoalEnvironment`,
embedded and against `shoal serve` (`--ek url=`): a WORKDIR-only Dockerfile (evoeval's 100 tasks have this
shape: nothing writes /app, the agent works in it), a multi-stage Dockerfile with a digest-pinned FROM and
heredocs, and a `docker_image` task. The oracle solves each (reward 1); nothing is left running."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_integration_harbor import ENV, HARBOR, TASK, _env, needs_harbor

pytestmark = [pytest.mark.root, pytest.mark.slow, needs_harbor]

SOLVE_CWD = """#!/bin/bash
# writes into the current directory: the image's WORKDIR
cat > fizzbuzz.py <<'PY'
for i in range(1, 16):
    print("FizzBuzz" if i % 15 == 0 else "Fizz" if i % 3 == 0 else "Buzz" if i % 5 == 0 else i)
PY
"""
TEST_AT = """#!/bin/bash
expected=$(cat /tests/expected.txt)
actual=$(timeout 10 python3 {path} 2>/dev/null)
if [ "$actual" = "$expected" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
"""


def _task(root: Path, name: str, dockerfile: str | None, path: str, docker_image: str | None = None) -> Path:
    """A copy of the example task with another environment and a solution that writes to the cwd."""
    d = root / name
    shutil.copytree(TASK, d)
    shutil.rmtree(d / "environment")
    (d / "environment").mkdir()
    if dockerfile is not None:
        (d / "environment" / "Dockerfile").write_text(dockerfile)
    if docker_image is not None:
        toml = (d / "task.toml").read_text().replace("[environment]\n",
                                                    f'[environment]\ndocker_image = "{docker_image}"\n')
        (d / "task.toml").write_text(toml)
    (d / "solution" / "solve.sh").write_text(SOLVE_CWD)
    (d / "tests" / "test.sh").write_text(TEST_AT.format(path=path))
    for f in ("solution/solve.sh", "tests/test.sh"):
        os.chmod(d / f, 0o755)
    (d / "instruction.md").write_text(f"Write `{path}` printing FizzBuzz from 1 to 15.\n")
    return d


def _run(task: Path, jobs: Path, *args: str) -> dict:
    r = subprocess.run([str(HARBOR), "run", "-p", str(task), "--env", ENV, "-o", str(jobs), "-y", "-q",
                        "-a", "oracle", *args], env=_env(), capture_output=True, text=True, timeout=900,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [result] = list(jobs.glob("*/result.json"))
    return json.loads(result.read_text())


def _ok(result: dict, trials: int) -> None:
    [ev] = result["stats"]["evals"].values()
    assert result["n_total_trials"] == trials and ev["n_errors"] == 0, ev["exception_stats"]
    assert ev["metrics"] == [{"mean": 1.0}], ev


def _shapes(root: Path, base_digest: str) -> dict[str, Path]:
    return {
        "workdir-only": _task(root, "evo-workdir", "FROM base\nWORKDIR /app\n", "/app/fizzbuzz.py"),
        "digest-multistage": _task(root, "pinned-multistage", f"""FROM base@{base_digest} AS tools
RUN <<EOF
mkdir -p /opt/tools
echo 'print("tool")' > /opt/tools/tool.py
EOF
FROM base@{base_digest}
COPY --from=tools /opt/tools /opt/tools
ARG PROJECT=/workspace/project
WORKDIR ${{PROJECT}}
""", "/workspace/project/fizzbuzz.py"),
        "docker_image": _task(root, "prebuilt", None, "/root/fizzbuzz.py", docker_image="base"),
    }


@pytest.mark.parametrize("shape", ["workdir-only", "digest-multistage", "docker_image"])
def test_public_task_shapes_embedded(shape: str, shoal_home: Path, base_image: str, tmp_path: Path) -> None:
    from shoal.config import Paths
    from shoal.images.store import ImageStore

    digest = ImageStore(Paths.from_env().store).resolve("base").digest
    task = _shapes(tmp_path / "tasks", digest)[shape]
    _ok(_run(task, tmp_path / "jobs", "-k", "2", "-n", "2"), 2)
    from shoal.records import list_records

    assert [r.id for r in list_records(shoal_home / "sandboxes") if "harbor.session" in r.labels] == []


@pytest.mark.parametrize("shape", ["workdir-only", "digest-multistage", "docker_image"])
def test_public_task_shapes_against_a_server(shape: str, api_server, tmp_path: Path) -> None:
    """`--ek url=`: the Dockerfile's context is uploaded and built on the server (it used to be refused)."""
    from shoal.config import Paths
    from shoal.images.store import ImageStore

    digest = ImageStore(Paths.from_env().store).resolve("base").digest
    task = _shapes(tmp_path / "tasks", digest)[shape]
    _ok(_run(task, tmp_path / "jobs", "-k", "2", "-n", "2", "--ek", f"url={api_server.url}",
             "--ek", f"token={api_server.token}"), 2)


@pytest.fixture
def public_python(registry_env, base_image: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    """`python:3.12-slim`-like under a Docker Hub name (`shoal-harbor-py:3.12-slim`, i.e.
    docker.io/library/…), served by the loopback registry as docker.io's mirror: shoal's base tree (Debian 12
    with python3), exported as a docker-archive and pushed with skopeo. Yields (name, manifest digest)."""
    from shoal.config import Paths
    from shoal.images.store import ImageStore
    from tests.dockerequal import docker_archive, shoal_tree

    store = ImageStore(Paths.from_env().store)
    rootfs = tmp_path / "rootfs.tar"
    with shoal_tree(store, "base") as root:
        subprocess.run(["tar", "--numeric-owner", "-C", str(root), "-cf", str(rootfs), "."], check=True)
    arch = docker_archive(rootfs, tmp_path / "py.tar", "shoal-harbor-py:3.12-slim")
    rootfs.unlink()
    registry_env.push_archive(arch, "library/shoal-harbor-py:3.12-slim")
    arch.unlink()
    yield "shoal-harbor-py:3.12-slim", registry_env.manifest_digest("library/shoal-harbor-py:3.12-slim")
    for tag in store.tags():
        if tag[0].endswith("shoal-harbor-py"):
            store.remove_image(f"{tag[0]}:{tag[1]}")


def test_public_name_through_a_mirror_and_digest_pinned(public_python, tmp_path: Path) -> None:
    """FROM a Docker Hub name, tag and digest, that the store lacks: pulled through the mirror
    (SHOAL_REGISTRY_MIRRORS) on demand by the embedded node, then built and solved."""
    name, digest = public_python
    tasks = tmp_path / "tasks"
    by_tag = _task(tasks, "hub-python", f"FROM {name}\nWORKDIR /app\n", "/app/fizzbuzz.py")
    pinned = _task(tasks, "hub-python-pinned", f"FROM docker.io/library/{name}@{digest}\nWORKDIR /srv\n",
                   "/srv/fizzbuzz.py")
    _ok(_run(by_tag, tmp_path / "jobs1", "-k", "2", "-n", "2"), 2)
    _ok(_run(pinned, tmp_path / "jobs2"), 1)


def test_public_name_through_a_mirror_against_a_server(public_python, shoal_home: Path, tmp_path: Path) -> None:
    """The same public-name and digest-pinned FROMs with `--ek url=`: the context is uploaded, and the
    server (its own mirror setting) pulls the base on demand and builds the task image."""
    from shoal.server.proc import ServerProcess
    from shoal.server.tokens import TokenStore

    name, digest = public_python
    tasks = tmp_path / "tasks"
    by_tag = _task(tasks, "hub-python", f"FROM {name}\nWORKDIR /app\n", "/app/fizzbuzz.py")
    pinned = _task(tasks, "hub-python-pinned", f"FROM docker.io/library/{name}@{digest}\nWORKDIR /srv\n",
                   "/srv/fizzbuzz.py")
    token = TokenStore(shoal_home).create("harbor-remote-pulls", name="test_harbor_tasks remote pulls")
    srv = ServerProcess(env=dict(os.environ), token=token, log_path=tmp_path / "serve.log").start()
    try:
        remote = ("--ek", f"url={srv.url}", "--ek", f"token={token}")
        _ok(_run(by_tag, tmp_path / "jobs1", "-k", "2", "-n", "2", *remote), 2)
        _ok(_run(pinned, tmp_path / "jobs2", *remote), 1)
    finally:
        srv.stop()
