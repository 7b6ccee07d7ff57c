"""Per-test outcomes from a pytest run, read three ways, most exact first.

1. `REPORTER_PLUGIN`: a tiny pytest plugin (no dependencies) uploaded next to the tests; it appends one
   JSON line per test phase to `$SHOAL_PYTEST_REPORT` with the exact node id. Used by the grader.
2. `parse_junit_xml`: pytest's `--junitxml` file. JUnit names tests by dotted class name + test name, so
   results are keyed by `junit_key(nodeid)`; `lookup()` matches either form.
3. `parse_pytest_log`: the console output of `pytest -rA` (short summary lines `PASSED <nodeid>`,
   `FAILED <nodeid> - msg`) or of `pytest -v` (`<nodeid> PASSED [ 10%]`). Node ids may contain spaces,
   brackets and " - " inside parametrized ids; when the expected ids are known they are matched exactly.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterable
from dataclasses import dataclass, field

PASSED, FAILED, ERROR, SKIPPED, XFAIL, XPASS = "passed", "failed", "error", "skipped", "xfailed", "xpassed"
#: statuses that count as a pass when grading (as SWE-bench counts them)
PASS_STATUSES = frozenset({PASSED, XFAIL})
_LOG_WORDS = {"PASSED": PASSED, "FAILED": FAILED, "ERROR": ERROR, "SKIPPED": SKIPPED, "XFAIL": XFAIL,
              "XPASS": XPASS}

REPORTER_PLUGIN = r'''
"""shoal's pytest reporter: one JSON line per test phase to $SHOAL_PYTEST_REPORT (written by shoal)."""
import json, os

_PATH = os.environ.get("SHOAL_PYTEST_REPORT")


def _write(rec):
    if _PATH:
        with open(_PATH, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")


def pytest_runtest_logreport(report):
    if type(report).__name__ != "TestReport":
        return  # subtest reports share the parent's node id; the parent's own report decides
    rec = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
           "xfail": hasattr(report, "wasxfail")}
    if report.failed and report.when == "call":
        try:
            rec["longrepr"] = str(report.longrepr)[-4000:]
        except Exception:
            pass
    _write(rec)


def pytest_collectreport(report):
    if report.failed:
        _write({"nodeid": report.nodeid, "when": "collect", "outcome": "failed",
                "longrepr": str(report.longrepr)[-4000:]})
