"""The code interpreter's REPL driver (shoal.server.compat.repl_driver) run as the program it is inside a
sandbox, here as a plain `python -c` child: its record protocol, ordering, interrupts and rich results."""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from shoal.server.compat.repl_driver import SOURCE


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


class Driver:
    def __init__(self, preexec: object = None) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", SOURCE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, env={**os.environ, "MPLBACKEND": "Agg"},
                                  start_new_session=True, preexec_fn=preexec)  # type: ignore[arg-type]
        self.buf = b""
        self.n = 0

    def send(self, code: str, env: dict | None = None) -> str:
        self.n += 1
        rid = f"r{self.n}"
        assert self.p.stdin is not None
        self.p.stdin.write((json.dumps({"id": rid, "code": code, "env": env or {}}) + "\n").encode())
        self.p.stdin.flush()
        return rid

    def record(self, timeout: float = 30) -> dict:
        assert self.p.stdout is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            assert left > 0, "no record from the driver"
            ready, _, _ = select.select([self.p.stdout], [], [], left)
            if ready:
                chunk = os.read(self.p.stdout.fileno(), 65536)
                assert chunk, f"the driver exited: {self.p.stderr.read().decode() if self.p.stderr else ''}"
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, code: str, env: dict | None = None) -> list[dict]:
        """Every record of one execution up to its end (which is left out)."""
        rid = self.send(code, env)
        out = []
        while True:
            rec = self.record()
            if rec["id"] != rid:
                continue
            if rec["type"] == "end":
                return out
            out.append(rec)

    def close(self) -> None:
        self.p.kill()
        self.p.wait()


@pytest.fixture
def drv() -> Iterator[Driver]:
    d = Driver()
    try:
        yield d
    finally:
        d.close()


def _kinds(recs: list[dict]) -> list[tuple]:
    return [(r["type"], r.get("text")) for r in recs if r["type"] in ("stdout", "stderr", "result")]


def test_values_state_and_execution_counts(drv: Driver) -> None:
    recs = drv.run("x = 6 * 7")
    assert recs == [{"type": "number_of_executions", "execution_count": 1, "id": "r1"}]
    recs = drv.run("x")
    assert recs[1] == {"type": "result", "is_main_result": True, "text": "42", "id": "r2"}
    assert drv.run("x;")[1:] == []  # a trailing semicolon hides the value
    assert drv.run("[1, 'a']")[1]["json"] == [1, "a"]
    assert drv.run("'quoted'")[1]["text"] == "quoted"
    recs = drv.run("import os\nos.environ['K']", env={"K": "v"})
    assert recs[1]["text"] == "v" and drv.run("'K' in os.environ")[1]["text"] == "False"  # restored after


def test_output_keeps_the_order_it_was_written_in(drv: Driver) -> None:
    recs = drv.run("import sys\nprint('a')\nprint('b', file=sys.stderr)\nsys.stdout.write('c')\nprint('d')\n"
                   "sys.stdout.write('partial');")
    assert _kinds(recs) == [("stdout", "a\n"), ("stderr", "b\n"), ("stdout", "cd\n"), ("stdout", "partial")]
    assert all(isinstance(r["timestamp"], int) for r in recs if r["type"] == "stdout")
    # what other processes (and raw fd writes) produce is captured too, before the end of the cell
    recs = drv.run("import os, subprocess\nos.system('echo shell')\nos.write(2, b'raw\\n')\n"
                   "subprocess.run(['printf', 'no newline'])")
    assert ("stdout", "shell\n") in _kinds(recs) and ("stderr", "raw\n") in _kinds(recs)
    assert ("stdout", "no newline") in _kinds(recs)


def test_output_made_between_executions_keeps_its_own_id(drv: Driver) -> None:
    drv.run("import threading, time\nev = threading.Event()\n"
            "def late():\n    ev.wait()\n    print('late')\nthreading.Thread(target=late).start()")
    rid = drv.send("ev.set(); import time; time.sleep(0.2)")
    late = None
    while True:
        rec = drv.record()
        if rec.get("text") == "late\n":
            late = rec
        if rec["id"] == rid and rec["type"] == "end":
            break
    assert late is not None and late["id"] == rid  # printed during r2: it belongs to r2


@pytest.mark.parametrize("inherited", ["default", "sigint-ignored-and-blocked"])
def test_interrupt_stops_the_cell_and_keeps_the_namespace(inherited: str) -> None:
    # started by a parent that ignores and blocks SIGINT (both survive exec), the driver still takes interrupts
    drv = Driver(_ignore_sigint if inherited != "default" else None)
    try:
        _interrupt_keeps_the_namespace(drv)
    finally:
        drv.close()


