"""The settings model: precedence and sources, bad values, unknown variables, `shoal config`, the docs table,
and no stray SHOAL_* environment reads in src/."""

from __future__ import annotations

import ast
import json
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

from shoal import config
from shoal.config import InvalidSetting, NodeConfig, Paths, Settings, UnknownSettingWarning
from tests import srcast
from tests.unit.test_import_cycles import BAD_SETTINGS_ENV, fresh_import_results

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src" / "shoal"


@pytest.fixture(autouse=True)
def no_host_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A host's /etc/shoal/config.toml must not leak into these tests."""
    monkeypatch.setattr(config, "DEFAULT_CONFIG_FILE", tmp_path / "absent.toml")
    monkeypatch.delenv("SHOAL_CONFIG", raising=False)
    config.reset()


def write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


# ---- precedence and sources ------------------------------------------------------------------------
def test_defaults_when_nothing_is_set() -> None:
    s = Settings.load(env={})
    assert s.home == Path("/var/lib/shoal") and s.source("home") == "default"
    assert s.store == Path("/var/lib/shoal/store") and s.source("store") == "default"
    assert s.memory_overcommit == 1000.0 and s.reclaim is True and s.warm_pool == {}
    assert s.file is None and not s.is_set("memory_overcommit")


def test_precedence_default_file_env_argument(tmp_path: Path) -> None:
    f = write(tmp_path / "c.toml", "memory_overcommit = 5.0\nmin_free_mb = 100\nnode_id = 'f1'\nruntime = 'runc'\n")
    env = {"SHOAL_CONFIG": str(f), "SHOAL_MIN_FREE_MB": "200", "SHOAL_NODE_ID": "e1"}
    s = Settings.load(args={"node_id": "a1", "runtime": None}, env=env)
    assert (s.memory_overcommit, s.source("memory_overcommit")) == (5.0, f"file {f}")
    assert (s.min_free_mb, s.source("min_free_mb")) == (200, "env")
    assert (s.node_id, s.source("node_id")) == ("a1", "argument")
    assert (s.runtime, s.source("runtime")) == ("runc", f"file {f}")  # a None argument is "not given"
    assert (s.reclaim, s.source("reclaim")) == (True, "default")
    assert s.file == f and s.source("config") == "env"


def test_store_follows_home_unless_set(tmp_path: Path) -> None:
    assert Settings.load(env={"SHOAL_HOME": "/srv/h"}).store == Path("/srv/h/store")
    s = Settings.load(env={"SHOAL_HOME": "/srv/h", "SHOAL_STORE": "/mnt/st"})
    assert s.store == Path("/mnt/st") and s.source("store") == "env"
    f = write(tmp_path / "c.toml", "home = '/srv/f'\n")
    assert Settings.load(env={"SHOAL_CONFIG": str(f)}).store == Path("/srv/f/store")


def test_paths_from_env_arguments_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_HOME", "/srv/h")
    monkeypatch.delenv("SHOAL_STORE", raising=False)
    assert Paths.from_env() == Paths(Path("/srv/h"), Path("/srv/h/store"))
    assert Paths.from_env("/x") == Paths(Path("/x"), Path("/x/store"))  # the store follows the given home
    monkeypatch.setenv("SHOAL_STORE", "/mnt/st")
    assert Paths.from_env("/x") == Paths(Path("/x"), Path("/mnt/st"))
    assert Paths.from_env("/x", "/y") == Paths(Path("/x"), Path("/y"))


