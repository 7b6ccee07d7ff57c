"""mini-swe-agent (PyPI, unmodified) on shoal: `environment_class: shoal.integrations.minisweagent.ShoalEnvironment`
in its YAML config run by its own `mini` CLI, its `DefaultAgent` with its `DeterministicModel` against a
`shoal serve`, and the SkyRL-style rollout of docs/rl.md run as written."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from shoal.server.proc import ServerProcess
from shoal.server.tokens import TokenStore

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
minisweagent = pytest.importorskip("minisweagent", reason="the rl-test extra brings mini-swe-agent")

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402

from tests.integration.test_doc_examples import _python_block, _run  # noqa: E402

pytestmark = [pytest.mark.root, pytest.mark.timeout(600)]
CLASS = "shoal.integrations.minisweagent.ShoalEnvironment"
AGENT = {"system_template": "You are a helpful assistant.", "instance_template": "{{task}} ({{system}})",
         "step_limit": 10}


def _mini_env(tmp_path: Path) -> dict[str, str]:
    cfg = tmp_path / "mswea"
    cfg.mkdir(exist_ok=True)
    return {**os.environ, "MSWEA_CONFIGURED": "1", "MSWEA_SILENT_STARTUP": "1", "MSWEA_GLOBAL_CONFIG_DIR": str(cfg),
            "FROM_HOST": "forwarded"}


def test_mini_cli_runs_on_a_yaml_config(tmp_path: Path, shoal_home: Path, base_image: str) -> None:
    """`mini -c mini.yaml -c shoal.yaml`: the environment section names shoal's class with the Docker
    environment's keys and sandbox spec fields; the run ends with COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT."""
    outputs = [
        make_output("Where am I?", [{"command": "pwd; echo $GREETING $FROM_HOST; echo to-stderr >&2"}]),
        make_output("Write the answer.", [{"command": "echo 42 > answer.txt && cat answer.txt"}]),
        make_output("Too slow.", [{"command": "sleep 30"}]),
        make_output("Submit.", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat answer.txt"}]),
    ]
    for o in outputs:
        o["extra"].pop("timestamp")
    config = {
        "environment": {"environment_class": CLASS, "image": "base", "cwd": "/tmp", "timeout": 3,
                        "env": {"GREETING": "hello"}, "forward_env": ["FROM_HOST", "NOT_SET_ANYWHERE"],
                        "interpreter": ["bash", "-lc"], "container_timeout": "30m", "memory_mb": 512,
                        "labels": {"run": "mini-cli"}, "run_args": ["--rm"]},
        "model": {"model_class": "deterministic", "model_name": "deterministic", "outputs": outputs},
        "agent": {"agent_class": "default", "cost_limit": 0, **AGENT},
    }
    (tmp_path / "shoal.yaml").write_text(yaml.safe_dump(config))
    traj = tmp_path / "traj.json"
    mini = Path(sys.executable).with_name("mini")
    r = subprocess.run([str(mini), "-c", "mini.yaml", "-c", str(tmp_path / "shoal.yaml"), "-t", "find the answer",
                        "-y", "--exit-immediately", "-o", str(traj)], capture_output=True, text=True, timeout=300,
                       env=_mini_env(tmp_path), cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = json.loads(traj.read_text())
    assert doc["info"]["exit_status"] == "Submitted" and doc["info"]["submission"] == "42\n"
    env_info = doc["info"]["config"]["environment"]
    assert doc["info"]["config"]["environment_type"] == CLASS and env_info["sandbox_id"]
    assert env_info["spec"]["memory_mb"] == 512 and "token" not in env_info
    # mini.yaml renders each observation as JSON
    observations = [json.loads(m["content"]) for m in [m for m in doc["messages"] if m["role"] == "user"][1:]]
    assert observations[0] == {"returncode": 0, "output": "/tmp\nhello forwarded\nto-stderr\n"}
    assert observations[1] == {"returncode": 0, "output": "42\n"}
    assert observations[2]["returncode"] == -1 and "timed out after 3 seconds" in observations[2]["exception_info"]
    # the sandbox went with the run
    from shoal.records import list_records

    left = [rec.id for rec in list_records(shoal_home / "sandboxes") if rec.id == env_info["sandbox_id"]
            and rec.state in ("running", "paused", "creating")]
    assert left == []


@pytest.fixture
def remote(api_server: ServerProcess, shoal_home: Path) -> dict:
    token = TokenStore(shoal_home).create(f"mini-{secrets.token_hex(3)}", name="mini-swe-agent")
    return {"url": api_server.url, "token": token, "hdr": {"Authorization": f"Bearer {token}"}}


def _state(remote: dict, sid: str) -> str:
    r = httpx.get(f"{remote['url']}/v1/sandboxes/{sid}", headers=remote["hdr"], timeout=30)
    return r.json().get("state", "gone") if r.status_code == 200 else "gone"


def test_default_agent_against_shoal_serve(remote: dict) -> None:
    """DefaultAgent + DeterministicModel with the environment on a `shoal serve` (url + token): commands,
    exit codes, a timeout's partial output, spec fields on the sandbox, no token in the trajectory, cleanup."""
    env = get_environment({"environment_class": CLASS, "image": "base", "cwd": "/", "timeout": 2,
                           "interpreter": ["bash", "-c"], "url": remote["url"], "token": remote["token"],
                           "spec": {"cpus": 0.5}, "memory_mb": 384, "labels": {"who": "test"}})
    sid = env.sandbox_id
    info = httpx.get(f"{remote['url']}/v1/sandboxes/{sid}", headers=remote["hdr"], timeout=30).json()
    assert info["spec"]["memory_mb"] == 384 and info["spec"]["cpus"] == 0.5
    assert info["labels"]["who"] == "test" and info["labels"]["shoal.client"] == "mini-swe-agent"
    r = env.execute({"command": "echo out; echo err >&2; exit 7"})
    assert r == {"output": "out\nerr\n", "returncode": 7, "exception_info": ""}
    r = env.execute({"command": "echo partial; sleep 30"})
    assert r["returncode"] == -1 and r["output"] == "partial\n" and "timed out" in r["exception_info"]
    r = env.execute({"command": "pwd"}, cwd="/no/such/dir")
    assert r["returncode"] == -1 and "/no/such/dir: No such file or directory" in r["exception_info"]
    model = DeterministicModel(outputs=[
        make_output("edit", [{"command": "mkdir -p /work && echo v1 > /work/f && cat /work/f"}]),
        make_output("done", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; cat /work/f"}])])
    agent = DefaultAgent(model, env, **AGENT)
    result = agent.run("make the file")
    assert result == {"exit_status": "Submitted", "submission": "v1\n"}
    saved = json.dumps(agent.serialize())
    assert remote["token"] not in saved and sid in saved
    assert remote["token"] not in json.dumps(env.get_template_vars(), default=str)
    env.cleanup()
    env.cleanup()  # twice is fine
    assert _state(remote, sid) in ("gone", "closed", "stopped")


def test_attach_to_an_existing_sandbox_and_config_errors(remote: dict) -> None:
    created = httpx.post(f"{remote['url']}/v1/sandboxes", json={"image": "base"}, headers=remote["hdr"],
                         timeout=120).json()["id"]
    try:
        env = get_environment({"environment_class": CLASS, "sandbox_id": created, "url": remote["url"],
                               "token": remote["token"]})
        assert env.execute({"command": "echo attached"})["output"] == "attached\n"
        env.cleanup()
        assert _state(remote, created) == "running"  # not ours to close
    finally:
        httpx.delete(f"{remote['url']}/v1/sandboxes/{created}", headers=remote["hdr"], timeout=60)
    with pytest.raises(ValueError, match="memory_gb"):
        get_environment({"environment_class": CLASS, "memory_gb": 4, "url": remote["url"], "token": remote["token"]})
    with pytest.raises(Exception, match="container_timeout"):
        get_environment({"environment_class": CLASS, "container_timeout": "soon", "url": remote["url"],
                         "token": remote["token"]})


def test_skyrl_style_rollout_in_the_docs(tmp_path: Path, base_image: str) -> None:
    """docs/rl.md's SkyRL-style example, as written: two rollouts in threads, graded in fresh sandboxes."""
    block = next(b for i in range(100) if "ShoalEnvironment" in (b := _python_block("docs/rl.md", i)))
    out = _run(block, tmp_path, env={"MSWEA_SILENT_STARTUP": "1", "MSWEA_GLOBAL_CONFIG_DIR": str(tmp_path)})
    assert out.strip().splitlines()[-1] == "[1.0, 0.0] [6, 6]"
