"""verl 0.9.1: shoal sandboxes as verl tools, one sandbox per trajectory, graded by shoal's grader.

verl's `ToolAgentLoop` calls `create → execute → release` around *every* tool call and never calls
`calc_reward`. So a tool instance here is only a handle: the sandbox belongs to the trajectory (the
`agent_data` verl passes to `execute`, keyed by its request id) and is kept across the trajectory's tool
calls, whichever shoal tool they name (`bash`, `read_file`, `write_file`, `submit` share it). It is closed
when the trajectory ends — `ShoalAgentLoop` (a `ToolAgentLoop` registered as "shoal_agent") grades it
then, in a fresh sandbox for SWE-style tasks, and sets verl's `reward_score` — or, under the plain
`tool_agent` loop, once idle for `idle_ttl_s` (every sandbox also has a hard shoal TTL, `ttl_s`).

Tool config (`actor_rollout_ref.rollout.multi_turn.tool_config_path`):

    tools:
      - class_name: shoal.integrations.verl.ShoalSandboxTool
        config: {type: native, tasks: /data/tasks.jsonl, idle_ttl_s: 600}
        # tool_schema omitted: the `bash` schema; give one named read_file / write_file / submit for those

Agent loop config (`actor_rollout_ref.rollout.agent.agent_loop_config_path`), and `agent_name: shoal_agent`
in the dataset (or `actor_rollout_ref.rollout.agent.default_agent_loop=shoal_agent`):

    - name: shoal_agent
      _target_: shoal.integrations.verl_agent_loop.ShoalAgentLoop

The task of each row: `extra_info.tools_kwargs.<tool>.create_kwargs.task_id` (or `task`: a task dict), ids
looked up in the tool config's `tasks` or $SHOAL_RL_TASKS.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from shoal.errors import InvalidRequest
from shoal.rl.adapters._common import loop_client, resolve_task
from shoal.rl.env import TOOL_SCHEMAS, SandboxEnv
from shoal.rl.grader import Grade

__all__ = ["ShoalSandboxTool", "finish_trajectory", "release_trajectory", "trajectory_key"]

#: the trajectory attribute ShoalAgentLoop sets on verl's AgentData (request ids repeat under full determinism)
TRAJECTORY_ATTR = "shoal_trajectory"
DEFAULT_IDLE_TTL_S = 600.0


@dataclass
class _Session:
    """One trajectory's sandbox episode."""

    env: SandboxEnv
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    idle_ttl_s: float = DEFAULT_IDLE_TTL_S


# per process (verl runs the agent loops of a worker in one process); keyed by trajectory
_sessions: dict[str, _Session] = {}


def trajectory_key(agent_data: Any = None, instance_id: str | None = None) -> str:
    """The trajectory a tool call belongs to: the agent loop's mark, else verl's request id, else the instance."""
    key = getattr(agent_data, TRAJECTORY_ATTR, None) or getattr(agent_data, "request_id", None) or instance_id
    if not key:
        raise InvalidRequest("no trajectory: execute() got neither agent_data nor an instance id")
    return str(key)


def _task_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return dict(kwargs.get("create_kwargs") or {k: v for k, v in kwargs.items() if k != "create_kwargs"})


async def _reap_idle() -> None:
    now = time.monotonic()
    for key, s in list(_sessions.items()):
        if now - s.last_used > s.idle_ttl_s and not s.lock.locked():
            _sessions.pop(key, None)
            with contextlib.suppress(Exception):
                await s.env.close()


async def open_trajectory(key: str, create_kwargs: dict[str, Any], config: dict[str, Any],
                          client: Any = None) -> _Session:
    """The trajectory's session, starting its sandbox on first use (task from `create_kwargs`)."""
    s = _sessions.get(key)
    if s is not None:
        return s
    task = resolve_task(create_kwargs.get("task"), create_kwargs.get("task_id") or create_kwargs.get("instance_id"),
                        config.get("tasks"))
    env = SandboxEnv(task, client or loop_client(), max_steps=int(config.get("max_steps", 10_000)),
                     step_timeout=float(config.get("step_timeout", 120)),
                     partial_reward=bool(config.get("partial_reward", False)),
                     ttl_s=float(config.get("ttl_s", 6 * 3600)))
    s = _Session(env, idle_ttl_s=float(config.get("idle_ttl_s", DEFAULT_IDLE_TTL_S)))
    _sessions[key] = s
    try:
        await env.reset()
    except BaseException:
        _sessions.pop(key, None)
        await env.close()
        raise
    return s


