"""Synthesize SWE-style tasks from real projects: inject a bug, record exactly which tests it breaks.

For each project of the recipe: run its test suite once in a sandbox (the baseline), then for each
sampled mutant write the mutated file, run the suite again and compare. A mutant that breaks nothing,
breaks test collection, runs too long or breaks too much is discarded. A kept mutant becomes a task:

* FAIL_TO_PASS — every test that passed on the original and fails (or errors) with the bug;
* PASS_TO_PASS — a deterministic sample of tests from the same files that still pass;
* the hidden tests — the test files holding FAIL_TO_PASS tests, removed from the task's image and
  shipped as `test_patch`; the gold `patch` reverts the mutation;
* the task image — one layer over the workspace with the bug, without the hidden tests, and a fresh
  one-commit git history (so `git log -p` cannot show what changed).

Every mutant verdict is cached in the store (`cache/rl-mutants`), the whole task set too
(`cache/rl-tasksets`), so a second run creates no sandbox at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import re
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.errors import ImageBuildError, InvalidRequest, ShoalError
from shoal.rl.pytest_results import PASS_STATUSES, REPORTER_PLUGIN, parse_reporter_lines
from shoal.rl.taskgen.config import Project, TaskRecipe
from shoal.rl.taskgen.images import (
    build_task_image,
    ensure_python_image,
    ensure_workspace_image,
    fetch_sdist,
    unpack_sdist,
)
from shoal.rl.taskgen.mutate import Mutation, check_mutant, find_mutations, sample_mutations
from shoal.rl.tasks import DEFAULT_TEST_CMD, SWETask

if TYPE_CHECKING:
    from shoal.images.store import Image
    from shoal.node.node import Node

#: bump when task images or records change shape (invalidates cached task sets and task images)
GEN_VERSION = 5
#: bump when a mutant's verdict could change (invalidates cached baselines and verdicts)
VERDICT_VERSION = 1
GEN_DIR = "/tmp/.shoal-gen"
Log = Callable[[str], None]


@dataclass
class ProjectReport:
    """What happened to one project's mutants."""

    name: str
    baseline_tests: int = 0
    tried: int = 0
    kept: int = 0
    cached: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class GenerationReport:
    """Where the time went and what was kept."""

    recipe_key: str = ""
    from_cache: bool = False
    images_s: float = 0.0
    mutants_s: float = 0.0
    task_images_s: float = 0.0
    projects: list[ProjectReport] = field(default_factory=list)
    tasks: int = 0
    images: dict[str, str] = field(default_factory=dict)


def _h(*parts: Any, version: int = GEN_VERSION) -> str:
    return hashlib.sha256(json.dumps([version, *parts], sort_keys=True, default=str).encode()).hexdigest()


