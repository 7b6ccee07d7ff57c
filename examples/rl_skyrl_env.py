"""SkyRL-gym: `skyrl_gym.make("shoal", ...)` (init / step / close, synchronous) with a scripted policy.

    pip install skyrl-gym==0.4.0
    python examples/rl_skyrl_env.py tasks.jsonl
"""

import sys

import skyrl_gym

import shoal.integrations.skyrl  # noqa: F401  (registers the env id "shoal")
from shoal.rl import load_tasks

path = sys.argv[1] if len(sys.argv) > 1 else "tasks.jsonl"
task = load_tasks(path)[0]
env = skyrl_gym.make("shoal", env_config={"tasks": path, "max_turns": 10},
                     extras={"extra_info": {"instance_id": task.id}})
chat, meta = env.init([{"role": "system", "content": "You fix bugs in Python projects."}])
for turn in ["<bash>git status --short</bash>", f"<bash>git apply <<'EOF'\n{task.patch}EOF</bash>", "<submit/>"]:
    out = env.step(turn)
print(task.id, "reward", out["reward"], out["metadata"])
env.close()
