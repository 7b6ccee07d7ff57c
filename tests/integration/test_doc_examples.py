"""The complete programs in the README and the docs run as written (extracted from the Markdown, run as
a user would run them) and print what their comments say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.root]
REPO = Path(__file__).resolve().parents[2]


def _python_block(doc: str, index: int) -> str:
    blocks = re.findall(r"```python\n(.*?)```", (REPO / doc).read_text(), re.S)
    return blocks[index]


def _run(code: str, tmp_path: Path, env: dict[str, str] | None = None) -> str:
    script = tmp_path / "example.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_readme_quick_start(tmp_path: Path, base_image: str) -> None:
    out = _run(_python_block("README.md", 0), tmp_path)
    assert out.splitlines() == ["0 b'42\\n'", "b'1 /tmp\\n'"]


def test_stateful_shell_example(tmp_path: Path, base_image: str) -> None:
    out = _run(_python_block("docs/stateful.md", 0), tmp_path)
    assert "/tmp\n1\nhi you\n/tmp/venv/bin/python" in out
    assert "True 130" in out and "b'1\\n'" in out and "b'b /etc\\n'" in out


def test_api_example_against_a_server(tmp_path: Path, api_server) -> None:
    out = _run(_python_block("docs/api.md", 0), tmp_path,
               env={"SHOAL_URL": api_server.url, "SHOAL_TOKEN": api_server.token})
    assert "stdout b'1\\n'" in out and "b'1 /tmp\\n'" in out and "10 created" in out and "typed error:" in out


def test_scheduling_sdk_example(tmp_path: Path, base_image: str) -> None:
    out = _run(_python_block("docs/scheduling.md", 0), tmp_path)
    lines = out.splitlines()
    assert lines[0] == "8 train-rollout" and lines[1].startswith("gang refused, would fit now:")
    assert lines[2] == "8 8"


def test_scheduling_driver_contract_example(tmp_path: Path) -> None:
    code = _python_block("docs/scheduling.md", 1) + "\nprint(p.node_id, sorted(req.avoid))\n"
    out = _run(code, tmp_path).split()
    assert out[0] in ("n1", "n2") and out[0] not in out[1:]
