"""SandboxFusion's languages on shoal's fncall backend: go, java, nodejs, typescript, rust, pytest next to python,
cpp, c and bash — through SandboxFusion's own client (`sandbox-fusion` from PyPI) against `shoal fncall serve`,
through verl's unmodified reward module, and warm-pooled like python. A language shoal does not run answers
SandboxFusion's 422, so neither the client nor verl can take it for code that ran.

The first test builds the image these languages run in (`fncall-langs`, ~1 GB of Debian packages) when the
store lacks it: a few minutes, once per store."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.frameworks import framework_file
from tests.integration.test_fncall_fusion import FusionServer

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(1200)]

#: (language, A+B program reading two integers from stdin) — what RL code tasks look like
PROGRAMS = {
    "python": "a, b = map(int, input().split())\nprint(a + b)\n",
    "bash": "read a b\necho $((a + b))\n",
    "cpp": "#include <iostream>\nint main(){long a,b; std::cin>>a>>b; std::cout<<a+b<<std::endl;}\n",
    "go": 'package main\n\nimport "fmt"\n\nfunc main() {\n\tvar a, b int\n\tfmt.Scan(&a, &b)\n'
          '\tfmt.Println(a + b)\n}\n',
    "java": "import java.util.*;\npublic class Main {\n  public static void main(String[] args) {\n"
            "    Scanner s = new Scanner(System.in);\n    long a = s.nextLong(), b = s.nextLong();\n"
            "    System.out.println(a + b);\n  }\n}\n",
    "nodejs": "const [a, b] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\n"
              "console.log(a + b);\n",
    "typescript": "import * as fs from 'fs';\nconst [a, b]: number[] = fs.readFileSync(0, 'utf8').trim()"
                  ".split(/\\s+/).map(Number);\nconsole.log(a + b);\n",
    "rust": "use std::io::Read;\nfn main() {\n    let mut s = String::new();\n"
            "    std::io::stdin().read_to_string(&mut s).unwrap();\n"
            "    let v: Vec<i64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();\n"
            "    println!(\"{}\", v[0] + v[1]);\n}\n",
}
#: a program that fails at run time (exit status != 0) per language
FAILING = {
    "go": 'package main\n\nimport "os"\n\nfunc main() { os.Exit(3) }\n',
    "java": "public class Main { public static void main(String[] a) { throw new RuntimeException(\"boom\"); } }\n",
    "nodejs": "throw new Error('boom');\n",
    "typescript": "const n: number = 1;\nif (n) { throw new Error('boom'); }\n",
    "rust": "fn main() { std::process::exit(3); }\n",
}
#: a program that does not compile, for the languages with a compile step
NOT_COMPILING = {
    "go": "package main\n\nfunc main() { undefinedThing() }\n",
    "java": "public class Main { public static void main(String[] a) { int x = \"s\"; } }\n",
    "rust": "fn main() { let x: i32 = \"s\"; }\n",
    "cpp": "int main() { return x; }\n",
}
NEW = ("go", "java", "nodejs", "typescript", "rust")


@pytest.fixture(scope="module")
def langs_image(shoal_home: Path, base_image: str) -> str:
    """The image go/java/nodejs/typescript/rust/pytest run in (built once per store when missing)."""
    import asyncio

    from shoal.backends.fncall_image import ensure_fncall_image
    from shoal.backends.fncall_languages import LANGS_IMAGE
    from shoal.node.node import Node

    async def go() -> str:
        n = Node()
        await n.start(reap=False, reconcile=False)
        try:
            return await ensure_fncall_image(n, LANGS_IMAGE)
        finally:
            await n.stop()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def fusion(shoal_home: Path, langs_image: str) -> Iterator[FusionServer]:
    srv = FusionServer(shoal_home / "fusion-langs.log")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def sf(fusion: FusionServer):
    import sandbox_fusion

    sandbox_fusion.set_endpoint(fusion.url)
    return sandbox_fusion


@pytest.mark.parametrize("language", [*NEW, "python", "cpp", "bash"])
def test_sandbox_fusion_client_runs_each_language(sf, language: str) -> None:
    mapping = sf.SummaryMapping(CompileFailed="CE", RunFailed="RE", RunTimeout="TLE")
    ok = sf.run_code(sf.RunCodeRequest(code=PROGRAMS[language], language=language, stdin="40 2\n",
                                       compile_timeout=60, run_timeout=20), max_attempts=1)
    assert ok.status == sf.RunStatus.Success, ok
    assert ok.run_result.stdout == "42\n" and ok.run_result.return_code == 0
    assert sf.summary_run_code_result(ok, mapping) == "Success"
    # SandboxFusion reports a compile step for its compiled languages only (typescript runs through tsx there)
    assert (ok.compile_result is not None) == (language in ("go", "java", "rust", "cpp")), ok.compile_result
    if language in FAILING:
        bad = sf.run_code(sf.RunCodeRequest(code=FAILING[language], language=language, compile_timeout=60,
                                            run_timeout=20), max_attempts=1)
        assert bad.status == sf.RunStatus.Failed and bad.run_result.return_code != 0, bad
        assert sf.summary_run_code_result(bad, mapping) == "RE"
    if language in NOT_COMPILING:
        ce = sf.run_code(sf.RunCodeRequest(code=NOT_COMPILING[language], language=language, compile_timeout=60),
                         max_attempts=1)
        assert ce.status == sf.RunStatus.Failed and ce.run_result is None, ce
        assert ce.compile_result.return_code != 0 and ce.compile_result.stderr
        assert sf.summary_run_code_result(ce, mapping) == "CE"


def test_pytest_and_c(sf, fusion: FusionServer) -> None:
    """`pytest` runs the snippet as a test file (a failing test fails the run); `c` (shoal's, not in
    SandboxFusion's client's list) over raw HTTP."""
    passing = "def add(a, b):\n    return a + b\n\ndef test_add():\n    assert add(40, 2) == 42\n"
    r = sf.run_code(sf.RunCodeRequest(code=passing, language="pytest"), max_attempts=1)
    assert r.status == sf.RunStatus.Success and "1 passed" in r.run_result.stdout, r
    failing = passing.replace("== 42", "== 41")
    r = sf.run_code(sf.RunCodeRequest(code=failing, language="pytest"), max_attempts=1)
    assert r.status == sf.RunStatus.Failed and r.run_result.return_code == 1 and "1 failed" in r.run_result.stdout
    c = httpx.post(fusion.url + "/run_code", timeout=120, json={
        "code": "#include <stdio.h>\nint main(){int a,b; scanf(\"%d %d\",&a,&b); printf(\"%d\\n\",a+b);}\n",
        "language": "c", "stdin": "40 2", "compile_timeout": 60}).json()
    assert c["status"] == "Success" and c["run_result"]["stdout"] == "42\n", c


def test_memory_limit_does_not_stop_the_jvm_or_node(sf) -> None:
    """verl sends memory_limit_MB (1024 by default): runtimes that reserve more address space than they use
    still start, and a program past the limit is stopped without taking the pool with it."""
    for language in ("java", "nodejs"):
        r = sf.run_code(sf.RunCodeRequest(code=PROGRAMS[language], language=language, stdin="1 2",
                                          memory_limit_MB=512, compile_timeout=60), max_attempts=1)
        assert r.status == sf.RunStatus.Success and r.run_result.stdout == "3\n", r
    hog = "const a = []; for (;;) a.push(new Array(1 << 20).fill(1));\n"
    r = sf.run_code(sf.RunCodeRequest(code=hog, language="nodejs", memory_limit_MB=256, run_timeout=30),
                    max_attempts=1)
    assert r.status == sf.RunStatus.Failed and r.run_result.return_code != 0, r
    after = sf.run_code(sf.RunCodeRequest(code=PROGRAMS["nodejs"], language="nodejs", stdin="2 2"),
                        max_attempts=1)
    assert after.status == sf.RunStatus.Success and after.run_result.stdout == "4\n"


def test_unknown_language_is_sandbox_fusions_422(sf, fusion: FusionServer) -> None:
    """As SandboxFusion's own server: a 422 locating `body.language` (its client raises it); a language
    SandboxFusion knows but shoal has no runtime for says so."""
    for language, extra in (("klingon", ""), ("php", "SandboxFusion itself knows it")):
        r = httpx.post(fusion.url + "/run_code", json={"code": "x", "language": language}, timeout=30)
        assert r.status_code == 422, r.text
        [d] = r.json()["detail"]
        assert d["loc"] == ["body", "language"] and d["input"] == language and extra in d["msg"]
        assert "go" in d["msg"] and "typescript" in d["msg"]
    with pytest.raises(Exception, match="422"):
        sf.run_code(sf.RunCodeRequest(code="<?php echo 1;", language="php"), max_attempts=1)
    # a batch answers per item: the others still run
    out = httpx.post(fusion.url + "/run_code_many", timeout=120, json={"requests": [
        {"code": PROGRAMS["go"], "language": "go", "stdin": "1 1", "compile_timeout": 60},
        {"code": "x", "language": "php"}]}).json()["results"]
    assert out[0]["run_result"]["stdout"] == "2\n" and out[1]["status"] == "SandboxError"


@pytest.fixture
def verl_sandbox_fusion(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """verl 0.9.1's reward module `verl.utils.reward_score.sandbox_fusion`, unmodified, from its wheel."""
    pkg_init = framework_file("verl", "verl/utils/reward_score/sandbox_fusion/__init__.py")
    for pkg in ("verl", "verl.utils", "verl.utils.reward_score"):
        mod = types.ModuleType(pkg)
        mod.__path__ = []
        monkeypatch.setitem(sys.modules, pkg, mod)
    spec = importlib.util.spec_from_file_location("verl.utils.reward_score.sandbox_fusion", pkg_init,
                                                  submodule_search_locations=[str(pkg_init.parent)])
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "verl.utils.reward_score.sandbox_fusion", mod)
    spec.loader.exec_module(mod)
    return mod


