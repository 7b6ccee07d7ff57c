"""Dockerfiles built by shoal in real sandboxes: every BuildKit feature task sets use, the image config,
the cache (base digest, build args, context files, from_map), the CLI, the SDK and the HTTP API.
(Equality with `docker build` itself: test_dockerfile_corpus.py.)"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import subprocess
import sys
import tarfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from shoal.config import NodeConfig, Paths
from shoal.errors import ImageBuildError, ImageNotFound, InvalidRequest
from shoal.images.dockerbuild import BuildOptions, build_dockerfile
from shoal.images.store import ImageStore
from tests.dockerequal import shoal_tree

pytestmark = pytest.mark.root
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(tmp_path: Path, base_image: str) -> ImageStore:
    st = ImageStore(tmp_path / "store")
    st.copy_image_from(ImageStore(Path(os.environ["SHOAL_STORE"])), "base:latest")
    return st


@pytest.fixture
async def node(shoal_home: Path, store: ImageStore) -> AsyncIterator:
    from shoal.node.node import Node

    n = Node(NodeConfig(paths=Paths(home=shoal_home, store=store.root)))
    await n.start(reap=False, reconcile=False)
    yield n
    ours = [i.id for i in await n.list() if i.labels.get("shoal.build")]
    for sid in ours:
        await n.close(sid)
    await n.stop()
    assert ours == [], f"build sandboxes left behind: {ours}"


@pytest.fixture
def http_files(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A loopback HTTP server of a directory (ADD of URLs)."""
    root = tmp_path / "www"
    root.mkdir()

    class H(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):  # type: ignore[no-untyped-def]
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *a):  # type: ignore[no-untyped-def]
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", root
    finally:
        srv.shutdown()
        srv.server_close()


def _write(ctx: Path, files: dict[str, str], mode: dict[str, int] | None = None) -> Path:
    for rel, text in files.items():
        p = ctx / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for rel, m in (mode or {}).items():
        os.chmod(ctx / rel, m)
    return ctx


def _tree(store: ImageStore, ref: str, *paths: str) -> dict[str, tuple]:
    out = {}
    with shoal_tree(store, ref) as root:
        for p in paths:
            full = root / p.lstrip("/")
            if not os.path.lexists(full):
                out[p] = None
                continue
            st = os.lstat(full)
            body = full.read_bytes() if full.is_file() and not full.is_symlink() else (
                os.readlink(full) if full.is_symlink() else None)
            out[p] = (oct(st.st_mode & 0o7777), st.st_uid, st.st_gid, body)
    return out


async def _build(node, ctx: Path, tag: str, **kw):  # type: ignore[no-untyped-def]
    lines: list[str] = []
    res = await build_dockerfile(node, BuildOptions(tag=tag, context=ctx, **kw), log=lines.append)
    res.log = lines  # type: ignore[attr-defined]
    return res


