"""A gym-style environment over one task in one sandbox, plus async helpers for agent loops.

    env = SandboxEnv(task, client)
    obs = await env.reset()                                   # a fresh sandbox from the task's image
    obs, reward, done, info = await env.step({"tool": "bash", "command": "ls"})
    obs, reward, done, info = await env.step({"tool": "submit"})   # graded; reward in [0, 1]
    await env.close()

Actions (a dict, an OpenAI-style tool call, or a plain string which runs as a bash command):

    {"tool": "bash", "command": "...", "timeout": 60}   persistent shell: cd, exports, venvs carry over
    {"tool": "read_file", "path": "..."}                 {"tool": "write_file", "path": "...", "content": "..."}
    {"tool": "submit"}                                   SWE tasks: the repository's diff is the answer
    {"tool": "submit", "patch": "diff --git ..."}        or submit a diff directly

SWE-style tasks are graded in a fresh sandbox (the agent's is closed first); Harbor-style tasks in the
agent's own sandbox after its processes are stopped. `run_episodes(policy, tasks, concurrency=64)` runs
many episodes at once and never lets one failing episode stop the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple, Protocol

from shoal.errors import InvalidRequest, ShoalError
from shoal.limits import DEFAULT_BACKEND
from shoal.rl.grader import SANDBOX_ERROR, Grade, grade_final_state, grade_patch
from shoal.rl.tasks import HarborTask, SWETask, Task

Action = dict[str, Any] | str
TOOLS = ("bash", "read_file", "write_file", "submit")
_OUT_LIMIT = 12_000

TOOL_SCHEMAS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "bash", "description": "Run a command in a persistent bash shell in the sandbox.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string", "description": "the command line"},
            "timeout": {"type": "number", "description": "seconds before it is interrupted"}},
            "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file from the sandbox.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Create or overwrite a file in the sandbox.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "submit", "description": "Finish the episode; your changes are graded.",
        "parameters": {"type": "object", "properties": {
            "patch": {"type": "string", "description": "optional unified diff; default: the repository's changes"}}}}},
]


class StepResult(NamedTuple):
    """What `step` returns; unpacks as `obs, reward, done, info`."""

    observation: str
    reward: float
    done: bool
    info: dict[str, Any]


def normalize_action(action: Action) -> dict[str, Any]:
    """Turn a dict, an OpenAI-style tool call or a string into {"tool": ..., **arguments}; InvalidRequest if not."""
    if isinstance(action, str):
        s = action.strip()
        if s in ("submit", "<submit>", "SUBMIT"):
            return {"tool": "submit"}
        return {"tool": "bash", "command": action}
    if not isinstance(action, dict):
        raise InvalidRequest(f"an action is a dict or a string, got {type(action).__name__}")
    a = action
    if "function" in a and isinstance(a["function"], dict):  # {"type": "function", "function": {...}}
        a = a["function"]
    if "name" in a and "tool" not in a:
        args = a.get("arguments", a.get("parameters", {})) or {}
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise InvalidRequest(f"tool call {a['name']!r}: arguments are not JSON: {e.msg}") from None
        if not isinstance(args, dict):
            raise InvalidRequest(f"tool call {a['name']!r}: arguments must be an object")
        a = {"tool": a["name"], **args}
    tool = a.get("tool")
    if tool not in TOOLS:
        raise InvalidRequest(f"unknown tool {tool!r}: use one of {', '.join(TOOLS)}")
    need = {"bash": ("command",), "read_file": ("path",), "write_file": ("path", "content")}.get(tool, ())
    for k in need:
        if not isinstance(a.get(k), str):
            raise InvalidRequest(f"tool {tool!r} needs a string {k!r}")
    return dict(a)


def _clip(s: str, limit: int = _OUT_LIMIT) -> str:
    if len(s) <= limit:
        return s
    half = limit // 2
    return s[:half] + f"\n… [{len(s) - limit} characters cut] …\n" + s[-half:]


def default_client() -> Any:
    """An embedded `shoal.Client` that closes its sandboxes when closed."""
    from shoal.sdk.client import Client

    return Client()


async def ensure_task_image(client: Any, task: HarborTask) -> None:
    """Build a Harbor task's environment/Dockerfile into its image, once (the embedded node's store)."""
    if task.environment_dir is None:
        return
    await client._ensure()
    node = getattr(client.transport, "node", None)
    if node is None:
        return  # a remote server: the image must be there already (create says so when it is not)
    from shoal.images.dockerfile import ensure_dockerfile_image

    built = await ensure_dockerfile_image(node, task.environment_dir, task.id)
    # the name covers the FROM images' digests too (a rebuilt base is a new image): the task runs what was built
    task.image = built.ref


class SandboxEnv:
    """One episode at a time over one task, in its own sandbox (async; gym-style reset/step)."""

    def __init__(self, task: Task, client: Any | None = None, *, max_steps: int = 50, step_timeout: float = 120.0,
                 partial_reward: bool = False, memory_mb: int = 1024, cpus: float = 1.0,
                 grade_semaphore: asyncio.Semaphore | None = None, labels: dict[str, str] | None = None,
                 time_limit_s: float | None = None, ttl_s: float | None = None,
                 backend: str = DEFAULT_BACKEND) -> None:
        if not isinstance(task, (SWETask, HarborTask)):
            raise InvalidRequest(f"SandboxEnv needs a SWETask or HarborTask, got {type(task).__name__}")
        if max_steps < 1:
            raise InvalidRequest("max_steps must be at least 1")
        self.task = task
        self._client = client
        self._own_client = client is None
        self.max_steps = max_steps
        self.step_timeout = step_timeout
        self.partial_reward = partial_reward
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.labels = labels or {}
        #: the sandbox's shoal TTL (None: the client's default): a backstop for trainers that never close
        self.ttl_s = ttl_s
        #: the backend of the episode's sandboxes (and of SWE grading sandboxes)
        self.backend = backend
        #: wall-clock budget of an episode (Harbor tasks: their agent timeout); past it, the next step grades
        self.time_limit_s = time_limit_s if time_limit_s is not None else (
            task.agent_timeout_s if isinstance(task, HarborTask) else None)
        self._t_start = 0.0
        self._grade_sem = grade_semaphore
        self.sandbox: Any = None
        self._shell: Any = None
        self.steps = 0
        self.done = False
        self.grade: Grade | None = None
        #: seconds per phase: sandbox create, agent steps, waiting for a grading slot, grading itself
        self.timings: dict[str, float] = {"create": 0.0, "agent": 0.0, "grade_wait": 0.0, "grade": 0.0}

    @property
    def client(self) -> Any:
        """The shoal client this env creates sandboxes with."""
        if self._client is None:
            self._client = default_client()
        return self._client

    @property
    def workdir(self) -> str | None:
        """Where the agent starts (the repository for SWE tasks)."""
        return self.task.workdir

    async def reset(self) -> str:
        """Start a new episode in a fresh sandbox; returns the first observation (the task prompt)."""
        await self._close_sandbox()
        self.steps, self.done, self.grade = 0, False, None
        self.timings = {"create": 0.0, "agent": 0.0, "grade_wait": 0.0, "grade": 0.0}
        t0 = time.monotonic()
        t = self.task
        kw: dict[str, Any] = dict(network=bool(getattr(t, "network", False)), memory_mb=self.memory_mb,
                                  cpus=self.cpus, labels={"shoal.rl/role": "agent", **self.labels},
                                  backend=self.backend)
        if isinstance(t, HarborTask):
            kw["memory_mb"], kw["cpus"] = max(self.memory_mb, t.memory_mb), max(self.cpus, t.cpus)
        if t.workdir:
            kw["workdir"] = t.workdir
        if self.ttl_s is not None:
            kw["ttl_s"] = self.ttl_s
        if isinstance(t, HarborTask) and t.environment_dir is not None:
            await ensure_task_image(self.client, t)
        self.sandbox = await self.client.create(t.image, **kw)
        self.timings["create"] = time.monotonic() - t0
        self._t_start = time.monotonic()
        return self.task.prompt()

    async def _ensure_shell(self) -> Any:
        if self._shell is None:
            self._shell = await self.sandbox.shell(cwd=self.task.workdir,
                                                   env=getattr(self.task, "env", None) or None)
        return self._shell

    async def step(self, action: Action) -> StepResult:
        """Apply one action; the episode ends on `submit` or when max_steps is reached (then it is graded)."""
        if self.sandbox is None and not self.done:
            raise InvalidRequest("call reset() before step()")
        if self.done:
            raise InvalidRequest("the episode is over; call reset() to start another")
        try:
            a = normalize_action(action)
        except InvalidRequest as e:
            return await self._count(StepResult(f"error: {e.message}", 0.0, False, {"error": "bad_action"}))
        if a["tool"] == "submit":
            self.steps += 1
            grade = await self.submit(a.get("patch"))
            return StepResult(self._grade_text(grade), grade.reward, True,
                              {"grade": grade.to_dict(), "outcome": grade.outcome, "truncated": False,
                               "steps": self.steps})
        t0 = time.monotonic()
        try:
            obs, info = await self._run_tool(a)
        except ShoalError as e:
            obs, info = f"error: {e.message}", {"error": e.code}
        self.timings["agent"] += time.monotonic() - t0
        return await self._count(StepResult(obs, 0.0, False, info))

    async def _count(self, res: StepResult) -> StepResult:
        self.steps += 1
        out_of_time = self.time_limit_s is not None and time.monotonic() - self._t_start > self.time_limit_s
        if self.steps < self.max_steps and not out_of_time:
            return res
        # out of steps: grade what is there, as agent harnesses auto-submit
        grade = await self.submit()
        info = {**res.info, "grade": grade.to_dict(), "outcome": grade.outcome, "truncated": True, "steps": self.steps}
        return StepResult(res.observation + "\n\n" + self._grade_text(grade), grade.reward, True, info)

    async def _run_tool(self, a: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        sb = self.sandbox
        tool = a["tool"]
        if tool == "bash":
            timeout = float(a.get("timeout") or self.step_timeout)
            sh = await self._ensure_shell()
            r = (await sh.run(a["command"], timeout=min(timeout, self.step_timeout * 10))).text()
            out = str(r.stdout) + (("\n" + str(r.stderr)) if r.stderr else "")
            tail = f"[timed out after {timeout:g}s]" if r.timed_out else f"[exit code {r.exit_code}]"
            return _clip(out.rstrip("\n")) + ("\n" if out.strip() else "") + tail, {
                "tool": "bash", "exit_code": r.exit_code, "timed_out": r.timed_out, "duration_s": r.duration_s}
        if tool == "read_file":
            data = await sb.read_file(self._path(a["path"]))
            return _clip(data.decode("utf-8", "replace")), {"tool": "read_file", "bytes": len(data)}
        if tool == "write_file":
            data = a["content"].encode()
            await sb.write_file(self._path(a["path"]), data)
            return f"wrote {len(data)} bytes to {a['path']}", {"tool": "write_file", "bytes": len(data)}
        raise InvalidRequest(f"unknown tool {tool!r}")

    def _path(self, path: str) -> str:
        if path.startswith("/") or not self.task.workdir:
            return path
        return self.task.workdir.rstrip("/") + "/" + path

    async def diff(self) -> str:
        """The repository's changes so far as a unified diff against the base commit (SWE tasks)."""
        if not isinstance(self.task, SWETask):
            raise InvalidRequest("diff() is for SWE-style tasks (a repository with a base commit)")
        r = (await self.sandbox.exec("git add -A >/dev/null 2>&1; git -c core.quotepath=off diff --cached "
                                     "--binary --no-color --no-ext-diff HEAD", cwd=self.task.workdir,
                                     timeout=120)).text()
        if r.exit_code != 0:
            raise ShoalError(f"could not read the repository's diff: {str(r.stderr)[-500:]}")
        return str(r.stdout)

    async def submit(self, patch: str | None = None) -> Grade:
        """End the episode and grade it (also called automatically when steps run out)."""
        if self.done and self.grade is not None:
            return self.grade
        self.done = True
        t0 = time.monotonic()
        try:
            if isinstance(self.task, SWETask):
                if patch is None:
                    try:
                        patch = await self.diff()
                    except ShoalError as e:
                        self.grade = Grade(self.task.id, SANDBOX_ERROR, 0.0, detail=str(e), infra_error=True)
                        return self.grade
                await self._close_sandbox()  # the agent's sandbox is done; the grader starts from the image
                async with self._grading():
                    self.grade = await grade_patch(self.client, self.task, patch, partial=self.partial_reward,
                                                   labels=self.labels, backend=self.backend)
            else:
                async with self._grading():
                    self.grade = await grade_final_state(self.sandbox, self.task)
                await self._close_sandbox()
        finally:
            self.timings["grade"] += time.monotonic() - t0
        return self.grade

    @contextlib.asynccontextmanager
    async def _grading(self) -> AsyncIterator[None]:
        if self._grade_sem is None:
            yield
            return
        t0 = time.monotonic()
        async with self._grade_sem:
            waited = time.monotonic() - t0
            self.timings["grade_wait"] += waited
            self.timings["grade"] -= waited  # submit() times the whole of grading, queue included
            yield

    def _grade_text(self, g: Grade) -> str:
        return f"Submitted. Outcome: {g.outcome}; reward {g.reward:g}." + (f" {g.detail}" if g.detail else "")

    async def _close_sandbox(self) -> None:
        sb, self.sandbox, self._shell = self.sandbox, None, None
        if sb is not None:
            with contextlib.suppress(ShoalError):
                await sb.close()

    async def close(self) -> None:
        """Close the episode's sandbox (and the client, when this env made its own)."""
        await self._close_sandbox()
        if self._own_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def __aenter__(self) -> SandboxEnv:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# ---- many episodes at once -----------------------------------------------------------------------------
