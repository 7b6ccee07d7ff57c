"""RL integration end to end on real sandboxes: generated tasks, the grader's outcomes, hidden tests,
SandboxEnv and the rollout helpers, every trainer adapter with a scripted policy, Harbor-style tasks.

The task set is the shipped recipe cut to one project and two tasks; its images live in the shared store,
so after the first run they are cached (and shared with `shoal demo`)."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import pytest

import shoal
from shoal.rl import SandboxEnv, env_pool, load_tasks, run_episode, run_episodes
from shoal.rl.grader import (
    EMPTY_PATCH,
    PATCH_APPLY_FAILED,
    RESOLVED,
    SANDBOX_ERROR,
    TEST_ERROR,
    TIMEOUT,
    UNRESOLVED,
    grade_patch,
)
from shoal.rl.rollout import corrupt_patch, explore_then_fix, give_up, gold
from shoal.rl.taskgen.generate import NOOP_PATCH, verify_task
from shoal.rl.tasks import SWETask

pytestmark = [pytest.mark.root, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
HARBOR_TASK = REPO / "examples" / "harbor-fizzbuzz"


async def _patch_from_edit(client: shoal.Client, task: SWETask, cmd: str) -> str:
    """The diff an agent would submit after running `cmd` in the repository."""
    env = SandboxEnv(task, client)
    try:
        await env.reset()
        r = await env.step({"tool": "bash", "command": cmd})
        assert r.info.get("exit_code") == 0, r.observation
        return await env.diff()
    finally:
        await env.close()


async def test_generated_tasks_are_sound(client: shoal.Client, rl_tasks: list[SWETask]) -> None:
    # the gold patch passes, the bug alone fails exactly FAIL_TO_PASS, PASS_TO_PASS keeps passing
    for t in rl_tasks:
        assert t.FAIL_TO_PASS and t.patch and t.test_patch and t.base_commit
        assert t.metadata["hidden_files"] == ["test_inflection.py"]
        assert await verify_task(client, t) == []


async def test_grader_outcomes(client: shoal.Client, rl_tasks: list[SWETask]) -> None:
    t = rl_tasks[0]
    g = await grade_patch(client, t, t.patch)
    assert (g.outcome, g.reward) == (RESOLVED, 1.0), g.summary()
    assert all(s == "passed" for s in g.fail_to_pass.values())
    g = await grade_patch(client, t, "")
    assert (g.outcome, g.reward) == (EMPTY_PATCH, 0.0)
    g = await grade_patch(client, t, NOOP_PATCH)  # applies, fixes nothing
    assert (g.outcome, g.reward) == (UNRESOLVED, 0.0)
    g = await grade_patch(client, t, corrupt_patch(t.patch))
    assert (g.outcome, g.reward) == (PATCH_APPLY_FAILED, 0.0), g.log
    g = await grade_patch(client, t, "this is not a patch\n")
    assert g.outcome == PATCH_APPLY_FAILED
    # planting the hidden test file or a conftest that forces passes changes nothing
    hack = await _patch_from_edit(client, t, (
        "printf 'def test_x():\\n    pass\\n' > test_inflection.py && printf '%s\\n' 'import pytest' "
        "'@pytest.hookimpl(hookwrapper=True)' 'def pytest_runtest_makereport(item, call):' "
        "'    rep = (yield).get_result()' '    rep.outcome = \"passed\"' > conftest.py"))
    assert "conftest.py" in hack and "test_inflection.py" in hack
    g = await grade_patch(client, t, hack)
    assert (g.outcome, g.reward) == (UNRESOLVED, 0.0), g.summary()
    # partial credit: the PASS_TO_PASS share of the named tests
    g = await grade_patch(client, t, NOOP_PATCH, partial=True)
    want = len(t.PASS_TO_PASS) / (len(t.FAIL_TO_PASS) + len(t.PASS_TO_PASS))
    assert g.outcome == UNRESOLVED and g.reward == pytest.approx(want)


async def test_grader_test_error_and_timeout(client: shoal.Client, rl_tasks: list[SWETask]) -> None:
    t = rl_tasks[0]
    broken = await _patch_from_edit(client, t, "sed -i '1i def broken(:' inflection/__init__.py")
    g = await grade_patch(client, t, broken)
    assert (g.outcome, g.reward) == (TEST_ERROR, 0.0), g.summary()
    assert "collection" in g.detail
    hang = await _patch_from_edit(client, t, "sed -i '1i import time; time.sleep(600)' inflection/__init__.py")
    g = await grade_patch(client, dataclasses.replace(t, timeout_s=5), hang)
    assert (g.outcome, g.reward) == (TIMEOUT, 0.0), g.summary()
    g = await grade_patch(client, dataclasses.replace(t, image="rl/no-such-image:x"), t.patch)
    assert g.outcome == SANDBOX_ERROR and g.infra_error


async def test_hidden_tests_are_invisible_to_the_agent(client: shoal.Client, rl_tasks: list[SWETask]) -> None:
    t = rl_tasks[0]
    marker = next(ln[1:].strip() for ln in t.test_patch.splitlines() if ln.startswith("+def test_"))
    async with SandboxEnv(t, client) as env:
        await env.reset()
        sb = env.sandbox
        r = await sb.exec("ls test_inflection.py; git log --all --oneline | wc -l; "
                          "git rev-list --all --objects | git cat-file --batch | grep -c -F " + shlex.quote(marker),
                          cwd=t.workdir)
        out = r.stdout.decode()
        assert "No such file" in r.stderr.decode()
        assert out.split() == ["1", "0"], out  # one commit, and no git object holds the hidden tests
        r = await sb.exec("grep -rlF --exclude-dir=proc --exclude-dir=sys --exclude-dir=dev "
                          f"-e {shlex.quote(marker)} / 2>/dev/null | head", timeout=120)
        assert r.stdout.decode().strip() == "", r.stdout
        # the original code is not reachable either: the workspace's history was replaced
        r = await sb.exec(f"git show HEAD --stat | grep -c {shlex.quote(t.metadata['file'])}", cwd=t.workdir)
        assert r.stdout.decode().strip() == "1"  # the only commit adds the file as it is now (with the bug)


async def test_env_explore_fix_and_diff_submission(client: shoal.Client, rl_tasks: list[SWETask]) -> None:
    t = rl_tasks[1]
    res = await run_episode(explore_then_fix, t, client, max_steps=10)
    assert (res.outcome, res.reward, res.error) == (RESOLVED, 1.0, ""), res
    assert res.steps == 6 and res.timings["create"] > 0 and res.timings["grade"] > 0
    res = await run_episode(give_up, t, client, max_steps=10)
    assert (res.outcome, res.reward) == (EMPTY_PATCH, 0.0)
    # out of steps: what is in the repository is graded (here the fix, applied at step 5 of 5)
    res = await run_episode(explore_then_fix, t, client, max_steps=5)
    assert res.truncated and res.outcome == RESOLVED
    # out of time: the step after the limit grades (here nothing was changed yet)
    res = await run_episode(lambda obs, ctx: "sleep 0.3", t, client, max_steps=50, time_limit_s=0.5)
    assert res.truncated and res.outcome == EMPTY_PATCH and res.steps < 10


async def test_env_state_and_errors(client: shoal.Client, rl_tasks: list[SWETask]) -> None:
    t = rl_tasks[0]
    async with SandboxEnv(t, client, max_steps=20) as env:
        with pytest.raises(shoal.InvalidRequest):
            await env.step("ls")  # before reset
        obs = await env.reset()
        assert t.workdir in obs
        await env.step("export MARK=42; cd /tmp")
        r = await env.step("echo $MARK $PWD")
        assert r.observation.startswith("42 /tmp") and not r.done
        r = await env.step({"tool": "nope"})
        assert r.observation.startswith("error: unknown tool") and r.info["error"] == "bad_action"
        r = await env.step({"tool": "write_file", "path": "notes.txt", "content": "hi"})
        r = await env.step({"tool": "read_file", "path": "notes.txt"})
        assert r.observation == "hi"
        r = await env.step({"tool": "read_file", "path": "/nope"})
        assert r.observation.startswith("error:")
        r = await env.step({"tool": "bash", "command": "sleep 5", "timeout": 1})
        assert "[timed out" in r.observation
        r = await env.step("submit")
        assert r.done and r.info["outcome"] == UNRESOLVED  # notes.txt is a change, but not a fix
        with pytest.raises(shoal.InvalidRequest):
            await env.step("ls")
    assert env.sandbox is None


async def test_run_episodes_reports_failures_and_never_leaks(client: shoal.Client, rl_tasks: list[SWETask]) -> None:
    def crashing(obs: str, ctx) -> dict:  # type: ignore[no-untyped-def]
        if ctx.episode == 1:
            raise RuntimeError("policy bug")
        return gold(obs, ctx)

    bad_image = dataclasses.replace(rl_tasks[0], instance_id="broken", image="rl/no-such-image:x")
    tasks = [rl_tasks[0], rl_tasks[1], bad_image]
    res = await run_episodes(crashing, tasks, client=client, episodes=4, concurrency=4)
    by = {r.episode: r for r in res}
    assert by[0].reward == 1.0 and by[3].reward == 1.0
    assert "policy bug" in by[1].error and by[1].outcome == "episode_error"
    assert "not found" in by[2].error
    assert [s for s in await client.list() if s.labels.get("shoal.rl/role")] == []


async def test_env_pool(client: shoal.Client, rl_tasks: list[SWETask]) -> None:
    async with env_pool(rl_tasks, client=client) as pool:
        assert all(isinstance(o, str) for o in pool.observations)  # type: ignore[attr-defined]
        out = await pool.step(["git status --short", None])
        assert out[1] is None and out[0].observation.endswith("[exit code 0]")
        out = await pool.step([{"tool": "submit", "patch": t.patch} for t in rl_tasks])
        assert [r.reward for r in out] == [1.0, 1.0]
    assert [s for s in await client.list() if s.labels.get("shoal.rl/role")] == []


# ---- adapters, each driven by a scripted policy ---------------------------------------------------
def _apply_cmd(patch: str) -> str:
    return f"git apply <<'SHOAL_PATCH_EOF'\n{patch}SHOAL_PATCH_EOF"


def test_sync_env(shoal_home: Path, base_image: str, rl_tasks: list[SWETask]) -> None:
    from shoal.rl import SyncSandboxEnv
    from shoal.sdk.sync import close_shared_client

    t = rl_tasks[1]
    try:
        with SyncSandboxEnv(t, max_steps=5) as env:
            assert t.workdir in env.reset()
            _obs, reward, done, _info = env.step({"tool": "submit", "patch": t.patch})
            assert (reward, done) == (1.0, True)
    finally:
        close_shared_client()


def test_cli_demo_and_tasks(shoal_home: Path, base_image: str, rl_tasks: list[SWETask], tmp_path: Path) -> None:
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, COLUMNS="120")
    shoal_cli = [sys.executable, "-m", "shoal.cli.main"]
    out = tmp_path / "tasks.jsonl"
    r = subprocess.run([*shoal_cli, "tasks", "generate", "-o", str(out), "--projects", "inflection",
                        "--tasks-per-project", "2"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(load_tasks(out)) == 2
    r = subprocess.run([*shoal_cli, "tasks", "grade", str(out), "--json"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and [g["outcome"] for g in json.loads(r.stdout)] == [RESOLVED, RESOLVED], r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instance_id": "x"}\n')
    r = subprocess.run([*shoal_cli, "tasks", "validate", str(bad)], env=env, capture_output=True, text=True)
    assert r.returncode == 1 and "task 'x'" in r.stderr and "field 'image'" in r.stderr
    report = tmp_path / "demo.json"
    r = subprocess.run([*shoal_cli, "demo", "--projects", "inflection", "--tasks-per-project", "2", "--episodes", "10",
                        "--concurrency", "10", "--json", str(report)], env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for words in ("reward by policy", "where the time went", "episodes/s", "failed episodes  0"):
        assert words in r.stdout, words
    rep = json.loads(report.read_text())
    roll = rep["rollout"]
    assert roll["episodes"] == 10 and len(roll["results"]) == 10
    for tag, v in roll["by_policy"].items():
        assert v["mean_reward"] == {"gold": 1.0, "explore+fix": 1.0}.get(tag, 0.0), (tag, v)


# ---- Harbor-style tasks ----------------------------------------------------------------------------
async def test_harbor_task_graded_after_the_agent(client: shoal.Client) -> None:
    [t] = load_tasks(HARBOR_TASK)
    res = await run_episode(gold, t, client, max_steps=5)  # runs solution/solve.sh, then submits
    assert (res.outcome, res.reward) == (RESOLVED, 1.0), res
    async with SandboxEnv(t, client) as env:
        await env.reset()
        r = await env.step("ls /tests 2>&1; echo 'print(1)' > /root/fizzbuzz.py")
        assert "No such file" in r.observation  # the tests are not there while the agent works
        # a background process that would rewrite the reward is killed before the verifier runs
        await env.step("nohup sh -c 'while true; do mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; "
                       "sleep 0.01; done' >/dev/null 2>&1 &")
        r = await env.step("submit")
        assert r.done and (r.info["outcome"], r.reward) == (UNRESOLVED, 0.0), r.observation
