"""Scripted policies (no LLM) and a rollout runner that measures where the time goes.

The policies use the task's gold patch the way a test oracle would, to produce every kind of episode a
trainer meets: solved directly, solved after exploring with shell commands (the answer is the
repository's diff), a wrong fix, giving up, and a patch that does not apply.
"""

from __future__ import annotations

import shlex
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.rl.env import Action, EpisodeContext, EpisodeResult, run_episodes
from shoal.rl.tasks import HarborTask, SWETask, Task, patch_files


def _file_of(task: SWETask) -> str:
    files = patch_files(task.patch)
    return files[0] if files else ""


def gold(obs: str, ctx: EpisodeContext) -> Action:
    """Submit the reference patch at once."""
    ctx.tag = ctx.tag or "gold"
    t = ctx.task
    if isinstance(t, HarborTask):
        if ctx.step == 0 and t.solution:
            return {"tool": "bash", "command": t.solution, "timeout": t.agent_timeout_s}
        return {"tool": "submit"}
    return {"tool": "submit", "patch": t.patch}


def explore_then_fix(obs: str, ctx: EpisodeContext) -> Action:
    """Look around with shell commands, apply the fix inside the sandbox, submit the repository's diff."""
    ctx.tag = ctx.tag or "explore+fix"
    t = ctx.task
    assert isinstance(t, SWETask)
    f = shlex.quote(_file_of(t))
    script = [
        {"tool": "bash", "command": "git status --short && git log --oneline | head -3 && ls"},
        {"tool": "bash", "command": f"grep -n 'def ' {f} | head -20"},
        {"tool": "read_file", "path": _file_of(t)},
        {"tool": "write_file", "path": "/tmp/fix.patch", "content": t.patch},
        {"tool": "bash", "command": "git apply /tmp/fix.patch && git diff --stat"},
        {"tool": "submit"},
    ]
    return script[min(ctx.step, len(script) - 1)]


def wrong_fix(obs: str, ctx: EpisodeContext) -> Action:
    """Explore, then change the right file in a way that does not fix the bug, and submit that."""
    ctx.tag = ctx.tag or "wrong"
    t = ctx.task
    assert isinstance(t, SWETask)
    f = shlex.quote(_file_of(t))
    script = [
        {"tool": "bash", "command": "ls && git status --short"},
        {"tool": "bash", "command": f"wc -l {f}"},
        # a plausible-looking edit that changes no behaviour
        {"tool": "bash", "command": f"printf '\\n# checked: behaviour looks right to me\\n' >> {f}"},
        {"tool": "submit"},
    ]
    return script[min(ctx.step, len(script) - 1)]


def give_up(obs: str, ctx: EpisodeContext) -> Action:
    """Run a few commands, change nothing, submit (an empty patch)."""
    ctx.tag = ctx.tag or "give-up"
    script: list[Action] = ["ls -la", "git log --oneline | head -5", "python3 --version", "submit"]
    return script[min(ctx.step, len(script) - 1)]


def malformed(obs: str, ctx: EpisodeContext) -> Action:
    """Submit a patch whose removed line is not in the file (it cannot apply)."""
    ctx.tag = ctx.tag or "malformed"
    t = ctx.task
    assert isinstance(t, SWETask)
    return {"tool": "submit", "patch": corrupt_patch(t.patch)}


def corrupt_patch(patch: str) -> str:
    """The same diff with every removed line replaced by text that is not in the file."""
    out = []
    for line in patch.splitlines(keepends=True):
        if line.startswith("-") and not line.startswith("---"):
            line = "-this line is not in the file # shoal corrupt\n"
        out.append(line)
    return "".join(out)


POLICIES: dict[str, Callable[[str, EpisodeContext], Action]] = {
    "gold": gold, "explore+fix": explore_then_fix, "wrong": wrong_fix, "give-up": give_up, "malformed": malformed,
}
#: the demo's mix (per 20 episodes): what a young policy's rollouts look like
DEFAULT_MIX = {"gold": 7, "explore+fix": 5, "wrong": 4, "give-up": 2, "malformed": 2}


class MixedPolicy:
    """Picks one scripted policy per episode from a weighted mix (deterministic: by episode number)."""

    def __init__(self, mix: dict[str, int] | None = None) -> None:
        mix = mix or DEFAULT_MIX
        bad = [k for k in mix if k not in POLICIES]
        if bad:
            raise ValueError(f"unknown policies {bad}; known: {sorted(POLICIES)}")
        self.slots = [name for name, n in mix.items() for _ in range(n)]

    def name_for(self, episode: int) -> str:
        """Which policy runs episode `episode`."""
        # spread each policy over the run instead of running them in blocks
        return self.slots[(episode * 7) % len(self.slots)]

    def __call__(self, obs: str, ctx: EpisodeContext) -> Action:
        name = self.name_for(ctx.episode)
        if isinstance(ctx.task, HarborTask) and name != "gold":
            name = "give-up"
        ctx.tag = name
        return POLICIES[name](obs, ctx)


