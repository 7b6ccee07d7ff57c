"""verl: a tool with the call shape of verl's `BaseTool` (verl/tools/base_tool.py).

verl's multi-turn rollout creates one tool instance per trajectory and calls, in order:
`create(instance_id, **create_kwargs)` → `(instance_id, response)`; `execute(instance_id, parameters)`
→ `(response, step_reward, metrics)` once per tool call the model makes; `calc_reward(instance_id)` →
float; `release(instance_id)`. Here an instance is a SandboxEnv: `create` starts a sandbox for the task
named in `create_kwargs` (from the dataset's `extra_info.tools_kwargs.<tool>.create_kwargs`),
`execute` runs the model's command in it, `calc_reward` grades (SWE tasks: the repository's diff in a
fresh sandbox), `release` closes everything.

In verl's tool config YAML:

    tools:
      - class_name: shoal.rl.adapters.verl.ShoalSandboxTool
        config: {type: native, tasks: /data/tasks.jsonl, max_steps: 50}
        tool_schema: {type: function, function: {name: bash, description: ..., parameters: {...}}}
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from shoal.errors import InvalidRequest
from shoal.rl.adapters._common import loop_client, resolve_task
from shoal.rl.env import SandboxEnv

try:  # the real response type when verl is installed; a stand-in with the same fields when not
    from verl.tools.schemas import ToolResponse  # type: ignore[import-not-found]
except Exception:
    @dataclass
    class ToolResponse:  # type: ignore[no-redef]
        """Stand-in for verl's ToolResponse (text, image, video)."""

        text: str | None = None
        image: list[Any] | None = None
        video: list[Any] | None = None

BASH_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command in your sandbox (a persistent bash session in the repository).",
        "parameters": {"type": "object", "properties": {"command": {"type": "string",
                                                                    "description": "the command line"}},
                       "required": ["command"]},
    },
}


@dataclass
class _Instance:
    env: SandboxEnv
    reward: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


class ShoalSandboxTool:
    """A verl tool whose instances are shoal sandboxes; reward = the grader's verdict on the final state."""

    def __init__(self, config: dict | None = None, tool_schema: Any = None) -> None:
        self.config = dict(config or {})
        self.tool_schema = tool_schema or BASH_SCHEMA
        fn = getattr(self.tool_schema, "function", None) or self.tool_schema.get("function", {})
        self.name = getattr(fn, "name", None) or fn.get("name", "bash")
        self._instances: dict[str, _Instance] = {}
        self._client = self.config.pop("client", None)

    def get_openai_tool_schema(self) -> Any:
        """The tool's OpenAI function schema."""
        return self.tool_schema

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Start a sandbox for the task in `kwargs` (`task=` a task or dict, or `task_id=`); returns its prompt."""
        iid = instance_id or str(uuid.uuid4())
        if iid in self._instances:
            raise InvalidRequest(f"tool instance {iid!r} already exists")
        create_kwargs = kwargs.get("create_kwargs", kwargs)
        task = resolve_task(create_kwargs.get("task"), create_kwargs.get("task_id") or create_kwargs.get("instance_id"),
                            self.config.get("tasks"))
        env = SandboxEnv(task, self._client or loop_client(), max_steps=int(self.config.get("max_steps", 10_000)),
                         step_timeout=float(self.config.get("step_timeout", 120)),
                         partial_reward=bool(self.config.get("partial_reward", False)))
        prompt = await env.reset()
        self._instances[iid] = _Instance(env)
        return iid, ToolResponse(text=prompt)

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        """Run the model's command; returns (output, step reward 0, metrics)."""
        inst = self._get(instance_id)
        if inst.env.done:
            return ToolResponse(text="The episode is over."), 0.0, {"done": True}
        action = {"tool": "bash", **parameters} if "tool" not in parameters else parameters
        res = await inst.env.step(action)
        if res.done:
            inst.reward = res.reward
        metrics = {k: v for k, v in res.info.items() if k in ("exit_code", "timed_out", "duration_s", "outcome")}
        return ToolResponse(text=res.observation), 0.0, metrics

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """Grade the instance's final state (once; later calls return the same reward)."""
        inst = self._get(instance_id)
        if inst.reward is None:
            grade = await inst.env.submit()
            inst.reward = grade.reward
            inst.metrics = {"outcome": grade.outcome}
        return inst.reward

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Close the instance's sandbox."""
        inst = self._instances.pop(instance_id, None)
        if inst is not None:
            await inst.env.close()

    def _get(self, instance_id: str) -> _Instance:
        try:
            return self._instances[instance_id]
        except KeyError:
            raise InvalidRequest(f"no tool instance {instance_id!r}: call create() first") from None
