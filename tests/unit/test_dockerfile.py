"""Dockerfile syntax (BuildKit's parser and word expansion), .dockerignore matching, stages and targets,
build options, and the clear errors for what cannot be built."""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

import pytest

from shoal.errors import InvalidRequest
from shoal.images.dockerbuild import (
    BuildOptions,
    _healthcheck,
    context_tarball,
    needed_stages,
    split_stages,
)
from shoal.images.dockerfile import dockerfile_digest, dockerfile_image_ref, substitute
from shoal.images.dockerfile_syntax import Lexer, parse_dockerfile
from shoal.images.dockerignore import DockerIgnore, context_files


def test_continuations_comments_flags_json_and_directives() -> None:
    df = parse_dockerfile("""# syntax=docker/dockerfile:1
# escape=\\
ARG BASE=debian
FROM ${BASE}:bookworm AS build
RUN apt-get update && \\
    # a comment inside a continued line is dropped

    apt-get install -y x
RUN --mount=type=cache,target=/root/.cache --mount=type=tmpfs,target=/t --network=none make
CMD ["sleep", "infinity"]
copy --chown=1:2 a b
""")
    assert df.directives == {"syntax": "docker/dockerfile:1", "escape": "\\"}
    cmds = [i.cmd for i in df.instructions]
    assert cmds == ["ARG", "FROM", "RUN", "RUN", "CMD", "COPY"]  # keywords are case-insensitive
    run = df.instructions[2]
    assert run.rest == "apt-get update &&     apt-get install -y x" and run.line == 5
    m = df.instructions[3]
    assert m.flag_all("mount") == ["type=cache,target=/root/.cache", "type=tmpfs,target=/t"]
    assert m.flag("network") == "none" and m.rest == "make"
    assert df.instructions[4].json == ["sleep", "infinity"]
    assert df.instructions[5].flag("chown") == "1:2"


def test_backtick_escape_directive() -> None:
    df = parse_dockerfile("# escape=`\nFROM x\nRUN echo a `\n  b\n")
    assert df.escape == "`" and df.instructions[1].rest == "echo a   b"


def test_heredocs() -> None:
    df = parse_dockerfile("""FROM x
RUN <<EOF
echo $HOME
EOF
RUN python3 <<'PY' > /out
print(1)
PY
COPY <<-"A" <<b /dir/
\thello $X
\tA
bee $X
b
""")
    r1, r2, c = df.instructions[1:]
    assert r1.heredocs[0].content == "echo $HOME\n" and r1.heredocs[0].expand
    assert r2.heredocs[0].name == "PY" and not r2.heredocs[0].expand and r2.rest == "python3 <<'PY' > /out"
    assert [(h.name, h.content, h.expand, h.chomp) for h in c.heredocs] == [
        ("A", "hello $X\n", False, True), ("b", "bee $X\n", True, False)]
    with pytest.raises(InvalidRequest, match="no terminating 'EOF'"):
        parse_dockerfile("FROM x\nRUN <<EOF\necho\n")


@pytest.mark.parametrize(("text", "env", "words"), [
    ('a "b c" $X', {"X": "d e"}, ["a", "b c", "d", "e"]),
    ("'$X' \"$X\"", {"X": "1"}, ["$X", "1"]),
    ("${A:-dflt} ${B:-dflt} ${A:+alt} ${B:+alt}x", {"A": "a"}, ["a", "dflt", "alt", "x"]),
    ("${E-unset} ${E:-empty}", {"E": ""}, ["empty"]),
    ("a\\ b \\$X", {"X": "1"}, ["a b", "$X"]),
    ("${F%.tar.gz} ${P##*/} ${P#*/} ${S/o/0} ${S//o/0}", {"F": "x.tar.gz", "P": "a/b/c", "S": "foo"},
     ["x", "c", "b/c", "f0o", "f00"]),
    ("${NESTED:-${A}-x}", {"A": "a"}, ["a-x"]),
])
def test_word_expansion(text: str, env: dict[str, str], words: list[str]) -> None:
    assert Lexer().words(text, env) == words


def test_expansion_errors() -> None:
    with pytest.raises(InvalidRequest, match="must be set"):
        Lexer().word("${X:?must be set}", {})
    with pytest.raises(InvalidRequest, match="matching double-quote"):
        Lexer().words('"abc', {})


