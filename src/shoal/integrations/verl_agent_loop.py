"""verl 0.9.1: `ShoalAgentLoop`, verl's `ToolAgentLoop` plus a shoal trajectory: the sandbox is kept across
the trajectory's tool calls (see `shoal.integrations.verl`) and, when the loop ends, graded by shoal's
grader — in a fresh sandbox for SWE-style tasks — into verl's `reward_score` (verl then skips its own
reward computation for the sample) and closed. Registered as "shoal_agent"; in the file named by
`actor_rollout_ref.rollout.agent.agent_loop_config_path`:

    - name: shoal_agent
      _target_: shoal.integrations.verl_agent_loop.ShoalAgentLoop

This module imports verl's agent loop (torch, transformers, Ray): it runs where verl runs.
"""

from __future__ import annotations

import uuid
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

from shoal.integrations.verl import TRAJECTORY_ATTR, finish_trajectory, release_trajectory

__all__ = ["ShoalAgentLoop"]


def _create_kwargs(kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The row's task, from any tool's create_kwargs (every shoal tool of a row names the same task)."""
    for tk in (kwargs.get("tools_kwargs") or {}).values():
        ck = (tk or {}).get("create_kwargs") or {}
        if any(k in ck for k in ("task", "task_id", "instance_id")):
            return dict(ck)
    return None


@register("shoal_agent")
class ShoalAgentLoop(ToolAgentLoop):
    """ToolAgentLoop whose trajectory owns one shoal sandbox, graded and closed when the trajectory ends."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # verl makes one agent loop per trajectory; request ids repeat under full determinism, this does not
        self.trajectory = uuid.uuid4().hex

    async def _handle_pending_state(self, agent_data: Any, sampling_params: dict[str, Any]) -> Any:
        setattr(agent_data, TRAJECTORY_ATTR, self.trajectory)  # what ShoalSandboxTool keys the sandbox by
        return await super()._handle_pending_state(agent_data, sampling_params)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """verl's tool loop, then the grade of the final state as the sample's reward."""
        try:
            output = await super().run(sampling_params, **kwargs)
        except BaseException:
            await release_trajectory(self.trajectory)
            raise
        tools = list(getattr(self, "tools", {}).values())
        config = dict(getattr(tools[0], "config", {}) or {}) if tools else {}
        grade = await finish_trajectory(self.trajectory, _create_kwargs(kwargs), config)
        output.reward_score = grade.reward
        output.extra_fields["reward_extra_info"] = {"shoal_outcome": grade.outcome,
                                                    "shoal_infra_error": float(grade.infra_error)}
        return output