@dataclass
class EpisodeContext:
    """What a policy sees besides the observation: the task, the step, the history, a tag it may set."""

    task: Task
    episode: int
    step: int = 0
    history: list[tuple[dict[str, Any] | str, StepResult]] = field(default_factory=list)
    tag: str = ""
    env: SandboxEnv | None = None


class Policy(Protocol):
    """An agent: given the latest observation and the context, choose the next action (sync or async)."""

    def __call__(self, observation: str, ctx: EpisodeContext) -> Action | Awaitable[Action]: ...


@dataclass
class EpisodeResult:
    """How one episode went."""

    episode: int
    task_id: str
    tag: str
    reward: float
    outcome: str
    steps: int
    truncated: bool = False
    error: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    grade: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        return asdict(self)


EventFn = Callable[[str, EpisodeContext, "EpisodeResult | None"], None]


async def _call_policy(policy: Policy, obs: str, ctx: EpisodeContext) -> Action:
    a = policy(obs, ctx)
    if inspect.isawaitable(a):
        a = await a
    return a  # type: ignore[return-value]


async def run_episode(policy: Policy, task: Task, client: Any, *, episode: int = 0, max_steps: int = 50,
                      on_event: EventFn | None = None, **env_kw: Any) -> EpisodeResult:
    """Run one episode to the end; any failure becomes an EpisodeResult with `error` set, never an exception."""
    ctx = EpisodeContext(task=task, episode=episode)
    env = SandboxEnv(task, client, max_steps=max_steps, **env_kw)
    ctx.env = env
    t0 = time.monotonic()
    emit = on_event or (lambda *a: None)
    try:
        emit("start", ctx, None)
        obs = await env.reset()
        emit("created", ctx, None)
        res = StepResult(obs, 0.0, False, {})
        while not res.done:
            action = await _call_policy(policy, res.observation, ctx)
            if (isinstance(action, dict) and action.get("tool") == "submit") or action == "submit":
                emit("grading", ctx, None)
            res = await env.step(action)
            ctx.step += 1
            ctx.history.append((action, res))
            emit("step", ctx, None)
        grade = env.grade
        out = EpisodeResult(episode, task.id, ctx.tag, res.reward, res.info.get("outcome", ""), env.steps,
                            bool(res.info.get("truncated")), grade=grade.to_dict() if grade else {})
    except Exception as e:  # one broken episode must never take the rollout down
        out = EpisodeResult(episode, task.id, ctx.tag, 0.0, "episode_error", env.steps,
                            error=f"{type(e).__name__}: {e}")
    finally:
        with contextlib.suppress(Exception):
            await env.close()
    out.timings = {**env.timings, "total": time.monotonic() - t0}
    emit("done", ctx, out)
    return out


