"""Run by test_integration_harbor.py with .venv-harbor's Python (Harbor needs >= 3.12): ShoalEnvironment
through Harbor's own models and BaseEnvironment helpers. Prints ALL OK at the end; any failure raises."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from harbor.models.task.config import EnvironmentConfig, NetworkMode
from harbor.models.trial.paths import TrialPaths

from shoal.errors import InvalidRequest
from shoal.integrations.harbor import ShoalEnvironment


def make_env(work: Path, env_dir: Path, name: str, **kw: object) -> ShoalEnvironment:
    paths = TrialPaths(trial_dir=work / f"trial-{name}")
    paths.mkdir()
    cfg = EnvironmentConfig(network_mode=NetworkMode.NO_NETWORK, cpus=1, memory_mb=512, env={"TASK_VAR": "tv"})
    return ShoalEnvironment(environment_dir=env_dir, environment_name=name, session_id=f"{name}__s1",
                            trial_paths=paths, task_env_config=cfg, network_policy=cfg.resolve_baseline(), **kw)


async def main(work: Path) -> None:
    ctx = work / "ctx"
    (ctx / "app" / "pkg").mkdir(parents=True)
    (ctx / "app" / "pkg" / "mod.py").write_text("X = 1\n")
    (ctx / "app" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (ctx / "app" / "run.sh").chmod(0o755)
    (ctx / "app" / "skip.log").write_text("ignored\n")
    (ctx / ".dockerignore").write_text("**/*.log\n")  # (Docker: a bare *.log matches the top level only)
    (ctx / "Dockerfile").write_text(
        "# a Dockerfile with every supported instruction\n"
        "ARG GREETING=hello\n"
        "FROM base AS final\n"
        "ARG WHO=world\n"
        "ENV APP_HOME=/opt/app \\\n    MODE=test\n"
        "WORKDIR $APP_HOME\n"
        "COPY app/ ./\n"
        "COPY --chown=1000:1000 app/pkg/mod.py /srv/owned.py\n"
        'RUN echo "$WHO" > who.txt && mkdir -p /home/u && chown 1000:1000 /home/u\n'
        'RUN ["sh", "-c", "echo exec-form > exec.txt"]\n'
        "LABEL org.example=1\nEXPOSE 8080\nCMD [\"sleep\", \"infinity\"]\n"
        "USER 1000:1000\n"
        "RUN id -u > /home/u/uid.txt\n"
        "USER root\n")
    env = make_env(work, ctx, "contract")
    await env.start(force_build=False)
    try:
        assert env.image and env.image.startswith("dockerfile/contract:"), env.image
        r = await env.exec("pwd; cat who.txt exec.txt; echo $MODE $TASK_VAR; ./run.sh; ls; stat -c %u /srv/owned.py")
        assert r.return_code == 0, r
        out = r.stdout.split()
        assert out[:4] == ["/opt/app", "world", "exec-form", "test"], out
        assert "tv" in out and "ran" in out and "skip.log" not in out and out[-1] == "1000", out
        assert (await env.exec("cat /home/u/uid.txt")).stdout.strip() == "1000"
        # Harbor's directories exist, writable by anyone, as with Docker's bind mounts
        r = await env.exec("stat -c '%a %n' /logs/agent /logs/verifier /logs/artifacts")
        assert r.return_code == 0 and r.stdout.count("777") == 3, r
        # user, cwd, env, exit codes, stderr
        r = await env.exec("id -u; pwd; echo $E1; echo oops >&2; exit 3", cwd="/tmp", env={"E1": "v1"},
                           user=1000)
        assert (r.return_code, r.stdout.split(), r.stderr.strip()) == (3, ["1000", "/tmp", "v1"], "oops"), r
        with env.with_default_user("nobody"):
            assert (await env.exec("id -un")).stdout.strip() == "nobody"
        try:
            await env.exec("sleep 30", timeout_sec=1)
        except RuntimeError as e:
            assert "timed out" in str(e)
        else:
            raise AssertionError("a command past its timeout must raise, as in Harbor's Docker environment")
        # uploads and downloads, files and directories
        src = work / "up"
        (src / "d" / "e").mkdir(parents=True)
        (src / "d" / "e" / "f.txt").write_text("deep\n")
        (src / "x.sh").write_text("echo x\n")
        (src / "x.sh").chmod(0o755)
        await env.upload_dir(src, "/data/in")
        r = await env.exec("cat /data/in/d/e/f.txt; /data/in/x.sh")
        assert r.stdout.split() == ["deep", "x"], r
        await env.upload_file(src / "x.sh", "/new/dir/x.sh")
        assert (await env.exec("/new/dir/x.sh")).stdout.strip() == "x"
        await env.exec("mkdir -p /out/sub && echo a > /out/a.txt && echo b > /out/sub/b.txt")
        dl = work / "down"
        await env.download_dir("/out", dl)
        assert (dl / "a.txt").read_text() == "a\n" and (dl / "sub" / "b.txt").read_text() == "b\n"
        await env.download_file("/out/sub/b.txt", work / "b-copy.txt")
        assert (work / "b-copy.txt").read_text() == "b\n"
        # Harbor's own helpers on top: filtered download, is_dir / is_file
        await env.download_dir_filtered(source_dir="/out", target_dir=work / "filtered", include=["sub/*"])
        assert (work / "filtered" / "sub" / "b.txt").exists() and not (work / "filtered" / "a.txt").exists()
        assert await env.is_dir("/out/sub") and await env.is_file("/out/a.txt") and not await env.is_file("/nope")
        # network_mode = no-network (the policy Harbor hands the environment): no route out
        r = await env.exec("cat /proc/net/route | wc -l")
        assert r.stdout.strip() == "1", r
    finally:
        await env.stop(delete=True)
    # a second start of the same content builds nothing (the image is found by its content)
    env2 = make_env(work, ctx, "contract")
    await env2.start(force_build=False)
    try:
        assert env2.image == env.image
    finally:
        await env2.stop(delete=True)
    # what shoal cannot build is refused with the line and what to do
    bad = work / "bad"
    bad.mkdir()
    (bad / "Dockerfile").write_text("FROM base AS a\nRUN true\nFROM base\nRUN --mount=type=ssh git clone x\n")
    env3 = make_env(work, bad, "bad")
    try:
        await env3.start(force_build=False)
    except InvalidRequest as e:
        assert "Dockerfile:4" in e.message and "type=ssh is not supported" in e.message, e.message
    else:
        raise AssertionError("RUN --mount=type=ssh must be refused")
    print("ALL OK")


asyncio.run(main(Path(sys.argv[1])))
