"""SkyRL-gym 0.4.0 (the real package, installed by `make setup`): `skyrl_gym.make("shoal", ...)` returns
shoal's BaseTextEnv subclass, and an episode runs through it on real sandboxes."""

from __future__ import annotations

from pathlib import Path

import pytest

skyrl_gym = pytest.importorskip("skyrl_gym", reason="skyrl-gym is installed by `make setup` (extra rl-test)")
pytestmark = [pytest.mark.root, pytest.mark.slow]


def _apply_cmd(patch: str) -> str:
    return f"git apply <<'SHOAL_PATCH_EOF'\n{patch}SHOAL_PATCH_EOF"


def test_make_returns_shoal_env_and_an_episode_is_graded(shoal_home: Path, base_image: str, rl_tasks: list,
                                                         tmp_path: Path) -> None:
    from skyrl_gym.envs.base_text_env import BaseTextEnv

    import shoal.integrations.skyrl as sk
    from shoal.rl.grader import RESOLVED
    from shoal.rl.tasks import dump_jsonl
    from shoal.sdk.sync import close_shared_client

    path = dump_jsonl(rl_tasks, tmp_path / "tasks.jsonl")
    t = rl_tasks[0]
    try:
        # as SkyRL-train builds it: make(env_class, env_config=..., extras=<dataset row>)
        env = skyrl_gym.make("shoal", env_config={"tasks": str(path), "max_turns": 4},
                             extras={"extra_info": {"instance_id": t.instance_id}})
        assert isinstance(env, sk.ShoalTextEnv) and isinstance(env, BaseTextEnv)
        prompt, meta = env.init([{"role": "system", "content": "You fix bugs."}])
        assert meta["task_id"] == t.instance_id and t.workdir in prompt[-1]["content"]
        out = env.step("```bash\ngit log --oneline\n```")
        assert out["done"] is False and "[exit code 0]" in out["observations"][0]["content"]
        out = env.step("no action here")
        assert out["done"] is False and out["metadata"] == {"error": "no_action"}
        env.step(f"<bash>{_apply_cmd(t.patch)}</bash>")
        out = env.step("<submit/>")
        assert out["done"] is True and out["reward"] == 1.0 and out["metadata"]["outcome"] == RESOLVED
        assert env.get_metrics() == {"turns": 4, "resolved": 1.0}
        env.close()
        # a task given whole in the row; out of turns: graded as it stands
        env = skyrl_gym.make("shoal", env_config={"max_turns": 2}, extras={"task": t.to_dict()})
        env.init([])
        env.step("thinking")
        out = env.step("still thinking")
        assert out["done"] is True and out["reward"] == 0.0
        env.close()
    finally:
        close_shared_client()