async def run_episodes(policy: Policy, tasks: Sequence[Task], *, client: Any | None = None, concurrency: int = 64,
                       grade_concurrency: int | None = None, episodes: int | None = None, max_steps: int = 50,
                       on_event: EventFn | None = None, **env_kw: Any) -> list[EpisodeResult]:
    """Run `episodes` episodes (default: one per task, cycling through tasks) with at most `concurrency` at once."""
    if not tasks:
        raise InvalidRequest("run_episodes needs at least one task")
    n = episodes if episodes is not None else len(tasks)
    own = client is None
    client = client or default_client()
    sem = asyncio.Semaphore(max(1, concurrency))
    gsem = asyncio.Semaphore(grade_concurrency or max(2, 2 * (os.cpu_count() or 1)))

    async def one(i: int) -> EpisodeResult:
        async with sem:
            return await run_episode(policy, tasks[i % len(tasks)], client, episode=i, max_steps=max_steps,
                                     on_event=on_event, grade_semaphore=gsem, **env_kw)

    try:
        return list(await asyncio.gather(*(one(i) for i in range(n))))
    finally:
        if own:
            await client.aclose()


class EnvPool:
    """A batch of SandboxEnvs reset together; `async with env_pool(tasks) as pool:` closes them all."""

    def __init__(self, envs: list[SandboxEnv], concurrency: int) -> None:
        self.envs = envs
        self._sem = asyncio.Semaphore(max(1, concurrency))

    def __len__(self) -> int:
        return len(self.envs)

    def __iter__(self) -> Any:
        return iter(self.envs)

    def __getitem__(self, i: int) -> SandboxEnv:
        return self.envs[i]

    async def reset(self) -> list[str | BaseException]:
        """Reset every env (bounded parallelism); a failed reset is returned in its slot, not raised."""
        async def one(e: SandboxEnv) -> str:
            async with self._sem:
                return await e.reset()

        return list(await asyncio.gather(*(one(e) for e in self.envs), return_exceptions=True))

    async def step(self, actions: Sequence[Action | None]) -> list[StepResult | BaseException | None]:
        """Step every env whose action is not None, all at once; errors are returned in their slots."""
        if len(actions) != len(self.envs):
            raise InvalidRequest(f"got {len(actions)} actions for {len(self.envs)} envs")

        async def one(e: SandboxEnv, a: Action | None) -> StepResult | None:
            if a is None or e.done:
                return None
            return await e.step(a)

        return list(await asyncio.gather(*(one(e, a) for e, a in zip(self.envs, actions, strict=True)),
                                         return_exceptions=True))

    async def close(self) -> None:
        """Close every env's sandbox."""
        await asyncio.gather(*(e.close() for e in self.envs), return_exceptions=True)


