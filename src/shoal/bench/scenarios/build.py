"""`build`: a 10-step Dockerfile built by shoal (`shoal image build -t`, BuildKit's semantics, every step in a
sandbox, layers EROFS at once) and by `docker build` (BuildKit, the private dockerd) in the same run.

Both build FROM the same tree (shoal's base image; Docker gets it by `docker import`, see bench/docker.py),
with the same context: cold (`--no-cache`: every step runs; the base is there for both), warm (unchanged:
every step cached) and after editing one source file (the COPY of the sources and the steps after it
rerun). Each phase `rounds` times; medians reported, with the load average of the machine at the time.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult
from shoal.bench.scenario import Scenario, param

#: ten instructions that make layers or config, shaped like a task environment's Dockerfile
DOCKERFILE = """FROM {base}
ENV PYTHONDONTWRITEBYTECODE=1 APP_HOME=/app
RUN useradd -m -u 1000 agent
WORKDIR /app
COPY requirements.txt ./
RUN python3 -m venv --without-pip /opt/venv && echo "deps: $(wc -l < requirements.txt)" > /opt/venv/DEPS
COPY src/ ./src/
RUN python3 -m compileall -q src && chown -R agent /app
RUN dd if=/dev/urandom of=/app/data.bin bs=1M count=8 status=none
USER agent
RUN echo "built as $(id -un)" > /app/BUILD_INFO
CMD ["python3", "-m", "src.main"]
"""


@dataclass(frozen=True)
class BuildParams:
    """How often each phase runs."""

    rounds: int = param(3, quick=1, help="builds per phase (cold, warm, one file edited); medians reported")
    files: int = param(200, quick=50, help="Python source files in the context")


def _context(root: Path, base: str, files: int) -> Path:
    ctx = root / "ctx"
    (ctx / "src" / "pkg").mkdir(parents=True)
    (ctx / "Dockerfile").write_text(DOCKERFILE.format(base=base))
    (ctx / "requirements.txt").write_text("".join(f"pkg{i}==1.0\n" for i in range(20)))
    (ctx / "src" / "__init__.py").write_text("")
    (ctx / "src" / "main.py").write_text("print('hello')\n")
    for i in range(files):
        (ctx / "src" / "pkg" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n" * 20)
    (ctx / ".dockerignore").write_text("**/__pycache__\n*.log\n")
    return ctx


def _docker(ctx: BenchContext, *args: str, timeout: float = 1800) -> None:
    assert ctx.docker is not None
    exe = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else "docker"
    env = dict(os.environ, DOCKER_BUILDKIT="1")
    r = subprocess.run([exe, "-H", f"unix://{ctx.docker.sock}", *args], capture_output=True, text=True,
                       timeout=timeout, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:3])}…: {r.stderr.strip()[-600:]}")


async def _shoal_build(ctx: BenchContext, c: Path, tag: str, base: str, no_cache: bool) -> tuple[float, int]:
    from shoal.images.dockerbuild import BuildOptions, build_dockerfile

    t0 = time.perf_counter()
    res = await build_dockerfile(ctx.node, BuildOptions(tag=tag, context=c, no_cache=no_cache,
                                                        from_map={base: ctx.image}))
    return time.perf_counter() - t0, res.steps_run


async def _docker_build(ctx: BenchContext, c: Path, tag: str, no_cache: bool) -> float:
    t0 = time.perf_counter()
    await asyncio.to_thread(_docker, ctx, "build", "--network=host", "-q", *(["--no-cache"] if no_cache else []),
                            "-t", tag, str(c))
    return time.perf_counter() - t0


def _med(xs: list[float]) -> float:
    return round(statistics.median(xs), 2) if xs else float("nan")


async def run(ctx: BenchContext, p: BuildParams) -> ScenarioResult:
    """The build scenario (see the module docstring)."""
    res = ScenarioResult("build", docker=ctx.docker_status)
    base = ctx.docker.image if ctx.docker is not None else "bench-base:latest"
    work = Path(tempfile.mkdtemp(prefix="sbb-", dir="/var/tmp"))
    phases: dict[str, dict[str, list[float]]] = {k: {"shoal": [], "docker": []} for k in ("cold", "warm", "edit")}
    steps: dict[str, list[int]] = {"cold": [], "warm": [], "edit": []}
    loads: list[float] = []
    try:
        c = _context(work, base, p.files)
        # a first build of each warms what neither system should be charged for twice (base mounted, pulled)
        await _shoal_build(ctx, c, "bench-build:warmup", base, no_cache=False)
        if ctx.docker is not None:
            await _docker_build(ctx, c, "bench-build:warmup", no_cache=False)
        with ctx.task("build rounds (cold, warm, one file edited)", p.rounds * 3) as adv:
            for r in range(p.rounds):
                loads.append(os.getloadavg()[0])
                for phase in ("cold", "warm", "edit"):
                    if phase == "edit":
                        (c / "src" / "main.py").write_text(f"print('hello {r} {time.time()}')\n")
                    no_cache = phase == "cold"
                    s, n = await _shoal_build(ctx, c, f"bench-build:{phase}", base, no_cache)
                    phases[phase]["shoal"].append(s)
                    steps[phase].append(n)
                    if ctx.docker is not None:
                        phases[phase]["docker"].append(await _docker_build(ctx, c, f"bench-build:{phase}", no_cache))
                    adv()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if ctx.docker is not None:
            for tag in ("warmup", "cold", "warm", "edit"):
                try:
                    await asyncio.to_thread(_docker, ctx, "rmi", "-f", f"bench-build:{tag}")
                except RuntimeError:
                    pass
        for tag in ("warmup", "cold", "warm", "edit"):
            try:
                ctx.node.store.remove_image(f"bench-build:{tag}")
            except Exception:
                pass
    data: dict[str, Any] = {k: {s: [round(x, 3) for x in v] for s, v in d.items()} for k, d in phases.items()}
    data["steps_run"] = steps
    data["load_avg_1m"] = [round(x, 2) for x in loads]
    data["dockerfile"] = DOCKERFILE.format(base="<base>")
    res.data.update(data)
    label = {"cold": "cold build (--no-cache, 7 layer steps run)", "warm": "warm rebuild (nothing changed)",
             "edit": "rebuild after editing one source file"}
    for phase in ("cold", "warm", "edit"):
        sh, dk = phases[phase]["shoal"], phases[phase]["docker"]
        res.add(Metric(label[phase], _med(sh), _med(dk) if dk else None, "s",
                       note=f"shoal ran {statistics.median(steps[phase]):.0f} steps"))
    res.notes.append(f"load average (1 min) at each round's start: {', '.join(f'{x:.1f}' for x in loads)}")
    return res


SCENARIO = Scenario("build", "a 10-step Dockerfile: shoal image build vs docker build (cold, warm, one edit)",
                    run, BuildParams)