def test_dockerignore_matching(tmp_path: Path) -> None:
    ign = DockerIgnore(["# comment", "*.log", "**/__pycache__", "/build", "docs/*.md", "!docs/keep.md", "node_modules",
                        "!node_modules/keep"])
    assert ign.excluded("a.log") and not ign.excluded("sub/a.log")  # `*` does not cross '/'
    assert ign.excluded("x/y/__pycache__/m.pyc") and ign.excluded("__pycache__")
    assert ign.excluded("build/out.o") and not ign.excluded("src/build")
    assert ign.excluded("docs/a.md") and not ign.excluded("docs/keep.md")
    assert ign.excluded("node_modules/x") and not ign.excluded("node_modules/keep")
    for rel in ("keep.txt", "drop.log", "node_modules/x/y", "node_modules/keep"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    got = [r for r, _ in context_files(tmp_path, ign)]
    assert got == ["keep.txt", "node_modules", "node_modules/keep"]


def _stages(text: str, **kw: object) -> tuple:
    return split_stages(text, BuildOptions(tag="t:1", context=Path("."), **kw))  # type: ignore[arg-type]


def test_stages_global_args_and_targets() -> None:
    stages, gargs, lex, _ = _stages("""ARG V=12
ARG REG
FROM debian:$V AS base
FROM ${REG:-docker.io}/python:3 AS py
FROM base AS build
COPY --from=py /x /y
FROM base AS unused
FROM build
RUN --mount=type=bind,from=unused,target=/u true
""", build_args={"V": "bookworm"})
    assert [(s.name, s.base) for s in stages] == [("base", "debian:bookworm"), ("py", "docker.io/python:3"),
                                                  ("build", "base"), ("unused", "base"), (None, "build")]
    assert gargs["V"] == "bookworm" and gargs["TARGETARCH"] == "amd64"
    need = needed_stages(stages, stages[2], lex, gargs)
    assert [s.name for s in need] == ["base", "py", "build"]  # `unused` is not built for --target build
    assert [s.index for s in needed_stages(stages, stages[-1], lex, gargs)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(("text", "words"), [
    ("RUN true\n", "before FROM"),
    ("# nothing\n", "no FROM"),
    ("FROM a AS x\nFROM b AS x\n", "duplicate stage name"),
    ("FROM a AS 1x\n", "invalid stage name"),
    ("FROM a b\n", "FROM needs an image"),
    ("FROM --platform=linux/arm64 a\n", "builds linux/amd64"),
])
def test_stage_errors(text: str, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        _stages(text)


def test_healthcheck_config() -> None:
    df = parse_dockerfile("FROM x\nHEALTHCHECK --interval=30s --timeout=1m30s --retries=3 CMD curl -f http://l/\n"
                          "HEALTHCHECK CMD [\"true\"]\nHEALTHCHECK NONE\n")
    a, b, c = (_healthcheck(i, ["/bin/sh", "-c"], "Dockerfile") for i in df.instructions[1:])
    assert a == {"Test": ["CMD-SHELL", "curl -f http://l/"], "Interval": 30 * 10**9, "Timeout": 90 * 10**9,
                 "Retries": 3}
    assert b == {"Test": ["CMD", "true"]} and c == {"Test": ["NONE"]}


def test_build_options_check(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="not a digest"):
        BuildOptions(tag="a@sha256:" + "0" * 64, context=tmp_path).check()
    with pytest.raises(InvalidRequest, match="linux/amd64 only"):
        BuildOptions(tag="a:1", context=tmp_path, platform="linux/arm64").check()
    with pytest.raises(InvalidRequest, match="not a directory"):
        BuildOptions(tag="a:1", context=tmp_path / "nope").check()
    BuildOptions(tag="a:1", context=tmp_path, platform="linux/amd64").check()


def test_context_tarball_leaves_out_ignored_files(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM x\n")
    (tmp_path / "keep.py").write_text("k")
    (tmp_path / "big.log").write_text("x" * 1000)
    (tmp_path / ".dockerignore").write_text("*.log\nDockerfile\n")
    other = tmp_path.parent / f"{tmp_path.name}-df"
    other.write_text("FROM y\n")
    data, name = context_tarball(tmp_path)
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data))) as tf:
        names = sorted(tf.getnames())
    # the Dockerfile always travels (the server reads it; COPY still leaves it out, as .dockerignore says)
    assert names == [".dockerignore", "Dockerfile", "keep.py"] and name == "Dockerfile"
    data, name = context_tarball(tmp_path, other)
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data))) as tf:
        assert tf.extractfile(name).read() == b"FROM y\n"  # type: ignore[union-attr]


def test_substitute() -> None:
    env = {"A": "1", "E": ""}
    assert substitute("$A ${A} ${B:-d} ${A:+alt} ${B:+alt} \\$A ${E:-empty}", env) == "1 1 d alt  $A empty"


def test_digest_and_ref_follow_content(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM base\n")
    d1 = dockerfile_digest(tmp_path)
    (tmp_path / "x").write_text("1")
    d2 = dockerfile_digest(tmp_path)
    assert d1 != d2 and len(d1) == 16
    assert dockerfile_image_ref("Org/My Task!", d1) == f"dockerfile/org-my-task:{d1}"


def test_registry_config_keeps_what_docker_keeps() -> None:
    """A pulled or imported image's Labels, ExposedPorts, Volumes, Healthcheck, StopSignal, Shell and OnBuild
    reach its ImageConfig (`shoal image inspect`; a Dockerfile FROM it inherits them), and an image without
    them keeps the manifest bytes it always had."""
    from shoal.images.oci import image_config_from_oci
    from shoal.images.store import ImageConfig

    c = image_config_from_oci({"config": {
        "Env": ["A=1"], "Labels": {"org.x": "y"}, "ExposedPorts": {"80/tcp": {}}, "Volumes": {"/data": {}},
        "Healthcheck": {"Test": ["CMD", "true"], "Interval": 10**9}, "StopSignal": "SIGINT",
        "Shell": ["/bin/bash", "-c"], "OnBuild": ["RUN true"]}})
    assert (c.labels, c.exposed_ports, c.volumes, c.stop_signal, c.shell, c.onbuild) == (
        {"org.x": "y"}, ["80/tcp"], ["/data"], "SIGINT", ["/bin/bash", "-c"], ["RUN true"])
    assert c.healthcheck == {"Test": ["CMD", "true"], "Interval": 10**9}
    assert ImageConfig.from_dict(c.to_dict()) == c
    assert set(ImageConfig().to_dict()) == {"env", "workdir", "user", "entrypoint", "cmd"}