def _interrupt_keeps_the_namespace(drv: Driver) -> None:
    drv.run("kept = 1")
    rid = drv.send("import time\nprint('started')\nwhile True:\n    time.sleep(0.01)")
    while drv.record().get("text") != "started\n":
        pass
    os.killpg(drv.p.pid, signal.SIGINT)
    recs = []
    while (rec := drv.record())["type"] != "end":
        recs.append(rec)
    assert rec["id"] == rid
    (err,) = [r for r in recs if r["type"] == "error"]
    assert err["name"] == "KeyboardInterrupt"
    assert drv.run("kept")[1]["text"] == "1"


def test_tracebacks_start_at_the_cell(drv: Driver) -> None:
    recs = drv.run("def f():\n    raise ValueError('bad')\nf()")
    (err,) = [r for r in recs if r["type"] == "error"]
    assert (err["name"], err["value"]) == ("ValueError", "bad")
    tb = err["traceback"]
    assert tb.startswith("Traceback (most recent call last):\n")
    assert 'File "<cell-1>", line 3, in <module>' in tb and "raise ValueError('bad')" in tb
    assert '"<string>"' not in tb
    (err,) = [r for r in drv.run("1 +") if r["type"] == "error"]
    assert err["name"] == "SyntaxError" and '"<string>"' not in err["traceback"]


def test_display_protocol_and_builtin_display(drv: Driver) -> None:
    recs = drv.run(
        "class Rich:\n"
        "    def _repr_html_(self): return '<i>r</i>'\n"
        "    def _repr_png_(self): return b'\\x89PNG'\n"
        "    def _repr_mimebundle_(self, include=None, exclude=None): return {'text/markdown': '*r*', 'x/y': 1}\n"
        "    def __repr__(self): return 'Rich()'\n"
        "display(Rich(), raw=False)\n"
        "display({'text/plain': 'p', 'text/html': '<p/>'}, raw=True)\n"
        "Rich()")
    shown, raw, main = [r for r in recs if r["type"] == "result"]
    assert shown["is_main_result"] is False and main["is_main_result"] is True
    assert (shown["html"], shown["markdown"], shown["text"]) == ("<i>r</i>", "*r*", "Rich()")
    assert base64.b64decode(shown["png"]) == b"\x89PNG" and shown["extra"] == {"x/y": 1}
    assert (raw["text"], raw["html"]) == ("p", "<p/>")


def test_matplotlib_figures_become_pngs(drv: Driver) -> None:
    pytest.importorskip("matplotlib")
    recs = drv.run("import matplotlib.pyplot as plt\nplt.plot([1, 2])\nplt.show()\nplt.figure()\nplt.plot([2, 1]);")
    figs = [r for r in recs if r["type"] == "result"]
    assert len(figs) == 2  # the shown one, then the one still open at the end of the cell
    for f in figs:
        assert base64.b64decode(f["png"]).startswith(b"\x89PNG") and f["text"].startswith("<Figure size")
    assert drv.run("plt.get_fignums()")[1]["text"] == "[]"


def test_dataframes_give_html_text_and_data(drv: Driver) -> None:
    pytest.importorskip("pandas")
    recs = drv.run("import pandas as pd\npd.DataFrame({'a': [1, 2], 't': pd.to_datetime(['2024-01-01', None])})")
    res = recs[1]
    assert "<table" in res["html"] and res["text"].split()[:2] == ["a", "t"]
    assert res["data"]["a"] == [1, 2] and res["data"]["t"][0].startswith("2024-01-01")


def test_cells_run_in_main_so_multiprocessing_works(drv: Driver) -> None:
    """Functions a cell defines pickle by reference (the cell's namespace is sys.modules['__main__']), and what
    forked children print comes back."""
    recs = drv.run("import multiprocessing as mp\n"
                   "def double(x):\n    print('child', x, flush=True)\n    return 2 * x\n"
                   "with mp.get_context('fork').Pool(2) as pool:\n    out = pool.map(double, range(4))\nout")
    assert [r for r in recs if r["type"] == "error"] == []
    assert recs[-1]["text"] == "[0, 2, 4, 6]"
    printed = "".join(r["text"] for r in recs if r["type"] == "stdout")
    assert sorted(printed.splitlines()) == ["child 0", "child 1", "child 2", "child 3"]