@dataclass
class RolloutStats:
    """Live counters of a rollout, updated as episodes move through their phases (for progress displays)."""

    total: int = 0
    done: int = 0
    errors: int = 0
    steps: int = 0
    reward_sum: float = 0.0
    outcomes: Counter = field(default_factory=Counter)
    phase: dict[int, str] = field(default_factory=dict)

    def count(self, phase: str) -> int:
        """Episodes currently in `phase` ("create", "agent" or "grade")."""
        return sum(1 for p in self.phase.values() if p == phase)

    def on_event(self, kind: str, ctx: EpisodeContext, res: EpisodeResult | None) -> None:
        """The `on_event` hook of run_episodes."""
        if kind == "start":
            self.phase[ctx.episode] = "create"
        elif kind == "created":
            self.phase[ctx.episode] = "agent"
        elif kind == "grading":
            self.phase[ctx.episode] = "grade"
        elif kind == "step":
            self.steps += 1
        elif kind == "done" and res is not None:
            self.phase.pop(ctx.episode, None)
            self.done += 1
            self.errors += bool(res.error)
            self.reward_sum += res.reward
            self.outcomes[res.outcome] += 1


@dataclass
class RolloutSummary:
    """What a rollout produced and where its time went."""

    episodes: int
    concurrency: int
    wall_s: float
    results: list[EpisodeResult]

    @property
    def mean_reward(self) -> float:
        """Average reward over all episodes."""
        return sum(r.reward for r in self.results) / len(self.results) if self.results else 0.0

    def outcomes(self) -> Counter:
        """Episodes per grader outcome."""
        return Counter(r.outcome for r in self.results)

    def by_tag(self) -> dict[str, tuple[int, float]]:
        """Per policy: (episodes, mean reward)."""
        out: dict[str, list[float]] = {}
        for r in self.results:
            out.setdefault(r.tag or "?", []).append(r.reward)
        return {k: (len(v), sum(v) / len(v)) for k, v in sorted(out.items())}

    def phase_totals(self) -> dict[str, float]:
        """Seconds summed over episodes per phase (create, agent, grade, total)."""
        tot: dict[str, float] = {}
        for r in self.results:
            for k, v in r.timings.items():
                tot[k] = tot.get(k, 0.0) + v
        return tot

    def phase_percentiles(self, phase: str) -> tuple[float, float, float]:
        """p50, p90, max of one phase's per-episode seconds."""
        xs = sorted(r.timings.get(phase, 0.0) for r in self.results)
        if not xs:
            return (0.0, 0.0, 0.0)
        return xs[len(xs) // 2], xs[min(len(xs) - 1, int(len(xs) * 0.9))], xs[-1]

    def steps_total(self) -> int:
        """Environment steps taken by all episodes."""
        return sum(r.steps for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return {"episodes": self.episodes, "concurrency": self.concurrency, "wall_s": self.wall_s,
                "mean_reward": self.mean_reward, "outcomes": dict(self.outcomes()),
                "by_policy": {k: {"episodes": n, "mean_reward": m} for k, (n, m) in self.by_tag().items()},
                "phase_seconds": self.phase_totals(), "steps": self.steps_total(),
                "results": [r.to_dict() for r in self.results]}


async def rollout(tasks: Sequence[Task], *, client: Any, episodes: int = 64, concurrency: int = 64,
                  policy: Any | None = None, grade_concurrency: int | None = None, max_steps: int = 20,
                  stats: RolloutStats | None = None, memory_mb: int = 512) -> RolloutSummary:
    """Run `episodes` episodes over `tasks` (cycling) with the mixed scripted policy; never raises per episode."""
    stats = stats if stats is not None else RolloutStats()
    stats.total = episodes
    pol = policy or MixedPolicy()
    t0 = time.monotonic()
    results = await run_episodes(pol, list(tasks), client=client, concurrency=concurrency, episodes=episodes,
                                 grade_concurrency=grade_concurrency, max_steps=max_steps, on_event=stats.on_event,
                                 memory_mb=memory_mb)
    return RolloutSummary(episodes=episodes, concurrency=concurrency, wall_s=time.monotonic() - t0, results=results)