def _slug(s: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", s.lower()).strip("_")[:40] or "fn"


def _test_cmd(project: Project) -> str:
    args = " ".join(shlex.quote(a) for a in project.test_args)
    return (f"export PYTHONPATH={GEN_DIR}${{PYTHONPATH:+:$PYTHONPATH}} PYTEST_PLUGINS=shoal_pytest_report "
            f"SHOAL_PYTEST_REPORT={GEN_DIR}/report.jsonl; rm -f {GEN_DIR}/report.jsonl; "
            f"python3 -m pytest -q --tb=short -p no:cacheprovider {args} >{GEN_DIR}/out.txt 2>&1; "
            "echo \"exit=$?\"")


@dataclass
class _Verdict:
    ok: bool
    reason: str = ""
    f2p: list[str] = field(default_factory=list)
    still_passing: list[str] = field(default_factory=list)
    failure: str = ""


async def _run_suite(node: Node, sid: str, project: Project, timeout: float) -> tuple[int | None, Any]:
    """Run the whole suite once; (exit code or None on timeout, TestResults)."""
    cmd = f"timeout -k 2 {int(timeout)} sh -c {shlex.quote(_test_cmd(project))}"
    r = (await node.exec(sid, ["/bin/sh", "-c", cmd], cwd=project.workdir, timeout=timeout + 30)).text()
    out = str(r.stdout)
    m = re.search(r"exit=(\d+)", out)
    if r.timed_out or r.exit_code in (124, 137) or not m:
        return None, None
    try:
        data = (await node.read_file(sid, f"{GEN_DIR}/report.jsonl")).decode("utf-8", "replace")
    except ShoalError:
        data = ""
    return int(m.group(1)), parse_reporter_lines(data)


def _judge(code: int | None, res: Any, base_pass: set[str], cfg: Any) -> _Verdict:
    if code is None:
        return _Verdict(False, "timeout")
    if res.collect_errors or code in (2, 3, 4, 5):
        return _Verdict(False, "breaks_collection")
    f2p = sorted(t for t in base_pass if res.statuses.get(t) not in PASS_STATUSES)
    if len(f2p) < cfg.min_fail_to_pass:
        return _Verdict(False, "survived")
    if len(f2p) > cfg.max_fail_to_pass:
        return _Verdict(False, "too_broad")
    still = sorted(t for t in base_pass if res.statuses.get(t) in PASS_STATUSES)
    failure = res.failure_text.get(f2p[0], "")
    return _Verdict(True, "", f2p, still, failure[-3000:])


def problem_statement(project: Project, mut: Mutation, failure: str, n_fail: int, hint: str) -> str:
    """An issue-like description: what breaks (the assertion and its error lines), never the fix."""
    lines = failure.splitlines()
    e_idx = [i for i, ln in enumerate(lines) if ln.startswith("E ")]
    excerpt: list[str] = []
    if e_idx:
        first = e_idx[0]
        if first > 0 and lines[first - 1].startswith("    ") and not lines[first - 1].strip().startswith("def "):
            excerpt.append(lines[first - 1].strip())
        excerpt += [ln.rstrip() for ln in lines[first:first + 12] if ln.startswith("E ")]
    else:
        excerpt = [ln.rstrip() for ln in lines[-8:] if ln.strip()]
    where = {"function": f" in `{mut.function}` ({mut.file})", "file": f" in `{mut.file}`", "none": ""}[hint]
    body = "\n".join("    " + ln for ln in excerpt) or "    (no assertion message)"
    what = f"{project.name} {project.version}" + (f" — {project.summary} —" if project.summary else "")
    return (f"{what} has a bug{where}.\n\n"
            f"A check in the project's test suite fails with:\n\n{body}\n\n"
            f"{n_fail} test(s) of the project fail because of it. Fix the library code so that it behaves "
            f"correctly again.")


async def _evaluate_project(node: Node, ws: Image, project: Project, tr: TaskRecipe, log: Log,
                            report: ProjectReport, no_cache: bool) -> list[tuple[Mutation, str, _Verdict]]:
    """Baseline + mutants of one project; returns kept (mutation, mutated source, verdict)."""
    from shoal.models import SandboxSpec

    t0 = time.monotonic()
    cfg = tr.mutations
    tree = unpack_sdist(fetch_sdist(project.name, project.version, log))
    sources = {}
    for rel in project.sources:
        p = tree / rel
        if not p.is_file():
            raise InvalidRequest(f"project {project.name}: source {rel} is not in the {project.version} sdist")
        sources[rel] = p.read_text()
    cands: list[Mutation] = []
    for rel, text in sources.items():
        cands += find_mutations(rel, text, cfg.operators)
    picked = sample_mutations(cands, cfg.max_candidates, f"{cfg.seed}:{project.name}")
    run_key = _h(ws.digest, project.test_args, cfg.test_timeout_s, version=VERDICT_VERSION)
    store = node.store
    kept: list[tuple[Mutation, str, _Verdict]] = []
    sid: str | None = None
    base_pass: set[str] | None = None

    async def sandbox() -> str:
        nonlocal sid, base_pass
        if sid is None:
            info = await node.create(SandboxSpec(image=ws.ref, network=False, memory_mb=1024, ttl_s=3600,
                                                 labels={"shoal.rl/role": "taskgen"}))
            sid = info.id
            await node.write_file(sid, f"{GEN_DIR}/shoal_pytest_report.py", REPORTER_PLUGIN.encode())
        return sid

    try:
        bkey = _h("baseline", run_key, version=VERDICT_VERSION)
        hit = None if no_cache else store.cache_get("rl-mutants", bkey)
        if hit and isinstance(hit.get("passing"), list):
            base_pass = set(hit["passing"])
        else:
            code, res = await _run_suite(node, await sandbox(), project, cfg.test_timeout_s * 3)
            if code is None or res is None or code not in (0, 1):
                raise ImageBuildError(f"project {project.name}: its test suite does not run in {ws.ref} "
                                      f"(exit code {code})")
            base_pass = {t for t, s in res.statuses.items() if s in PASS_STATUSES}
            store.cache_put("rl-mutants", bkey, {"passing": sorted(base_pass), "project": project.name})
        report.baseline_tests = len(base_pass)
        if not base_pass:
            raise ImageBuildError(f"project {project.name}: no test passes on the unmodified code")
        for mut in picked:
            if len(kept) >= cfg.tasks_per_project:
                break
            original = sources[mut.file]
            try:
                mutated = mut.apply(original)
            except ValueError:
                continue
            if not check_mutant(original, mutated):
                continue
            report.tried += 1
            mkey = _h("mutant", run_key, mut.to_dict(), cfg.min_fail_to_pass, cfg.max_fail_to_pass,
                      version=VERDICT_VERSION)
            hit = None if no_cache else store.cache_get("rl-mutants", mkey)
            if hit is not None and "ok" in hit:
                v = _Verdict(hit["ok"], hit.get("reason", ""), hit.get("f2p", []), hit.get("still", []),
                             hit.get("failure", ""))
                report.cached += 1
            else:
                s = await sandbox()
                path = f"{project.workdir}/{mut.file}"
                await node.write_file(s, path, mutated.encode())
                try:
                    code, res = await _run_suite(node, s, project, cfg.test_timeout_s)
                finally:
                    await node.write_file(s, path, original.encode())
                v = _judge(code, res, base_pass, cfg)
                if code is None:
                    # a runaway mutant may leave processes behind; start the next one from a clean sandbox
                    with contextlib.suppress(ShoalError):
                        await node.close(s)
                    sid = None
                store.cache_put("rl-mutants", mkey, {"ok": v.ok, "reason": v.reason, "f2p": v.f2p,
                                                     "still": v.still_passing, "failure": v.failure,
                                                     "project": project.name})
            if v.ok:
                kept.append((mut, mutated, v))
                report.kept += 1
                log(f"  {project.name}: kept {mut.operator} in {mut.function} ({len(v.f2p)} failing)")
            else:
                report.rejected[v.reason] = report.rejected.get(v.reason, 0) + 1
    finally:
        if sid is not None:
            with contextlib.suppress(ShoalError):
                await node.close(sid)
        report.seconds = time.monotonic() - t0
    return kept


async def _make_task(node: Node, ws: Image, project: Project, tr: TaskRecipe, mut: Mutation, mutated: str,
                     v: _Verdict) -> SWETask:
    f2p_files = sorted({t.split("::", 1)[0] for t in v.f2p})
    rng = random.Random(mut.key)
    pool = [t for t in v.still_passing if t.split("::", 1)[0] in f2p_files]
    p2p = sorted(rng.sample(pool, min(len(pool), tr.mutations.max_pass_to_pass)))
    iid = f"{project.name}__{_slug(mut.function)}-{mut.key}"
    key = _h("task", ws.digest, mut.to_dict(), f2p_files)[:16]
    ref = f"rl/task-{iid.replace('__', '.')}:{key}"
    # diffs made by git in a sandbox from the workspace: exact, and in the form `git apply` wants
    patches = await _diffs(node, ws, project, mut.file, mutated, f2p_files)
    img, commit = await build_task_image(
        node, ws, ref, project.workdir, {mut.file: mutated}, f2p_files,
        f"{project.name} {project.version}", {"task": iid, "mutation": mut.to_dict()})
    return SWETask(
        instance_id=iid, image=img.ref, problem_statement=problem_statement(
            project, mut, v.failure, len(v.f2p), tr.mutations.hint),
        test_patch=patches["test_patch"], FAIL_TO_PASS=list(v.f2p), PASS_TO_PASS=p2p, patch=patches["patch"],
        repo=project.name, base_commit=commit, version=project.version, workdir=project.workdir,
        # run exactly the graded tests: the same verdict as running their files, at a fraction of the cost
        test_cmd=DEFAULT_TEST_CMD, test_directives=sorted(v.f2p + p2p),
        timeout_s=float(tr.mutations.test_timeout_s) * 2,
        metadata={"generator": "shoal.rl.taskgen", "operator": mut.operator, "function": mut.function,
                  "file": mut.file, "line": mut.lineno, "mutation": mut.to_dict(), "workspace": ws.ref,
                  "hidden_files": f2p_files})


async def _diffs(node: Node, ws: Image, project: Project, file: str, mutated: str,
                 hidden: list[str]) -> dict[str, str]:
    from shoal.models import SandboxSpec

    info = await node.create(SandboxSpec(image=ws.ref, network=False, memory_mb=256, ttl_s=600,
                                         labels={"shoal.rl/role": "taskgen"}))
    try:
        await node.write_file(info.id, f"{project.workdir}/{file}", mutated.encode())
        files = " ".join(shlex.quote(f) for f in hidden)
        # stage the task's state as a tree, then diff task state -> original: forward diffs with a/ b/ paths
        script = (f"set -e; git add -- {shlex.quote(file)}; git rm -q --cached -- {files}; T=$(git write-tree); "
                  f"git diff --no-color --no-ext-diff $T HEAD -- {shlex.quote(file)} >{GEN_DIR}.patch; "
                  f"git diff --no-color --no-ext-diff $T HEAD -- {files} >{GEN_DIR}.tests")
        r = (await node.exec(info.id, ["/bin/sh", "-c", script], cwd=project.workdir, timeout=120)).text()
        if r.exit_code != 0:
            raise ImageBuildError(f"diffing a task of {project.name} failed: {str(r.stderr)[-1000:]}")
        patch = (await node.read_file(info.id, f"{GEN_DIR}.patch")).decode()
        tests = (await node.read_file(info.id, f"{GEN_DIR}.tests")).decode()
    finally:
        with contextlib.suppress(ShoalError):
            await node.close(info.id)
    if not patch.strip() or not tests.strip():
        raise ImageBuildError(f"diffing a task of {project.name} gave an empty patch")
    return {"patch": patch, "test_patch": tests}


async def ensure_images(node: Node, tr: TaskRecipe, log: Log) -> dict[str, Image]:
    """base, the Python image and every project's workspace image (built when missing)."""
    from shoal.images.base import ensure_base

    await asyncio.to_thread(ensure_base, node.store, log)
    py = await ensure_python_image(node, tr, log)
    out: dict[str, Image] = {"python": py}
    results = await asyncio.gather(*(ensure_workspace_image(node, p, py, log) for p in tr.projects),
                                   return_exceptions=True)
    for p, img in zip(tr.projects, results, strict=True):
        if isinstance(img, ShoalError):
            # one project that cannot be fetched or built must not sink the others
            log(f"warning: skipping project {p.name}: {img.message[:300]}")
            continue
        if isinstance(img, BaseException):
            raise img
        out[p.name] = img
    if len(out) == 1:
        raise ImageBuildError("no project's workspace image could be built (see the warnings above)")
    return out


async def generate_tasks(node: Node, tr: TaskRecipe, *, log: Log | None = None, no_cache: bool = False,
                         report: GenerationReport | None = None) -> list[SWETask]:
    """The recipe's task set: images built, mutants tried and task images made where missing (cached)."""
    log = log or (lambda s: None)
    report = report if report is not None else GenerationReport()
    report.recipe_key = tr.key()
    t0 = time.monotonic()
    images = await ensure_images(node, tr, log)
    report.images = {k: v.ref for k, v in images.items()}
    report.images_s = time.monotonic() - t0
    set_key = _h("taskset", tr.key(), {p.name: images[p.name].digest for p in tr.projects if p.name in images})
    hit = None if no_cache else node.store.cache_get("rl-tasksets", set_key)
    if hit and isinstance(hit.get("tasks"), list):
        tasks = [SWETask.from_dict(d) for d in hit["tasks"]]
        if all(node.store.exists(t.image) for t in tasks):
            report.from_cache = True
            report.tasks = len(tasks)
            log(f"task set {set_key[:12]}: {len(tasks)} tasks (cached)")
            return tasks
    t1 = time.monotonic()
    projects = [p for p in tr.projects if p.name in images]
    reports = [ProjectReport(p.name) for p in projects]
    report.projects = reports
    results = await asyncio.gather(*(_evaluate_project(node, images[p.name], p, tr, log, r, no_cache)
                                     for p, r in zip(projects, reports, strict=True)), return_exceptions=True)
    kept: list[list[tuple[Mutation, str, _Verdict]]] = []
    for p, res in zip(projects, results, strict=True):
        if isinstance(res, ShoalError):
            log(f"warning: no tasks from {p.name}: {res.message[:300]}")
            res = []
        elif isinstance(res, BaseException):
            raise res
        kept.append(res)
    report.mutants_s = time.monotonic() - t1
    t2 = time.monotonic()
    sem = asyncio.Semaphore(3)

    async def make(p: Project, m: Mutation, src: str, v: _Verdict) -> SWETask:
        async with sem:
            return await _make_task(node, images[p.name], p, tr, m, src, v)

    jobs = [make(p, m, src, v) for p, ks in zip(projects, kept, strict=True) for (m, src, v) in ks]
    tasks = list(await asyncio.gather(*jobs))
    report.task_images_s = time.monotonic() - t2
    report.tasks = len(tasks)
    if not tasks:
        raise ImageBuildError("the recipe produced no task: every mutant was rejected "
                              f"({[r.rejected for r in reports]}); raise mutations.max_candidates")
    node.store.cache_put("rl-tasksets", set_key, {"tasks": [t.to_dict() for t in tasks], "recipe": tr.source,
                                                  "created": time.time()})
    log(f"task set {set_key[:12]}: {len(tasks)} tasks generated")
    return tasks


def task_set_path(tasks: list[SWETask], dest: str | Path) -> Path:
    """Write tasks to a JSONL file (for other tools and trainers)."""
    from shoal.rl.tasks import dump_jsonl

    return dump_jsonl(tasks, dest)


#: a patch that changes nothing the tests can see: what grading the bug alone looks like
NOOP_PATCH = ("diff --git a/.shoal-noop b/.shoal-noop\nnew file mode 100644\n--- /dev/null\n+++ b/.shoal-noop\n"
              "@@ -0,0 +1 @@\n+noop\n")


async def verify_task(client: Any, task: SWETask) -> list[str]:
    """Problems with a task (empty when sound): the gold patch must resolve it, and the bug alone must fail
    exactly FAIL_TO_PASS while every PASS_TO_PASS test passes."""
    from shoal.rl.grader import RESOLVED, UNRESOLVED, grade_patch

    gold, bug = await asyncio.gather(grade_patch(client, task, task.patch), grade_patch(client, task, NOOP_PATCH))
    problems = []
    if gold.outcome != RESOLVED:
        problems.append(f"gold patch: {gold.outcome} ({gold.detail})")
    if bug.outcome != UNRESOLVED:
        problems.append(f"bug alone: {bug.outcome} ({bug.detail})")
    fixed = [t for t, s in bug.fail_to_pass.items() if s in PASS_STATUSES]
    broken = [t for t, s in bug.pass_to_pass.items() if s not in PASS_STATUSES]
    if fixed:
        problems.append(f"FAIL_TO_PASS tests pass without the fix: {fixed[:3]}")
    if broken:
        problems.append(f"PASS_TO_PASS tests fail with the bug alone: {broken[:3]}")
    return problems
