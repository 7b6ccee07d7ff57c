"""Settings have one channel (issue 27, item 3): they are resolved once at an edge (CLI, server, cluster agent,
bench, a test) and injected — `NodeConfig.settings`, `NodeContext.settings` — so the node and its backends
never read the process's settings themselves, and no component configures another one through os.environ."""

from __future__ import annotations

import ast
from pathlib import Path

from shoal.config import NODE_SETTINGS, NodeConfig, Settings
from tests import srcast

SRC = Path(__file__).resolve().parents[2] / "src" / "shoal"


def _py_files(under: Path) -> list[Path]:
    return srcast.py_files(under)


def _settings_calls(path: Path) -> list[int]:
    """Lines calling `settings()` (the process-wide, environment-reading accessor of shoal.config) or
    `Settings.load()` (resolving them again)."""
    lines = []
    for node in srcast.nodes(path):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        bare = isinstance(f, ast.Name) and f.id == "settings"
        qualified = isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
            and (f.value.id, f.attr) in {("config", "settings"), ("Settings", "load")}
        if bare or qualified:
            lines.append(node.lineno)
    return lines


def test_node_and_backends_never_resolve_settings_themselves() -> None:
    offenders = [f"{p.relative_to(SRC)}:{n}" for d in ("node", "backends") for p in _py_files(SRC / d)
                 for n in _settings_calls(p)]
    assert not offenders, ("settings() called inside the node or a backend; read config.settings / ctx.settings "
                           "(resolved once at the edge) instead:\n" + "\n".join(offenders))


def test_the_scan_finds_a_settings_call(tmp_path: Path) -> None:
    # the rule above must be able to fail: a module that calls settings() is found
    bad = tmp_path / "bad.py"
    bad.write_text("from shoal.config import settings\n\ndef f():\n    return settings().home\n")
    assert _settings_calls(bad) == [4]


def test_node_config_is_derived_from_the_settings_it_is_given() -> None:
    s = Settings.load(env={"SHOAL_MEMORY_OVERCOMMIT": "3.5", "SHOAL_NODE_ID": "n7", "SHOAL_MIN_FREE_MB": "123",
                           "SHOAL_WARM_POOL": "base=2"})
    cfg = NodeConfig(settings=s)
    assert cfg.settings is s
    for field, key in NODE_SETTINGS.items():
        assert getattr(cfg, field) == getattr(s, key), field
    assert (cfg.memory_overcommit, cfg.node_id, cfg.min_free_memory_mb) == (3.5, "n7", 123)
    assert cfg.paths == s.paths()
    # an explicit field wins over its setting; the rest still come from the settings
    cfg2 = NodeConfig.from_settings(s, memory_overcommit=1000.0)
    assert cfg2.memory_overcommit == 1000.0 and cfg2.node_id == "n7"
    # the pool map is the node's own copy: changing it does not change the settings
    cfg.warm_pool["base"] = 9
    assert s.warm_pool == {"base": 2}
    # every NodeConfig field a setting feeds is named in the one table
    assert set(NODE_SETTINGS) <= {f for f in NodeConfig.__dataclass_fields__}
    assert set(NODE_SETTINGS.values()) <= set(Settings.specs())


#: modules that do write os.environ, and why that configures no other shoal component
ENVIRON_WRITERS = {
    # runs inside a sandbox as the user's interpreter: its environment is the user code's (per call)
    "backends/fncall_zygote.py": "in-sandbox zygote: the environment of the user's call",
    # third-party libraries read these switches at import or in processes they start themselves
    "integrations/minisweagent.py": "mini-swe-agent's own switch, read when it is imported",
    "cluster/raylink.py": "Ray's documented loopback switch, read when ray is imported",
    "cluster/local.py": "Ray's temp dir for the processes of a detached local cluster Ray starts",
}
_WRITE_METHODS = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
        and node.value.id == "os"


def _environ_writes(path: Path) -> list[int]:
    """Lines that change this process's environment: os.environ[k] = / del / .update(…) / os.putenv …"""
    lines = []
    for node in srcast.nodes(path):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        if any(isinstance(t, ast.Subscript) and _is_environ(t.value) for t in targets):
            lines.append(node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr in _WRITE_METHODS and _is_environ(f.value)) \
                    or (f.attr in {"putenv", "unsetenv"} and isinstance(f.value, ast.Name) and f.value.id == "os"):
                lines.append(node.lineno)
    return sorted(lines)


def test_no_component_is_configured_by_writing_os_environ() -> None:
    offenders = []
    for p in _py_files(SRC):
        rel = str(p.relative_to(SRC))
        if rel == "config.py" or rel in ENVIRON_WRITERS:
            continue
        offenders += [f"{rel}:{n}" for n in _environ_writes(p)]
    assert not offenders, ("os.environ written: pass Settings (NodeConfig(settings=…), Settings.replace, "
                           "config.use at an edge) or give a child process its own env instead:\n"
                           + "\n".join(offenders))
    # the exceptions still exist (an entry whose module stopped writing goes)
    for rel in ENVIRON_WRITERS:
        assert _environ_writes(SRC / rel), f"{rel} no longer writes os.environ: drop it from ENVIRON_WRITERS"


def test_the_environ_scan_finds_each_kind_of_write(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nos.environ['A'] = '1'\nos.environ.setdefault('B', '2')\ndel os.environ['A']\n"
                   "os.environ.update({})\nos.putenv('C', '3')\nx = os.environ.get('D')\n")
    assert _environ_writes(bad) == [2, 3, 4, 5, 6]
