"""SWE-agent's request sequence, replayed through the unmodified SWE-ReX client.

SWE-agent (github.com/SWE-agent/SWE-agent, 1.x) is not on PyPI, so the tests cannot run `sweagent run`
itself. What reaches a SWE-ReX server from it is fully determined by its source, and this module sends exactly
that, in the same order and with the same fields, through `swerex.runtime.remote.RemoteRuntime` — what
`--env.deployment.type=remote` makes SWE-agent use:

- `SWEEnv.start`: `create_session(startup_source=["/root/.bashrc"], startup_timeout=10)`; the locale exports;
  `cd /`; `ls` (is the repository there?); the repository reset (`cd /<repo> && export ROOT=$(pwd -P) && git
  fetch && git status && git restore . && git reset --hard && git checkout HEAD && git clean -fdq`, timeout
  120);
- `ToolHandler.install` with `config/default.yaml`'s tools (bundles registry, edit_anthropic,
  review_on_submit_m): the env exports, `pwd`, the three bundle uploads (concurrent), one install command per
  bundle (`export PATH=... && chmod +x ... && cd ... && source install.sh && chmod +x ...`, timeout 300),
  `cd <cwd>`, `echo $PATH`, `which <tool>` per tool through `execute` (concurrent, `check=True`,
  `env={"PATH": ...}`);
- `ToolHandler.reset`: the env exports again, `write_file` of `/root/.swe-agent-env` and `/root/state.json`,
  then the joined reset commands — an empty string with `check="raise"`;
- the problem statement export, and the state command (`_state_anthropic`) plus `read_file
  /root/state.json` after every step;
- each step: `BashAction(command, timeout=<execution_timeout>, check="silent")` (SWE-agent's `communicate`
  maps every `check` value it uses to "silent"); on CommandTimeoutError a `BashInterruptAction()`;
- `submit` twice (review-on-submit prints the review message first), then `read_file /root/model.patch`
  (`encoding="utf-8", errors="backslashreplace"`), and `close`.

The tool bundles are written here (same layout and behaviour as SWE-agent's: a registry library reading
`/root/.swe-agent-env`, an editor with view/str_replace whose state command records the working directory in
`/root/state.json`, a submit that reviews once, then prints the patch between `<<SWE_AGENT_SUBMISSION>>`
markers); their code is not SWE-agent's.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swerex.exceptions import CommandTimeoutError
from swerex.runtime.abstract import (
    BashAction,
    BashInterruptAction,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

#: default.yaml's `tools.env_variables`
TOOL_ENV = {"PAGER": "cat", "MANPAGER": "cat", "LESS": "-R", "PIP_PROGRESS_BAR": "off", "TQDM_DISABLE": "1",
            "GIT_PAGER": "cat"}
REVIEW = "Thank you for your work on this issue. Please review your changes:\n<diff>\n{{diff}}\n</diff>\n"
SUBMISSION = "<<SWE_AGENT_SUBMISSION>>"


def write_bundles(root: Path) -> list[Path]:
    """Write the three tool bundles of SWE-agent's default config under `root`; their paths, in config order."""
    files = {
        "registry/config.yaml": "tools: {}\n",
        "registry/install.sh": textwrap.dedent("""\
            #!/usr/bin/env bash
            here=$( cd -- "$( dirname -- "${BASH_SOURCE[0]}" )" &> /dev/null && pwd )
            export PYTHONPATH="$here/lib":$PYTHONPATH
            """),
        "registry/lib/registry.py": textwrap.dedent("""\
            import json, os
            from pathlib import Path

            class Registry:
                def __init__(self):
                    self.path = Path(os.environ.get("SWE_AGENT_ENV_FILE", "/root/.swe-agent-env"))
                def _load(self):
                    return json.loads(self.path.read_text()) if self.path.exists() else {}
                def get(self, key, default=None):
                    return self._load().get(key, default)
                def __setitem__(self, key, value):
                    data = self._load()
                    data[key] = value
                    self.path.write_text(json.dumps(data))

            registry = Registry()
            """),
        "registry/bin/_read_env": "#!/usr/bin/env python3\nimport sys\nfrom registry import registry\n"
                                  "print(registry.get(sys.argv[1], ''))\n",
        "edit_anthropic/config.yaml": "tools:\n  str_replace_editor: {}\nstate_command: _state_anthropic\n",
        # SWE-agent's installs tree-sitter with pip and ignores failures (no network here): the same shape
        "edit_anthropic/install.sh": "python3 -c 'import tree_sitter' 2>/dev/null || true\n",
        "edit_anthropic/bin/_state_anthropic": textwrap.dedent("""\
            #!/usr/bin/env python3
            import json, os
            from pathlib import Path
            p = Path("/root/state.json")
            state = json.loads(p.read_text()) if p.exists() else {}
            state["working_dir"] = os.getcwd()
            p.write_text(json.dumps(state))
            """),
        "edit_anthropic/bin/str_replace_editor": textwrap.dedent("""\
            #!/usr/bin/env python3
            import argparse, sys
            from pathlib import Path
            ap = argparse.ArgumentParser()
            ap.add_argument("command")
            ap.add_argument("path")
            ap.add_argument("--old_str")
            ap.add_argument("--new_str", default="")
            ap.add_argument("--file_text")
            a = ap.parse_args()
            p = Path(a.path)
            if a.command == "view":
                for n, line in enumerate(p.read_text().splitlines(), 1):
                    print(f"{n:6}\\t{line}")
            elif a.command == "create":
                p.write_text(a.file_text)
                print(f"File created successfully at: {p}")
            elif a.command == "str_replace":
                text = p.read_text()
                if text.count(a.old_str) != 1:
                    print(f"No replacement was performed: old_str occurs {text.count(a.old_str)} times in {p}")
                    sys.exit(0)
                p.write_text(text.replace(a.old_str, a.new_str))
                print(f"The file {p} has been edited.")
            else:
                print(f"unknown command {a.command}")
                sys.exit(1)
            """),
        "review_on_submit_m/config.yaml": "tools:\n  submit: {}\n",
        "review_on_submit_m/install.sh": "",
        "review_on_submit_m/bin/submit": textwrap.dedent("""\
            #!/usr/bin/env python3
            import os, subprocess
            from pathlib import Path
            from registry import registry
            root = registry.get("ROOT", os.getenv("ROOT"))
            patch = Path("/root/model.patch")
            subprocess.run(f"git add -A && git diff --cached > {patch}", shell=True, cwd=root,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            diff = patch.read_text(errors="backslashreplace")
            stages = registry.get("SUBMIT_REVIEW_MESSAGES", [])
            stage = registry.get("SUBMIT_STAGE", 0)
            if stage != len(stages):
                registry["SUBMIT_STAGE"] = stage + 1
                print(stages[stage].replace("{{diff}}", diff))
            else:
                print("<<SWE_AGENT_SUBMISSION>>")
                print(diff)
                print("<<SWE_AGENT_SUBMISSION>>")
            """),
    }
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        if "/bin/" in rel:
            p.chmod(0o755)
    return [root / "registry", root / "edit_anthropic", root / "review_on_submit_m"]


