"""OpenRLHF: an agent file for `--train.agent_func_path` (it exports `AgentExecutor`). Run directly, it drives
one episode the way OpenRLHF's executor does (reset, then step after each generation) with scripted text.

    pip install openrlhf==0.11.2          # (with its GPU stack; the agent file itself needs only shoal)
    python examples/rl_openrlhf_agent.py tasks.jsonl
"""

import asyncio
import sys

from shoal.integrations.openrlhf import make_agent_executor

TASKS = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1].endswith((".jsonl", ".json")) else "tasks.jsonl"
AgentExecutor = make_agent_executor(tasks=TASKS, max_steps=10)   # what OpenRLHF loads from this file


async def main() -> None:
    from shoal.rl import load_tasks

    task = load_tasks(TASKS)[0]
    agent = AgentExecutor().agent_instance_cls()
    obs = (await agent.reset({"observation": "You fix bugs.", "label": task.id}))["observation"]
    for text in ["Let me look.\n```bash\ngit log --oneline\n```",
                 f"Here is the fix.\n```bash\ngit apply <<'EOF'\n{task.patch}EOF\n```",
                 "Done. <submit/>"]:
        out = await agent.step({"observation_text": obs, "action_text": text, "label": task.id})
        obs += text + out["environment_feedback"]
    print(task.id, "reward", out["rewards"].item(), out["extra_logs"])


if __name__ == "__main__":
    asyncio.run(main())
