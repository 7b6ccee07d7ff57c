"""Rewards the way SWE-bench computes them, in sandboxes the agent never touched.

`grade_patch` (SWE-style tasks): in a **fresh** sandbox from the task's image, apply the agent's patch
(`git apply`, falling back to `patch -p1 --fuzz`), put the test files back to the base commit and apply
the hidden `test_patch`, run the tests with a small reporter plugin, and read each test's outcome.
Reward 1 only when every FAIL_TO_PASS and PASS_TO_PASS test passes (or, with `partial=True`, the
fraction of those that pass).

`grade_final_state` (Harbor-style tasks): the final state of the agent's own sandbox is what is judged.
The agent's processes are killed first, then `tests/` is uploaded (it was never in the sandbox before),
`test.sh` runs and the reward is read from `/logs/verifier/reward.txt` (or `reward.json`).

Every outcome is distinct, so a trainer can tell a wrong answer from a broken one:
resolved · unresolved · empty_patch · patch_apply_failed · test_error · timeout · sandbox_error.
`sandbox_error` (an infrastructure failure, not the agent's) sets `infra_error=True`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from shoal.errors import FileNotFound, ShoalError
from shoal.limits import DEFAULT_BACKEND
from shoal.rl.pytest_results import (
    PASS_STATUSES,
    REPORTER_PLUGIN,
    TestResults,
    parse_pytest_log,
    parse_reporter_lines,
)
from shoal.rl.tasks import HarborTask, SWETask

if TYPE_CHECKING:
    from shoal.sdk.client import Client
    from shoal.sdk.sandbox import Sandbox

RESOLVED = "resolved"
UNRESOLVED = "unresolved"
EMPTY_PATCH = "empty_patch"
PATCH_APPLY_FAILED = "patch_apply_failed"
TEST_ERROR = "test_error"
TIMEOUT = "timeout"
SANDBOX_ERROR = "sandbox_error"
OUTCOMES = (RESOLVED, UNRESOLVED, EMPTY_PATCH, PATCH_APPLY_FAILED, TEST_ERROR, TIMEOUT, SANDBOX_ERROR)

GRADE_DIR = "/tmp/.shoal-grade"
MISSING = "missing"
_LOG_KEEP = 6000

# git apply first (exact, all-or-nothing), then with recounted hunks, then GNU patch with fuzz last (it may
# leave partial hunks behind, which is why nothing is tried after it), as SWE-bench's harness does
_APPLY = f"""
set -u
p={GRADE_DIR}/agent.patch
for cmd in "git apply --verbose --whitespace=nowarn" "git apply --verbose --whitespace=nowarn --recount" \
           "patch --batch --forward --fuzz=5 -p1 -i"; do
  if $cmd "$p" >>{GRADE_DIR}/apply.log 2>&1; then echo "applied with: $cmd"; exit 0; fi
