"""TRL 1.16.0's environment_factory contract, checked against TRL's own source (the wheel, unpacked by
`make setup`; TRL needs torch and transformers, whose install does not fit `make test`'s time: a real
`GRPOTrainer` run on CPU is in `make test-trainers`). The statements of `GRPOTrainer` that define the
contract are asserted verbatim, then applied to shoal's environment on real sandboxes: a no-argument
factory, `reset(**row)` appended to the prompt, public methods but reset/get_reward as tools (each a
typed, documented function), `get_reward()` once per rollout."""

from __future__ import annotations

import inspect
import re

import pytest

from tests.frameworks import framework_file, wheel_version

pytestmark = [pytest.mark.root, pytest.mark.slow]

# what GRPOTrainer (trl/trainer/grpo_trainer.py, 1.16.0) does with an environment
CONTRACT = [
    "instance = factory()",  # no arguments
    "for member_name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction):",
    'if member_name == "reset":',
    'elif member_name == "get_reward":',
    'elif not member_name.startswith("_"):',
    'if member_name not in ("reset", "get_reward") and not member_name.startswith("_")',
    "observation = environment.reset(**reset_kwargs)",
    "return [e.get_reward() if type(e) is _env_type else None for e in environments]",
]


def trl_tools(env_cls: type) -> list[str]:
    """The tool names TRL exposes for an environment class (its own filter, as asserted above)."""
    return [n for n, _ in inspect.getmembers(env_cls, predicate=inspect.isfunction)
            if n not in ("reset", "get_reward") and not n.startswith("_")]


def test_trl_source_has_the_contract() -> None:
    assert wheel_version("trl") == "1.16.0"
    src = framework_file("trl", "trl/trainer/grpo_trainer.py").read_text()
    missing = [c for c in CONTRACT if c not in src]
    assert missing == [], f"TRL's environment_factory contract changed: {missing}"


def test_tools_are_typed_and_documented() -> None:
    from shoal.integrations.trl import ShoalToolEnv

    assert trl_tools(ShoalToolEnv) == ["bash", "read_file", "submit", "write_file"]
    for name in trl_tools(ShoalToolEnv):
        fn = getattr(ShoalToolEnv, name)
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters if p != "self"]
        doc = inspect.getdoc(fn) or ""
        assert doc and sig.return_annotation in ("str", str), name
        for p in params:  # transformers' get_json_schema needs every argument typed and described under Args:
            assert sig.parameters[p].annotation in ("str", str), (name, p)
            assert re.search(rf"^\s+{p}: \S", doc.split("Args:", 1)[1], re.M), (name, p)


def test_rollouts_as_trl_runs_them(shoal_home, base_image, rl_tasks: list) -> None:
    from shoal.integrations.trl import ShoalToolEnv
    from shoal.sdk.sync import close_shared_client

    class Env(ShoalToolEnv):
        tasks = rl_tasks

    try:
        factory = Env
        pool = [factory(), factory()]  # TRL probes one at init and pools them; no sandbox until reset
        rows = [{"prompt": [{"role": "user", "content": "Fix the bug."}], "instance_id": t.instance_id}
                for t in rl_tasks]
        for env, row, t in zip(pool, rows, rl_tasks, strict=True):
            obs = env.reset(**row)
            assert isinstance(obs, str) and t.workdir in obs
        tools = [{n: getattr(env, n) for n in trl_tools(type(env))} for env in pool]
        tools[0]["write_file"](path="/tmp/fix.patch", content=rl_tasks[0].patch)
        assert "[exit code 0]" in tools[0]["bash"](command="git apply /tmp/fix.patch")
        assert "Outcome: resolved" in tools[0]["submit"]()
        tools[1]["bash"](command="ls")  # never submits: graded when TRL asks for the reward
        assert [e.get_reward() if type(e) is Env else None for e in pool] == [1.0, 0.0]
        # pooled instances are reset for the next batch: a fresh sandbox each time
        assert rl_tasks[1].workdir in pool[0].reset(**rows[1])
        assert "No such file" in pool[0].bash(command="cat /tmp/fix.patch")
        assert pool[0].get_reward() == 0.0
    finally:
        close_shared_client()