async def test_multistage_heredocs_users_copy_add_and_config(node, store: ImageStore, tmp_path: Path,
                                                             http_files) -> None:
    url, www = http_files
    (www / "tool.txt").write_text("downloaded\n")
    good = "sha256:" + hashlib.sha256(b"downloaded\n").hexdigest()
    ctx = _write(tmp_path / "ctx", {"app/main.py": "print('hi')\n", "app/util/u.py": "u\n", "notes.log": "no\n",
                                    "app/cache.pyc": "no\n", ".dockerignore": "*.log\n**/*.pyc\n",
                                    "req.txt": "x==1\n"}, {"app/main.py": 0o750})
    arch = tmp_path / "ctx" / "bundle.tar.gz"
    with tarfile.open(arch, "w:gz") as tf:
        tf.add(ctx / "req.txt", arcname="inner/req.txt")
    (ctx / "Dockerfile").write_text(f"""ARG PYV=3
FROM base AS builder
ARG PYV
ENV OUT=/out
RUN <<EOF
set -e
mkdir -p $OUT
echo "python$PYV" > $OUT/version
EOF
RUN cat > $OUT/data.txt <<'DATA'
literal $OUT
DATA

FROM base AS other
RUN echo other > /other.txt

FROM base
ARG WHO=world
ENV GREETING="hello ${{WHO}}" EMPTY=${{UNSET:-fallback}}
RUN useradd -m -u 1234 app && groupadd -g 2000 grp
WORKDIR /srv/app
COPY --from=builder /out/ /srv/app/out/
COPY --from=other /other.txt ./
COPY --chown=app:grp app/ ./code/
COPY <<-EOF /etc/motd
	$GREETING
	EOF
ADD bundle.tar.gz /opt/
ADD --checksum={good} {url}/tool.txt /opt/tool.txt
USER app
WORKDIR /home/app/work
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN echo "$GREETING from $(id -un):$(id -gn) in $PWD" > /home/app/work/who.txt
USER app:grp
LABEL org.example.name="demo app" version=1
EXPOSE 8080 53/udp
HEALTHCHECK --interval=5s CMD true
STOPSIGNAL SIGINT
VOLUME /data
ENTRYPOINT ["python3"]
CMD ["-c", "print(1)"]
""")
    res = await _build(node, ctx, "df-features:1", build_args={"WHO": "shoal"})
    img = res.image
    assert res.stages == ["builder", "other", "2"] and res.warnings == []
    c = img.config
    assert c.env["GREETING"] == "hello shoal" and c.env["EMPTY"] == "fallback" and "WHO" not in c.env
    assert c.workdir == "/home/app/work" and c.user == "app:grp"
    assert c.entrypoint == ["python3"] and c.cmd == ["-c", "print(1)"]
    assert c.labels == {"org.example.name": "demo app", "version": "1"}
    assert c.exposed_ports == ["8080/tcp", "53/udp"] and c.stop_signal == "SIGINT" and c.volumes == ["/data"]
    assert c.healthcheck == {"Test": ["CMD-SHELL", "true"], "Interval": 5 * 10**9}
    assert c.shell == ["/bin/bash", "-o", "pipefail", "-c"]
    t = _tree(store, "df-features:1", "/srv/app/out/version", "/srv/app/out/data.txt", "/srv/app/other.txt",
              "/srv/app/code/main.py", "/srv/app/code/util/u.py", "/srv/app/code/cache.pyc", "/srv/app/notes.log",
              "/etc/motd", "/opt/inner/req.txt", "/opt/bundle.tar.gz", "/opt/tool.txt", "/home/app/work",
              "/home/app/work/who.txt", "/srv/app/code")
    assert t["/srv/app/out/version"][3] == b"python3\n"
    assert t["/srv/app/out/data.txt"][3] == b"literal $OUT\n"  # a quoted heredoc is not expanded
    assert t["/srv/app/other.txt"][3] == b"other\n"
    assert t["/srv/app/code/main.py"][:3] == ("0o750", 1234, 2000)  # mode kept, --chown names resolved
    assert t["/srv/app/code"][:3] == ("0o755", 1234, 2000)
    assert t["/srv/app/code/cache.pyc"] is None and t["/srv/app/notes.log"] is None  # .dockerignore
    assert t["/etc/motd"] == ("0o644", 0, 0, b"hello shoal\n")  # <<- strips tabs; unquoted: expanded
    assert t["/opt/inner/req.txt"][3] == b"x==1\n" and t["/opt/bundle.tar.gz"] is None  # local archive unpacked
    assert t["/opt/tool.txt"][:3] == ("0o600", 0, 0)  # a URL's file is 0600, as in Docker
    assert t["/home/app/work"][:3] == ("0o755", 1234, 1234)  # WORKDIR creates it, owned by USER
    assert t["/home/app/work/who.txt"][3] == b"hello shoal from app:app in /home/app/work\n"

    # a sandbox of the image starts in its WORKDIR as its USER (a WORKDIR-only image used to fail here)
    from shoal.spec import SandboxSpec

    info = await node.create(SandboxSpec(image="df-features:1"))
    try:
        r = await node.exec(info.id, ["sh", "-c", "pwd; id -un; id -gn"])
        assert r.stdout == b"/home/app/work\napp\ngrp\n", r
    finally:
        await node.close(info.id)

    # unchanged: every step cached; a new build arg reruns only what sees it
    again = await _build(node, ctx, "df-features:2", build_args={"WHO": "shoal"})
    assert again.steps_run == 0 and again.image.layers == img.layers
    other = await _build(node, ctx, "df-features:3", build_args={"WHO": "there"})
    assert 0 < other.steps_run < res.steps_run
    # --target builds that stage and what it needs only
    tgt = await _build(node, ctx, "df-features:builder", target="builder")
    assert tgt.stages == ["builder"]
    # a bad checksum fails clearly
    bad = ctx / "Dockerfile"
    bad.write_text(f"FROM base\nADD --checksum=sha256:{'0' * 64} {url}/tool.txt /x\n")
    with pytest.raises(InvalidRequest, match="checksum mismatch"):
        await _build(node, ctx, "df-features:bad")


