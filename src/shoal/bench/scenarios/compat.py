"""`compat`: exec round trip through the compatible APIs vs shoal's own HTTP API, in one run, on one server and
one sandbox.

A `shoal serve` child process (sharing the run's SHOAL_HOME, with a token) serves both. Measured, sequentially
and interleaved round by round (so drift on a shared machine hits every path alike):

- shoal's HTTP API (`shoal.Client(url, token)`): `exec(["true"])`, and `exec(["/bin/bash", "-l", "-c", "true"])`
  — the command the E2B SDK actually sends for `commands.run("true")`;
- the unmodified E2B SDK (`AsyncSandbox.connect(id).commands.run("true")`: Connect RPC server stream);
- the unmodified SWE-ReX client (`RemoteRuntime.execute(Command(command=["true"]))`).

The E2B vs shoal ratio compares the same command (`bash -l -c true`), so it is the protocol's cost alone.
Then, on the same server (`compat_agents.py`): a SWE-agent-shaped step (command + state command + read_file)
through `/swerex` vs shoal's own shell API, an HTTP request to a server in a sandbox through E2B's `get_host`
routing vs straight to the sandbox's address (`compat_ports.py`), and SandboxFusion's `/run_code` calls/s per
language next to python's (`-p languages=` to choose; the go/java/... image is built first when the store
lacks it).
Needs the `compat` extra (`pip install -e .[compat]`); without it the scenario says so and measures nothing.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shoal.bench.context import BenchContext
from shoal.bench.results import Metric, ScenarioResult
from shoal.bench.scenario import Scenario, param
from shoal.bench.scenarios.common import shoal_child_env
from shoal.bench.scenarios.compat_agents import fusion_languages, swe_agent_step
from shoal.bench.scenarios.compat_ports import get_host_round_trip
from shoal.bench.stats import latency_summary

BASH_TRUE = ["/bin/bash", "-l", "-c", "true"]


@dataclass(frozen=True)
class CompatParams:
    """How much work the compat scenario does."""

    rounds: int = param(500, quick=100, help="interleaved rounds of `true`, one call through each of the 4 paths")
    step_rounds: int = param(200, quick=40, help="interleaved SWE-agent steps through /swerex and shoal's shell")
    port_rounds: int = param(300, quick=50, help="interleaved GETs to a server in a sandbox: via get_host, directly")
    fusion_calls: int = param(48, quick=12, help="SandboxFusion /run_code calls per language")
    fusion_concurrency: int = param(4, help="/run_code calls in flight")
    languages: tuple[str, ...] = param(("python", "bash", "cpp", "go", "java", "nodejs", "typescript", "rust",
                                        "pytest"), help="languages of the /run_code comparison (empty: skip it)")


async def run(ctx: BenchContext, p: CompatParams) -> ScenarioResult:
    """The compat scenario (see the module docstring)."""
    res = ScenarioResult("compat", docker="absent: not compared with Docker (compares transports)")
    try:
        from e2b import AsyncSandbox
        from swerex.runtime.abstract import Command
        from swerex.runtime.remote import RemoteRuntime
    except ImportError as e:
        res.data["skipped"] = f"the compat clients are not installed ({e}): pip install -e '.[compat]'"
        ctx.log(res.data["skipped"])
        return res

    import shoal
    from shoal.server.proc import ServerProcess
    from shoal.server.tokens import TokenStore

    n = max(1, p.rounds)
    token = TokenStore(ctx.home).create("bench-compat", name="shoal bench compat")
    srv = ServerProcess(env=shoal_child_env(SHOAL_HOME=str(ctx.home)), log_path=ctx.home / "compat-server.log",
                        token=token)
    srv.start()
    try:
        async with shoal.Client(srv.url, token=token) as client:
            sb = await client.create(ctx.image, memory_mb=256)
            try:
                e2b_sb = await AsyncSandbox.connect(sb.id, api_key=token, api_url=srv.url, sandbox_url=srv.url)
                rex = RemoteRuntime(host=f"{srv.url}/swerex/{sb.id}", port=None, auth_token=token, timeout=30)

                async def shoal_true() -> None:
                    await _ok((await sb.exec(["true"])).exit_code)

                async def shoal_bash() -> None:
                    await _ok((await sb.exec(BASH_TRUE)).exit_code)

                async def e2b_true() -> None:
                    await _ok((await e2b_sb.commands.run("true")).exit_code)

                async def rex_true() -> None:
                    await _ok((await rex.execute(Command(command=["true"]))).exit_code)

                paths: dict[str, Callable[[], Awaitable[None]]] = {
                    "shoal_http_true": shoal_true, "shoal_http_bash": shoal_bash, "e2b": e2b_true,
                    "swerex": rex_true}
                lat: dict[str, list[float]] = {k: [] for k in paths}
                errors: dict[str, list[str]] = {k: [] for k in paths}
                for _ in range(10):  # warm-up: connections, the agent's pages, bash's
                    for call in paths.values():
                        await call()
                with ctx.task(f"{n} rounds of `true` through 4 paths", n) as adv:
                    for _ in range(n):
                        for name, call in paths.items():
                            t = time.perf_counter()
                            try:
                                await call()
                            except Exception as e:
                                errors[name].append(str(e)[:200])
                                continue
                            lat[name].append(time.perf_counter() - t)
                        adv()
            finally:
                await sb.close()
            step_data, step_metrics = await swe_agent_step(ctx, client, srv.url, token, max(1, p.step_rounds))
            res.data["swe_agent_step"] = step_data
            port_data, port_metrics = await get_host_round_trip(ctx, client, srv.url, token, max(1, p.port_rounds))
            res.data["get_host"] = port_data
            if p.languages:
                fusion_data, fusion_metrics = await fusion_languages(
                    ctx, srv.url, token, max(1, p.fusion_calls), max(1, p.fusion_concurrency), p.languages)
                res.data["fusion_languages"] = fusion_data
    finally:
        srv.stop()
    summ = {k: latency_summary(v) for k, v in lat.items()}
    res.data.update({"rounds": n, "latency": summ, "errors": {k: v[:3] for k, v in errors.items() if v},
                     "server": srv.url, "interleaved": True})
    p50 = {k: s.get("p50_ms") for k, s in summ.items()}

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}× of shoal's" if a and b else ""

    res.add(Metric("exec p50, shoal HTTP API, `true`", p50["shoal_http_true"], None, "ms"),
            Metric("exec p50, shoal HTTP API, `bash -l -c true`", p50["shoal_http_bash"], None, "ms",
                   note="the command E2B's commands.run sends"),
            Metric("exec p50, E2B SDK commands.run(\"true\")", p50["e2b"], None, "ms",
                   note=ratio(p50["e2b"], p50["shoal_http_bash"]) + " (same command)"),
            Metric("exec p50, SWE-ReX execute([\"true\"])", p50["swerex"], None, "ms",
                   note=ratio(p50["swerex"], p50["shoal_http_true"]) + " (same command)"))
    res.add(*step_metrics)
    res.add(*port_metrics)
    if p.languages:
        res.add(*fusion_metrics)
    return res


async def _ok(code: int | None) -> None:
    if code != 0:
        raise RuntimeError(f"true exited {code}")


SCENARIO = Scenario("compat", "E2B, SWE-ReX, SWE-agent steps, get_host and SandboxFusion languages vs shoal's API",
                    run, CompatParams, uses_docker=False)
