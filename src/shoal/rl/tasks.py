"""Task formats an RL trainer already has, loaded and validated with errors that name the task and field.

Two kinds:

* `SWETask` — SWE-bench style: a repository at `base_commit` inside `image`, a `problem_statement`, the
  reference fix `patch`, the hidden `test_patch`, and the test ids `FAIL_TO_PASS` / `PASS_TO_PASS`
  (JSON lists, or JSON-encoded strings as SWE-bench ships them). Graded from the agent's diff in a fresh
  sandbox (see `shoal.rl.grader`).
* `HarborTask` — Harbor / Terminal-Bench style: an `instruction`, an environment image, a `tests/`
  directory uploaded only after the agent finishes, whose `test.sh` writes a reward file. Graded in the
  agent's own sandbox, since the final state is what is judged.

Sources: a JSONL file (one task per line), a JSON file holding a list, a Harbor task directory
(`task.toml` + `instruction.md` + `tests/`), a Terminal-Bench task directory (`task.yaml` +
`run-tests.sh` + `tests/`), or a directory of any of these.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shoal.errors import InvalidRequest

#: where a SWE task's repository lives when the task does not say (SWE-bench's images use /testbed)
DEFAULT_WORKDIR = "/testbed"
#: how hidden tests are run when a task gives no `test_cmd` (test files are appended)
DEFAULT_TEST_CMD = "python3 -m pytest -rA --tb=short -p no:cacheprovider"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/@+-]{0,199}$")


class TaskError(InvalidRequest):
    """A task (or task file) is malformed; the message names the task, the field and what to do."""

    code = "task_error"


def _where(task_id: str | None, source: str | None) -> str:
    parts = []
    if task_id:
        parts.append(f"task {task_id!r}")
    if source:
        parts.append(f"({source})")
    return " ".join(parts) or "task"


def _err(task_id: str | None, source: str | None, fld: str, msg: str) -> TaskError:
    return TaskError(f"{_where(task_id, source)}: field {fld!r}: {msg}", task=task_id, field=fld, source=source)


def parse_test_list(value: Any, *, task_id: str | None = None, fld: str = "FAIL_TO_PASS",
                    source: str | None = None) -> list[str]:
    """A list of test ids from a JSON list or a JSON-encoded string of one (SWE-bench ships the latter)."""
    if value is None:
        return []
    if isinstance(value, str):
        s = value.strip()
        if not s:
            return []
        try:
            value = json.loads(s)
        except json.JSONDecodeError as e:
            raise _err(task_id, source, fld, f"is a string but not JSON ({e.msg} at char {e.pos}); "
                                             'give a list like ["tests/test_x.py::test_y"]') from None
    if not isinstance(value, list):
        raise _err(task_id, source, fld, f"expected a list of test ids, got {type(value).__name__}")
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, str) or not t.strip():
            raise _err(task_id, source, fld, f"item {i} must be a non-empty string (a pytest node id), got {t!r}")
        out.append(t.strip())
    if len(set(out)) != len(out):
        dup = sorted({t for t in out if out.count(t) > 1})[:3]
        raise _err(task_id, source, fld, f"lists the same test more than once: {dup}")
    return out


def patch_files(patch: str) -> list[str]:
    """Paths (relative to the repository root) a unified diff touches, in order, without duplicates."""
    out: list[str] = []
    for line in patch.splitlines():
        path = None
        if line.startswith("diff --git "):
            m = re.match(r"diff --git a/(.+?) b/(.+)$", line)
            if m:
                path = m.group(2)
        elif line.startswith("+++ ") or line.startswith("--- "):
            p = line[4:].split("\t")[0].strip()
            if p != "/dev/null" and p[:2] in ("a/", "b/"):
                path = p[2:]
        if path and path not in out:
            out.append(path)
    return out


def _looks_like_patch(patch: str) -> bool:
    return bool(re.search(r"^(diff --git |--- \S)", patch, re.M)) and bool(re.search(r"^@@ ", patch, re.M))


@dataclass
class SWETask:
    """A SWE-bench-style task: fix the repository so the hidden tests pass."""

    instance_id: str
    image: str
    problem_statement: str
    test_patch: str
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str] = field(default_factory=list)
    patch: str = ""
    repo: str = ""
    base_commit: str = ""
    version: str = ""
    hints_text: str = ""
    workdir: str = DEFAULT_WORKDIR
    test_cmd: str = DEFAULT_TEST_CMD
    #: what to pass to test_cmd (SWE-bench's "test directives"); empty: the test files (see `test_targets`)
    test_directives: list[str] = field(default_factory=list)
    timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)

    kind = "swe"

    @property
    def id(self) -> str:
        """The task's id (`instance_id`)."""
        return self.instance_id

    @property
    def hidden_files(self) -> list[str]:
        """Files the hidden test patch adds or changes (never shown to the agent)."""
        return patch_files(self.test_patch)

    @property
    def test_files(self) -> list[str]:
        """Test files to run when grading: those of the named tests, then those the test patch touches."""
        out: list[str] = []
        for t in self.FAIL_TO_PASS + self.PASS_TO_PASS:
            f = t.split("::", 1)[0]
            if "::" in t and f not in out:
                out.append(f)
        for f in self.hidden_files:
            if f not in out and _is_test_file(f):
                out.append(f)
        return out

    @property
    def test_targets(self) -> list[str]:
        """The arguments the grader passes to test_cmd: the directives if given, else the test files."""
        return list(self.test_directives) or self.test_files

    def prompt(self) -> str:
        """What the agent is told at the start of an episode."""
        return (f"{self.problem_statement.rstrip()}\n\n"
                f"The repository is checked out at {self.workdir}. Edit the code so the problem is solved; "
                "do not edit the tests. When you are done, submit: your changes to the repository are "
                "your answer.")

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (SWE-bench field names; FAIL_TO_PASS/PASS_TO_PASS as lists)."""
        d = asdict(self)
        d["kind"] = "swe"
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str | None = None, image_template: str | None = None,
                  defaults: dict[str, Any] | None = None) -> SWETask:
        """Validate a SWE-bench-style record; TaskError names the task and the field at fault."""
        if not isinstance(d, dict):
            raise TaskError(f"{_where(None, source)}: expected a JSON object, got {type(d).__name__}")
        d = {**(defaults or {}), **d}
        tid = d.get("instance_id")
        if not isinstance(tid, str) or not _ID.match(tid):
            raise _err(tid if isinstance(tid, str) else None, source, "instance_id",
                       "required: a string of letters, digits and . _ / @ + - (at most 200 chars)")

        def text(name: str, required: bool = False) -> str:
            v = d.get(name)
            if v is None:
                if required:
                    raise _err(tid, source, name, "required")
                return ""
            if not isinstance(v, str):
                raise _err(tid, source, name, f"expected a string, got {type(v).__name__}")
            if required and not v.strip():
                raise _err(tid, source, name, "must not be empty")
            return v

        image = d.get("image") or (image_template.format(**{k: v for k, v in d.items() if isinstance(v, str)})
                                   if image_template else None)
        if not image:
            raise _err(tid, source, "image", "required: the shoal image holding the repository at base_commit "
                                             "(or pass image_template=, e.g. 'sweb.eval.{instance_id}')")
        if not isinstance(image, str):
            raise _err(tid, source, "image", f"expected an image reference string, got {type(image).__name__}")
        from shoal.images.refs import parse_ref

        try:
            parse_ref(image)
        except InvalidRequest as e:
            raise _err(tid, source, "image", e.message) from None
        statement = text("problem_statement", required=True)
        test_patch = text("test_patch", required=True)
        if not _looks_like_patch(test_patch):
            raise _err(tid, source, "test_patch", "is not a unified diff (no file header and @@ hunk found)")
        patch = text("patch")
        if patch.strip() and not _looks_like_patch(patch):
            raise _err(tid, source, "patch", "is not a unified diff (no file header and @@ hunk found)")
        f2p = parse_test_list(d.get("FAIL_TO_PASS"), task_id=tid, fld="FAIL_TO_PASS", source=source)
        if not f2p:
            raise _err(tid, source, "FAIL_TO_PASS", "must name at least one test the fix makes pass")
        p2p = parse_test_list(d.get("PASS_TO_PASS"), task_id=tid, fld="PASS_TO_PASS", source=source)
        both = set(f2p) & set(p2p)
        if both:
            raise _err(tid, source, "PASS_TO_PASS", f"also listed in FAIL_TO_PASS: {sorted(both)[:3]}")
        workdir = text("workdir") or DEFAULT_WORKDIR
        if not workdir.startswith("/"):
            raise _err(tid, source, "workdir", f"must be an absolute path inside the image, got {workdir!r}")
        timeout = d.get("timeout_s", 300.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
            raise _err(tid, source, "timeout_s", f"must be seconds in (0, 86400], got {timeout!r}")
        env = d.get("env") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise _err(tid, source, "env", "must map variable names to strings")
        meta = d.get("metadata") or {}
        if not isinstance(meta, dict):
            raise _err(tid, source, "metadata", "must be an object")
        directives = parse_test_list(d.get("test_directives"), task_id=tid, fld="test_directives", source=source)
        return cls(instance_id=tid, image=image, problem_statement=statement, test_patch=test_patch,
                   FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, patch=patch, repo=text("repo"),
                   base_commit=text("base_commit"), version=str(d.get("version") or ""),
                   hints_text=text("hints_text"), workdir=workdir,
                   test_cmd=text("test_cmd") or DEFAULT_TEST_CMD, test_directives=directives,
                   timeout_s=float(timeout), env=dict(env),
                   metadata=dict(meta))


def _is_test_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


@dataclass
class HarborTask:
    """A Harbor / Terminal-Bench-style task: follow the instruction; `tests/` judge the final state."""

    task_id: str
    instruction: str
    image: str
    tests_dir: Path
    test_script: str = "test.sh"
    solution: str = ""
    agent_timeout_s: float = 600.0
    verifier_timeout_s: float = 300.0
    workdir: str | None = None
    cpus: float = 1.0
    memory_mb: int = 1024
    network: bool = False
    verifier_env: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    #: the task's environment/ when `image` is built from its Dockerfile (on first use, by content)
    environment_dir: Path | None = None

    kind = "harbor"

    @property
    def id(self) -> str:
        """The task's id (its directory name unless task.toml names it)."""
        return self.task_id

    def prompt(self) -> str:
        """What the agent is told at the start of an episode."""
        return self.instruction.rstrip() + "\n"

    def test_files(self) -> dict[str, bytes]:
        """Every file under `tests/` (relative path → bytes), read when grading, never before."""
        out = {}
        for p in sorted(self.tests_dir.rglob("*")):
            if p.is_file():
                out[p.relative_to(self.tests_dir).as_posix()] = p.read_bytes()
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form."""
        d = asdict(self)
        d["tests_dir"] = str(self.tests_dir)
        d["environment_dir"] = str(self.environment_dir) if self.environment_dir else None
        d["kind"] = "harbor"
        return d


Task = SWETask | HarborTask


def _num(tid: str, source: str, fld: str, v: Any, default: float) -> float:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 7 * 86400:
        raise _err(tid, source, fld, f"must be a positive number of seconds, got {v!r}")
    return float(v)


def load_harbor_dir(path: str | Path, *, default_image: str | None = None) -> HarborTask:
    """Load one Harbor (`task.toml`) or Terminal-Bench (`task.yaml`) task directory."""
    d = Path(path)
    tid = d.name
    if (d / "task.toml").is_file():
        return _load_harbor_toml(d, tid, default_image)
    if (d / "task.yaml").is_file():
        return _load_tbench_yaml(d, tid, default_image)
    raise TaskError(f"{_where(tid, str(d))}: not a task directory: expected task.toml (Harbor) "
                    "or task.yaml (Terminal-Bench)", task=tid, source=str(d))


def _image_from(env: dict[str, Any], tid: str, src: str, default_image: str | None, d: Path) -> str:
    image = env.get("image") or env.get("docker_image") or default_image
    if not image and (d / "environment" / "Dockerfile").is_file():
        # built from environment/Dockerfile as a shoal recipe the first time an episode needs it
        from shoal.images.dockerfile import dockerfile_digest, dockerfile_image_ref

        return dockerfile_image_ref(tid, dockerfile_digest(d / "environment"))
    if not image:
        raise _err(tid, src, "environment.image", "required: the shoal image the agent works in (`docker_image`), "
                                                  "or an environment/Dockerfile")
    if not isinstance(image, str):
        raise _err(tid, src, "environment.image", "must be a string")
    from shoal.images.refs import parse_ref

    try:
        parse_ref(image)
    except InvalidRequest as e:
        raise _err(tid, src, "environment.image", e.message) from None
    return image


def _network(env: dict[str, Any]) -> bool:
    """Harbor's `network_mode` ("public", "allowlist", "no-network"), or the older `allow_internet`."""
    mode = env.get("network_mode")
    if isinstance(mode, str):
        return mode != "no-network"
    return bool(env.get("allow_internet", env.get("network", False)))