async def test_workdir_only_and_cache_keys(node, store: ImageStore, tmp_path: Path) -> None:
    ctx = _write(tmp_path / "ctx", {"Dockerfile": "FROM base\nWORKDIR /app\n", "f.txt": "1"})
    res = await _build(node, ctx, "df-wd:1")
    assert res.image.config.workdir == "/app"
    assert _tree(store, "df-wd:1", "/app")["/app"] == ("0o755", 0, 0, None)

    # context files a step reads key its cache; others do not
    (ctx / "Dockerfile").write_text("FROM base\nCOPY f.txt /f\nRUN echo run >> /log\n")
    a = await _build(node, ctx, "df-wd:2")
    (ctx / "unrelated.txt").write_text("x")
    b = await _build(node, ctx, "df-wd:3")
    assert b.steps_run == 0
    (ctx / "f.txt").write_text("2")
    c = await _build(node, ctx, "df-wd:4")
    assert c.steps_run == 2 and c.image.layers != a.image.layers

    # what .dockerignore leaves out keys the cache too: a newly ignored file is gone from the rebuilt image
    (ctx / "Dockerfile").write_text("FROM base\nCOPY . /c/\n")
    (ctx / "x.log").write_text("x")
    assert _tree(store, (await _build(node, ctx, "df-wd:ign1")).image.ref, "/c/x.log")["/c/x.log"] is not None
    (ctx / ".dockerignore").write_text("*.log\n")
    ign = await _build(node, ctx, "df-wd:ign2")
    assert ign.steps_run == 1 and _tree(store, "df-wd:ign2", "/c/x.log")["/c/x.log"] is None
    (ctx / "Dockerfile").write_text("FROM base\nCOPY f.txt /f\nRUN echo run >> /log\n")

    # from_map: the same Dockerfile on another base is a new image, never the old one's cache
    store.put_image("otherbase:1", [*(lay.digest for lay in store.resolve("base").layers),
                                    c.image.layers[-1].digest])
    d = await _build(node, ctx, "df-wd:5", from_map={"base": "otherbase:1"})
    assert d.steps_run == 2 and d.image.layers[:-2] == store.resolve("otherbase:1").layers

    # the base's digest keys the cache too: a rebuilt (re-tagged) base is not the old image
    store.put_image("base:latest", [lay.digest for lay in store.resolve("otherbase:1").layers])
    e = await _build(node, ctx, "df-wd:6")
    assert e.steps_run == 0 and e.image.layers == d.image.layers


