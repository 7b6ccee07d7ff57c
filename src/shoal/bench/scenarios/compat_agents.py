"""Parts of `shoal bench compat` about what agents and reward code send (issue 26):

- **SWE-agent step**: one step as SWE-agent takes it — the model's command, then the state command (a python
  script writing `/root/state.json`, like its `_state_anthropic`), then `read_file` of that file — through the
  unmodified SWE-ReX client against `/swerex/{id}`, and the same three calls through shoal's own shell API
  (`Shell.run` twice, `read_file`), interleaved round by round on one sandbox;
- **SandboxFusion languages**: calls/s of `/run_code` (SandboxFusion's request, as its client and verl send it)
  per language, an A+B program reading stdin, next to python's — the cost of each language's toolchain on
  shoal's warm pools (compiled languages pay their compiler on every call, as in SandboxFusion).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from shoal.bench.context import BenchContext
from shoal.bench.results import Metric
from shoal.bench.stats import latency_summary

#: SWE-agent's state command, in effect (its `_state_anthropic` is this python script)
STATE_SCRIPT = ("import json, os\nfrom pathlib import Path\np = Path('/root/state.json')\n"
                "s = json.loads(p.read_text()) if p.exists() else {}\ns['working_dir'] = os.getcwd()\n"
                "p.write_text(json.dumps(s))\n")
STEP_COMMAND = "grep -n 'def ' /work/repo/calc.py | head -20"
STATE_COMMAND = "/root/tools/_state_anthropic"

#: an A+B program per language (what RL code tasks look like), answer "42"
AB_PROGRAMS = {
    "python": "a, b = map(int, input().split())\nprint(a + b)\n",
    "bash": "read a b\necho $((a + b))\n",
    "cpp": "#include <iostream>\nint main(){long a,b; std::cin>>a>>b; std::cout<<a+b<<std::endl;}\n",
    "go": 'package main\n\nimport "fmt"\n\nfunc main() {\n\tvar a, b int\n\tfmt.Scan(&a, &b)\n'
          '\tfmt.Println(a + b)\n}\n',
    "java": "import java.util.*;\npublic class Main {\n  public static void main(String[] args) {\n"
            "    Scanner s = new Scanner(System.in);\n    System.out.println(s.nextLong() + s.nextLong());\n  }\n}\n",
    "nodejs": "const [a, b] = require('fs').readFileSync(0, 'utf8').trim().split(/\\s+/).map(Number);\n"
              "console.log(a + b);\n",
    "typescript": "import * as fs from 'fs';\nconst [a, b]: number[] = fs.readFileSync(0, 'utf8').trim()"
                  ".split(/\\s+/).map(Number);\nconsole.log(a + b);\n",
    "rust": "use std::io::Read;\nfn main() {\n    let mut s = String::new();\n"
            "    std::io::stdin().read_to_string(&mut s).unwrap();\n"
            "    let v: Vec<i64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();\n"
            "    println!(\"{}\", v[0] + v[1]);\n}\n",
    "pytest": "def add(a, b):\n    return a + b\n\ndef test_add():\n    assert add(40, 2) == 42\n",
}


async def swe_agent_step(ctx: BenchContext, client: Any, url: str, token: str, rounds: int) -> tuple[dict, list]:
    """Latency of a SWE-agent step through /swerex vs shoal's shell API (see the module docstring)."""
    from swerex.runtime.abstract import BashAction, CreateBashSessionRequest, ReadFileRequest
    from swerex.runtime.remote import RemoteRuntime

    sb = await client.create(ctx.image, memory_mb=256)
    try:
        await sb.write_file("/root/tools/_state_anthropic", "#!/usr/bin/env python3\n" + STATE_SCRIPT, 0o755)
        await sb.write_file("/work/repo/calc.py", "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(50)))
        rex = RemoteRuntime(host=f"{url}/swerex/{sb.id}", port=None, auth_token=token, timeout=30)
        await rex.create_session(CreateBashSessionRequest(startup_source=["/root/.bashrc"], startup_timeout=10))
        shell = await sb.shell()

        async def rex_step() -> None:
            a = await rex.run_in_session(BashAction(command=STEP_COMMAND, timeout=30, check="silent"))
            s = await rex.run_in_session(BashAction(command=STATE_COMMAND, timeout=25, check="silent"))
            state = (await rex.read_file(ReadFileRequest(path="/root/state.json"))).content
            if a.exit_code != 0 or s.exit_code != 0 or "working_dir" not in state or "def f19" not in a.output:
                raise RuntimeError(f"unexpected step: {a!r} {s!r} {state!r}")

        async def shoal_step() -> None:
            a = await shell.run(STEP_COMMAND, timeout=30)
            s = await shell.run(STATE_COMMAND, timeout=25)
            state = await sb.read_file("/root/state.json")
            if a.exit_code != 0 or s.exit_code != 0 or b"working_dir" not in state or b"def f19" not in a.stdout:
                raise RuntimeError(f"unexpected step: {a!r} {s!r} {state!r}")

        paths = {"swerex_step": rex_step, "shoal_shell_step": shoal_step}
        lat: dict[str, list[float]] = {k: [] for k in paths}
        errors: list[str] = []
        for _ in range(5):
            for call in paths.values():
                await call()
        with ctx.task(f"{rounds} SWE-agent steps through /swerex and shoal's shell", rounds) as adv:
            for _ in range(rounds):
                for name, call in paths.items():
                    t = time.perf_counter()
                    try:
                        await call()
                    except Exception as e:
                        errors.append(f"{name}: {str(e)[:200]}")
                        continue
                    lat[name].append(time.perf_counter() - t)
                adv()
        await rex.close()
    finally:
        await sb.close()
    summ = {k: latency_summary(v) for k, v in lat.items()}
    a, b = summ["swerex_step"].get("p50_ms"), summ["shoal_shell_step"].get("p50_ms")
    metrics = [
        Metric("SWE-agent step p50, shoal shell API (run + state command + read_file)", b, None, "ms"),
        Metric("SWE-agent step p50, SWE-ReX client via /swerex", a, None, "ms",
               note=f"{a / b:.2f}× of shoal's shell" if a and b else ""),
    ]
    return {"latency": summ, "errors": errors[:5], "rounds": rounds}, metrics


async def fusion_languages(ctx: BenchContext, url: str, token: str, calls: int, concurrency: int,
                           languages: tuple[str, ...]) -> tuple[dict, list]:
    """calls/s of SandboxFusion's /run_code per language (see the module docstring)."""
    import httpx

    from shoal.backends.fncall_image import ensure_fncall_image
    from shoal.backends.fncall_languages import get_language

    images = {get_language(lang).image for lang in languages} - {"base:latest"}
    if images:
        from shoal.node.node import Node

        node = Node()
        await node.start(reap=False, reconcile=False)
        try:
            for ref in sorted(images):
                if not node.store.exists(ref):
                    ctx.log(f"building {ref} (once per store, a few minutes)")
                    await ensure_fncall_image(node, ref, log=lambda s: None)
        finally:
            await node.stop()
    out: dict[str, Any] = {}
    metrics: list[Metric] = []
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as http:
        async def call(lang: str) -> float:
            body = {"code": AB_PROGRAMS[lang], "language": lang, "stdin": "40 2\n", "compile_timeout": 60,
                    "run_timeout": 30}
            t = time.perf_counter()
            r = await http.post("/run_code", json=body)
            dt = time.perf_counter() - t
            j = r.json()
            ok = r.status_code == 200 and j.get("status") == "Success"
            if not ok or (lang != "pytest" and (j["run_result"]["stdout"] or "").strip() != "42"):
                raise RuntimeError(f"{lang}: {r.status_code} {str(j)[:300]}")
            return dt

        with ctx.task(f"/run_code per language ({calls} calls each, {concurrency} in flight)",
                      len(languages)) as adv:
            for lang in languages:
                for _ in range(2):  # warm-up: the pool's workers, the language's first compile
                    await call(lang)
                lat: list[float] = []
                errors: list[str] = []

                async def one(lang: str, lat: list[float], errors: list[str], sem: asyncio.Semaphore) -> None:
                    async with sem:
                        try:
                            lat.append(await call(lang))
                        except Exception as e:
                            errors.append(str(e)[:300])

                t0 = time.perf_counter()
                sem = asyncio.Semaphore(concurrency)
                await asyncio.gather(*(one(lang, lat, errors, sem) for _ in range(calls)))
                wall = time.perf_counter() - t0
                out[lang] = {"calls_per_s": round(len(lat) / wall, 2) if wall else None, "ok": len(lat),
                             "errors": errors[:3], **latency_summary(lat)}
                adv()
    py = (out.get("python") or {}).get("calls_per_s")
    for lang in languages:
        cps = out[lang]["calls_per_s"]
        note = "" if lang == "python" or not (cps and py) else f"{py / cps:.1f}× slower than python"
        metrics.append(Metric(f"/run_code calls/s, {lang}", cps, None, "calls/s", better="higher", note=note))
    return {"per_language": out, "calls": calls, "concurrency": concurrency}, metrics
