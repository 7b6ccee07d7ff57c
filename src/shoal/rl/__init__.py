"""RL integration: task formats, graders, sandbox environments, trainer adapters, a task generator.

    from shoal.rl import SandboxEnv, load_tasks, run_episodes
    tasks = load_tasks("tasks.jsonl")                  # SWE-bench-style JSONL or Harbor task dirs
    async with SandboxEnv(tasks[0], client) as env:
        obs = await env.reset()
        obs, reward, done, info = await env.step({"tool": "bash", "command": "git status"})
"""

from shoal.rl.env import (
    EnvPool,
    EpisodeContext,
    EpisodeResult,
    SandboxEnv,
    StepResult,
    SyncSandboxEnv,
    env_pool,
    normalize_action,
    run_episode,
    run_episodes,
)
from shoal.rl.grader import OUTCOMES, Grade, grade_final_state, grade_patch
from shoal.rl.tasks import HarborTask, SWETask, Task, TaskError, dump_jsonl, load_harbor_dir, load_tasks

__all__ = [
    "OUTCOMES", "EnvPool", "EpisodeContext", "EpisodeResult", "Grade", "HarborTask", "SWETask", "SandboxEnv",
    "StepResult", "SyncSandboxEnv", "Task", "TaskError", "dump_jsonl", "env_pool", "grade_final_state", "grade_patch",
    "load_harbor_dir", "load_tasks", "normalize_action", "run_episode", "run_episodes",
]
