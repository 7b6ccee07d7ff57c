"""Dockerfiles as shoal recipes: a task's `environment/Dockerfile` builds with the recipe step cache.

    built = dockerfile_recipe(Path("task/environment"), ref="dockerfile/fizzbuzz:1a2b3c")
    image = await build_recipe(node, built.recipe)
    built = await ensure_dockerfile_image(node, Path("task/environment"), "fizzbuzz")   # or: build once, by content

Supported: one stage (`FROM image [AS name]`, the image being a shoal image, or mapped to one with
`from_map`), `RUN` (shell and JSON forms), `COPY`/`ADD` of files from the build context (`--chown` with
numeric ids or root), `ENV`, `ARG` (with defaults and `build_args`), `WORKDIR`, `USER` and `SHELL`.
`CMD`, `ENTRYPOINT`, `EXPOSE`, `LABEL`, `MAINTAINER`, `HEALTHCHECK`, `STOPSIGNAL` and `VOLUME` describe how
a container is *run*, not what is in it; a sandbox runs its own agent as PID 1, so they are skipped and
listed in `DockerfileRecipe.ignored`. Everything else (multi-stage builds, `RUN --mount`, `COPY --from`,
`ADD` of URLs or archives, heredocs, `ONBUILD`) raises `InvalidRequest` naming the line and what to do.
"""

from __future__ import annotations

import glob
import json
import os
import posixpath
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.errors import InvalidRequest
from shoal.images.recipe import Copy, Env, Recipe, Run, Step, User, Workdir

if TYPE_CHECKING:
    from shoal.node.node import Node

#: instructions that only say how a container runs (a sandbox runs shoal's agent as PID 1)
RUNTIME_ONLY = frozenset({"CMD", "ENTRYPOINT", "EXPOSE", "LABEL", "MAINTAINER", "HEALTHCHECK", "STOPSIGNAL",
                          "VOLUME"})
