"""SkyRL-gym: a text environment with the call shape of SkyRL-gym's `BaseTextEnv`
(skyrl_gym/envs/base_text_env.py).

SkyRL constructs the env with `(env_config, extras)` — `extras` carries the dataset row's fields — then
calls `init(prompt)` → `(prompt, metadata)`, `step(action_text)` → a dict with `observations` (a list of
chat messages), `reward`, `done`, `metadata`, and finally `close()`. All three are synchronous, so the
sandbox work runs on a private event loop (the `shoal.sdk.bridge.Bridge` of `shoal.sdk.sync.shared_client()`).
The task is `extras["task"]` (a task dict), or the id in `extras["instance_id"]` / `extras["extra_info"]["instance_id"]`
looked up in `env_config["tasks"]` or $SHOAL_RL_TASKS.

Registered with SkyRL-gym like any text env:

    from skyrl_gym.envs import register
    register(id="shoal", entry_point="shoal.rl.adapters.skyrl:ShoalTextEnv")
"""

from __future__ import annotations

from typing import Any

from shoal.rl.adapters._common import NO_ACTION, parse_action_text, resolve_task
from shoal.rl.env import SandboxEnv
from shoal.sdk.sync import shared_client


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


class ShoalTextEnv:
    """Text in, text out: the model's turns are parsed into shell commands or a submission."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        extras = dict(extras or {})
        info = extras.get("extra_info") or {}
        self.task = resolve_task(extras.get("task"), extras.get("instance_id") or info.get("instance_id"),
                                 _get(env_config, "tasks"))
        self.max_turns = int(_get(env_config, "max_turns", 30))
        self._bridge = shared_client().bridge
        # the shared client serves every env of the process and is closed at exit, not by close()
        client = _get(env_config, "client") or shared_client().async_client
        self.env = SandboxEnv(self.task, client, max_steps=self.max_turns,
                              step_timeout=float(_get(env_config, "step_timeout", 120)))
        self.turns = 0

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """Start the sandbox; the task's instructions are appended to the conversation."""
        text = self._bridge.run(self.env.reset())
        return [*prompt, {"role": "user", "content": text}], {"task_id": self.task.id}

    def step(self, action: str) -> dict[str, Any]:
        """One model turn: run the parsed action; the last turn carries the grader's reward."""
        self.turns += 1
        parsed = parse_action_text(action)
        if parsed is None:
            if self.turns >= self.max_turns:
                grade = self._bridge.run(self.env.submit())
                return {"observations": [{"role": "user", "content": f"Out of turns. Outcome: {grade.outcome}."}],
                        "reward": grade.reward, "done": True, "metadata": {"outcome": grade.outcome}}
            return {"observations": [{"role": "user", "content": NO_ACTION}], "reward": 0.0, "done": False,
                    "metadata": {"error": "no_action"}}
        r = self._bridge.run(self.env.step(parsed))
        return {"observations": [] if r.done else [{"role": "user", "content": r.observation}],
                "reward": r.reward, "done": r.done,
                "metadata": {k: v for k, v in r.info.items() if k in ("outcome", "exit_code", "truncated")}}

    def close(self) -> None:
        """Close the sandbox."""
        self._bridge.run(self.env._close_sandbox())