done
cat {GRADE_DIR}/apply.log
exit 1
"""


@dataclass
class Grade:
    """The verdict on one submission."""

    task_id: str
    outcome: str
    reward: float
    fail_to_pass: dict[str, str] = field(default_factory=dict)
    pass_to_pass: dict[str, str] = field(default_factory=dict)
    detail: str = ""
    duration_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    log: str = ""
    infra_error: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def resolved(self) -> bool:
        """True when the task counts as solved."""
        return self.outcome == RESOLVED

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)

    def summary(self) -> str:
        """One line: outcome, reward and how many named tests passed."""
        def frac(d: dict[str, str]) -> str:
            return f"{sum(v in PASS_STATUSES for v in d.values())}/{len(d)}"

        s = f"{self.task_id}: {self.outcome} reward={self.reward:g}"
        if self.fail_to_pass or self.pass_to_pass:
            s += f" F2P {frac(self.fail_to_pass)} P2P {frac(self.pass_to_pass)}"
        return s + (f" ({self.detail})" if self.detail else "")


def _tail(s: str | bytes, n: int = _LOG_KEEP) -> str:
    if isinstance(s, bytes):
        s = s.decode("utf-8", "replace")
    return s if len(s) <= n else "…" + s[-n:]


def compute_reward(results: TestResults, f2p: list[str], p2p: list[str], partial: bool = False,
                   ) -> tuple[float, dict[str, str], dict[str, str]]:
    """Reward from per-test results: 1 iff every named test passes (or the passing fraction when partial)."""
    f = {t: results.get(t) or MISSING for t in f2p}
    p = {t: results.get(t) or MISSING for t in p2p}
    named = list(f.values()) + list(p.values())
    ok = sum(s in PASS_STATUSES for s in named)
    if not named:
        return 0.0, f, p
    return (ok / len(named) if partial else float(ok == len(named))), f, p


def _reset_tests_script(task: SWETask) -> str:
    """Put every file the hidden tests touch back to the base commit (or remove it when new)."""
    files = list(dict.fromkeys(task.hidden_files + [t.split("::", 1)[0] for t in task.FAIL_TO_PASS + task.PASS_TO_PASS
                                                    if "::" in t]))
    # a conftest.py beside or above a test file can rewrite its outcome: those are reset too
    for f in list(files):
        parts = f.split("/")[:-1]
        for i in range(len(parts) + 1):
            c = "/".join([*parts[:i], "conftest.py"])
            if c not in files:
                files.append(c)
    lines = ["set -u"]
    for f in files:
        q = shlex.quote(f)
        lines.append(f"if git cat-file -e HEAD:{q} 2>/dev/null; then git checkout -q HEAD -- {q}; "
                     f"else rm -rf -- {q}; fi")
    return "\n".join(lines) + "\n"


async def grade_patch(client: Client, task: SWETask, patch: str | None, *, partial: bool = False,
                      timeout_s: float | None = None, memory_mb: int = 1024, cpus: float = 1.0,
                      labels: dict[str, str] | None = None, backend: str = DEFAULT_BACKEND) -> Grade:
    """Grade a SWE-style submission (a unified diff against the task's base commit) in a fresh sandbox."""
    t0 = time.monotonic()
    phases: dict[str, float] = {}
    tid = task.instance_id
    if not patch or not patch.strip():
        return Grade(tid, EMPTY_PATCH, 0.0, {t: MISSING for t in task.FAIL_TO_PASS},
                     {t: MISSING for t in task.PASS_TO_PASS}, detail="no changes were submitted")
    if not patch.endswith("\n"):
        patch += "\n"  # a diff cut at its last newline is still a diff; git apply insists on the newline
    limit = float(timeout_s or task.timeout_s)
    try:
        sb = await client.create(task.image, network=False, memory_mb=memory_mb, cpus=cpus, backend=backend,
                                 ttl_s=max(600.0, limit * 3),
                                 labels={"shoal.rl/role": "grader", **(labels or {})})
    except ShoalError as e:
        return Grade(tid, SANDBOX_ERROR, 0.0, detail=f"could not create the grading sandbox: {e}",
                     duration_s=time.monotonic() - t0, infra_error=True)
    phases["create"] = time.monotonic() - t0
    try:
        return await _grade_in(sb, task, patch, partial, limit, phases, t0)
    except ShoalError as e:
        return Grade(tid, SANDBOX_ERROR, 0.0, detail=f"grading sandbox failed: {e}", phases=phases,
                     duration_s=time.monotonic() - t0, infra_error=True)
    finally:
        with contextlib.suppress(ShoalError):
            await sb.close()


async def _grade_in(sb: Sandbox, task: SWETask, patch: str, partial: bool, limit: float,
                    phases: dict[str, float], t0: float) -> Grade:
    tid = task.instance_id
    f2p, p2p = task.FAIL_TO_PASS, task.PASS_TO_PASS
    t = time.monotonic()
    await sb.write_file(f"{GRADE_DIR}/agent.patch", patch)
    r = (await sb.exec(_APPLY, cwd=task.workdir, timeout=120)).text()
    phases["apply"] = time.monotonic() - t
    if r.exit_code != 0:
        return Grade(tid, PATCH_APPLY_FAILED, 0.0, {x: MISSING for x in f2p}, {x: MISSING for x in p2p},
                     detail="the patch does not apply to the base commit", phases=phases,
                     duration_s=time.monotonic() - t0, log=_tail(str(r.stdout) + str(r.stderr)))
    applied_with = str(r.stdout).strip().splitlines()[-1:] or [""]
    t = time.monotonic()
    await sb.write_file(f"{GRADE_DIR}/test.patch", task.test_patch)
    await sb.write_file(f"{GRADE_DIR}/shoal_pytest_report.py", REPORTER_PLUGIN)
    script = _reset_tests_script(task) + f"git apply --whitespace=nowarn {GRADE_DIR}/test.patch\n"
    r = (await sb.exec(script, cwd=task.workdir, timeout=120)).text()
    if r.exit_code != 0:
        return Grade(tid, TEST_ERROR, 0.0, {x: MISSING for x in f2p}, {x: MISSING for x in p2p},
                     detail="the hidden test patch does not apply (the task is broken)", phases=phases,
                     duration_s=time.monotonic() - t0, log=_tail(str(r.stdout) + str(r.stderr)), infra_error=True)
    phases["apply"] += time.monotonic() - t
    t = time.monotonic()
    files = " ".join(shlex.quote(f) for f in task.test_targets)
    cmd = (f"export PYTHONPATH={GRADE_DIR}${{PYTHONPATH:+:$PYTHONPATH}} PYTEST_PLUGINS=shoal_pytest_report "
           f"SHOAL_PYTEST_REPORT={GRADE_DIR}/report.jsonl PYTHONDONTWRITEBYTECODE=1\n"
           f"rm -f {GRADE_DIR}/report.jsonl\n"
           f"timeout -k 5 {int(limit)} {task.test_cmd} {files}")
    r = (await sb.exec(cmd, cwd=task.workdir, env=task.env or None, timeout=limit + 30)).text()
    phases["test"] = time.monotonic() - t
    log = str(r.stdout) + ("\n" + str(r.stderr) if r.stderr else "")
    base = dict(phases=phases, log=_tail(log), extra={"exit_code": r.exit_code, "applied_with": applied_with[0]})
    if r.timed_out or r.exit_code in (124, 137):
        return Grade(tid, TIMEOUT, 0.0, {x: MISSING for x in f2p}, {x: MISSING for x in p2p},
                     detail=f"the tests did not finish within {limit:g}s", duration_s=time.monotonic() - t0, **base)
    try:
        results = parse_reporter_lines((await sb.read_file(f"{GRADE_DIR}/report.jsonl")).decode("utf-8", "replace"))
    except FileNotFound:
        results = TestResults()
    if not results.statuses and not results.collect_errors:
        # no reporter output (a custom test_cmd, an old pytest): fall back to the -rA console summary
        results = parse_pytest_log(log, known=f2p + p2p)
    reward, f, p = compute_reward(results, f2p, p2p, partial)
    if results.collect_errors or r.exit_code in (2, 3, 4):
        what = ", ".join(results.collect_errors[:3]) or f"pytest exit code {r.exit_code}"
        return Grade(tid, TEST_ERROR, 0.0, f, p, detail=f"the tests could not run: collection failed ({what})",
                     duration_s=time.monotonic() - t0, **base)
    if not results.statuses:
        return Grade(tid, TEST_ERROR, 0.0, f, p, detail=f"no test ran (exit code {r.exit_code})",
                     duration_s=time.monotonic() - t0, **base)
    outcome = RESOLVED if all(s in PASS_STATUSES for s in list(f.values()) + list(p.values())) else UNRESOLVED
    failing = [k for k, v in {**f, **p}.items() if v not in PASS_STATUSES]
    detail = "" if outcome == RESOLVED else f"{len(failing)} named test(s) not passing, e.g. {failing[0]}"
    return Grade(tid, outcome, reward, f, p, detail=detail, duration_s=time.monotonic() - t0, **base)


# ---- Harbor / Terminal-Bench: judge the final state of the agent's sandbox ----------------------------
_KILL_AGENT_PROCS = "kill -KILL -1 2>/dev/null; sleep 0.05; true"


def parse_reward_file(text: str, *, json_file: bool = False) -> tuple[float, dict[str, float]]:
    """A reward from reward.txt (one number) or reward.json ({"reward": x} or named numbers, averaged)."""
    if not json_file:
        return float(text.strip().split()[0]), {}
    data = json.loads(text)
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return float(data), {}
    if not isinstance(data, dict):
        raise ValueError("reward.json must hold a number or an object of numbers")
    nums = {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if "reward" in nums:
        return nums["reward"], nums
    if not nums:
        raise ValueError("reward.json holds no numbers")
    return sum(nums.values()) / len(nums), nums


async def grade_final_state(sb: Sandbox, task: HarborTask, *, timeout_s: float | None = None,
                            kill_agent_processes: bool = True) -> Grade:
    """Grade a Harbor-style task in the agent's sandbox: upload tests now, run test.sh, read the reward file."""
    t0 = time.monotonic()
    tid = task.task_id
    limit = float(timeout_s or task.verifier_timeout_s)
    phases: dict[str, float] = {}
    try:
        if kill_agent_processes:
            # anything the agent left running could rewrite the tests or the reward file once they appear
            await sb.exec(_KILL_AGENT_PROCS, timeout=30)
        await sb.exec("rm -rf /tests /logs/verifier && mkdir -p /tests /logs/verifier", timeout=30)
        files = task.test_files()
        await asyncio.gather(*(sb.write_file(f"/tests/{rel}", data, mode=0o755 if rel.endswith(".sh") else 0o644)
                               for rel, data in files.items()))
        phases["upload"] = time.monotonic() - t0
        t = time.monotonic()
        r = (await sb.exec(f"timeout -k 5 {int(limit)} bash /tests/{shlex.quote(task.test_script)}",
                           cwd=task.workdir, env=task.verifier_env or None, timeout=limit + 30)).text()
        phases["test"] = time.monotonic() - t
        log = str(r.stdout) + ("\n" + str(r.stderr) if r.stderr else "")
        if r.timed_out or r.exit_code in (124, 137):
            return Grade(tid, TIMEOUT, 0.0, detail=f"the verifier did not finish within {limit:g}s", phases=phases,
                         duration_s=time.monotonic() - t0, log=_tail(log))
        reward: float | None = None
        metrics: dict[str, float] = {}
        problem = "the verifier wrote no /logs/verifier/reward.txt or reward.json"
        for name, is_json in (("reward.txt", False), ("reward.json", True)):
            try:
                text = (await sb.read_file(f"/logs/verifier/{name}")).decode("utf-8", "replace")
            except FileNotFound:
                continue
            try:
                reward, metrics = parse_reward_file(text, json_file=is_json)
            except (ValueError, IndexError) as e:
                problem = f"/logs/verifier/{name} is not a reward: {e} ({text[:80]!r})"
                reward = None
            break
        extra = {"exit_code": r.exit_code, "metrics": metrics}
        if reward is None:
            return Grade(tid, TEST_ERROR, 0.0, detail=problem, phases=phases, duration_s=time.monotonic() - t0,
                         log=_tail(log), extra=extra)
        outcome = RESOLVED if reward >= 1.0 - 1e-9 else UNRESOLVED
        return Grade(tid, outcome, reward, phases=phases, duration_s=time.monotonic() - t0, log=_tail(log),
                     extra=extra)
    except ShoalError as e:
        return Grade(tid, SANDBOX_ERROR, 0.0, detail=f"grading failed: {e}", phases=phases,
                     duration_s=time.monotonic() - t0, infra_error=True)