_ARCHIVE = re.compile(r"\.(tar|tar\.gz|tgz|tar\.bz2|tbz2?|tar\.xz|txz|tar\.zst)$", re.I)
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?([-+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass
class DockerfileRecipe:
    """What a Dockerfile became: the recipe, plus what was read and what was skipped."""

    recipe: Recipe
    base: str
    ignored: list[str] = field(default_factory=list)


@dataclass
class _Line:
    no: int
    cmd: str
    flags: dict[str, str]
    rest: str


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join continuation lines; drop comments and blank lines; keep the first physical line number."""
    out: list[tuple[int, str]] = []
    buf: list[str] = []
    start = 0
    for no, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):  # a comment inside a continued instruction is dropped
            continue
        if not buf:
            start = no
        if raw.rstrip().endswith("\\"):
            buf.append(raw.rstrip()[:-1])
            continue
        buf.append(raw)
        out.append((start, " ".join(s.strip() for s in buf if s.strip())))
        buf = []
    if buf:
        out.append((start, " ".join(s.strip() for s in buf if s.strip())))
    return out


def _split(no: int, line: str, where: str) -> _Line:
    parts = line.split(None, 1)
    cmd = parts[0].upper()
    rest = parts[1] if len(parts) > 1 else ""
    flags: dict[str, str] = {}
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        name, _, val = word[2:].partition("=")
        flags[name.lower()] = val
        rest = rest.lstrip()
    if "<<" in rest and cmd in ("RUN", "COPY", "ADD") and re.search(r"<<-?\s*['\"]?[A-Za-z_]", rest):
        raise InvalidRequest(f"{where}:{no}: heredocs (`{cmd} <<EOF`) are not supported; put the script in a file "
                             "and COPY it, or use one RUN line")
    return _Line(no, cmd, flags, rest)


def _json_list(rest: str) -> list[str] | None:
    s = rest.strip()
    if not s.startswith("["):
        return None
    try:
        v = json.loads(s)
    except json.JSONDecodeError:
        return None
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return v
    return None


def substitute(s: str, env: dict[str, str]) -> str:
    """Docker's `$VAR`, `${VAR}`, `${VAR:-default}` and `${VAR:+alt}` expansion (unset = empty)."""
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(4)
        val = env.get(name)
        if m.group(2) == "-":
            return val if val else m.group(3)
        if m.group(2) == "+":
            return m.group(3) if val else ""
        return val or ""

    return _VAR.sub(one, s.replace("\\$", "\0")).replace("\0", "$")


def _kv_pairs(no: int, rest: str, what: str, where: str, env: dict[str, str]) -> dict[str, str]:
    """ENV/ARG bodies: `K=V K2="v 2"` or the legacy `K value with spaces`."""
    if "=" not in rest.split(None, 1)[0]:
        k, _, v = rest.partition(" ")
        if not k:
            raise InvalidRequest(f"{where}:{no}: {what} needs NAME=value")
        return {k: substitute(v.strip(), env)}
    out: dict[str, str] = {}
    try:
        words = shlex.split(rest, posix=True)
    except ValueError as e:
        raise InvalidRequest(f"{where}:{no}: {what}: {e}") from None
    for w in words:
        k, eq, v = w.partition("=")
        if not k or not eq:
            raise InvalidRequest(f"{where}:{no}: {what} {w!r} must look like NAME=value")
        out[k] = substitute(v, {**env, **out})
    return out


def _declare(args: dict[str, str], given: dict[str, str], no: int, rest: str, where: str,
             scope: dict[str, str]) -> None:
    """ARG NAME[=default]: the build arg given for NAME, else its default (else empty)."""
    pairs = _kv_pairs(no, rest, "ARG", where, scope) if "=" in rest else {k: "" for k in rest.split()}
    for k, v in pairs.items():
        args[k] = given.get(k, v)


def _owner(no: int, chown: str, where: str) -> str:
    if not chown:
        return "0:0"
    user, _, group = chown.partition(":")
    ids = []
    for x in (user, group or user):
        if x == "root":
            ids.append("0")
        elif x.isdigit():
            ids.append(x)
        else:
            raise InvalidRequest(f"{where}:{no}: COPY --chown={chown}: give numeric ids (uid:gid), e.g. "
                                 "--chown=1000:1000; user names are not resolved at build time")
    return ":".join(ids)


def _sources(no: int, srcs: list[str], context: Path, where: str, cmd: str) -> list[Path]:
    out: list[Path] = []
    root = context.resolve()
    for s in srcs:
        if re.match(r"^[a-z][a-z0-9+.-]*://", s, re.I):
            raise InvalidRequest(f"{where}:{no}: {cmd} of a URL ({s}) is not supported: download it in a RUN "
                                 "step, or put the file in the build context")
        if cmd == "ADD" and _ARCHIVE.search(s):
            raise InvalidRequest(f"{where}:{no}: ADD of an archive ({s}) would be unpacked by Docker; shoal does "
                                 "not: COPY it and unpack it in a RUN step")
        matches = sorted(glob.glob(str(context / s.lstrip("/")))) if any(c in s for c in "*?[") else \
            [str(context / s.lstrip("/"))]
        if not matches:
            raise InvalidRequest(f"{where}:{no}: {cmd} {s}: nothing in the build context matches")
        for m in matches:
            p = Path(m)
            real = p.resolve()
            if real != root and root not in real.parents:
                raise InvalidRequest(f"{where}:{no}: {cmd} {s}: outside the build context {context}")
            if not p.exists() and not p.is_symlink():
                raise InvalidRequest(f"{where}:{no}: {cmd} {s}: no such file in the build context {context}")
            out.append(p)
    return out


def _dockerignore(context: Path) -> list[str]:
    f = context / ".dockerignore"
    if not f.is_file():
        return []
    pats = []
    for ln in f.read_text().splitlines():
        ln = ln.strip()
        if ln and not ln.startswith("#") and not ln.startswith("!"):
            pats.append(ln.strip("/").removeprefix("**/"))
    return pats


def dockerfile_recipe(context: Path, ref: str, *, dockerfile: Path | None = None,
                      from_map: dict[str, str] | None = None, build_args: dict[str, str] | None = None,
                      network: bool = True) -> DockerfileRecipe:
    """The shoal recipe for `context/Dockerfile` (or `dockerfile`), tagged `ref`; COPY sources come from
    `context`. `from_map` maps FROM names (e.g. "debian:bookworm") to shoal images."""
    context = Path(context)
    path = Path(dockerfile) if dockerfile else context / "Dockerfile"
    where = str(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InvalidRequest(f"{path}: no such Dockerfile") from None
    except UnicodeDecodeError:
        raise InvalidRequest(f"{path}: not a text file") from None
    given = dict(build_args or {})
    # as in Docker: ARGs before FROM serve FROM only; after it, a declared ARG takes the given value or its default
    args: dict[str, str] = {}
    env: dict[str, str] = {}
    steps: list[Step] = []
    ignored: list[str] = []
    base: str | None = None
    workdir = "/"
    shell: list[str] | None = None
    excludes = _dockerignore(context)
    for no, line in _logical_lines(text):
        ins = _split(no, line, where)
        cmd, rest = ins.cmd, ins.rest
        scope = {**args, **env}
        if cmd == "FROM":
            if base is not None:
                raise InvalidRequest(f"{where}:{no}: multi-stage builds (a second FROM) are not supported: build "
                                     "the earlier stage's result as a shoal image and start FROM it")
            words = substitute(rest, scope).split()
            if not words or (len(words) not in (1, 3)) or (len(words) == 3 and words[1].upper() != "AS"):
                raise InvalidRequest(f"{where}:{no}: FROM needs an image (`FROM image [AS name]`)")
            name = words[0]
            base = (from_map or {}).get(name, name)
            args = {}
            if base == "scratch":
                raise InvalidRequest(f"{where}:{no}: FROM scratch is not supported: start from a shoal image")
            continue
        if base is None:
            if cmd == "ARG":
                _declare(args, given, no, rest, where, scope)
                continue
            raise InvalidRequest(f"{where}:{no}: {cmd} before FROM; a Dockerfile starts with FROM")
        if cmd in RUNTIME_ONLY:
            ignored.append(f"{cmd} (line {no})")
            continue
        if cmd == "ARG":
            _declare(args, given, no, rest, where, scope)
            continue
        if cmd == "ENV":
            kv = _kv_pairs(no, rest, "ENV", where, scope)
            env.update(kv)
            steps.append(Env(kv))
            continue
        if cmd == "WORKDIR":
            p = substitute(rest.strip(), scope)
            if not p:
                raise InvalidRequest(f"{where}:{no}: WORKDIR needs a path")
            workdir = posixpath.normpath(posixpath.join(workdir, p))
            steps.append(Workdir(workdir))
            continue
        if cmd == "USER":
            u = substitute(rest.strip(), scope)
            if not u:
                raise InvalidRequest(f"{where}:{no}: USER needs a user")
            steps.append(User(u))
            continue
        if cmd == "SHELL":
            sh = _json_list(rest)
            if not sh:
                raise InvalidRequest(f"{where}:{no}: SHELL takes a JSON list, e.g. SHELL [\"/bin/bash\", \"-c\"]")
            shell = sh
            continue
        if cmd == "RUN":
            if ins.flags:
                raise InvalidRequest(f"{where}:{no}: RUN --{next(iter(ins.flags))} is not supported (BuildKit "
                                     "mounts and options): use plain RUN")
            argv = _json_list(rest)
            body = shlex.join(argv) if argv is not None else rest
            if not body.strip():
                raise InvalidRequest(f"{where}:{no}: RUN needs a command")
            if shell and argv is None:
                body = shlex.join([*shell, body])
            # build args are in the environment of RUN steps only, as in Docker; not in the image
            run_args = {k: v for k, v in args.items() if k not in env}
            if run_args:
                body = "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(run_args.items())) + "; " + body
            steps.append(Run(body, network=network))
            continue
        if cmd in ("COPY", "ADD"):
            for flag in ins.flags:
                if flag not in ("chown", "link"):
                    raise InvalidRequest(f"{where}:{no}: {cmd} --{flag} is not supported"
                                         + (" (multi-stage builds are not)" if flag == "from" else ""))
            words = _json_list(rest)
            if words is None:
                try:
                    words = shlex.split(substitute(rest, scope))
                except ValueError as e:
                    raise InvalidRequest(f"{where}:{no}: {cmd}: {e}") from None
            else:
                words = [substitute(w, scope) for w in words]
            if len(words) < 2:
                raise InvalidRequest(f"{where}:{no}: {cmd} needs a source and a destination")
            *srcs, dst = words
            owner = _owner(no, substitute(ins.flags.get("chown", ""), scope), where)
            if len(srcs) > 1 and not dst.endswith("/"):
                dst += "/"  # Docker: several sources need a directory destination
            # as in Docker, a directory source's contents (not the directory itself) land in the destination
            for src in _sources(no, srcs, context, where, cmd):
                steps.append(Copy(src, dst, exclude=list(excludes), owner=owner))
            continue
        if cmd == "ONBUILD":
            raise InvalidRequest(f"{where}:{no}: ONBUILD is not supported")
        raise InvalidRequest(f"{where}:{no}: unknown instruction {cmd}")
    if base is None:
        raise InvalidRequest(f"{where}: no FROM line: a Dockerfile starts with FROM <image>")
    recipe = Recipe(ref=ref, base=base, steps=steps, network=network)
    try:
        recipe.validate()
    except InvalidRequest as e:
        raise InvalidRequest(f"{where}: {e.message}") from None
    return DockerfileRecipe(recipe=recipe, base=base, ignored=ignored)


def dockerfile_digest(context: Path, dockerfile: Path | None = None) -> str:
    """A short content hash of the Dockerfile and its build context (names an image built from it)."""
    import hashlib

    h = hashlib.sha256()
    context = Path(context)
    for root, dirs, files in os.walk(context):
        dirs.sort()
        for name in sorted(files):
            p = Path(root, name)
            rel = p.relative_to(context).as_posix()
            h.update(rel.encode() + b"\0")
            try:
                h.update(p.read_bytes() if not p.is_symlink() else os.readlink(p).encode())
            except OSError:
                pass
            h.update(b"\0")
    if dockerfile is not None:
        h.update(Path(dockerfile).read_bytes())
    return h.hexdigest()[:16]


def dockerfile_image_ref(name: str, digest: str) -> str:
    """A valid shoal image ref for the build of `name`'s Dockerfile (`name` may hold any characters)."""
    clean = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-._") or "task"
    return f"dockerfile/{clean[:80]}:{digest}"


_build_locks: dict[tuple[int, str], Any] = {}


async def ensure_dockerfile_image(node: Node, context: Path, name: str, *, from_map: dict[str, str] | None = None,
                                  build_args: dict[str, str] | None = None, network: bool = True,
                                  force: bool = False, log: Callable[[str], None] | None = None) -> DockerfileRecipe:
    """Build `context/Dockerfile` into `node`'s store unless an image of the same content exists; returns the
    recipe (its `recipe.ref` is the image). Concurrent callers in one process build once; the others wait
    and find the image (every step cached in the store, so another process rebuilds nothing either)."""
    import asyncio

    from shoal.images.recipe import build_recipe

    context = Path(context)
    digest = await asyncio.to_thread(dockerfile_digest, context)
    ref = dockerfile_image_ref(name, digest)
    built = dockerfile_recipe(context, ref, from_map=from_map, build_args=build_args, network=network)
    lock = _build_locks.setdefault((id(asyncio.get_running_loop()), ref), asyncio.Lock())
    async with lock:
        if force or not node.store.exists(ref):
            await build_recipe(node, built.recipe, no_cache=force, log=log)
    return built
