"""Task formats: SWE-bench-style records and Harbor / Terminal-Bench task directories, with errors that
name the task and the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.rl.tasks import (
    DEFAULT_WORKDIR,
    HarborTask,
    SWETask,
    TaskError,
    dump_jsonl,
    load_harbor_dir,
    load_tasks,
    parse_test_list,
    patch_files,
)

TEST_PATCH = """diff --git a/tests/test_x.py b/tests/test_x.py
new file mode 100644
--- /dev/null
+++ b/tests/test_x.py
@@ -0,0 +1,2 @@
+def test_a():
+    assert True
"""
GOLD = """diff --git a/pkg/mod.py b/pkg/mod.py
--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -1 +1 @@
-x = 1
+x = 2
"""


def rec(**kw: object) -> dict:
    d = {"instance_id": "proj__fn-1", "image": "rl/task-x:abc", "problem_statement": "it is broken",
         "test_patch": TEST_PATCH, "patch": GOLD, "FAIL_TO_PASS": ["tests/test_x.py::test_a"],
         "PASS_TO_PASS": ["tests/test_y.py::test_b[1-2]"]}
    d.update(kw)
    return d


def test_swe_record_round_trip(tmp_path: Path) -> None:
    t = SWETask.from_dict(rec(repo="o/r", base_commit="abc", version="1.0"))
    assert t.id == "proj__fn-1" and t.workdir == DEFAULT_WORKDIR
    assert t.hidden_files == ["tests/test_x.py"]
    assert t.test_files == ["tests/test_x.py", "tests/test_y.py"]
    assert t.test_targets == t.test_files
    p = dump_jsonl([t], tmp_path / "t.jsonl")
    [back] = load_tasks(p)
    assert back == t


def test_json_encoded_test_lists_as_swe_bench_ships_them() -> None:
    t = SWETask.from_dict(rec(FAIL_TO_PASS=json.dumps(["a.py::t"]), PASS_TO_PASS="[]"))
    assert t.FAIL_TO_PASS == ["a.py::t"] and t.PASS_TO_PASS == []
    t = SWETask.from_dict(rec(test_directives=json.dumps(["a.py::t"])))
    assert t.test_targets == ["a.py::t"]


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"instance_id": None}, "instance_id", "required"),
    ({"instance_id": "has space"}, "instance_id", "letters"),
    ({"image": None}, "image", "required"),
    ({"image": "Bad Image"}, "image", "bad image"),
    ({"problem_statement": ""}, "problem_statement", "empty"),
    ({"problem_statement": 3}, "problem_statement", "string"),
    ({"test_patch": "not a diff"}, "test_patch", "unified diff"),
    ({"patch": "garbage"}, "patch", "unified diff"),
    ({"FAIL_TO_PASS": "[oops"}, "FAIL_TO_PASS", "not JSON"),
    ({"FAIL_TO_PASS": 7}, "FAIL_TO_PASS", "list"),
    ({"FAIL_TO_PASS": []}, "FAIL_TO_PASS", "at least one"),
    ({"FAIL_TO_PASS": ["a", "a"]}, "FAIL_TO_PASS", "more than once"),
    ({"PASS_TO_PASS": ["tests/test_x.py::test_a"]}, "PASS_TO_PASS", "also listed"),
    ({"workdir": "relative"}, "workdir", "absolute"),
    ({"timeout_s": -1}, "timeout_s", "seconds"),
    ({"env": {"A": 1}}, "env", "strings"),
])
def test_swe_validation_names_task_and_field(change: dict, field: str, words: str) -> None:
    with pytest.raises(TaskError) as ei:
        SWETask.from_dict(rec(**change), source="tasks.jsonl:3")
    msg = ei.value.message
    assert f"field {field!r}" in msg and words in msg, msg
    if change.get("instance_id", "x") is not None:
        assert "proj__fn-1" in msg or field == "instance_id"
    assert "tasks.jsonl:3" in msg


def test_image_template_fills_the_image() -> None:
    r = rec()
    del r["image"]
    t = SWETask.from_dict(r, image_template="sweb.eval.{instance_id}")
    assert t.image == "sweb.eval.proj__fn-1"


def test_jsonl_errors_carry_the_line(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(rec()) + "\n\n{broken\n")
    with pytest.raises(TaskError, match=r"t.jsonl:3: not valid JSON"):
        load_tasks(p)
    p.write_text(json.dumps(rec()) + "\n" + json.dumps(rec(FAIL_TO_PASS=5)) + "\n")
    with pytest.raises(TaskError, match=r"t.jsonl:2.*FAIL_TO_PASS"):
        load_tasks(p)
    p.write_text(json.dumps(rec()) + "\n" + json.dumps(rec()) + "\n")
    with pytest.raises(TaskError, match="unique"):
        load_tasks(p)
    with pytest.raises(TaskError, match="no such file"):
        load_tasks(tmp_path / "missing.jsonl")


def test_json_list_file(tmp_path: Path) -> None:
    p = tmp_path / "t.json"
    p.write_text(json.dumps([rec(), rec(instance_id="two")]))
    assert [t.id for t in load_tasks(p)] == ["proj__fn-1", "two"]


def make_harbor(d: Path, toml: str = 'version = "1.0"\n[environment]\nimage = "base"\n[verifier]\ntimeout_sec = 30\n',
                instruction: str = "Write 42 to /tmp/answer.\n") -> Path:
    (d / "tests").mkdir(parents=True)
    (d / "task.toml").write_text(toml)
    if instruction is not None:
        (d / "instruction.md").write_text(instruction)
    (d / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    (d / "solution").mkdir()
    (d / "solution" / "solve.sh").write_text("echo 42 > /tmp/answer\n")
    return d


def test_harbor_dir(tmp_path: Path) -> None:
    t = load_harbor_dir(make_harbor(tmp_path / "answer-42"))
    assert isinstance(t, HarborTask)
    assert (t.id, t.image, t.verifier_timeout_s, t.agent_timeout_s) == ("answer-42", "base", 30.0, 600.0)
    assert t.solution.startswith("echo 42")
    assert list(t.test_files()) == ["test.sh"]
    # a directory of task directories
    make_harbor(tmp_path / "second")
    assert sorted(x.id for x in load_tasks(tmp_path)) == ["answer-42", "second"]


def test_harbor_errors(tmp_path: Path) -> None:
    d = make_harbor(tmp_path / "noimg", toml='[environment]\ncpus = 1\n')
    (d / "environment").mkdir()
    with pytest.raises(TaskError, match=r"environment\.image.*Dockerfile"):
        load_harbor_dir(d)
    d = make_harbor(tmp_path / "noins", instruction=None)
    with pytest.raises(TaskError, match=r"instruction\.md"):
        load_harbor_dir(d)
    d = make_harbor(tmp_path / "badtoml", toml="[environment\n")
    with pytest.raises(TaskError, match="not valid TOML"):
        load_harbor_dir(d)
    d = make_harbor(tmp_path / "badmem", toml='[environment]\nimage = "base"\nmemory_mb = 1\n')
    with pytest.raises(TaskError, match="memory_mb"):
        load_harbor_dir(d)
    d = make_harbor(tmp_path / "gigs", toml='[environment]\nimage = "base"\nmemory = "2G"\n')
    assert load_harbor_dir(d).memory_mb == 2048
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError, match="found no tasks"):
        load_tasks(tmp_path / "empty")


def test_terminal_bench_yaml(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    d = tmp_path / "tb"
    (d / "tests").mkdir(parents=True)
    (d / "task.yaml").write_text("instruction: |\n  do it\nimage: base\nmax_test_timeout_sec: 20\n")
    (d / "run-tests.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    t = load_harbor_dir(d)
    assert (t.instruction.strip(), t.test_script, t.verifier_timeout_s) == ("do it", "run-tests.sh", 20.0)


def test_patch_files_and_parse_test_list() -> None:
    assert patch_files(GOLD + TEST_PATCH) == ["pkg/mod.py", "tests/test_x.py"]
    assert parse_test_list(None) == [] and parse_test_list("") == []
    assert parse_test_list(' ["a::b"] ') == ["a::b"]


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["instance_id", "image", "problem_statement", "test_patch", "patch",
                                        "FAIL_TO_PASS", "PASS_TO_PASS", "workdir", "timeout_s", "env"]),
                       st.one_of(st.none(), st.text(max_size=20), st.integers(), st.lists(st.text(max_size=5)),
                                 st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))))
def test_arbitrary_records_fail_only_with_task_errors(d: dict) -> None:
    base = rec()
    base.update(d)
    try:
        SWETask.from_dict(base)
    except TaskError as e:
        assert "field" in e.message or "task" in e.message


def test_adapters_find_task_ids_in_the_rl_tasks_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.rl.adapters._common import resolve_task

    t = SWETask.from_dict(rec())
    p = dump_jsonl([t], tmp_path / "t.jsonl")
    monkeypatch.setenv("SHOAL_RL_TASKS", str(p))  # what a trainer's launcher sets for its workers
    assert resolve_task(task_id="proj__fn-1") == t
