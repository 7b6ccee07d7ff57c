"""OpenRLHF 0.11.2: its own `openrlhf/utils/agent.py` (loaded by path from the PyPI wheel, as OpenRLHF's
tests/test_agent.py loads it: the package needs torch, DeepSpeed and vLLM to import) runs shoal's agent
file. OpenRLHF's unmodified `_load_agent_executor` loads `shoal/integrations/openrlhf.py` as the
`--train.agent_func_path` file, and its `MultiTurnAgentExecutor.execute` drives an episode on real
sandboxes. The LLM engine is scripted and the tokenizer is one character per token: vLLM needs a GPU."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.frameworks import framework_file, function_from_source, load_module, stub_logger_module, wheel_version

pytestmark = [pytest.mark.root, pytest.mark.slow]


class CharTokenizer:
    """One token per character (OpenRLHF calls tokenizer(text=..., add_special_tokens=False, return_tensors=...))."""

    class _Ids(list):
        def tolist(self) -> list[int]:
            return list(self)

    def __call__(self, text: str, add_special_tokens: bool = False, return_tensors: str | None = None) -> dict:
        return {"input_ids": [self._Ids(ord(c) for c in text)]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


class ScriptedEngine:
    """Answers each generate() with the next scripted turn (what a policy model would write)."""

    def __init__(self, turns: list[str]) -> None:
        self.turns = list(turns)
        self.prompts: list[str] = []

    async def generate(self, tokens: list[int], sampling_params: object, multi_modal_data: object = None) -> object:
        self.prompts.append("".join(chr(t) for t in tokens))
        text = self.turns.pop(0)
        out = SimpleNamespace(token_ids=[ord(c) for c in text], text=text, finish_reason="stop", logprobs=None)
        return SimpleNamespace(outputs=[out])


@pytest.fixture
def openrlhf_agent(monkeypatch: pytest.MonkeyPatch):
    stub_logger_module("openrlhf.utils.logging_utils", monkeypatch)
    agent = load_module("openrlhf.utils.agent", framework_file("openrlhf", "openrlhf/utils/agent.py"), monkeypatch)
    assert wheel_version("openrlhf") == "0.11.2"
    monkeypatch.delitem(__import__("sys").modules, "shoal.integrations.openrlhf", raising=False)
    return agent


async def test_agent_file_loads_and_runs_an_episode(openrlhf_agent, client, rl_tasks: list, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import shoal.integrations.openrlhf as mod
    from shoal.rl.tasks import dump_jsonl

    # the module file itself is an agent file: OpenRLHF's own loader accepts it (tasks from $SHOAL_RL_TASKS)
    load = function_from_source(framework_file("openrlhf", "openrlhf/trainer/ray/vllm_engine.py"),
                                "_load_agent_executor", {"AgentExecutorBase": openrlhf_agent.AgentExecutorBase})
    monkeypatch.setenv("SHOAL_RL_TASKS", str(dump_jsonl(rl_tasks, tmp_path / "tasks.jsonl")))
    executor = load(mod.__file__)
    assert isinstance(executor, openrlhf_agent.MultiTurnAgentExecutor)
    assert issubclass(executor.agent_instance_cls, openrlhf_agent.AgentInstanceBase)

    # a user's agent file binding the tasks: an episode through OpenRLHF's executor, graded 1.0
    agent_file = tmp_path / "agent_func.py"
    agent_file.write_text("from shoal.integrations.openrlhf import make_agent_executor\n"
                          f"AgentExecutor = make_agent_executor(tasks={str(tmp_path / 'tasks.jsonl')!r}, "
                          "max_steps=5)\n")
    executor = load(str(agent_file))
    t = rl_tasks[0]
    engine = ScriptedEngine(["Let me look first.",
                             "```bash\ngit apply <<'EOF'\n" + t.patch + "EOF\n```",
                             "Done. <submit/>"])
    out = await executor.execute("You fix bugs. ", t.instance_id, SimpleNamespace(max_tokens=None, logprobs=None),
                                 1_000_000, CharTokenizer(), engine)
    assert out["reward"] == 1.0 and out["scores"].item() == 1.0 and out["extra_logs"]["outcome"] == "resolved"
    assert len(out["action_ranges"]) == 3
    # reset() kept the dataset prompt and added the task's instructions after it
    assert engine.prompts[0].startswith("You fix bugs. \n") and t.workdir in engine.prompts[0]
    assert "No action found" in engine.prompts[1]  # the first turn had no command: the env said so
    assert os.environ["SHOAL_RL_TASKS"]


async def test_out_of_steps_is_graded(openrlhf_agent, client, rl_tasks: list) -> None:
    from shoal.integrations.openrlhf import make_agent_executor

    executor = make_agent_executor(tasks=rl_tasks, client=client, max_steps=2)()
    t = rl_tasks[1]
    engine = ScriptedEngine(["```bash\nls\n```", "thinking..."])
    out = await executor.execute("", t.instance_id, SimpleNamespace(max_tokens=None, logprobs=None), 1_000_000,
                                 CharTokenizer(), engine)
    assert out["reward"] == 0.0 and out["extra_logs"]["outcome"] == "empty_patch"
    assert len(out["action_ranges"]) == 2
