"""A Harbor-format task (instruction.md, task.toml, tests/ uploaded only after the agent finishes):

    python examples/rl_harbor.py examples/harbor-fizzbuzz
"""

import asyncio
import sys

import shoal
from shoal.rl import SandboxEnv, load_tasks


async def main(path: str) -> None:
    [task] = load_tasks(path)
    async with shoal.Client() as client, SandboxEnv(task, client) as env:
        print(await env.reset())
        await env.step({"tool": "bash", "command": task.solution})   # the reference solution
        obs, reward, _done, _info = await env.step({"tool": "submit"})
        print(obs, "| reward", reward)


asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "examples/harbor-fizzbuzz"))
