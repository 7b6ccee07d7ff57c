"""verl: drive ShoalSandboxTool the way verl's multi-turn rollout does (create → execute… → calc_reward →
release), with a scripted policy instead of a model.

    python examples/rl_verl_tool.py tasks.jsonl
"""

import asyncio
import sys

from shoal.rl import load_tasks
from shoal.rl.adapters.verl import ShoalSandboxTool


async def main(path: str) -> None:
    tasks = load_tasks(path)
    tool = ShoalSandboxTool({"tasks": path, "max_steps": 20})   # as in verl's tool config YAML
    for task in tasks[:2]:
        iid, _prompt = await tool.create(create_kwargs={"task_id": task.id})
        await tool.execute(iid, {"command": "git status --short"})
        # the "model" fixes the bug with one command
        await tool.execute(iid, {"command": f"git apply <<'EOF'\n{task.patch}EOF"})
        print(task.id, "reward", await tool.calc_reward(iid))
        await tool.release(iid)


asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "tasks.jsonl"))