def test_default_file_is_read_when_present(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = write(tmp_path / "etc.toml", "warm_pool = { base = 3, 'py:3.12' = 1 }\nreclaim = false\n")
    monkeypatch.setattr(config, "DEFAULT_CONFIG_FILE", f)
    s = Settings.load(env={})
    assert s.warm_pool == {"base": 3, "py:3.12": 1} and s.reclaim is False and s.source("reclaim") == f"file {f}"
    assert Settings.load(env={"SHOAL_CONFIG": "/dev/null"}).reclaim is True  # /dev/null: no file


def test_empty_variable_means_unset_except_where_empty_is_a_value() -> None:
    s = Settings.load(env={"SHOAL_MEMORY_OVERCOMMIT": "", "SHOAL_FNCALL_PRELOAD": ""})
    assert s.memory_overcommit == 1000.0 and s.source("memory_overcommit") == "default"
    assert s.fncall_preload == () and s.source("fncall_preload") == "env"  # "preload nothing"
    assert Settings.load(env={}).fncall_preload is None


def test_typed_values_from_the_environment() -> None:
    s = Settings.load(env={"SHOAL_RECLAIM": "off", "SHOAL_VM_VERBOSE": "yes", "SHOAL_WARM_POOL": "base=16, py:3.12=4",
                           "SHOAL_FNCALL_PRELOAD": "json, re", "SHOAL_SANDBOX_SWAP": "NONE",
                           "SHOAL_RUNTIME": "GVISOR", "SHOAL_VM_BOOT_TIMEOUT": "45"})
    assert s.reclaim is False and s.vm_verbose is True
    assert s.warm_pool == {"base": 16, "py:3.12": 4} and s.fncall_preload == ("json", "re")
    assert s.sandbox_swap == "0" and s.runtime == "gvisor" and s.vm_boot_timeout == 45.0


def test_replace_checks_and_records_arguments() -> None:
    s = Settings.load(env={}).replace(api_port=9000)
    assert s.api_port == 9000 and s.source("api_port") == "argument" and s.source("api_host") == "default"
    with pytest.raises(InvalidSetting, match="SHOAL_API_PORT"):
        s.replace(api_port=70000)
    with pytest.raises(InvalidSetting, match="did you mean api_port"):
        s.replace(api_prot=1)


# ---- bad values ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("var", "value", "allowed"), [
    ("SHOAL_MEMORY_OVERCOMMIT", "lots", "must be a number > 0"),
    ("SHOAL_MEMORY_OVERCOMMIT", "0", "must be a number > 0"),
    ("SHOAL_MEMORY_OVERCOMMIT", "nan", "must be a number > 0"),
    ("SHOAL_MIN_FREE_MB", "1.5", "must be an integer ≥ 0"),
    ("SHOAL_RECLAIM", "maybe", "must be 1/true/yes/on or 0/false/no/off"),
    ("SHOAL_RUNTIME", "docker", "must be one of auto, crun, runc, gvisor"),
    ("SHOAL_WARM_POOL", "base", "must look like IMAGE=COUNT"),
    ("SHOAL_ZRAM_SWAP", "lots", "must be auto (half the RAM, at most 8G, when the host has no swap), off"),
    ("SHOAL_NODE_ID", "N 0", "1-32 characters of a-z, 0-9 and -"),
    ("SHOAL_API_PORT", "99999", "must be an integer ≥ 0 and ≤ 65535"),
    ("SHOAL_URL", "localhost:8700", "an http(s):// or ray:// URL"),
    ("SHOAL_FNCALL_PRELOAD", "json,no such", "Python module names"),
])
def test_bad_environment_value_names_variable_value_and_what_is_allowed(var: str, value: str, allowed: str) -> None:
    with pytest.raises(InvalidSetting) as ei:
        Settings.load(env={var: value})
    msg = str(ei.value)
    assert f"{var}={value!r}" in msg and "(from env)" in msg and allowed in msg, msg
    assert ei.value.details["setting"] == var