def test_verl_reward_scores_each_language(verl_sandbox_fusion: types.ModuleType, fusion: FusionServer) -> None:
    """verl's check_correctness(language=...) per language: True on the right answer, False on a wrong one,
    -4 on a compile error, -2 on a runtime error; a language shoal does not run is an API error (-1, with
    the 422 in its metadata), never a sandbox_error that looks like a scored run."""
    utils = sys.modules["verl.utils.reward_score.sandbox_fusion.utils"]
    url = fusion.url + "/run_code"
    cases = {"inputs": ["40 2\n", "1 2\n"], "outputs": ["42\n", "3\n"]}
    sem = threading.Semaphore(4)
    for language in NEW:
        res, meta = utils.check_correctness(url, cases, PROGRAMS[language], timeout=20, language=language,
                                            concurrent_semaphore=sem)
        assert res == [True, True], (language, meta)
        wrong = {"inputs": ["40 2\n"], "outputs": ["41\n"]}
        res, meta = utils.check_correctness(url, wrong, PROGRAMS[language], timeout=20, language=language)
        assert res == [False] and meta[0]["status"] == "wrong_answer", (language, meta)
        res, meta = utils.check_correctness(url, {"inputs": ["1 1\n"], "outputs": ["2\n"]}, FAILING[language],
                                            timeout=20, language=language)
        assert res == [-2], (language, meta)
    for language in ("go", "java", "rust"):
        res, _ = utils.check_correctness(url, {"inputs": ["1 1\n"], "outputs": ["2\n"]}, NOT_COMPILING[language],
                                         timeout=20, language=language)
        assert res == [-4], language
    res, meta = utils.check_correctness(url, {"inputs": ["1\n"], "outputs": ["1\n"]}, "<?php echo 1;",
                                        language="php")
    assert res == [-1] and meta[0]["status"] == "api_error" and "422" in meta[0]["api_request_error"], meta
    # the python path verl uses by default, through compute_score
    score, meta = verl_sandbox_fusion.compute_score(url, sem, 512, f"```python\n{PROGRAMS['python']}```",
                                                    json.dumps(cases), timeout=10)
    assert score == 1.0, meta


async def test_languages_share_one_warm_pool(shoal_home: Path, langs_image: str) -> None:
    """Warming go starts the pool of the image the new languages share: java, nodejs, typescript, rust and pytest
    calls then run on those warm workers without starting a container."""
    from shoal.backends.fncall import FncallConfig, FncallManager
    from shoal.node.node import Node

    n = Node()
    await n.start(reap=False, reconcile=False)
    m = FncallManager(n, FncallConfig(min_idle=1, max_size=2))
    try:
        snap = await m.warm("go", 2)
        assert snap["idle"] == 2, snap
        [pool] = m.pools.values()
        started = pool.stats["started"]
        for language in NEW:
            r = await m.run_code(PROGRAMS[language], language, stdin="2 3", compile_timeout=60, timeout=20)
            assert r.status == "success" and r.stdout == b"5\n", (language, r)
        r = await m.run_code("def test_x():\n    assert 1\n", "pytest")
        assert r.status == "success"
        assert list(m.pools.values()) == [pool] and pool.stats["started"] == started
    finally:
        await m.close()
        await n.stop()