'''


@dataclass
class TestResults:
    """Per-test statuses of one pytest run, plus collection errors and failure texts."""

    statuses: dict[str, str] = field(default_factory=dict)
    collect_errors: list[str] = field(default_factory=list)
    failure_text: dict[str, str] = field(default_factory=dict)
    source: str = ""

    __test__ = False  # not a pytest test class, despite the name

    def __len__(self) -> int:
        return len(self.statuses)

    def get(self, nodeid: str) -> str | None:
        """Status of one test by node id (or JUnit key), None when it did not run."""
        return lookup(self.statuses, nodeid)

    def passed(self, nodeid: str) -> bool:
        """True when the test ran and counts as a pass."""
        return self.get(nodeid) in PASS_STATUSES

    def by_status(self, status: str) -> list[str]:
        """Node ids with this status, sorted."""
        return sorted(k for k, v in self.statuses.items() if v == status)


def junit_key(nodeid: str) -> str:
    """The dotted `classname::name` JUnit uses for a pytest node id (`a/test_x.py::C::t[1]` → `a.test_x.C::t[1]`)."""
    if "::" not in nodeid:
        return nodeid
    path, rest = nodeid.split("::", 1)
    parts = rest.split("::")
    mod = path[:-3] if path.endswith(".py") else path
    mod = mod.replace("/", ".").replace("\\", ".")
    return ".".join([mod, *parts[:-1]]) + "::" + parts[-1]


def lookup(statuses: dict[str, str], nodeid: str) -> str | None:
    """Find a test's status by exact node id, else by its JUnit key."""
    if nodeid in statuses:
        return statuses[nodeid]
    return statuses.get(junit_key(nodeid))


def _merge(cur: str | None, when: str, outcome: str, xfail: bool) -> str | None:
    """Fold one phase report into a test's status the way pytest's own summary does."""
    if outcome == "failed":
        if when == "call":
            # a strict xpass is reported as failed with wasxfail set; call it what it is
            return XPASS if xfail else FAILED
        return ERROR if cur in (None, PASSED, XFAIL, XPASS, SKIPPED) or cur == ERROR else cur
    if outcome == "skipped":
        if cur is None or when in ("setup", "call"):
            return XFAIL if xfail else SKIPPED
        return cur
    # passed
    if when == "call":
        return XPASS if xfail else PASSED
    return cur


def parse_reporter_lines(text: str) -> TestResults:
    """Fold the JSON lines written by REPORTER_PLUGIN into per-test statuses."""
    res = TestResults(source="reporter")
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        nodeid, when, outcome = rec.get("nodeid", ""), rec.get("when", ""), rec.get("outcome", "")
        if when == "collect":
            res.collect_errors.append(nodeid)
            if rec.get("longrepr"):
                res.failure_text[nodeid] = rec["longrepr"]
            continue
        new = _merge(res.statuses.get(nodeid), when, outcome, bool(rec.get("xfail")))
        if new is not None:
            res.statuses[nodeid] = new
        if rec.get("longrepr"):
            res.failure_text[nodeid] = rec["longrepr"]
    return res


def parse_junit_xml(xml_text: str | bytes) -> TestResults:
    """Per-test statuses from a `--junitxml` report, keyed by `junit_key` form (or node id when `file` is given)."""
    res = TestResults(source="junit")
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError:
        return res
    for tc in root.iter("testcase"):
        cls, name = tc.get("classname", ""), tc.get("name", "")
        key = f"{cls}::{name}" if cls else name
        status = PASSED
        for child in tc:
            tag = child.tag
            if tag == "failure":
                status = FAILED
                res.failure_text[key] = (child.get("message") or "") + "\n" + (child.text or "")
            elif tag == "error":
                # an error in setup/teardown; when the test also failed, the failure is the headline
                status = ERROR if status != FAILED else status
                res.failure_text.setdefault(key, (child.get("message") or "") + "\n" + (child.text or ""))
            elif tag == "skipped":
                status = XFAIL if (child.get("type") == "pytest.xfail") else SKIPPED
        if not cls and not name:
            continue
        if not cls:
            # pytest reports collection errors as a testcase with an empty classname
            res.collect_errors.append(name)
            continue
        res.statuses[key] = status
    return res


_SUMMARY_LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(.*)$")
_VERBOSE_LINE = re.compile(r"^(.+?::.+?)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?:\s+\[\s*\d+%\])?\s*$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _split_nodeid(rest: str, known: Iterable[str] | None) -> str | None:
    """The node id at the start of `rest` (which may be followed by ' - message')."""
    if known is not None:
        best = None
        for k in known:
            matches = rest == k or rest.startswith(k + " - ") or rest.startswith(k + " ")
            if matches and (best is None or len(k) > len(best)):
                best = k
        if best is not None:
            return best
    if "::" not in rest:
        return None  # e.g. "SKIPPED [1] file.py:12: reason" names no test
    start = rest.find("[", rest.rfind("::"))
    if start != -1:
        # parametrized: ids may hold " - ", spaces and brackets; the id ends at the first "]" followed by
        # the " - message" separator, or is the whole line when no message follows
        j = rest.find("] - ", start)
        return rest[:j + 1] if j != -1 else rest.rstrip()
    return rest.split(" - ", 1)[0].rstrip()


def parse_pytest_log(log: str, known: Iterable[str] | None = None) -> TestResults:
    """Per-test statuses from pytest console output (`-rA` summary or `-v` lines); `known` ids match exactly."""
    res = TestResults(source="log")
    known_list = list(known) if known is not None else None
    for raw in log.splitlines():
        line = _ANSI.sub("", raw).rstrip()
        m = _SUMMARY_LINE.match(line)
        if m:
            nodeid = _split_nodeid(m.group(2), known_list)
            if nodeid:
                if m.group(1) == "ERROR" and not nodeid.count("::"):
                    res.collect_errors.append(nodeid)
                    continue
                status = _LOG_WORDS[m.group(1)]
                # the -rA summary is the final word: it overrides a status seen in verbose lines
                res.statuses[nodeid] = status
            continue
        m = _VERBOSE_LINE.match(line)
        if m and not line.startswith(("E ", "> ")):
            nodeid = m.group(1)
            if known_list is not None:
                exact = _split_nodeid(nodeid, known_list)
                nodeid = exact or nodeid
            res.statuses.setdefault(nodeid, _LOG_WORDS[m.group(2)])
        elif line.startswith("ERROR collecting ") or line.startswith("_ ERROR collecting "):
            res.collect_errors.append(line.split("ERROR collecting ", 1)[1].strip(" _"))
    return res


def summary_counts(log: str) -> dict[str, int]:
    """The closing '== 3 passed, 1 failed in 0.5s ==' line as counts (empty when absent)."""
    out: dict[str, int] = {}
    for line in reversed(log.splitlines()):
        line = _ANSI.sub("", line)
        if re.search(r"\b(passed|failed|error|errors|skipped|no tests ran)\b", line) and " in " in line:
            for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected)", line):
                out[word.rstrip("s") if word.startswith("error") else word] = int(n)
            if out or "no tests ran" in line:
                return out
    return out
