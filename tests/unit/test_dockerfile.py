"""Dockerfile -> shoal recipe: what each instruction becomes, and a clear error for what shoal cannot build."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.errors import InvalidRequest
from shoal.images.dockerfile import dockerfile_digest, dockerfile_image_ref, dockerfile_recipe, substitute
from shoal.images.recipe import Copy, Env, Run, User, Workdir


def _df(tmp_path: Path, text: str, **kw: object):
    (tmp_path / "Dockerfile").write_text(text)
    return dockerfile_recipe(tmp_path, "t:1", **kw)


def test_instructions_become_steps(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("a")
    (tmp_path / "req.txt").write_text("x")
    b = _df(tmp_path, """# comment
ARG BASE=base
FROM ${BASE} AS build
ARG VER=1.2
ENV A=1 B="two words" \\
    C=$A-x
ENV LEGACY value with spaces
WORKDIR /app
WORKDIR sub
COPY --chown=1000:1000 src/ ./src/
ADD req.txt /etc/
RUN echo $VER && \\
    # a comment inside a continued line
    echo done
RUN ["python3", "-c", "print(1)"]
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN set -x | cat
USER 1000
CMD ["sleep", "infinity"]
EXPOSE 80
""")
    r = b.recipe
    assert b.base == r.base == "base" and r.ref == "t:1"
    assert r.steps[0] == Env({"A": "1", "B": "two words", "C": "1-x"})
    assert r.steps[1] == Env({"LEGACY": "value with spaces"})
    assert r.steps[2:4] == [Workdir("/app"), Workdir("/app/sub")]
    assert isinstance(r.steps[4], Copy) and r.steps[4].owner == "1000:1000" and r.steps[4].dst == "./src/"
    assert isinstance(r.steps[5], Copy) and r.steps[5].dst == "/etc/"
    # build args are in RUN's environment (as in Docker), not in the image's
    assert r.steps[6] == Run("export VER=1.2; echo $VER && echo done", network=True)
    assert r.steps[7].cmd.endswith("python3 -c 'print(1)'")
    assert r.steps[8].cmd.endswith("/bin/bash -o pipefail -c 'set -x | cat'")
    assert r.steps[9] == User("1000")
    assert b.ignored == ["CMD (line 19)", "EXPOSE (line 20)"]


def test_from_map_build_args_and_dockerignore(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("k")
    (tmp_path / "drop.log").write_text("d")
    (tmp_path / ".dockerignore").write_text("# logs\n*.log\n")
    b = _df(tmp_path, "ARG TAG=12\nFROM debian:$TAG\nARG N\nRUN echo $N\nCOPY . /w\n",
            from_map={"debian:bookworm": "base"}, build_args={"TAG": "bookworm", "N": "7"})
    assert b.recipe.base == "base"
    assert b.recipe.steps[0].cmd == "export N=7; echo $N"
    assert b.recipe.steps[1].exclude == ["*.log"]


@pytest.mark.parametrize(("text", "words"), [
    ("RUN true\n", "before FROM"),
    ("FROM base\nFROM base\n", "multi-stage"),
    ("FROM base AS a\nCOPY --from=a /x /y\n", "--from"),
    ("FROM base\nRUN --mount=type=cache,target=/x true\n", "BuildKit"),
    ("FROM base\nADD https://example.com/x.tgz /x\n", "URL"),
    ("FROM base\nADD a.tar.gz /x\n", "archive"),
    ("FROM base\nCOPY missing.txt /x\n", "no such file"),
    ("FROM base\nCOPY ../outside /x\n", "outside the build context"),
    ("FROM base\nCOPY --chown=app:app f /x\n", "numeric ids"),
    ("FROM base\nRUN <<EOF\necho hi\nEOF\n", "heredocs"),
    ("FROM base\nONBUILD RUN true\n", "ONBUILD"),
    ("FROM base\nFROBNICATE x\n", "unknown instruction FROBNICATE"),
    ("FROM scratch\n", "scratch"),
    ("# nothing\n", "no FROM"),
    ("FROM base\nENV =x\n", "NAME=value"),
])
def test_unsupported_is_a_clear_error(tmp_path: Path, text: str, words: str) -> None:
    (tmp_path / "f").write_text("f")
    (tmp_path / "a.tar.gz").write_text("")
    (tmp_path.parent / "outside").mkdir(exist_ok=True)
    with pytest.raises(InvalidRequest, match=words) as e:
        _df(tmp_path, text)
    assert str(tmp_path / "Dockerfile") in e.value.message  # names the file (and the line)


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