async def finish_trajectory(key: str, create_kwargs: dict[str, Any] | None = None,
                            config: dict[str, Any] | None = None, client: Any = None) -> Grade:
    """Grade the trajectory's final state (SWE tasks: its diff, in a fresh sandbox) and close it. A trajectory
    that never used a tool is graded from a fresh sandbox of its task (the agent did nothing)."""
    s = _sessions.get(key)
    if s is None:
        if create_kwargs is None:
            raise InvalidRequest(f"trajectory {key!r} has no sandbox and no task to grade")
        s = await open_trajectory(key, create_kwargs, config or {}, client)
    try:
        async with s.lock:
            return await s.env.submit()
    finally:
        await release_trajectory(key)


async def release_trajectory(key: str) -> None:
    """Close the trajectory's sandbox without grading it."""
    s = _sessions.pop(key, None)
    if s is not None:
        await s.env.close()


def _schema(tool_schema: Any) -> OpenAIFunctionToolSchema:
    if tool_schema is None:
        return OpenAIFunctionToolSchema.model_validate(TOOL_SCHEMAS[0])
    if isinstance(tool_schema, dict):
        return OpenAIFunctionToolSchema.model_validate(tool_schema)
    return tool_schema


class ShoalSandboxTool(BaseTool):
    """A verl tool acting in its trajectory's shoal sandbox: bash (default), read_file, write_file or submit
    (by the schema's function name; arguments as in `shoal.rl.env.TOOL_SCHEMAS`)."""

    def __init__(self, config: dict | None = None, tool_schema: Any = None) -> None:
        config = dict(config or {})
        self._client = config.pop("client", None)
        super().__init__(config, _schema(tool_schema))
        self._instances: dict[str, dict[str, Any]] = {}

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """A handle for one tool call (verl makes one per call); the sandbox starts at the first execute."""
        iid = instance_id or uuid.uuid4().hex
        self._instances[iid] = _task_kwargs(kwargs)
        await _reap_idle()
        return iid, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any,
                      ) -> tuple[ToolResponse, float, dict]:
        """Run the call in the trajectory's sandbox (`kwargs["agent_data"]`, as ToolAgentLoop passes it)."""
        if instance_id not in self._instances:
            raise InvalidRequest(f"no tool instance {instance_id!r}: call create() first")
        key = trajectory_key(kwargs.get("agent_data"), instance_id)
        s = await open_trajectory(key, self._instances[instance_id], self.config, self._client)
        async with s.lock:
            s.last_used = time.monotonic()
            if s.env.done:
                return ToolResponse(text="The episode is over; the answer was already graded."), 0.0, {"done": True}
            res = await s.env.step({"tool": self.name, **(parameters or {})})
            s.last_used = time.monotonic()
        metrics = {k: v for k, v in res.info.items() if k in ("exit_code", "timed_out", "duration_s", "outcome")}
        # the trajectory's reward is the grader's, at its end; a tool call earns nothing by itself
        return ToolResponse(text=res.observation), 0.0, metrics

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """Grade the trajectory now (for loops that call it; ShoalAgentLoop grades at the trajectory's end)."""
        key = trajectory_key(kwargs.get("agent_data"), instance_id)
        s = _sessions.get(key)
        if s is None:
            raise InvalidRequest(f"no sandbox for trajectory {key!r}")
        async with s.lock:
            return (await s.env.submit()).reward

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Drop the call's handle; the trajectory's sandbox lives on (its end or idle_ttl_s closes it)."""
        self._instances.pop(instance_id, None)
