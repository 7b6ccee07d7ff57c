"""SandboxEnv's episode logic on the fake backend: reset, the persistent bash tool, file tools with paths
relative to the task's workdir, bad actions, the repository diff, close. (Grading runs hidden tests at
absolute paths in the sandbox, which the fake backend does not isolate: tests/integration/test_rl.py.)"""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import shoal
from shoal.node.node import Node
from shoal.rl.env import SandboxEnv
from shoal.rl.tasks import SWETask
from shoal.sdk.local import LocalTransport
from tests.unit.conftest import AGENT_BUILT, fake_config

pytestmark = pytest.mark.skipif(not AGENT_BUILT, reason="the agent is not built: run `make agent`")


def _repo_image(node: Node, tmp: Path) -> str:
    """An image whose /repo is a git repository with one commit (calc.py)."""
    from shoal.images.store import ImageConfig

    root = tmp / "img"
    repo = root / "repo"
    repo.mkdir(parents=True)
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    layer = node.store.add_layer_from_dir(root, {"type": "test"})
    node.store.put_image("repo:1", [layer.digest], ImageConfig(workdir="/repo"))
    return "repo:1"


@pytest.fixture
async def env(fake_home: Path, tmp_path: Path) -> AsyncIterator[SandboxEnv]:
    node = Node(fake_config(fake_home))
    image = _repo_image(node, tmp_path)
    task = SWETask(instance_id="calc-1", image=image, problem_statement="add() subtracts", test_patch="",
                   FAIL_TO_PASS=["test_calc.py::test_add"], workdir="/repo")
    async with shoal.Client(transport=LocalTransport(node=node, reap=False)) as client:
        e = SandboxEnv(task, client, max_steps=20, backend="fake", labels={"run": "unit"})
        yield e
        await e.close()
        assert await node.list() == []


async def test_an_episode_without_grading(env: SandboxEnv) -> None:
    prompt = await env.reset()
    assert "add() subtracts" in prompt
    info = env.sandbox.info
    assert info.backend == "fake" and info.labels == {"shoal.rl/role": "agent", "run": "unit"}
    obs, reward, done, meta = await env.step("cat calc.py")
    assert "return a - b" in obs and obs.endswith("[exit code 0]") and not done and reward == 0.0
    assert meta == {"tool": "bash", "exit_code": 0, "timed_out": False, "duration_s": meta["duration_s"]}
    await env.step({"tool": "bash", "command": "export MODE=fixing; false"})
    call = {"type": "function", "function": {"name": "bash", "arguments": '{"command": "echo $MODE"}'}}
    obs, *_ = await env.step(call)
    assert obs.startswith("fixing") and obs.endswith("[exit code 0]")  # the shell persists
    obs, _, done, meta = await env.step({"tool": "write_file", "path": "calc.py",
                                         "content": "def add(a, b):\n    return a + b\n"})
    assert obs == "wrote 32 bytes to calc.py" and meta["bytes"] == 32
    obs, *_ = await env.step({"tool": "read_file", "path": "/repo/calc.py"})
    assert "a + b" in obs
    obs, _, done, meta = await env.step({"tool": "rm", "path": "x"})
    assert obs.startswith("error: unknown tool") and meta == {"error": "bad_action"} and not done
    obs, *_ = await env.step({"tool": "bash", "command": "sleep 5", "timeout": 0.2})
    assert obs.endswith("[timed out after 0.2s]")
    diff = await env.diff()
    assert "-    return a - b" in diff and "+    return a + b" in diff
    assert env.steps == 7 and not env.done
    await env.close()
    assert env.sandbox is None


async def test_steps_before_reset_are_refused(env: SandboxEnv) -> None:
    with pytest.raises(shoal.InvalidRequest, match="reset"):
        await env.step("ls")