def repo_setup_command(repo: str) -> str:
    """Shell command that makes the task's repository (what a SWE-bench image already has at /<repo>)."""
    calc = "def add(a, b):\n    return a - b\n"
    return (f"mkdir -p {repo} && cd {repo} && git init -q && printf %s {shlex.quote(calc)} > calc.py && "
            "echo __pycache__/ > .gitignore && git add calc.py .gitignore && "
            "git -c user.name=t -c user.email=t@t commit -q -m init && echo made")


@dataclass
class Transcript:
    """What each request answered: (label, observation or exception class name)."""

    entries: list[tuple[str, Any]] = field(default_factory=list)

    def add(self, label: str, value: Any) -> Any:
        self.entries.append((label, value))
        return value


def _exports(env: dict[str, str]) -> str:
    return " && ".join(f"export {k}={shlex.quote(str(v))}" for k, v in env.items())


async def replay(rt: Any, *, repo: str, bundles: list[Path], execution_timeout: float = 30.0,
                 problem: str = "add() subtracts instead of adding") -> Transcript:
    """Send SWE-agent's requests for one task (see the module docstring) and return what came back.

    The agent's steps are those of a model that fixes `calc.py` of `repo`: view the file, replace the bug, run
    a check, run a command that hangs past `execution_timeout` (SWE-agent then interrupts the session),
    submit (review), submit again. Raises what SWE-agent itself would stop on (a failing `check="raise"`
    command there is a RuntimeError; here the exit status is asserted)."""
    t = Transcript()

    async def communicate(cmd: str, *, timeout: float = 25, must_succeed: bool = False, label: str = "") -> str:
        obs = await rt.run_in_session(BashAction(command=cmd, timeout=timeout, check="silent"))
        t.add(label or cmd[:60], (obs.output, obs.exit_code))
        if must_succeed:  # SWEEnv.communicate(check="raise"): a non-zero status stops SWE-agent
            assert obs.exit_code == 0, f"SWE-agent would stop here: {cmd!r} -> {obs.exit_code}: {obs.output!r}"
        return str(obs.output)

    async def get_state() -> dict[str, Any]:
        await communicate("_state_anthropic", label="state command")
        state = json.loads((await rt.read_file(ReadFileRequest(path="/root/state.json"))).content)
        t.add("state", state)
        return dict(state)

    # SWEEnv.start -> _init_deployment, reset
    t.add("create_session", (await rt.create_session(
        CreateBashSessionRequest(startup_source=["/root/.bashrc"], startup_timeout=10))).session_type)
    await communicate(_exports({"LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PIP_PROGRESS_BAR": "off", "PAGER": "cat"}),
                      must_succeed=True)
    await communicate("cd /", must_succeed=True)
    await communicate("ls", must_succeed=True, label="ls /")
    reset = [f"cd {repo}", "export ROOT=$(pwd -P)", "git fetch", "git status", "git restore .", "git reset --hard",
             "git checkout HEAD", "git clean -fdq"]
    await communicate(" && ".join(reset), timeout=120, must_succeed=True, label="repository reset")

    # ToolHandler.install
    await communicate(_exports(TOOL_ENV), must_succeed=True)
    cwd = (await communicate("pwd", must_succeed=True)).strip()
    t.add("cwd", cwd)
    await asyncio.gather(*(rt.upload(UploadRequest(source_path=b.as_posix(), target_path=f"/root/tools/{b.name}"))
                           for b in bundles))
    for b in bundles:
        d = f"/root/tools/{b.name}"
        cmds = [f"export PATH={d}/bin:$PATH", f"chmod +x {d}/bin/*"]
        if (b / "install.sh").exists():
            cmds.append(f"cd {d} && source install.sh")
        cmds.append(f"chmod +x {d}/bin/*")
        await communicate(" && ".join(cmds), timeout=300, must_succeed=True, label=f"install {b.name}")
    await communicate(f"cd {cwd}", must_succeed=True)
    path = (await communicate("echo $PATH", must_succeed=True, label="echo $PATH")).strip()
    which = await asyncio.gather(*(rt.execute(Command(command=f"which {tool}", shell=True, check=True,
                                                      env={"PATH": path}))
                                   for tool in ("str_replace_editor", "submit")))
    t.add("which", [w.stdout.strip() for w in which])

    # ToolHandler.reset
    await communicate(_exports(TOOL_ENV), must_succeed=True)
    registry = {"USE_FILEMAP": "true", "SUBMIT_REVIEW_MESSAGES": [REVIEW]}  # default.yaml's registry_variables
    await rt.write_file(WriteFileRequest(path="/root/.swe-agent-env", content=json.dumps(registry)))
    await rt.write_file(WriteFileRequest(path="/root/state.json", content="{}"))
    await communicate("", timeout=300, must_succeed=True, label="reset commands (empty)")

    # DefaultAgent.setup
    await communicate(_exports({"PROBLEM_STATEMENT": problem}), must_succeed=True)
    await get_state()

    # the model's steps
    steps = [
        f"str_replace_editor view {repo}/calc.py",
        f"str_replace_editor str_replace {repo}/calc.py   --old_str {shlex.quote('return a - b')} "
        f"--new_str {shlex.quote('return a + b')}",
        "python3 -c 'from calc import add; print(add(2, 3))'",
        "sleep 600",
        "submit",
        "submit",
    ]
    submission = None
    for action in steps:
        try:
            out = await communicate(action, timeout=execution_timeout, label=f"step {action.split()[0]}")
        except CommandTimeoutError:
            t.add(f"step {action.split()[0]}", "CommandTimeoutError")
            obs = await rt.run_in_session(BashInterruptAction())
            t.add("interrupt", obs.exit_code)
            out = ""
        await get_state()
        if SUBMISSION in out:
            submission = (await rt.read_file(ReadFileRequest(path="/root/model.patch", encoding="utf-8",
                                                             errors="backslashreplace"))).content
            t.add("submission", submission)
            break
    assert submission is not None, "the second submit did not submit"
    await rt.close()  # SWEEnv.close -> RemoteDeployment.stop
    return t
