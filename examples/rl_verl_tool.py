"""verl: shoal's tool as verl's ToolAgentLoop calls it — create → execute → release around every call —
with one sandbox kept for the whole trajectory, graded at its end (what ShoalAgentLoop does).

    pip install verl==0.9.1                 # verl's tool modules import torch and Ray
    python examples/rl_verl_tool.py tasks.jsonl
"""

import asyncio
import sys
from types import SimpleNamespace

from shoal.integrations.verl import ShoalSandboxTool, finish_trajectory


async def main(tasks: str) -> None:
    from shoal.rl import load_tasks

    task = load_tasks(tasks)[0]
    tool = ShoalSandboxTool({"type": "native", "tasks": tasks}, None)   # the `bash` tool
    trajectory = SimpleNamespace(request_id="trajectory-1")             # verl's AgentData
    for command in ["git log --oneline | head -3", f"git apply <<'EOF'\n{task.patch}EOF"]:
        iid, _ = await tool.create(create_kwargs={"task_id": task.id})
        out, _, _ = await tool.execute(iid, {"command": command}, agent_data=trajectory)
        await tool.release(iid)
        print(out.text)
    grade = await finish_trajectory("trajectory-1")                     # the trajectory's reward
    print(task.id, "reward", grade.reward, grade.outcome)


asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "tasks.jsonl"))