def _load_harbor_toml(d: Path, tid: str, default_image: str | None) -> HarborTask:
    src = str(d / "task.toml")
    try:
        cfg = tomllib.loads((d / "task.toml").read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise TaskError(f"{_where(tid, src)}: task.toml is not valid TOML: {e}", task=tid, source=src) from None
    meta = cfg.get("metadata") or {}
    tid = str(cfg.get("name") or meta.get("name") or tid)
    ins_path = d / "instruction.md"
    if not ins_path.is_file():
        raise _err(tid, src, "instruction", "missing instruction.md next to task.toml")
    instruction = ins_path.read_text()
    if not instruction.strip():
        raise _err(tid, src, "instruction", "instruction.md is empty")
    tests = d / "tests"
    if not (tests / "test.sh").is_file():
        raise _err(tid, src, "tests", "missing tests/test.sh (the verifier that writes /logs/verifier/reward.txt)")
    env = cfg.get("environment") or {}
    if not isinstance(env, dict):
        raise _err(tid, src, "environment", "must be a table")
    image = _image_from(env, tid, src, default_image, d)
    agent = cfg.get("agent") or {}
    verifier = cfg.get("verifier") or {}
    venv = verifier.get("env") or {}
    if not isinstance(venv, dict):
        raise _err(tid, src, "verifier.env", "must be a table of strings")
    mem = env.get("memory_mb", env.get("memory", 1024))
    if isinstance(mem, str):
        m = re.match(r"^(\d+)\s*([MG])", mem, re.I)
        mem = int(m.group(1)) * (1024 if m.group(2).upper() == "G" else 1) if m else None
    if not isinstance(mem, int) or isinstance(mem, bool) or not 16 <= mem <= 1 << 20:
        raise _err(tid, src, "environment.memory_mb", f"must be MiB between 16 and 1048576, got {mem!r}")
    cpus = env.get("cpus", 1)
    if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not 0 < cpus <= 256:
        raise _err(tid, src, "environment.cpus", f"must be a number of CPUs, got {cpus!r}")
    sol = d / "solution" / "solve.sh"
    return HarborTask(
        task_id=tid, instruction=instruction, image=image, tests_dir=tests, test_script="test.sh",
        solution=sol.read_text() if sol.is_file() else "",
        agent_timeout_s=_num(tid, src, "agent.timeout_sec", agent.get("timeout_sec"), 600.0),
        verifier_timeout_s=_num(tid, src, "verifier.timeout_sec", verifier.get("timeout_sec"), 300.0),
        workdir=env.get("workdir"), cpus=float(cpus), memory_mb=mem,
        network=_network(env),
        environment_dir=(d / "environment") if not (env.get("image") or env.get("docker_image") or default_image)
        and (d / "environment" / "Dockerfile").is_file() else None,
        verifier_env={str(k): str(v) for k, v in venv.items()},
        metadata=dict(meta) if isinstance(meta, dict) else {})


def _load_tbench_yaml(d: Path, tid: str, default_image: str | None) -> HarborTask:
    src = str(d / "task.yaml")
    try:
        import yaml
    except ImportError:
        raise TaskError(f"{_where(tid, src)}: reading task.yaml needs PyYAML: pip install pyyaml",
                        task=tid, source=src) from None
    try:
        cfg = yaml.safe_load((d / "task.yaml").read_text()) or {}
    except yaml.YAMLError as e:
        raise TaskError(f"{_where(tid, src)}: task.yaml is not valid YAML: {e}", task=tid, source=src) from None
    if not isinstance(cfg, dict):
        raise TaskError(f"{_where(tid, src)}: task.yaml must hold a mapping", task=tid, source=src)
    instruction = cfg.get("instruction") or cfg.get("descriptions", [{}])[0].get("description", "")
    if not isinstance(instruction, str) or not instruction.strip():
        raise _err(tid, src, "instruction", "required and must be non-empty")
    if not (d / "run-tests.sh").is_file():
        raise _err(tid, src, "run-tests.sh", "missing: Terminal-Bench tasks run their tests with run-tests.sh")
    # Terminal-Bench keeps the script beside tests/; upload both together, the script at the top
    image = _image_from(cfg, tid, src, default_image, d)
    sol = d / "solution.sh"
    return HarborTask(
        task_id=tid, instruction=instruction, image=image, tests_dir=d, test_script="run-tests.sh",
        solution=sol.read_text() if sol.is_file() else "",
        agent_timeout_s=_num(tid, src, "max_agent_timeout_sec", cfg.get("max_agent_timeout_sec"), 600.0),
        verifier_timeout_s=_num(tid, src, "max_test_timeout_sec", cfg.get("max_test_timeout_sec"), 300.0),
        metadata={k: cfg[k] for k in ("difficulty", "category", "tags", "author_email") if k in cfg})


def _records_from_file(p: Path) -> Iterable[tuple[dict[str, Any], str]]:
    text = p.read_text()
    if p.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TaskError(f"{p}: not valid JSON: {e.msg} at line {e.lineno}", source=str(p)) from None
        if isinstance(data, dict):
            data = [data]
        if not isinstance(data, list):
            raise TaskError(f"{p}: expected a list of task objects", source=str(p))
        for i, rec in enumerate(data):
            yield rec, f"{p} item {i}"
        return
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("//"):
            continue
        try:
            yield json.loads(line), f"{p}:{n}"
        except json.JSONDecodeError as e:
            raise TaskError(f"{p}:{n}: not valid JSON ({e.msg} at column {e.colno}); "
                            "a JSONL file holds one JSON object per line", source=f"{p}:{n}") from None


def task_from_dict(d: dict[str, Any], *, source: str | None = None, image_template: str | None = None) -> Task:
    """Build a task from a JSON record (`kind` "swe" — the default — or "harbor")."""
    if isinstance(d, dict) and d.get("kind") == "harbor":
        tid = str(d.get("task_id") or "")
        if not d.get("tests_dir"):
            raise _err(tid, source, "tests_dir", "required for harbor tasks given as JSON")
        t = HarborTask(**{k: v for k, v in d.items() if k != "kind" and k in HarborTask.__dataclass_fields__})
        t.tests_dir = Path(t.tests_dir)
        t.environment_dir = Path(t.environment_dir) if t.environment_dir else None
        if not (t.tests_dir / t.test_script).is_file():
            raise _err(tid, source, "tests_dir", f"{t.tests_dir / t.test_script} does not exist")
        return t
    return SWETask.from_dict(d, source=source, image_template=image_template)


def load_tasks(path: str | Path, *, image_template: str | None = None, default_image: str | None = None) -> list[Task]:
    """Load tasks from a JSONL/JSON file, a task directory, or a directory of those; ids must be unique."""
    p = Path(path)
    if not p.exists():
        raise TaskError(f"{p}: no such file or directory", source=str(p))
    tasks: list[Task] = []
    if p.is_file():
        for rec, src in _records_from_file(p):
            tasks.append(task_from_dict(rec, source=src, image_template=image_template))
    elif (p / "task.toml").is_file() or (p / "task.yaml").is_file():
        tasks.append(load_harbor_dir(p, default_image=default_image))
    else:
        for child in sorted(p.iterdir()):
            if child.is_dir() and ((child / "task.toml").is_file() or (child / "task.yaml").is_file()):
                tasks.append(load_harbor_dir(child, default_image=default_image))
            elif child.is_file() and child.suffix in (".jsonl", ".json"):
                tasks.extend(load_tasks(child, image_template=image_template))
        if not tasks:
            raise TaskError(f"{p}: found no tasks (expected *.jsonl, *.json, or task directories with "
                            "task.toml / task.yaml)", source=str(p))
    seen: dict[str, int] = {}
    for t in tasks:
        seen[t.id] = seen.get(t.id, 0) + 1
    dups = [k for k, n in seen.items() if n > 1]
    if dups:
        raise TaskError(f"{p}: task ids must be unique; repeated: {dups[:5]}", source=str(p))
    return tasks


def dump_jsonl(tasks: Iterable[Task], path: str | Path) -> Path:
    """Write tasks as JSONL (atomically)."""
    from shoal.fsutil import atomic_write

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(json.dumps(t.to_dict(), sort_keys=True) + "\n" for t in tasks)
    atomic_write(p, data.encode())
    return p
