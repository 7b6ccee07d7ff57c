"""Per-test outcomes from pytest, three ways (reporter plugin, JUnit XML, -rA log), checked against a real
pytest run with awkward parametrized ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from shoal.rl.pytest_results import (
    ERROR,
    FAILED,
    PASSED,
    REPORTER_PLUGIN,
    SKIPPED,
    XFAIL,
    XPASS,
    junit_key,
    parse_junit_xml,
    parse_pytest_log,
    parse_reporter_lines,
    summary_counts,
)

SUITE = textwrap.dedent('''
    import pytest

    @pytest.mark.parametrize("a,b", [(1, 2), ("x - y", "z]"), ("sp ace", "[nested]")])
    def test_param(a, b):
        assert a != "x - y"

    class TestThing:
        def test_ok(self):
            pass

        def test_fail(self):
            assert 1 == 2

    @pytest.fixture
    def broken_teardown():
        yield
        raise RuntimeError("teardown")

    def test_teardown_error(broken_teardown):
        pass

    @pytest.fixture
    def broken_setup():
        raise RuntimeError("setup")

    def test_setup_error(broken_setup):
        pass

    @pytest.mark.skip(reason="no")
    def test_skipped():
        pass

    @pytest.mark.xfail(reason="known")
    def test_xfail():
        assert False

    @pytest.mark.xfail(reason="fixed")
    def test_xpass():
        pass
''')

EXPECTED = {
    "test_suite.py::test_param[1-2]": PASSED,
    "test_suite.py::test_param[x - y-z]]": FAILED,
    "test_suite.py::test_param[sp ace-[nested]]": PASSED,
    "test_suite.py::TestThing::test_ok": PASSED,
    "test_suite.py::TestThing::test_fail": FAILED,
    "test_suite.py::test_teardown_error": ERROR,
    "test_suite.py::test_setup_error": ERROR,
    "test_suite.py::test_skipped": SKIPPED,
    "test_suite.py::test_xfail": XFAIL,
    "test_suite.py::test_xpass": XPASS,
}


@pytest.fixture(scope="module")
def real_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("suite")
    (d / "test_suite.py").write_text(SUITE)
    (d / "shoal_pytest_report.py").write_text(REPORTER_PLUGIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(PYTHONPATH=str(d), PYTEST_PLUGINS="shoal_pytest_report", SHOAL_PYTEST_REPORT=str(d / "r.jsonl"),
               PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-rA", "--tb=short", "-p", "no:cacheprovider",
                        f"--junitxml={d / 'j.xml'}", "-o", "junit_family=xunit2", "test_suite.py"],
                       cwd=d, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    return {"log": r.stdout, "report": (d / "r.jsonl").read_text(), "junit": (d / "j.xml").read_text()}


def test_reporter_plugin_is_exact(real_run: dict[str, str]) -> None:
    res = parse_reporter_lines(real_run["report"])
    assert res.statuses == EXPECTED
    assert "assert 1 == 2" in res.failure_text["test_suite.py::TestThing::test_fail"]


def test_log_parser_with_known_ids(real_run: dict[str, str]) -> None:
    res = parse_pytest_log(real_run["log"], known=list(EXPECTED))
    for nodeid, status in EXPECTED.items():
        if status == SKIPPED:
            continue  # `SKIPPED [1] file:line: reason` names no test id
        assert res.get(nodeid) == status, nodeid


def test_log_parser_without_known_ids(real_run: dict[str, str]) -> None:
    res = parse_pytest_log(real_run["log"])
    assert res.get("test_suite.py::test_param[x - y-z]]") == FAILED
    assert res.get("test_suite.py::test_param[sp ace-[nested]]") == PASSED
    assert res.get("test_suite.py::TestThing::test_fail") == FAILED
    assert summary_counts(real_run["log"])["failed"] == 2


def test_junit_parser(real_run: dict[str, str]) -> None:
    res = parse_junit_xml(real_run["junit"])
    for nodeid, status in EXPECTED.items():
        want = {XPASS: PASSED}.get(status, status)  # JUnit has no xpass: it reports a plain pass
        if status == ERROR and "teardown" in nodeid:
            want = ERROR
        assert res.get(nodeid) == want, (nodeid, res.statuses)


def test_junit_key() -> None:
    assert junit_key("a/b/test_x.py::C::t[1]") == "a.b.test_x.C::t[1]"
    assert junit_key("test_x.py::t") == "test_x::t"


def test_reporter_folding_rules() -> None:
    lines = [
        {"nodeid": "a::t", "when": "setup", "outcome": "passed"},
        {"nodeid": "a::t", "when": "call", "outcome": "passed"},
        {"nodeid": "a::t", "when": "teardown", "outcome": "failed"},
        {"nodeid": "a::u", "when": "setup", "outcome": "skipped", "xfail": False},
        {"nodeid": "a::v", "when": "call", "outcome": "failed", "xfail": True},
        {"nodeid": "a::w", "when": "call", "outcome": "skipped", "xfail": True},
        {"nodeid": "a.py", "when": "collect", "outcome": "failed", "longrepr": "SyntaxError"},
    ]
    text = "\n".join(json.dumps(x) for x in lines) + "\n{cut short"
    res = parse_reporter_lines(text)
    assert res.statuses == {"a::t": ERROR, "a::u": SKIPPED, "a::v": XPASS, "a::w": XFAIL}
    assert res.collect_errors == ["a.py"]


def test_verbose_lines() -> None:
    log = "t.py::test_a PASSED [ 50%]\nt.py::test_b[x y] FAILED [100%]\n"
    res = parse_pytest_log(log)
    assert res.statuses == {"t.py::test_a": PASSED, "t.py::test_b[x y]": FAILED}
    assert parse_junit_xml(b"<not xml").statuses == {}
