"""A minimal agent loop on shoal: one SWE-style task, a scripted "agent", a graded episode.

    shoal tasks generate -o tasks.jsonl --projects inflection --tasks-per-project 2
    python examples/rl_quickstart.py tasks.jsonl
"""

import asyncio
import sys

import shoal
from shoal.rl import SandboxEnv, load_tasks


async def main(path: str) -> None:
    task = load_tasks(path)[0]
    async with shoal.Client() as client, SandboxEnv(task, client, max_steps=10) as env:
        print(await env.reset())                                   # the problem statement
        for action in ["git log --oneline", "git status --short",  # look around (a persistent shell)
                       {"tool": "write_file", "path": "/tmp/fix.patch", "content": task.patch},
                       "git apply /tmp/fix.patch && git diff --stat",
                       {"tool": "submit"}]:                        # the repository's diff is the answer
            obs, reward, _done, info = await env.step(action)
            print(f"> {action if isinstance(action, str) else action['tool']}\n{obs}\n")
        print("reward", reward, "outcome", info["outcome"])


asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "tasks.jsonl"))