def test_bad_file_values_and_keys(tmp_path: Path) -> None:
    f = write(tmp_path / "c.toml", "memory_overcommit = 'lots'\n")
    with pytest.raises(InvalidSetting, match=rf"SHOAL_MEMORY_OVERCOMMIT='lots' \(from file {f}\)"):
        Settings.load(env={"SHOAL_CONFIG": str(f)})
    f.write_text("memory_overcomit = 8.0\n")
    with pytest.raises(InvalidSetting, match="'memory_overcomit' is not a setting; did you mean memory_overcommit"):
        Settings.load(env={"SHOAL_CONFIG": str(f)})
    f.write_text("config = '/elsewhere.toml'\n")  # the file cannot name another file
    with pytest.raises(InvalidSetting, match="'config' is not a setting"):
        Settings.load(env={"SHOAL_CONFIG": str(f)})
    f.write_text("reclaim = \n")
    with pytest.raises(InvalidSetting, match="not valid TOML"):
        Settings.load(env={"SHOAL_CONFIG": str(f)})
    with pytest.raises(InvalidSetting, match="does not exist"):
        Settings.load(env={"SHOAL_CONFIG": str(tmp_path / "missing.toml")})
    f.write_text("reclaim = 3\n")  # TOML types are checked too
    with pytest.raises(InvalidSetting, match="SHOAL_RECLAIM=3"):
        Settings.load(env={"SHOAL_CONFIG": str(f)})


def test_secret_value_is_not_echoed_in_errors_or_rows() -> None:
    s = Settings.load(env={"SHOAL_TOKEN": "shoal_abc_secret"})
    row = next(r for r in s.rows() if r["key"] == "token")
    assert row["value"] == "****" and s.token == "shoal_abc_secret"


def test_bad_value_fails_when_a_node_config_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_MEMORY_OVERCOMMIT", "lots")
    with pytest.raises(InvalidSetting, match="SHOAL_MEMORY_OVERCOMMIT"):
        NodeConfig()


# ---- unknown variables -----------------------------------------------------------------------------
def test_unknown_variable_warns_with_suggestion() -> None:
    with pytest.warns(UnknownSettingWarning, match="SHOAL_MEMORY_OVERCOMIT .*did you mean SHOAL_MEMORY_OVERCOMMIT"):
        s = Settings.load(env={"SHOAL_MEMORY_OVERCOMIT": "8"})
    assert s.memory_overcommit == 1000.0
    seen: list[str] = []
    Settings.load(env={"SHOAL_NOT_A_THING": "1"}, warn=seen.append)
    assert len(seen) == 1 and "SHOAL_NOT_A_THING is set but is not a shoal setting" in seen[0]
    assert "did you mean" not in seen[0]


def test_known_child_variables_and_other_prefixes_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Settings.load(env={"SHOAL_PYTEST_REPORT": "/x", "SHOAL_AGENT_NO_MEMFD": "1", "HOME": "/root",
                           "SHOAL_TEST_STORE": "/tmp/st"})


# ---- the accessor and the node's config ------------------------------------------------------------
def test_accessor_reloads_when_the_environment_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_VM_TCG_TB_MB", "64")
    first = config.settings()
    assert first.vm_tcg_tb_mb == 64 and config.settings() is first  # cached while nothing changes
    monkeypatch.setenv("SHOAL_VM_TCG_TB_MB", "32")
    assert config.settings().vm_tcg_tb_mb == 32


def test_node_config_reads_settings_when_made_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_MEMORY_OVERCOMMIT", "7.5")
    monkeypatch.setenv("SHOAL_WARM_POOL", "base=2")
    monkeypatch.setenv("SHOAL_SH", "1")
    c = NodeConfig()
    assert c.memory_overcommit == 7.5 and c.warm_pool == {"base": 2} and c.posix_sh is True
    assert NodeConfig(memory_overcommit=1.0).memory_overcommit == 1.0  # a constructor argument wins
    s = Settings.load(env={"SHOAL_HOME": "/srv/n", "SHOAL_MIN_FREE_MB": "64"})
    c = NodeConfig.from_settings(s, runtime="runc")
    assert c.paths == Paths(Path("/srv/n"), Path("/srv/n/store")) and c.min_free_memory_mb == 64
    assert c.runtime == "runc" and c.memory_overcommit == 1000.0