@contextlib.asynccontextmanager
async def env_pool(tasks: Sequence[Task], *, client: Any | None = None, concurrency: int = 64,
                   reset: bool = True, **env_kw: Any) -> AsyncIterator[EnvPool]:
    """One SandboxEnv per task, reset together (unless reset=False); all closed on exit."""
    own = client is None
    client = client or default_client()
    pool = EnvPool([SandboxEnv(t, client, **env_kw) for t in tasks], concurrency)
    try:
        if reset:
            pool.observations = await pool.reset()  # type: ignore[attr-defined]
        yield pool
    finally:
        await pool.close()
        if own:
            await client.aclose()


class SyncSandboxEnv:
    """The blocking twin of SandboxEnv, for gym-style loops that are not async (a private event loop runs
    the sandbox work; its client closes at interpreter exit, or with `shoal.sdk.sync.close_shared_client`)."""

    def __init__(self, task: Task, client: Any | None = None, **env_kw: Any) -> None:
        from shoal.sdk.sync import shared_client

        self._bridge = shared_client().bridge
        self.env = SandboxEnv(task, client or shared_client().async_client, **env_kw)

    def reset(self) -> str:
        """Start a new episode in a fresh sandbox; returns the task prompt."""
        return self._bridge.run(self.env.reset())

    def step(self, action: Action) -> StepResult:
        """Apply one action (see SandboxEnv.step)."""
        return self._bridge.run(self.env.step(action))

    def close(self) -> None:
        """Close the episode's sandbox."""
        self._bridge.run(self.env._close_sandbox())

    def __enter__(self) -> SyncSandboxEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
