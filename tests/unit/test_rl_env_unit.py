"""Actions, action-text parsing, rewards and reward files: the pure parts of the env and grader."""

from __future__ import annotations

import pytest

from shoal.errors import InvalidRequest
from shoal.rl.adapters._common import parse_action_text, resolve_task
from shoal.rl.env import normalize_action
from shoal.rl.grader import compute_reward, parse_reward_file
from shoal.rl.pytest_results import TestResults
from shoal.rl.rollout import DEFAULT_MIX, MixedPolicy, corrupt_patch


def test_normalize_action_forms() -> None:
    assert normalize_action("ls -la") == {"tool": "bash", "command": "ls -la"}
    assert normalize_action("submit") == {"tool": "submit"}
    assert normalize_action({"tool": "read_file", "path": "a"}) == {"tool": "read_file", "path": "a"}
    call = {"type": "function", "function": {"name": "bash", "arguments": '{"command": "pwd"}'}}
    assert normalize_action(call) == {"tool": "bash", "command": "pwd"}
    assert normalize_action({"name": "submit", "arguments": ""}) == {"tool": "submit"}
    for bad, words in [({"tool": "rm"}, "unknown tool"), ({"tool": "bash"}, "command"), (3, "dict or a string"),
                       ({"name": "bash", "arguments": "{x"}, "not JSON"),
                       ({"tool": "write_file", "path": "a"}, "content")]:
        with pytest.raises(InvalidRequest, match=words):
            normalize_action(bad)  # type: ignore[arg-type]


def test_parse_action_text() -> None:
    assert parse_action_text("I will look.\n```bash\nls\n```") == {"tool": "bash", "command": "ls"}
    assert parse_action_text("<bash>git diff</bash>") == {"tool": "bash", "command": "git diff"}
    assert parse_action_text('<tool_call>{"name": "read_file", "arguments": {"path": "x"}}</tool_call>') == \
        {"tool": "read_file", "path": "x"}
    assert parse_action_text("All done. <submit/>") == {"tool": "submit"}
    assert parse_action_text("just thinking") is None
    assert parse_action_text('<tool_call>{"name": "nope"}</tool_call>') is None


def test_compute_reward_binary_and_partial() -> None:
    res = TestResults(statuses={"a": "passed", "b": "failed", "c": "xfailed"})
    assert compute_reward(res, ["a"], ["c"])[0] == 1.0
    r, f, p = compute_reward(res, ["a", "b"], ["c", "d"])
    assert r == 0.0 and f == {"a": "passed", "b": "failed"} and p == {"c": "xfailed", "d": "missing"}
    assert compute_reward(res, ["a", "b"], ["c", "d"], partial=True)[0] == 0.5
    assert compute_reward(res, [], [])[0] == 0.0


def test_reward_files() -> None:
    assert parse_reward_file("1\n") == (1.0, {})
    assert parse_reward_file("0.25 extra") == (0.25, {})
    assert parse_reward_file('{"reward": 0.5, "style": 1}', json_file=True) == (0.5, {"reward": 0.5, "style": 1.0})
    assert parse_reward_file('{"a": 1, "b": 0}', json_file=True)[0] == 0.5
    for bad, js in [("", False), ("yes", False), ('"x"', True), ("{}", True)]:
        with pytest.raises((ValueError, IndexError)):
            parse_reward_file(bad, json_file=js)


def test_corrupt_patch_keeps_the_shape() -> None:
    p = "--- a/x\n+++ b/x\n@@ -1 +1 @@\n-old\n+new\n"
    c = corrupt_patch(p)
    assert c.startswith("--- a/x\n+++ b/x\n") and "-old" not in c and "+new" in c


def test_mixed_policy_covers_the_mix() -> None:
    m = MixedPolicy()
    names = [m.name_for(i) for i in range(sum(DEFAULT_MIX.values()))]
    assert {n: names.count(n) for n in DEFAULT_MIX} == DEFAULT_MIX
    with pytest.raises(ValueError):
        MixedPolicy({"nope": 1})


def test_resolve_task_errors(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("SHOAL_RL_TASKS", raising=False)
    with pytest.raises(InvalidRequest, match="no task given"):
        resolve_task()
    with pytest.raises(InvalidRequest, match="no tasks file"):
        resolve_task(task_id="x")
    with pytest.raises(InvalidRequest, match="not among"):
        resolve_task(task_id="x", tasks=[])