# ---- the model itself ------------------------------------------------------------------------------
def test_every_setting_is_documented_and_its_default_is_valid() -> None:
    s = Settings()
    for key, (_f, meta) in Settings.specs().items():
        assert meta.doc and meta.group in config.GROUPS, key
        default = getattr(s, key)
        if default is not None:
            assert meta.conv(default) == default, key
    assert not set(config.CHILD_VARIABLES) & {Settings.env_name(k) for k in Settings.specs()}


# ---- `shoal config` --------------------------------------------------------------------------------
def _cli(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str, str]:
    from shoal.cli.main import app

    r = CliRunner().invoke(app, args, env=env)
    return r.exit_code, r.stdout, r.stderr


def test_cli_config_json_reports_values_and_sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    f = write(tmp_path / "c.toml", "min_free_mb = 99\n")
    monkeypatch.setenv("SHOAL_CONFIG", str(f))
    monkeypatch.setenv("SHOAL_RECLAIM", "0")
    code, out, _ = _cli(["config", "--json"])
    assert code == 0
    data = json.loads(out)
    rows = {r["name"]: r for r in data["settings"]}
    assert data["config_file"] == str(f)
    assert (rows["SHOAL_RECLAIM"]["value"], rows["SHOAL_RECLAIM"]["source"]) == (False, "env")
    assert (rows["SHOAL_MIN_FREE_MB"]["value"], rows["SHOAL_MIN_FREE_MB"]["source"]) == (99, f"file {f}")
    assert rows["SHOAL_RUNTIME"]["source"] == "default" and rows["SHOAL_RUNTIME"]["default"] == "auto"
    assert len(rows) == len(Settings.specs())


def test_cli_config_group_changed_and_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_VM_ACCEL", "tcg")
    code, out, _ = _cli(["config", "--json", "--group", "vm"])
    assert code == 0 and {r["group"] for r in json.loads(out)["settings"]} == {"vm"}
    code, out, _ = _cli(["config", "--json", "--changed"])
    names = {r["name"] for r in json.loads(out)["settings"]}
    assert "SHOAL_VM_ACCEL" in names and "SHOAL_RUNTIME" not in names
    code, out, _ = _cli(["config", "--group", "vm"])
    assert code == 0 and "SHOAL_VM_ACCEL" in out and "tcg" in out and "env" in out
    code, _, err = _cli(["config", "--group", "nope"])
    assert code == 2 and "no settings group 'nope'" in err


def test_cli_stops_at_start_on_a_bad_value_and_warns_on_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_VM_ACCEL", "kvm")
    code, _, err = _cli(["config"])
    assert code == 2 and "SHOAL_VM_ACCEL='kvm'" in err and "must be one of auto, tcg" in err
    monkeypatch.delenv("SHOAL_VM_ACCEL")
    monkeypatch.setenv("SHOAL_ZRAM_SWP", "8G")
    code, _, err = _cli(["config", "--changed"])
    assert code == 0 and "SHOAL_ZRAM_SWP" in err and "did you mean SHOAL_ZRAM_SWAP" in err


# ---- docs ------------------------------------------------------------------------------------------
def test_docs_table_is_up_to_date(tmp_path: Path) -> None:
    doc = REPO / "docs" / "configuration.md"
    copy = tmp_path / "configuration.md"
    copy.write_text(doc.read_text())
    assert not config.update_docs(copy), (
        "docs/configuration.md is out of date with src/shoal/config.py: refresh it with "
        "`shoal config --markdown --update docs/configuration.md`")
    code, out, _ = _cli(["config", "--markdown"])
    assert code == 0 and out == config.markdown() and out in doc.read_text()
    for key in Settings.specs():
        assert f"`{Settings.env_name(key)}`" in out


