"""docs/cluster.md's "Try it on one machine", run as written: its commands (`shoal cluster local`, `shoal cluster
up --home-per-node`, `shoal cluster status`), its Python program (`create_many("base")` over the cluster), then
the two commands its text ends with (`shoal cluster down`, `shoal cluster local --stop`).

Only the port changes (6390 becomes a free one: the machine is shared). The environment is a user's default
one — SHOAL_HOME set, no SHOAL_STORE, the `base` image in `$SHOAL_HOME/store` (here a link to the suite's
shared store) — which is what made the per-node homes miss it before (each got an empty store of its own)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from shoal.server.proc import free_port

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]
DOC_PORT = "6390"


def _section() -> tuple[list[str], str, list[str]]:
    """(the bash block's commands, the Python program, the commands the text names after it)."""
    doc = (REPO / "docs" / "cluster.md").read_text()
    sec = doc[doc.index("## Try it on one machine"):doc.index("## Deploying")]
    [bash] = re.findall(r"```bash\n(.*?)```", sec, re.S)
    [py] = re.findall(r"```python\n(.*?)```", sec, re.S)
    cmds = [ln.strip() for ln in bash.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    after = [" ".join(c.split()) for c in re.findall(r"`(shoal cluster [^`]*)`", sec[sec.index(py) + len(py):])]
    return cmds, py, after


def _run(line: str, port: str, env: dict[str, str], timeout: float = 600) -> str:
    argv = shlex.split(line.replace(DOC_PORT, port))
    if argv[0] == "shoal":
        argv[0] = str(Path(sys.executable).with_name("shoal"))
    elif argv[0] == "python":
        argv[0] = sys.executable
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{line} -> {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_loopback_example_runs_as_written(tmp_path: Path, base_image: str) -> None:
    cmds, program, after = _section()
    assert [c.split()[:3] for c in cmds] == [["shoal", "cluster", "local"], ["shoal", "cluster", "up"],
                                             ["shoal", "cluster", "status"]]
    assert after == [f"shoal cluster down --address 127.0.0.1:{DOC_PORT}",
                     f"shoal cluster local --stop --port {DOC_PORT}"]
    port = str(free_port("127.0.0.1"))
    home = Path(tempfile.mkdtemp(prefix="shd-", dir="/tmp"))  # short: sandbox sockets live below the node homes
    (home / "store").symlink_to(os.environ["SHOAL_STORE"])  # `base` where a default install keeps it
    env = {k: v for k, v in os.environ.items() if k not in ("SHOAL_STORE", "SHOAL_TEST_STORE")}
    env.update(SHOAL_HOME=str(home), RAY_USAGE_STATS_ENABLED="0")
    state = Path("/run/shoal/local-clusters") / f"{port}.json"
    temp_dir = ""
    try:
        out = _run(cmds[0], port, env)
        assert f"127.0.0.1:{port}" in out
        temp_dir = json.loads(state.read_text())["temp_dir"]
        out = _run(cmds[1], port, env)
        assert out.count("started node agent") == 2, out
        status = json.loads(_run(cmds[2] + " --json", port, env))
        assert [r["health"] for r in status] == ["ok", "ok"], status
        script = tmp_path / "example.py"
        script.write_text(program.replace(DOC_PORT, port))
        lines = _run(f"python {script}", port, env).strip().splitlines()
        assert len(eval(lines[0])) == 2, lines  # the burst went to both nodes
        assert lines[1] == "b'Linux\\n'" and lines[2] == "stdout b'streamed\\n'" and lines[3].startswith("exit")
        assert lines[-1] == "30", lines
        # each agent has a home of its own, and no per-node store was made: they used this host's
        agents = sorted(p.name for p in (home / "nodes").iterdir())
        assert len(agents) == 2 and not any((home / "nodes" / a / "store").exists() for a in agents)
        for line in after:
            _run(line, port, env)
        assert not state.exists() and not Path(temp_dir).exists()
    finally:
        if state.exists():  # a failure above: stop the Ray nodes all the same
            from shoal.cluster.local import stop_session

            stop_session(json.loads(state.read_text())["temp_dir"])
            state.unlink(missing_ok=True)
        if not any(ln.split()[4].startswith(str(home)) for ln in Path("/proc/self/mountinfo").read_text().splitlines()):
            shutil.rmtree(home, ignore_errors=True)
    from shoal.cluster.local import ray_processes_of

    assert temp_dir and ray_processes_of(temp_dir) == []
    mounts = [ln.split()[4] for ln in Path("/proc/self/mountinfo").read_text().splitlines()
              if ln.split()[4].startswith(str(home))]
    assert mounts == [], mounts
