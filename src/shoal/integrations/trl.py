"""TRL 1.16: an environment class for `GRPOTrainer(environment_factory=...)`.

TRL instantiates the factory with no arguments (one instance per concurrent rollout, pooled and reused),
calls `reset(**row)` with the dataset row's columns at the start of each rollout — the returned text is
appended to the prompt — and exposes every public method but `reset` and `get_reward` as a tool the model
can call (typed signature + docstring → tool schema). `get_reward()` is called once per finished rollout:
the grade of the sandbox's final state (SWE tasks: its diff, in a fresh sandbox), so no `reward_funcs` are
needed. Methods are synchronous; sandbox work runs on the shared client's private event loop.

    from shoal.integrations.trl import ShoalToolEnv
    class Env(ShoalToolEnv):
        tasks = "/data/tasks.jsonl"                          # or $SHOAL_RL_TASKS
    trainer = GRPOTrainer(model=..., train_dataset=ds,       # ds rows: a `prompt` and an `instance_id`
                          environment_factory=Env)

(`shoal_reward` is the same grade as a reward function, for TRL versions without `get_reward`.)
"""

from __future__ import annotations

from typing import Any

from shoal.rl.adapters._common import resolve_task
from shoal.rl.env import SandboxEnv
from shoal.sdk.sync import shared_client


class ShoalToolEnv:
    """Tools: bash, read_file, write_file, submit. Tasks by id from `tasks` or $SHOAL_RL_TASKS."""

    tasks: Any = None
    client: Any = None
    max_steps: int = 50

    def __init__(self) -> None:
        self._bridge = shared_client().bridge
        self._env: SandboxEnv | None = None
        self.reward: float = 0.0
        self.outcome: str = ""

    def reset(self, **kwargs: Any) -> str:
        """Start a sandbox for the row's task (`instance_id`/`task_id`, or `task` as a dict); returns the prompt."""
        self._close()
        task = resolve_task(kwargs.get("task"), kwargs.get("instance_id") or kwargs.get("task_id"), self.tasks)
        client = self.client or shared_client().async_client
        self._env = SandboxEnv(task, client, max_steps=self.max_steps)
        self.reward, self.outcome = 0.0, ""
        return self._bridge.run(self._env.reset())

    def bash(self, command: str) -> str:
        """Run a shell command in the sandbox (a persistent bash session in the repository).

        Args:
            command: The command line to run.
        """
        return self._step({"tool": "bash", "command": command})

    def read_file(self, path: str) -> str:
        """Read a text file in the sandbox.

        Args:
            path: The file's path (relative paths start in the repository).
        """
        return self._step({"tool": "read_file", "path": path})

    def write_file(self, path: str, content: str) -> str:
        """Create or overwrite a file in the sandbox.

        Args:
            path: The file's path (relative paths start in the repository).
            content: The file's new text.
        """
        return self._step({"tool": "write_file", "path": path, "content": content})

    def submit(self) -> str:
        """Finish: your changes to the repository are graded by the hidden tests."""
        return self._step({"tool": "submit"})

    def get_reward(self) -> float:
        """The rollout's reward (TRL calls it once per finished rollout): the grade, graded now if not yet."""
        reward = self._finish()
        self._close()
        return reward

    def _step(self, action: dict[str, Any]) -> str:
        if self._env is None:
            return "error: no task: reset() was not called"
        if self._env.done:
            return "The episode is over; the answer was already graded."
        r = self._bridge.run(self._env.step(action))
        if r.done:
            self.reward, self.outcome = r.reward, str(r.info.get("outcome", ""))
        return r.observation

    def _finish(self) -> float:
        """Grade now if the model never submitted (the diff so far is the answer)."""
        if self._env is not None and not self._env.done:
            g = self._bridge.run(self._env.submit())
            self.reward, self.outcome = g.reward, g.outcome
        return self.reward

    def _close(self) -> None:
        if self._env is not None:
            self._bridge.run(self._env._close_sandbox())
            self._env = None


def shoal_reward(environments: list[ShoalToolEnv], **kwargs: Any) -> list[float]:
    """A TRL reward function: each rollout's grade (grading the final state when the model did not submit)."""
    out = []
    for env in environments:
        out.append(env._finish())
        env._close()
    return out