# ---- no stray reads --------------------------------------------------------------------------------
def stray_reads(source: str | ast.Module) -> list[tuple[int, str]]:
    """(line, variable) of every SHOAL_* environment read in `source`: os.environ.get/[]/in, os.getenv, and
    helpers whose name mentions env called with a SHOAL_* name (module-level string constants resolved)."""
    tree = ast.parse(source) if isinstance(source, str) else source
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
              for t in n.targets if isinstance(t, ast.Name)}

    def name(e: ast.AST | None) -> str | None:
        v = e.value if isinstance(e, ast.Constant) else consts.get(e.id) if isinstance(e, ast.Name) else None
        return v if isinstance(v, str) and v.startswith("SHOAL_") else None

    def is_environ(e: ast.AST) -> bool:
        return (isinstance(e, ast.Attribute) and e.attr == "environ") or (isinstance(e, ast.Name)
                                                                          and e.id == "environ")

    out = []
    for n in ast.walk(tree):
        var = None
        if isinstance(n, ast.Call) and n.args:
            f = n.func
            fname = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            on_environ = isinstance(f, ast.Attribute) and is_environ(f.value) and fname in ("get", "pop")
            if on_environ or fname == "getenv" or "env" in fname.lower():
                var = name(n.args[0])
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Load) and is_environ(n.value):
            var = name(n.slice)
        elif isinstance(n, ast.Compare) and any(is_environ(c) for c in n.comparators):
            var = name(n.left)
        if var:
            out.append((n.lineno, var))
    return sorted(out)


def test_stray_read_checker_finds_every_form() -> None:
    src = ('import os\nfrom os import environ\nK = "SHOAL_K"\nos.environ.get("SHOAL_A")\nos.getenv("SHOAL_B")\n'
           'os.environ["SHOAL_C"]\n"SHOAL_D" in os.environ\n_env_float("SHOAL_E", 1.0)\nenviron.get(K)\n'
           'env = {}\nenv["SHOAL_W"] = "1"\nos.environ["SHOAL_W2"] = "1"\nos.environ.get("PATH")\n')
    assert [v for _, v in stray_reads(src)] == ["SHOAL_A", "SHOAL_B", "SHOAL_C", "SHOAL_D", "SHOAL_E", "SHOAL_K"]


def test_no_shoal_variable_is_read_outside_config() -> None:
    found = []
    for p in sorted(SRC.rglob("*.py")):
        if p == SRC / "config.py":
            continue
        found += [f"{p.relative_to(REPO)}:{line}: {var}" for line, var in stray_reads(srcast.tree(p))]
    assert not found, ("SHOAL_* variables read outside src/shoal/config.py (declare them in the Settings model and "
                       "read settings() instead):\n" + "\n".join(found))


def test_docs_python_example_runs_as_written(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    text = (REPO / "docs" / "configuration.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.delenv("SHOAL_MEMORY_OVERCOMMIT", raising=False)
    exec(compile(code, "docs/configuration.md", "exec"), {})
    assert capsys.readouterr().out.splitlines()[0] == "8.0 argument"


def test_docs_config_file_example_loads(tmp_path: Path) -> None:
    text = (REPO / "docs" / "configuration.md").read_text()
    f = write(tmp_path / "c.toml", text.split("```toml\n", 1)[1].split("```", 1)[0])
    s = Settings.load(env={"SHOAL_CONFIG": str(f)})
    assert s.store == Path("/mnt/moosefs/shoal-store") and s.warm_pool == {"base": 32, "py:3.12": 8}
    assert s.source("api_max_inflight") == f"file {f}"


def test_no_module_reads_settings_at_import() -> None:
    # a bad value must not break an import: settings are read when a node, server or command starts. Every
    # module is imported first in a fresh process with SHOAL_MEMORY_OVERCOMMIT=lots (the import-cycle test's
    # run, shared: importing ~270 modules twice cost the unit suite ~8 s)
    assert BAD_SETTINGS_ENV["SHOAL_MEMORY_OVERCOMMIT"] == "lots"
    with pytest.raises(InvalidSetting):
        Settings.load(env=BAD_SETTINGS_ENV)
    results = fresh_import_results()
    broken = {n: m for n, m in results.items() if m.startswith("error:")}
    assert not broken, "modules that fail to import with a bad setting:\n" + "\n".join(
        f"  {n}: {m}" for n, m in broken.items())
