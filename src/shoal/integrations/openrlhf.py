"""OpenRLHF: an agent file for `--train.agent_func_path` — `AgentExecutor` (a no-argument subclass of
OpenRLHF's `MultiTurnAgentExecutor`, itself an `AgentExecutorBase`) running `AgentInstance`
(an `AgentInstanceBase`) episodes in shoal sandboxes.

This module *is* such a file: tasks come from $SHOAL_RL_TASKS, and each dataset row's label is a task id.

    SHOAL_RL_TASKS=/data/tasks.jsonl python -m openrlhf.cli.train_ppo_ray ... \\
        --train.agent_func_path "$(python -c 'import shoal.integrations.openrlhf as m; print(m.__file__)')"

or a file of your own, binding tasks and episode options:

    # agent_func.py
    from shoal.integrations.openrlhf import make_agent_executor
    AgentExecutor = make_agent_executor(tasks="/data/tasks.jsonl", max_steps=30)

OpenRLHF builds one instance per prompt and calls `reset({"observation": prompt, "label": label})` — the
returned observation is the dataset prompt followed by the task's instructions — then, after every
generation, `step({"observation_text", "action_text", "label", "sampling_params"})`. The model's text is
parsed for a ```bash block, `<bash>…</bash>`, a `<tool_call>` JSON or `<submit/>`; the step that ends the
episode (a submission, or the last step) carries the grader's reward. Rewards are torch tensors, as
OpenRLHF sums them with `.item()`.
"""

from __future__ import annotations

from typing import Any

from openrlhf.utils.agent import AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor

from shoal.rl.adapters._common import NO_ACTION, loop_client, parse_action_text, resolve_task
from shoal.rl.env import SandboxEnv

__all__ = ["AgentExecutor", "AgentExecutorBase", "AgentInstance", "make_agent_executor"]


class _Reward(float):
    """A float with `.item()`, for OpenRLHF's executor where torch is absent (only in tests of this module)."""

    def item(self) -> float:
        """The number, as torch.Tensor.item() gives it."""
        return float(self)


def _num(x: float) -> Any:
    try:
        import torch
    except ImportError:
        return _Reward(x)
    return torch.tensor(float(x))


class AgentInstance(AgentInstanceBase):
    """One episode per instance: `reset` starts the label's task in a sandbox, `step` runs the parsed action."""

    tasks: Any = None
    client: Any = None
    env_kwargs: dict[str, Any] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.env: SandboxEnv | None = None

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        """Start the episode of task `states["label"]`; the observation is the prompt, then the instructions."""
        if self.env is not None:
            await self.env.close()
        task = resolve_task(states.get("task"), states.get("label") or states.get("task_id"), self.tasks)
        self.env = SandboxEnv(task, self.client or loop_client(), **self.env_kwargs)
        instructions = await self.env.reset()
        prompt = str(states.get("observation") or "")
        sep = "\n" if prompt and not prompt.endswith("\n") else ""
        return {"observation": prompt + sep + instructions}

    async def step(self, states: dict, **kwargs: Any) -> dict:
        """Run the action in `states["action_text"]`; the reward arrives with done=True."""
        if self.env is None:
            raise RuntimeError("step() before reset(): OpenRLHF resets every instance first")
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


class AgentExecutor(MultiTurnAgentExecutor):
    """What OpenRLHF's `_load_agent_executor` instantiates (no arguments): multi-turn episodes of AgentInstance."""

    instance_cls: type[AgentInstance] = AgentInstance

    def __init__(self) -> None:
        super().__init__(self.instance_cls)


def make_agent_executor(tasks: Any = None, client: Any = None, **env_kwargs: Any) -> type[AgentExecutor]:
    """An AgentExecutor class bound to a task source and SandboxEnv options (max_steps, step_timeout, …)."""
    inst = type("AgentInstance", (AgentInstance,), {"tasks": tasks, "client": client, "env_kwargs": dict(env_kwargs)})
    return type("AgentExecutor", (AgentExecutor,), {"instance_cls": inst})
