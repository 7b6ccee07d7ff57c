"""Harbor 0.25.0 itself (`harbor run`, its oracle and nop agents, its verifier) on shoal sandboxes, through
`shoal.integrations.harbor:ShoalEnvironment` loaded by import path, as a Harbor user runs it.

Harbor needs Python >= 3.12, so it runs from `.venv-harbor` (made by `make setup` where such a Python
exists); these tests are skipped, with that reason, where it does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
HARBOR_VENV = REPO / ".venv-harbor"
HARBOR = HARBOR_VENV / "bin" / "harbor"
TASK = REPO / "examples" / "harbor-fizzbuzz"
ENV = "shoal.integrations.harbor:ShoalEnvironment"

needs_harbor = pytest.mark.skipif(not HARBOR.exists(), reason="no .venv-harbor: Harbor needs Python >= 3.12 and "
                                  "`make setup` found none (install python3.12 and run it again)")


def _env() -> dict[str, str]:
    # no telemetry and no model-price download: the tests send nothing off this machine
    return dict(os.environ, HARBOR_TELEMETRY="0", LITELLM_LOCAL_MODEL_COST_MAP="True", COLUMNS="200",
                DO_NOT_TRACK="1")


def harbor_run(jobs: Path, *args: str) -> dict:
    """`harbor run` on the example task with ShoalEnvironment; returns the job's result.json."""
    r = subprocess.run([str(HARBOR), "run", "-p", str(TASK), "--env", ENV, "-o", str(jobs), "-y", "-q", *args],
                       env=_env(), capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [result] = list(jobs.glob("*/result.json"))
    return json.loads(result.read_text())


def _eval(result: dict) -> dict:
    [ev] = result["stats"]["evals"].values()
    return ev


@needs_harbor
def test_oracle_many_trials_in_parallel_reward_1(shoal_home: Path, base_image: str, tmp_path: Path) -> None:
    result = harbor_run(tmp_path / "jobs", "-a", "oracle", "-k", "6", "-n", "6")
    ev = _eval(result)
    assert result["n_total_trials"] == 6 and ev["n_errors"] == 0, ev["exception_stats"]
    assert ev["metrics"] == [{"mean": 1.0}]
    assert sorted(ev["reward_stats"]["reward"]) == ["1.0"] and len(ev["reward_stats"]["reward"]["1.0"]) == 6
    # Harbor downloaded the verifier's and the agent's logs out of the sandbox
    for trial in (tmp_path / "jobs").glob("*/harbor-fizzbuzz__*"):
        assert (trial / "verifier" / "reward.txt").read_text().strip() == "1"
        assert (trial / "agent" / "oracle.txt").exists()
    from shoal.records import list_records

    left = [r.id for r in list_records(shoal_home / "sandboxes") if "harbor.session" in r.labels]
    assert left == [], f"harbor's trials left sandboxes behind: {left}"


@needs_harbor
def test_nop_agent_reward_0(shoal_home: Path, base_image: str, tmp_path: Path) -> None:
    ev = _eval(harbor_run(tmp_path / "jobs", "-a", "nop"))
    assert ev["n_errors"] == 0, ev["exception_stats"]
    assert ev["metrics"] == [{"mean": 0.0}]


@needs_harbor
def test_environment_contract(shoal_home: Path, base_image: str, tmp_path: Path) -> None:
    """exec (user, cwd, env, timeout), uploads and downloads of files and directories, the log directories
    and the Dockerfile build, driven through Harbor's own BaseEnvironment machinery (see harbor_env_check.py)."""
    script = Path(__file__).with_name("harbor_env_check.py")
    r = subprocess.run([str(HARBOR_VENV / "bin" / "python"), str(script), str(tmp_path)], env=_env(),
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and "ALL OK" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]


def test_example_is_a_harbor_task() -> None:
    """The example has what Harbor reads (task.toml schema 1.4, environment/Dockerfile, tests/test.sh) and
    shoal's own loader reads it too (its image built from the Dockerfile)."""
    import tomllib

    from shoal.rl import load_tasks

    cfg = tomllib.loads((TASK / "task.toml").read_text())
    assert cfg["schema_version"] == "1.4" and "image" not in cfg["environment"]
    assert (TASK / "environment" / "Dockerfile").is_file() and os.access(TASK / "tests" / "test.sh", os.X_OK)
    [t] = load_tasks(TASK)
    assert t.image.startswith("dockerfile/harbor-fizzbuzz:") and t.network is False
    if HARBOR.exists():  # Harbor's own task model accepts it
        code = ("from harbor.models.task.task import Task; import sys; t = Task(sys.argv[1]); "
                "print(t.config.environment.network_mode.value, t.config.verifier.environment_mode)")
        r = subprocess.run([str(HARBOR_VENV / "bin" / "python"), "-c", code, str(TASK)], env=_env(),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.split()[0] == "no-network", r.stdout


def test_harbor_module_names_what_to_install() -> None:
    """Importing the integration where Harbor is missing says what to do (here: Python 3.11, no harbor)."""
    if sys.version_info >= (3, 12):
        pytest.skip("runs on an interpreter without harbor")
    r = subprocess.run([sys.executable, "-c", "import shoal.integrations.harbor"], capture_output=True, text=True)
    assert r.returncode != 0 and "pip install 'shoal[harbor]'" in r.stderr, r.stderr[-2000:]
