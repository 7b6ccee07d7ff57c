"""TRL: an environment class for GRPOTrainer(environment_factory=...), exercised by a scripted "model"
calling its tools; TRL then calls get_reward() on each (no reward_funcs needed).

    python examples/rl_trl_env.py tasks.jsonl
"""

import sys

from shoal.integrations.trl import ShoalToolEnv
from shoal.rl import load_tasks

path = sys.argv[1] if len(sys.argv) > 1 else "tasks.jsonl"


class Env(ShoalToolEnv):
    tasks = path                      # or set $SHOAL_RL_TASKS


tasks = load_tasks(path)[:2]
envs = [Env() for _ in tasks]         # TRL makes one per rollout slot
for env, task in zip(envs, tasks, strict=True):
    env.reset(instance_id=task.id)    # the dataset row's columns
envs[0].write_file("/tmp/fix.patch", tasks[0].patch)
envs[0].bash("git apply /tmp/fix.patch")
envs[0].submit()
envs[1].bash("ls")                    # this one never fixes anything
print("rewards", [env.get_reward() for env in envs])  # [1.0, 0.0]
