"""SkyRL-gym: the text environment (init / step / close, synchronous) with a scripted policy.

    python examples/rl_skyrl_env.py tasks.jsonl
"""

import sys

from shoal.rl import load_tasks
from shoal.rl.adapters.skyrl import ShoalTextEnv

path = sys.argv[1] if len(sys.argv) > 1 else "tasks.jsonl"
task = load_tasks(path)[0]
env = ShoalTextEnv({"tasks": path, "max_turns": 10}, {"extra_info": {"instance_id": task.id}})
chat, meta = env.init([{"role": "system", "content": "You fix bugs in Python projects."}])
for turn in ["<bash>git status --short</bash>", f"<bash>git apply <<'EOF'\n{task.patch}EOF</bash>", "<submit/>"]:
    out = env.step(turn)
print(task.id, "reward", out["reward"], out["metadata"])
env.close()
