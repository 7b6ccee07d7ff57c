"""Who the kernel's OOM killer picks: oom_score_adj of the node agent, sandbox agents and their children.

The kernel picks the task with the highest badness = resident pages + swap + page tables
+ oom_score_adj × (memory the OOM is about) / 1000. So:

* every process of a sandbox gets SANDBOX_OOM_SCORE_ADJ (500): in an OOM shared by sandboxes and host
  processes, sandbox processes go first, whatever the host's processes weigh;
* the in-sandbox agent (PID 1) is lowered after start (`protect_agent`): a process it runs, not the
  agent, dies when its sandbox runs out of memory (the agent resets its children to 500, see
  `--child-oom-score-adj` in agent/spawn.c);
* the node agent lowers itself to NODE_OOM_SCORE_ADJ (-1000: never picked) where it may.

Lowering a score below a process's `oom_score_adj_min` needs CAP_SYS_RESOURCE. A privileged write of
`oom_score_adj` also sets that minimum, so the OCI runtime's write of 500 at container start stops any
sandbox process from lowering itself again. The agent is lowered through the legacy `oom_adj` file,
which changes the score without touching the minimum (its children are reset to 500 anyway). Without
CAP_SYS_RESOURCE (some container hosts) nothing can be lowered below 0; `capabilities()` says so and
the node relies on the sandboxes' parent cgroup limit (shoal.node.protect) instead.
"""

from __future__ import annotations

import contextlib
import functools

#: every process of a sandbox (raising a score needs no privilege)
SANDBOX_OOM_SCORE_ADJ = 500
#: the node agent: -1000 disables OOM kills of it entirely
NODE_OOM_SCORE_ADJ = -1000
#: the sandbox's agent through the legacy interface (-16 of -17..15 = oom_score_adj -941)
AGENT_OOM_ADJ_LEGACY = -16
_CAP_SYS_RESOURCE = 24


@functools.cache
def can_lower() -> bool:
    """True when this process has CAP_SYS_RESOURCE (may lower scores below 0)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_RESOURCE & 1)
    except OSError:
        pass
    return False


def read_adj(pid: int | str = "self") -> int | None:
    """oom_score_adj of a process (None when it is gone)."""
    try:
        with open(f"/proc/{pid}/oom_score_adj") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def write_adj(pid: int | str, value: int) -> bool:
    """Set oom_score_adj of a process; False when refused (lowering without CAP_SYS_RESOURCE) or gone."""
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write(str(int(value)))
        return True
    except OSError:
        return False


def protect_agent(pid: int) -> int | None:
    """Lower a sandbox agent's score so its children, not it, die in its sandbox's OOM. Returns the score
    it has now (None when the process is gone). Never raises."""
    lowered = False
    if can_lower():
        with contextlib.suppress(OSError), open(f"/proc/{pid}/oom_adj", "w") as f:
            f.write(str(AGENT_OOM_ADJ_LEGACY))
            lowered = True
    if not lowered:
        # unprivileged: as low as the runtime's minimum allows (0), still below its children's 500
        write_adj(pid, 0)
    return read_adj(pid)


def protect_self(value: int = NODE_OOM_SCORE_ADJ) -> tuple[int | None, str]:
    """Lower this process's score to `value` (the node agent). Returns (score now, "" or why not)."""
    cur = read_adj()
    if cur is not None and cur <= value:
        return cur, ""
    if value < 0 and not can_lower():
        return cur, (f"oom_score_adj stays {cur}: lowering it needs CAP_SYS_RESOURCE, which this process lacks "
                     "(the sandboxes' parent cgroup limit and their score of 500 still keep the OOM killer on them)")
    if not write_adj("self", value):
        return read_adj(), "writing /proc/self/oom_score_adj was refused"
    return read_adj(), ""
