"""SkyRL-gym: a shoal task as a `skyrl_gym.envs.base_text_env.BaseTextEnv`, registered as "shoal".

    import shoal.integrations.skyrl                      # registers the env id "shoal" with skyrl-gym
    env = skyrl_gym.make("shoal", env_config={"tasks": "/data/tasks.jsonl"},
                         extras={"extra_info": {"instance_id": "inflection-3"}})
    prompt, meta = env.init([{"role": "system", "content": "..."}])
    out = env.step("```bash\\npytest -x\\n```")           # {"observations", "reward", "done", "metadata"}
    env.close()

SkyRL-train builds each env with `skyrl_gym.make(env_class, env_config=..., extras=<the dataset row>)`;
set `environment.env_class=shoal` and import this module where the generator runs (or register the
entry point yourself: `register(id="shoal", entry_point="shoal.integrations.skyrl:ShoalTextEnv")`).
The task is `extras["task"]` (a task dict), or the id in `extras["instance_id"]` /
`extras["extra_info"]["instance_id"]` looked up in `env_config["tasks"]` or $SHOAL_RL_TASKS. Model
turns are parsed by `shoal.rl.adapters._common.parse_action_text`: a ```bash block, `<bash>…</bash>`, a
`<tool_call>` JSON, or `<submit/>`; the last turn carries the grader's reward.

The methods are synchronous, as SkyRL calls them; sandbox work runs on the shared client's private loop
(`shoal.sdk.sync.shared_client()`), so many envs of one process share one embedded node.
"""

from __future__ import annotations

from typing import Any

from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
from skyrl_gym.envs.registration import register, registry

from shoal.rl.adapters._common import NO_ACTION, parse_action_text, resolve_task
from shoal.rl.env import SandboxEnv
from shoal.sdk.sync import shared_client

ENV_ID = "shoal"


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    try:  # an omegaconf DictConfig, as SkyRL passes
        return cfg.get(key, default)
    except AttributeError:
        return getattr(cfg, key, default)


class ShoalTextEnv(BaseTextEnv):
    """Text in, text out: the model's turns become shell commands or a submission in a shoal sandbox."""

    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = dict(extras or {})
        info = extras.get("extra_info") or {}
        self.task = resolve_task(extras.get("task") or info.get("task"),
                                 extras.get("instance_id") or info.get("instance_id"), _get(env_config, "tasks"))
        self.max_turns = int(_get(env_config, "max_turns", 30))
        self._bridge = shared_client().bridge
        # the shared client serves every env of the process and is closed at exit, not by close()
        client = _get(env_config, "client") or shared_client().async_client
        self.env = SandboxEnv(self.task, client, max_steps=self.max_turns,
                              step_timeout=float(_get(env_config, "step_timeout", 120)))
        self._outcome = ""

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        """Start the sandbox; the task's instructions join the conversation as a user message."""
        text = self._bridge.run(self.env.reset())
        return [*prompt, {"role": "user", "content": text}], {"task_id": self.task.id}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """One model turn: run the parsed action; the episode's last turn carries the grader's reward."""
        self.turns += 1
        parsed = parse_action_text(action)
        if parsed is None:
            if self.turns >= self.max_turns:
                grade = self._bridge.run(self.env.submit())
                self._outcome = grade.outcome
                return BaseTextEnvStepOutput(
                    observations=[{"role": "user", "content": f"Out of turns. Outcome: {grade.outcome}."}],
                    reward=grade.reward, done=True, metadata={"outcome": grade.outcome})
            return BaseTextEnvStepOutput(observations=[{"role": "user", "content": NO_ACTION}], reward=0.0,
                                         done=False, metadata={"error": "no_action"})
        r = self._bridge.run(self.env.step(parsed))
        if r.done:
            self._outcome = str(r.info.get("outcome", ""))
        return BaseTextEnvStepOutput(
            observations=[] if r.done else [{"role": "user", "content": r.observation}], reward=r.reward,
            done=r.done, metadata={k: v for k, v in r.info.items() if k in ("outcome", "exit_code", "truncated")})

    def get_metrics(self) -> dict[str, Any]:
        """Per-episode metrics SkyRL aggregates: turns taken and whether the task was resolved."""
        return {"turns": self.turns, "resolved": float(self._outcome == "resolved")}

    def close(self) -> None:
        """Close the sandbox (also when the episode ended early)."""
        self._bridge.run(self.env._close_sandbox())


def register_env(env_id: str = ENV_ID) -> None:
    """Register ShoalTextEnv with skyrl-gym under `env_id` (done for "shoal" on import)."""
    if env_id not in registry:
        register(id=env_id, entry_point=f"{__name__}:ShoalTextEnv")


register_env()
