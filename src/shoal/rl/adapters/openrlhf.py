"""OpenRLHF: an agent instance with the call shape of OpenRLHF's `AgentInstanceBase`
(openrlhf/utils/agent.py; the `--agent_func_path` examples).

OpenRLHF calls `await reset(states)` with the dataset row (`prompt`, `label`) and expects
`{"observation": text}`; then, after each generation, `await step(states)` with `observation_text`,
`action_text` and `label`, and expects `{"rewards", "scores", "environment_feedback", "done",
"sampling_params", "extra_logs"}`. Here `label` is the task id (tasks come from `tasks=` or
$SHOAL_RL_TASKS), the model's action text is parsed for a ```bash block, a `<tool_call>` or `<submit/>`,
and the final step's reward is the grader's.

In an agent_func.py given to OpenRLHF:

    from shoal.rl.adapters.openrlhf import make_agent_instance
    AgentInstance = make_agent_instance(tasks="/data/tasks.jsonl")
"""

from __future__ import annotations

from typing import Any

from shoal.rl.adapters._common import NO_ACTION, loop_client, parse_action_text, resolve_task
from shoal.rl.env import SandboxEnv

try:  # OpenRLHF sums torch tensors; plain floats when torch is absent
    import torch  # type: ignore[import-not-found]
except Exception:
    torch = None


def _num(x: float) -> Any:
    return torch.tensor(float(x)) if torch is not None else float(x)


class ShoalAgentInstance:
    """One episode per instance: reset starts the task's sandbox, step runs the parsed action."""

    tasks: Any = None
    env_kwargs: dict[str, Any] = {}
    client: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.env: SandboxEnv | None = None

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        """Start the episode for `states["label"]` (a task id) or `states["task"]`; returns the prompt."""
        if self.env is not None:
            await self.env.close()
        task = resolve_task(states.get("task"), states.get("label") or states.get("task_id"), self.tasks)
        self.env = SandboxEnv(task, self.client or loop_client(), **self.env_kwargs)
        prompt = await self.env.reset()
        return {"observation": (states.get("prompt") or "") + prompt}

    async def step(self, states: dict, **kwargs: Any) -> dict:
        """Run the action in `states["action_text"]`; the reward arrives with done=True."""
        assert self.env is not None, "reset() first"
        action = parse_action_text(states.get("action_text", ""))
        if action is None:
            # a turn without an action still counts against max_steps, as a malformed action would
            feedback, reward, done, info = NO_ACTION, 0.0, False, {"error": "no_action"}
            self.env.steps += 1
            if self.env.steps >= self.env.max_steps:
                grade = await self.env.submit()
                feedback = f"Out of steps. Outcome: {grade.outcome}."
                reward, done, info = grade.reward, True, {"outcome": grade.outcome}
        else:
            r = await self.env.step(action)
            feedback, reward, done, info = r.observation, r.reward, r.done, r.info
        if done:
            await self.env.close()
        return {
            "rewards": _num(reward), "scores": _num(reward),
            "environment_feedback": "\n" + feedback + "\n",
            "done": done, "sampling_params": states.get("sampling_params"),
            "extra_logs": {"outcome": info.get("outcome", ""), "steps": self.env.steps},
        }


def make_agent_instance(tasks: Any = None, client: Any = None, **env_kwargs: Any) -> type[ShoalAgentInstance]:
    """A ShoalAgentInstance class bound to a task source (OpenRLHF instantiates the class itself)."""
    return type("AgentInstance", (ShoalAgentInstance,), {"tasks": tasks, "client": client,
                                                         "env_kwargs": dict(env_kwargs)})
