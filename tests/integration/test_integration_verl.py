"""verl 0.9.1 — its own modules, loaded by path from the PyPI wheel (the package needs torch and Ray to
import): `tools/schemas.py`, `tools/base_tool.py` and `tools/tool_registry.py` instantiate shoal's tool
from a tool config YAML as verl does; `ToolAgentLoop._call_tool`, compiled unmodified from
`experimental/agent_loop/tool_agent_loop.py`, makes the tool calls (create → execute → release around
each one), and the trajectory keeps one sandbox across them until it is graded; `sandbox_fusion` (verl's
reward client, unmodified) scores code against `shoal fncall serve`.

Stubbed, and only these: `verl.utils.rollout_trace` (tracing; rollout_trace_op passes calls through when
tracing is off, as here) and `verl.tools.function_tool` (function tools import transformers; shoal's tool
is a BaseTool, so only the names verl's code refers to are needed)."""

from __future__ import annotations

import json
import logging
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.frameworks import framework_file, load_module, method_from_source, wheel_version
from tests.integration.test_fncall_fusion import fusion  # noqa: F401  (shoal fncall serve, module-scoped)

pytestmark = [pytest.mark.root, pytest.mark.slow]


@pytest.fixture
def verl(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    assert wheel_version("verl") == "0.9.1"
    trace = types.ModuleType("verl.utils.rollout_trace")
    trace.rollout_trace_op = lambda f: f  # type: ignore[attr-defined]
    for pkg in ("verl", "verl.utils", "verl.tools"):
        mod = types.ModuleType(pkg)
        mod.__path__ = []
        monkeypatch.setitem(sys.modules, pkg, mod)
    monkeypatch.setitem(sys.modules, "verl.utils.rollout_trace", trace)
    schemas = load_module("verl.tools.schemas", framework_file("verl", "verl/tools/schemas.py"), monkeypatch)
    base = load_module("verl.tools.base_tool", framework_file("verl", "verl/tools/base_tool.py"), monkeypatch)

    class FunctionTool:  # verl's function tools; shoal's tool is not one
        pass

    ft = types.ModuleType("verl.tools.function_tool")
    ft.FunctionTool = FunctionTool  # type: ignore[attr-defined]
    ft.load_function_tools_from_path = lambda path: []  # type: ignore[attr-defined]
    ft.normalize_function_tool_return = lambda raw: raw  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "verl.tools.function_tool", ft)
    registry = load_module("verl.tools.tool_registry", framework_file("verl", "verl/tools/tool_registry.py"),
                           monkeypatch)
    call_tool = method_from_source(
        framework_file("verl", "verl/experimental/agent_loop/tool_agent_loop.py"), "ToolAgentLoop", "_call_tool",
        {"json": json, "logger": logging.getLogger("verl-test"), "FunctionTool": FunctionTool,
         "normalize_function_tool_return": ft.normalize_function_tool_return, "ToolResponse": schemas.ToolResponse,
         "Any": object})
    monkeypatch.delitem(sys.modules, "shoal.integrations.verl", raising=False)
    import shoal.integrations.verl as shoal_verl

    return SimpleNamespace(schemas=schemas, base=base, registry=registry, call_tool=call_tool, shoal=shoal_verl)


class Loop:
    """What `_call_tool` reads from its ToolAgentLoop (the configured tools and response truncation)."""

    def __init__(self, tools: list) -> None:
        self.tools = {t.name: t for t in tools}
        self.max_tool_response_length = 100_000
        self.tool_response_truncate_side = "middle"


async def _call(verl: SimpleNamespace, loop: Loop, agent_data: object, name: str, args: dict, kw: dict) -> str:
    resp, reward, _metrics = await verl.call_tool(loop, SimpleNamespace(name=name, arguments=json.dumps(args)),
                                                  kw, agent_data)
    assert reward == 0.0
    return resp.text


