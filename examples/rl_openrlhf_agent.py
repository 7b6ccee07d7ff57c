"""OpenRLHF: the AgentInstance class to give `--agent_func_path`, driven here by a scripted policy the
way OpenRLHF's agent executor drives it (reset, then step after each generation).

    python examples/rl_openrlhf_agent.py tasks.jsonl
"""

import asyncio
import sys

from shoal.rl import load_tasks
from shoal.rl.adapters.openrlhf import make_agent_instance

TASKS = sys.argv[1] if len(sys.argv) > 1 else "tasks.jsonl"
AgentInstance = make_agent_instance(tasks=TASKS, max_steps=10)   # what an agent_func.py exports


async def main() -> None:
    task = load_tasks(TASKS)[0]
    agent = AgentInstance()
    obs = (await agent.reset({"prompt": "", "label": task.id}))["observation"]
    for text in ["Let me look.\n```bash\ngit log --oneline\n```",
                 f"Here is the fix.\n```bash\ngit apply <<'EOF'\n{task.patch}EOF\n```",
                 "Done. <submit/>"]:
        out = await agent.step({"observation_text": obs, "action_text": text, "label": task.id})
        obs += text + out["environment_feedback"]
    print(task.id, "reward", float(out["rewards"]), out["extra_logs"])


asyncio.run(main())
