"""A rollout step on a Ray cluster, in the shape of verl's / SkyRL's: rollout workers are Ray actors; each
episode gets a sandbox from the cluster (`shoal.Client("ray://ADDR")`: placed on whichever node has room),
the "policy" acts in it (writes code, runs it), and the result is graded in a fresh sandbox, like SkyRL and
slime grade SWE tasks. A scripted policy stands in for the model.

    shoal cluster up --address HEAD:6379          # once: a node agent on every Ray node offering `shoal`
    python examples/cluster_rollout.py --address HEAD:6379 --workers 8 --episodes 4
"""

from __future__ import annotations

import argparse
import statistics

import ray

import shoal
from shoal.cluster.raylink import connect

TASKS = [  # (prompt, hidden test the grader runs)
    ("write add(a, b) in solution.py", "from solution import add; assert add(2, 3) == 5"),
    ("write is_even(n) in solution.py", "from solution import is_even; assert is_even(4) and not is_even(7)"),
    ("write rev(s) in solution.py", "from solution import rev; assert rev('abc') == 'cba'"),
]
POLICY = {  # what the scripted "model" answers to each prompt
    TASKS[0][0]: "def add(a, b):\n    return a + b\n",
    TASKS[1][0]: "def is_even(n):\n    return n % 2 == 0\n",
    TASKS[2][0]: "def rev(s):\n    return s[::-1]\n",
}


@ray.remote(num_cpus=0.1)
class RolloutWorker:
    """One rollout worker: creates, uses and grades sandboxes through the cluster client."""

    def __init__(self, address: str) -> None:
        # inside a Ray actor the process is already part of the cluster: the client joins it as is
        self.client = shoal.SyncClient(f"ray://{address}")

    def episode(self, step: int, k: int) -> dict:
        prompt, test = TASKS[k % len(TASKS)]
        labels = {"job": f"rollout-step-{step}", "episode": str(k)}
        with self.client.create("base", memory_mb=128, ttl_s=600, labels=labels) as sb:
            # the agent's turns: look around, write the solution, try it
            sb.exec("ls /work")
            sb.write_file("/work/solution.py", POLICY[prompt])
            tried = sb.exec(["python3", "-c", "import solution"], cwd="/work")
            answer = sb.read_file("/work/solution.py")
            node = sb.info.node
        # grade in a fresh sandbox: only the answer goes in, the hidden test runs there
        with self.client.create("base", memory_mb=128, ttl_s=600, labels={**labels, "role": "grader"}) as g:
            g.write_file("/work/solution.py", answer)
            r = g.exec(["python3", "-c", test], cwd="/work", timeout=60)
        return {"episode": k, "node": node, "ran": tried.exit_code == 0, "reward": 1.0 if r.exit_code == 0 else 0.0}

    def close(self) -> None:
        self.client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", required=True, help="the Ray cluster's GCS address HOST:PORT (or auto)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--episodes", type=int, default=4, help="episodes per worker")
    ap.add_argument("--step", type=int, default=0)
    args = ap.parse_args()
    connect(args.address)  # ray.init, keeping a loopback address as it is
    workers = [RolloutWorker.remote(args.address) for _ in range(args.workers)]
    futures = [w.episode.remote(args.step, i * args.episodes + j)
               for i, w in enumerate(workers) for j in range(args.episodes)]
    results = ray.get(futures)
    ray.get([w.close.remote() for w in workers])
    rewards = [r["reward"] for r in results]
    print("rewards:", rewards)
    per_node: dict[str, int] = {}
    for r in results:
        per_node[r["node"]] = per_node.get(r["node"], 0) + 1
    print("episodes per node:", per_node)
    print(f"mean reward {statistics.mean(rewards):.2f}")


if __name__ == "__main__":
    main()