async def test_one_sandbox_per_trajectory_across_verls_tool_calls(verl, client, rl_tasks: list,
                                                                  tmp_path: Path) -> None:
    cfg = tmp_path / "tools.yaml"
    cfg.write_text(json.dumps({"tools": [
        {"class_name": "shoal.integrations.verl.ShoalSandboxTool", "config": {"type": "native", "idle_ttl_s": 600}},
        {"class_name": "shoal.integrations.verl.ShoalSandboxTool", "config": {"type": "native"},
         "tool_schema": {"type": "function", "function": {
             "name": "write_file", "description": "Write a file.",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                             "content": {"type": "string"}},
                            "required": ["path", "content"]}}}}]}))
    tools = verl.registry.initialize_tools_from_config(str(cfg))  # verl's own loader, from a YAML/JSON config
    assert [t.name for t in tools] == ["bash", "write_file"]
    assert all(isinstance(t, verl.base.BaseTool) for t in tools)
    for t in tools:
        t._client = client
    loop = Loop(tools)
    a, b = rl_tasks
    kw_a = {name: {"create_kwargs": {"task": a.to_dict()}} for name in ("bash", "write_file")}
    kw_b = {name: {"create_kwargs": {"task": b.to_dict()}} for name in ("bash", "write_file")}
    traj_a, traj_b = SimpleNamespace(request_id="req-a"), SimpleNamespace(request_id="req-b")
    before = {sb.id for sb in await client.list()}

    out = await _call(verl, loop, traj_a, "bash", {"command": "export X=kept; echo one > /tmp/state"}, kw_a)
    assert "[exit code 0]" in out
    # the second call, a different tool, sees the first one's files and shell: the same sandbox
    await _call(verl, loop, traj_a, "write_file", {"path": "/tmp/fix.patch", "content": a.patch}, kw_a)
    out = await _call(verl, loop, traj_a, "bash", {"command": "cat /tmp/state; echo $X; git apply /tmp/fix.patch"},
                      kw_a)
    assert "one" in out and "kept" in out and "[exit code 0]" in out, out
    # another trajectory has its own sandbox
    out = await _call(verl, loop, traj_b, "bash", {"command": "cat /tmp/state"}, kw_b)
    assert "No such file" in out
    assert set(verl.shoal._sessions) == {"req-a", "req-b"}
    assert len({sb.id for sb in await client.list()} - before) == 2
    # verl's release after each call dropped only the call's handle
    assert all(t._instances == {} for t in tools)

    grade = await verl.shoal.finish_trajectory("req-a")
    assert (grade.outcome, grade.reward) == ("resolved", 1.0)
    grade = await verl.shoal.finish_trajectory("req-b")
    assert (grade.outcome, grade.reward) == ("empty_patch", 0.0)
    assert verl.shoal._sessions == {} and {sb.id for sb in await client.list()} - before == set()


async def test_idle_trajectories_are_released_and_bad_calls_are_answers(verl, client, rl_tasks: list) -> None:
    tool = verl.shoal.ShoalSandboxTool({"type": "native", "idle_ttl_s": 0, "client": client}, None)
    loop = Loop([tool])
    kw = {"bash": {"create_kwargs": {"task": rl_tasks[0].to_dict()}}}
    before = {sb.id for sb in await client.list()}
    await _call(verl, loop, SimpleNamespace(request_id="idle"), "bash", {"command": "true"}, kw)
    assert "idle" in verl.shoal._sessions
    await tool.create(create_kwargs={})  # the next call anywhere reaps trajectories idle past idle_ttl_s
    assert "idle" not in verl.shoal._sessions and {sb.id for sb in await client.list()} - before == set()
    # verl turns a tool's exception into the tool message; a call without a task says what is missing
    out = await _call(verl, loop, SimpleNamespace(request_id="nt"), "bash", {"command": "ls"}, {})
    assert "no task given" in out
    # a trajectory that never called a tool is graded from its task (the agent did nothing)
    grade = await verl.shoal.finish_trajectory("never", {"task": rl_tasks[1].to_dict()}, {}, client)
    assert grade.outcome == "empty_patch" and verl.shoal._sessions == {}


def test_sandbox_fusion_reward_against_fncall_serve(monkeypatch: pytest.MonkeyPatch, fusion) -> None:  # noqa: F811
    """verl's reward path `reward.sandbox_fusion.url` → its unmodified sandbox_fusion client → shoal."""
    import threading

    pkg_init = framework_file("verl", "verl/utils/reward_score/sandbox_fusion/__init__.py")
    for pkg in ("verl", "verl.utils", "verl.utils.reward_score"):
        mod = types.ModuleType(pkg)
        mod.__path__ = []
        monkeypatch.setitem(sys.modules, pkg, mod)
    import importlib.util

    spec = importlib.util.spec_from_file_location("verl.utils.reward_score.sandbox_fusion", pkg_init,
                                                  submodule_search_locations=[str(pkg_init.parent)])
    sf = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "verl.utils.reward_score.sandbox_fusion", sf)
    spec.loader.exec_module(sf)
    url = fusion.url + "/run_code"
    sem = threading.Semaphore(4)
    cases = {"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12\n"]}
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    score, meta = sf.compute_score(url, sem, 512, good, json.dumps(cases), continuous=False, timeout=10)
    assert score == 1.0, meta
    wrong = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
    score, _ = sf.compute_score(url, sem, 512, wrong, json.dumps(cases), continuous=False, timeout=10)
    assert score == 0.0