async def test_run_mounts(node, store: ImageStore, tmp_path: Path, shoal_home: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("s3cret")
    ctx = _write(tmp_path / "ctx", {"Dockerfile": """FROM base AS tools
RUN mkdir /tools && echo tool > /tools/t.txt
FROM base
RUN --mount=type=cache,target=/root/.cache/pip echo $(date +%N) >> /root/.cache/pip/runs && \\
    cat /root/.cache/pip/runs > /runs-seen
RUN --mount=type=secret,id=token cat /run/secrets/token > /secret-len && wc -c < /run/secrets/token > /secret-len
RUN --mount=type=tmpfs,target=/scratch echo x > /scratch/f && test -f /scratch/f
RUN --mount=type=bind,source=data,target=/mnt/data cp /mnt/data/in.txt /copied.txt
RUN --mount=type=bind,from=tools,source=/tools,target=/t cp /t/t.txt /from-stage.txt
""", "data/in.txt": "bound\n"})
    await _build(node, ctx, "df-mounts:1", secrets={"token": secret})
    t = _tree(store, "df-mounts:1", "/root/.cache/pip", "/root/.cache", "/run/secrets", "/secret-len", "/scratch",
              "/mnt/data", "/copied.txt", "/from-stage.txt", "/runs-seen")
    assert t["/secret-len"][3] == b"6\n"  # the secret was there; its content is not in the image
    assert t["/root/.cache/pip"] is None and t["/run/secrets"] is None and t["/scratch"] is None
    assert t["/mnt/data"] is None  # mount stubs are removed, as BuildKit >= 0.12 does
    assert t["/copied.txt"][3] == b"bound\n" and t["/from-stage.txt"][3] == b"tool\n"
    assert t["/runs-seen"][3].count(b"\n") == 1
    # the cache mount persists between builds (the step reruns: --no-cache)
    res2 = await _build(node, ctx, "df-mounts:2", secrets={"token": secret}, no_cache=True)
    assert _tree(store, "df-mounts:2", "/runs-seen")["/runs-seen"][3].count(b"\n") == 2
    assert res2.steps_run >= 5
    with contextlib.suppress(Exception):
        import shutil
        shutil.rmtree(shoal_home / "build-cache")


async def test_independent_stages_build_side_by_side(node, store: ImageStore, tmp_path: Path) -> None:
    """Two stages that need each other's progress (through a shared cache mount) finish only when they run
    at the same time; a stage nobody needs is never built."""
    wait = ("echo {me} > /c/{me}; for i in $(seq 600); do [ -f /c/{other} ] && exit 0; sleep 0.1; done; "
            "echo 'the other stage never ran beside this one'; exit 1")
    ctx = _write(tmp_path / "ctx", {"Dockerfile": f"""FROM base AS a
RUN --mount=type=cache,id=side-by-side-{os.getpid()},target=/c {wait.format(me="a", other="b")}
RUN echo a > /a
FROM base AS b
RUN --mount=type=cache,id=side-by-side-{os.getpid()},target=/c {wait.format(me="b", other="a")}
RUN echo b > /b
FROM base AS never
RUN exit 1
FROM base
COPY --from=a /a /a
COPY --from=b /b /b
"""})
    res = await _build(node, ctx, "df-par:1")
    assert res.stages == ["a", "b", "3"]
    t = _tree(store, "df-par:1", "/a", "/b")
    assert t["/a"][3] == b"a\n" and t["/b"][3] == b"b\n"


async def test_scratch_images_without_tar(node, store: ImageStore, tmp_path: Path) -> None:
    """FROM scratch + COPY --from=builder (Go-style), a WORKDIR, and COPY --from out of that tar-less stage."""
    ctx = _write(tmp_path / "ctx", {"Dockerfile": """FROM base AS build
RUN mkdir -p /out/bin && printf 'binary' > /out/bin/app && chmod 750 /out/bin/app && echo cfg > /out/cfg
FROM scratch AS final
COPY --from=build /out/ /
COPY --from=build --chown=1000:1000 /out/cfg /etc/app/app.cfg
WORKDIR /data
ENTRYPOINT ["/bin/app"]
FROM scratch
COPY --from=final /etc/app /app-etc
""", "x": "x"})
    res = await _build(node, ctx, "df-scratch:final", target="final")
    t = _tree(store, "df-scratch:final", "/bin/app", "/cfg", "/etc/app/app.cfg", "/etc/app", "/data", "/proc",
              "/.shoal")
    assert t["/bin/app"] == ("0o750", 0, 0, b"binary") and t["/cfg"][3] == b"cfg\n"
    assert t["/etc/app/app.cfg"][:3] == ("0o644", 1000, 1000) and t["/etc/app"][:3] == ("0o755", 1000, 1000)
    assert t["/data"] == ("0o755", 0, 0, None)
    assert t["/proc"] is None and t["/.shoal"] is None  # no runtime mountpoints in the layers
    assert res.image.config.entrypoint == ["/bin/app"] and res.image.config.workdir == "/data"
    await _build(node, ctx, "df-scratch:last")
    assert _tree(store, "df-scratch:last", "/app-etc/app.cfg")["/app-etc/app.cfg"][:4] == ("0o644", 1000, 1000,
                                                                                          b"cfg\n")


@pytest.mark.parametrize(("text", "err", "words"), [
    ("FROM nosuchimage:1\n", ImageNotFound, "nosuchimage:1"),
    ("FROM base\nCOPY missing.txt /x\n", InvalidRequest, "not found in the build context"),
    ("FROM base\nCOPY ../outside /x\n", InvalidRequest, "outside the build context"),
    ("FROM base\nCOPY --chown=nobody:nogroupx f /x\n", InvalidRequest, "no group 'nogroupx'"),
    ("FROM base\nCOPY f g /x\n", InvalidRequest, "must be a directory and end with a /"),
    ("FROM base\nRUN exit 3\n", ImageBuildError, "exit code 3"),
    ("FROM base\nRUN --mount=type=ssh true\n", InvalidRequest, "type=ssh is not supported"),
    ("FROM base\nADD https://github.com/x/y.git /src\n", InvalidRequest, "git repository"),
    ("FROM base\nRUN --mount=type=secret,id=nope,required=true true\n", InvalidRequest, "is required"),
])
async def test_errors_are_clear_and_leave_nothing(node, store: ImageStore, tmp_path: Path, text: str,
                                                   err: type, words: str) -> None:
    ctx = _write(tmp_path / "ctx", {"Dockerfile": text, "f": "f", "g": "g"})
    with pytest.raises(err, match=words):
        await _build(node, ctx, "df-err:1")
    assert not store.exists("df-err:1")
    assert [i.id for i in await node.list() if i.labels.get("shoal.build")] == []


def test_cli_build_inspect_and_run_default_command(shoal_home: Path, base_image: str, tmp_path: Path) -> None:
    ctx = _write(tmp_path / "ctx", {"Dockerfile": "FROM base\nARG MSG\nENV MSG=$MSG\nWORKDIR /app\n"
                                                  "ENTRYPOINT [\"sh\", \"-c\"]\nCMD [\"echo $MSG in $PWD\"]\n"})
    env = dict(os.environ, SHOAL_HOME=str(shoal_home))
    shoal = [sys.executable, "-m", "shoal.cli.main"]
    r = subprocess.run([*shoal, "image", "build", "-t", "df-cli:1", "--build-arg", "MSG=hi", "-q", str(ctx)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "built df-cli:1" in r.stdout
    r = subprocess.run([*shoal, "image", "inspect", "df-cli:1"], capture_output=True, text=True, env=env)
    conf = json.loads(r.stdout)["config"]
    assert conf["entrypoint"] == ["sh", "-c"] and conf["workdir"] == "/app" and conf["env"]["MSG"] == "hi"
    r = subprocess.run([*shoal, "run", "df-cli:1"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout == "hi in /app\n", r.stderr
    # a directory without -t is refused with the fix named
    r = subprocess.run([*shoal, "image", "build", str(ctx)], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "-t NAME" in r.stderr
    subprocess.run([*shoal, "image", "rm", "df-cli:1"], env=env, capture_output=True)


FLAGS_DOCKERFILE = """FROM base AS build
ARG V=1
LABEL stage=build
RUN echo "v=$V $(date +%s%N)" > /stamp
FROM base AS final
LABEL stage=final
COPY --from=build /stamp /stamp
"""


def test_cli_build_flags(shoal_home: Path, base_image: str, tmp_path: Path) -> None:
    """Docker's flags on the CLI: -f (a Dockerfile outside the context's root), --build-arg, --target,
    --platform linux/amd64 (others refused), --no-cache (a cached rebuild says so; --no-cache reruns)."""
    ctx = _write(tmp_path / "ctx", {"docker/Build.dockerfile": FLAGS_DOCKERFILE, "x": "x"})
    env = dict(os.environ, SHOAL_HOME=str(shoal_home), COLUMNS="300")
    shoal = [sys.executable, "-m", "shoal.cli.main"]
    name = f"df-flags-{os.getpid()}:1"

    def build(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*shoal, "image", "build", "-t", name, "-f", str(ctx / "docker/Build.dockerfile"),
                               "--build-arg", "V=2", "--target", "build", "--platform", "linux/amd64", *extra,
                               str(ctx)], capture_output=True, text=True, env=env, timeout=600)

    def stamp() -> str:
        r = subprocess.run([*shoal, "run", name, "--", "cat", "/stamp"], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout

    try:
        r = build()
        assert r.returncode == 0, r.stderr[-2000:]
        first = stamp()
        assert first.startswith("v=2 "), "the build arg reached RUN"
        conf = json.loads(subprocess.run([*shoal, "image", "inspect", name], capture_output=True, text=True,
                                         env=env).stdout)["config"]
        assert conf["labels"] == {"stage": "build"}, "--target stops at the build stage"
        r = build()
        assert r.returncode == 0 and "(cached)" in r.stderr and stamp() == first
        r = build("--no-cache")
        assert r.returncode == 0 and "(cached)" not in r.stderr, r.stderr[-2000:]
        assert stamp() != first, "--no-cache reran the RUN"
        r = build("--platform", "linux/arm64")
        assert r.returncode == 2 and "linux/amd64" in r.stderr and "Traceback" not in r.stderr
    finally:
        subprocess.run([*shoal, "image", "rm", name], env=env, capture_output=True)


async def test_sdk_build_over_http(api_server, tmp_path: Path) -> None:
    """The context goes up as a tarball; the server builds it into the caller's project."""
    from shoal.sdk.client import Client

    ctx = _write(tmp_path / "ctx", {"Dockerfile": "FROM base\nWORKDIR /w\nCOPY . .\nRUN ls /w > /listing\n",
                                    "a.txt": os.urandom(8).hex(), "skip.log": "s", ".dockerignore": "*.log\n"})
    async with Client(api_server.url, token=api_server.token) as c:
        out = await c.build_image("df-http:1", str(ctx))
        assert out["image"]["name"] == "df-http" and out["steps_run"] >= 2
        sb = await c.create("df-http:1")
        try:
            r = await sb.exec(["cat", "/listing"])
            assert r.stdout == b"Dockerfile\na.txt\n"  # .dockerignore'd files never left the client
        finally:
            await sb.close()
        again = await c.build_image("df-http:1", str(ctx))
        assert again["steps_run"] == 0
        info = await c.image("df-http:1")
        assert info["config"]["workdir"] == "/w"
        with pytest.raises(InvalidRequest, match="no FROM"):
            (ctx / "Dockerfile").write_text("# empty\n")
            await c.build_image("df-http:2", str(ctx))
        # Docker's flags over HTTP: a Dockerfile elsewhere in the context, build args, target, no-cache, platform
        _write(ctx, {"docker/Build.dockerfile": FLAGS_DOCKERFILE})
        opts = {"dockerfile": "docker/Build.dockerfile", "build_args": {"V": "3"}, "target": "build",
                "platform": "linux/amd64"}
        one = await c.build_image("df-http:flags", str(ctx), **opts)
        assert one["stages"] == ["build"] and one["image"]["config"]["labels"] == {"stage": "build"}
        assert (await c.build_image("df-http:flags", str(ctx), **opts))["steps_run"] == 0
        fresh = await c.build_image("df-http:flags", str(ctx), **opts, no_cache=True)
        assert fresh["steps_run"] == 1 and fresh["steps_cached"] == 0
        sb = await c.create("df-http:flags")
        try:
            assert (await sb.exec(["cat", "/stamp"])).stdout.startswith(b"v=3 ")
        finally:
            await sb.close()
        with pytest.raises(InvalidRequest, match="linux/amd64"):
            await c.build_image("df-http:flags", str(ctx), **{**opts, "platform": "linux/arm64"})
