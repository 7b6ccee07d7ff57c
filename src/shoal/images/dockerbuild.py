"""`docker build` in shoal: a Dockerfile (BuildKit's frontend semantics) built with shoal's step cache.

    opts = BuildOptions(tag="app:1", context=Path("."), build_args={"V": "2"}, target="runtime")
    result = await build_dockerfile(node, opts, log=print)      # -> BuildResult(image=Image, …)

Each layer-making instruction (RUN, COPY, ADD, and WORKDIR when it creates a directory) runs in a fresh
shoal sandbox on top of the layers so far; the sandbox's writable layer becomes one EROFS layer at once
(shoal.images.recipe does the same for recipes). Stages are built concurrently when independent, and only
the stages the target needs are built. ENV, ARG, USER, SHELL, LABEL, EXPOSE, CMD, ENTRYPOINT, HEALTHCHECK,
STOPSIGNAL and VOLUME change the image config only.

Cache: a layer-making step is reused when its key matches: the parent layers' digests (so the base image's
digest and whatever `from_map`/pull resolved it to), the config it runs with (env, workdir, user), the
step itself, the build args it sees, and for COPY/ADD a digest of the sources' names, types, modes, link
targets and bytes. What is supported and what differs from Docker: docs/images.md, "Dockerfiles".
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hashlib
import io
import json
import os
import posixpath
import re
import shlex
import shutil
import stat
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.errors import ImageBuildError, ImageNotFound, InvalidRequest, ShoalError
from shoal.images.dockerfile_syntax import Instruction, Lexer, parse_dockerfile
from shoal.images.dockerignore import DockerIgnore, context_files
from shoal.images.dockerignore import _compile as _compile_glob
from shoal.images.refs import parse_ref
from shoal.images.store import Image, ImageConfig, ImageStore

if TYPE_CHECKING:
    from shoal.node.node import Node

STEP_CACHE = "steps"
_KEY_VERSION = "dockerfile-2"
DEFAULT_SHELL = ["/bin/sh", "-c"]
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PLATFORM = "linux/amd64"
#: build args every Dockerfile may use without declaring them globally (BuildKit's automatic platform args)
PLATFORM_ARGS = {"TARGETPLATFORM": PLATFORM, "TARGETOS": "linux", "TARGETARCH": "amd64", "TARGETVARIANT": "",
                 "BUILDPLATFORM": PLATFORM, "BUILDOS": "linux", "BUILDARCH": "amd64", "BUILDVARIANT": ""}
#: predefined proxy args: usable without ARG, never kept in the image
PROXY_ARGS = frozenset({"HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "FTP_PROXY", "ftp_proxy",
                        "NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy"})
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.I)
_GIT = re.compile(r"^(git@|git://|.*\.git(#.*)?$)")


# ---- options and results ------------------------------------------------------------------------
@dataclass
class BuildOptions:
    """What `docker build` takes: tag, context, Dockerfile, build args, target, cache, platform; plus
    `from_map` (FROM names -> images to use instead) and secrets for `RUN --mount=type=secret`."""

    tag: str
    context: Path
    dockerfile: Path | None = None
    dockerfile_text: str | None = None
    build_args: dict[str, str] = field(default_factory=dict)
    target: str | None = None
    no_cache: bool = False
    platform: str | None = None
    from_map: dict[str, str] = field(default_factory=dict)
    #: RUN steps' network: True (the default, as docker build), False, or egress rules like a sandbox's
    #: (`["debian", "pypi"]`: the build reaches those only; see docs/security.md)
    network: bool | list[str] = True
    secrets: dict[str, Path] = field(default_factory=dict)
    cpus: float = 2.0
    memory_mb: int = 2048
    disk_mb: int = 16384
    run_timeout: float = 3600.0
    labels: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        """InvalidRequest for a bad tag, platform or missing context."""
        r = parse_ref(self.tag)
        if r.digest:
            raise InvalidRequest(f"build target {self.tag!r} must be name[:tag], not a digest")
        if self.platform not in (None, "", PLATFORM, "linux/x86_64", "amd64", "linux"):
            raise InvalidRequest(f"--platform {self.platform}: this node builds {PLATFORM} only")
        if not Path(self.context).is_dir():
            raise InvalidRequest(f"build context {self.context} is not a directory")


@dataclass
class BuildResult:
    """The tagged image, the stages built, steps run and cached, and warnings (unused build args…)."""

    image: Image
    stages: list[str]
    steps_run: int = 0
    steps_cached: int = 0
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly summary."""
        return {"image": self.image.to_dict(), "stages": self.stages, "steps_run": self.steps_run,
                "steps_cached": self.steps_cached, "seconds": round(self.seconds, 3), "warnings": self.warnings}


# ---- stages -------------------------------------------------------------------------------------
@dataclass
class Stage:
    """One FROM … section."""

    index: int
    name: str | None
    base: str
    line: int
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class _State:
    """A stage while it builds: layers so far and the config."""

    layers: list[str]
    cfg: ImageConfig
    args: dict[str, str]
    shell: list[str]
    base_digest: str
    pending_dirs: list[tuple[str, str]] = field(default_factory=list)  # WORKDIRs to create (path, user)


def _where(opts: BuildOptions) -> str:
    return str(opts.dockerfile) if opts.dockerfile else "Dockerfile"


def read_dockerfile(opts: BuildOptions) -> str:
    """The Dockerfile's text (`dockerfile_text`, `-f` file, or CONTEXT/Dockerfile)."""
    if opts.dockerfile_text is not None:
        return opts.dockerfile_text
    path = Path(opts.dockerfile) if opts.dockerfile else Path(opts.context) / "Dockerfile"
    if not path.is_absolute() and opts.dockerfile and not path.exists():
        path = Path(opts.context) / path
    try:
        return path.read_text()
    except FileNotFoundError:
        raise InvalidRequest(f"{path}: no such Dockerfile") from None
    except IsADirectoryError:
        raise InvalidRequest(f"{path} is a directory, not a Dockerfile") from None
    except UnicodeDecodeError:
        raise InvalidRequest(f"{path}: not a text file") from None


def split_stages(text: str, opts: BuildOptions) -> tuple[list[Stage], dict[str, str], Lexer, list[str]]:
    """(stages, global args, lexer, warnings): ARGs before the first FROM are global (FROM lines see them)."""
    where = _where(opts)
    df = parse_dockerfile(text, where)
    lex = Lexer(df.escape)
    given = dict(opts.build_args)
    gargs: dict[str, str] = dict(PLATFORM_ARGS)
    stages: list[Stage] = []
    warnings: list[str] = []
    for ins in df.instructions:
        if ins.cmd == "FROM":
            words = lex.words(ins.rest, gargs)
            if len(words) not in (1, 3) or (len(words) == 3 and words[1].upper() != "AS"):
                raise InvalidRequest(f"{where}:{ins.line}: FROM needs an image: `FROM image [AS name]`")
            plat = ins.flag("platform")
            if plat:
                plat = lex.word(plat, gargs)
                if plat not in (PLATFORM, "linux/x86_64", "$BUILDPLATFORM", "$TARGETPLATFORM"):
                    raise InvalidRequest(f"{where}:{ins.line}: FROM --platform={plat}: this node builds {PLATFORM}")
            name = words[2].lower() if len(words) == 3 else None
            if name is not None and not re.fullmatch(r"[a-z][a-z0-9._-]*", name):
                raise InvalidRequest(f"{where}:{ins.line}: invalid stage name {words[2]!r}")
            if name is not None and any(s.name == name for s in stages):
                raise InvalidRequest(f"{where}:{ins.line}: duplicate stage name {name!r}")
            if not words[0]:
                raise InvalidRequest(f"{where}:{ins.line}: FROM expands to an empty image name")
            stages.append(Stage(index=len(stages), name=name, base=words[0], line=ins.line))
            continue
        if not stages:
            if ins.cmd == "ARG":
                for k, v in _arg_pairs(ins, lex, gargs, where):
                    gargs[k] = given[k] if k in given else (v if v is not None else gargs.get(k, ""))
                continue
            raise InvalidRequest(f"{where}:{ins.line}: {ins.cmd} before FROM: a Dockerfile starts with FROM "
                                 "(or ARG)")
        stages[-1].instructions.append(ins)
    if not stages:
        raise InvalidRequest(f"{where}: no FROM line: a Dockerfile needs `FROM <image>`")
    return stages, gargs, lex, warnings


def _arg_pairs(ins: Instruction, lex: Lexer, env: dict[str, str], where: str) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for w in _raw_words(ins.rest):
        k, eq, v = w.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise InvalidRequest(f"{where}:{ins.line}: ARG {w!r}: a name is letters, digits and _")
        out.append((k, lex.word(v, env) if eq else None))
    if not out:
        raise InvalidRequest(f"{where}:{ins.line}: ARG needs a name")
    return out


def _raw_words(s: str) -> list[str]:
    """Split on unquoted whitespace, keeping quotes and escapes (they are processed per value later)."""
    out, cur, quote, i = [], [], "", 0
    has = False
    while i < len(s):
        c = s[i]
        if quote:
            cur.append(c)
            if c == quote:
                quote = ""
            elif c == "\\" and quote == '"' and i + 1 < len(s):
                cur.append(s[i + 1])
                i += 1
        elif c in "\"'":
            quote = c
            cur.append(c)
            has = True
        elif c == "\\" and i + 1 < len(s):
            cur.append(c + s[i + 1])
            i += 1
            has = True
        elif c.isspace():
            if has:
                out.append("".join(cur))
            cur, has = [], False
        else:
            cur.append(c)
            has = True
        i += 1
    if has:
        out.append("".join(cur))
    return out


def _kv(ins: Instruction, lex: Lexer, env: dict[str, str], where: str, what: str) -> list[tuple[str, str]]:
    """ENV/LABEL bodies: `K=V K2="v 2"`, or the legacy `K value with spaces`."""
    words = _raw_words(ins.rest)
    if not words:
        raise InvalidRequest(f"{where}:{ins.line}: {what} needs NAME=value")
    if "=" not in words[0]:
        if what == "LABEL":
            raise InvalidRequest(f"{where}:{ins.line}: LABEL needs key=value pairs")
        k, _, v = ins.rest.strip().partition(" ")
        return [(k, lex.word(v.strip(), env))]
    out = []
    scope = dict(env)
    for w in words:
        k, eq, v = w.partition("=")
        if not eq:
            raise InvalidRequest(f"{where}:{ins.line}: {what} {w!r} must look like NAME=value")
        k = lex.word(k, scope)
        val = lex.word(v, scope)
        if what == "ENV":
            scope[k] = val
        out.append((k, val))
    return out


def needed_stages(stages: list[Stage], target: Stage, lex: Lexer, gargs: dict[str, str]) -> list[Stage]:
    """The stages `target` depends on (FROM stage, COPY --from, RUN --mount from=), target last."""
    by_name = {s.name: s for s in stages if s.name}
    order: list[Stage] = []
    seen: set[int] = set()

    def ref(name: str, before: int) -> Stage | None:
        low = name.lower()
        if low in by_name and by_name[low].index < before:
            return by_name[low]
        if name.isdigit() and int(name) < before:
            return stages[int(name)]
        return None

    def visit(s: Stage) -> None:
        if s.index in seen:
            return
        seen.add(s.index)
        b = ref(s.base, s.index)
        if b is not None:
            visit(b)
        for ins in s.instructions:
            srcs = []
            if ins.cmd in ("COPY", "ADD") and ins.flag("from"):
                srcs.append(ins.flag("from") or "")
            if ins.cmd == "RUN":
                for m in ins.flag_all("mount"):
                    opts = _mount_fields(m)
                    if opts.get("from"):
                        srcs.append(opts["from"])
            for f in srcs:
                dep = ref(lex.word(f, gargs), s.index)
                if dep is not None:
                    visit(dep)
        order.append(s)

    visit(target)
    return order


def _mount_fields(spec: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in spec.split(","):
        k, eq, v = part.partition("=")
        out[k.strip().lower()] = v.strip() if eq else "true"
    return out


# ---- the builder ----------------------------------------------------------------------------------
class DockerBuild:
    """One `docker build`: stages, their tasks, counters."""

    def __init__(self, node: Node, opts: BuildOptions, log: Callable[[str], None] | None = None,
                 resolve_base: Callable[[str], Any] | None = None) -> None:
        opts.check()
        self.node = node
        self.store: ImageStore = node.store
        self.opts = opts
        self.log = log or (lambda s: None)
        self.where = _where(opts)
        self.resolve_base = resolve_base
        self.context = Path(opts.context).resolve()
        self.ignore = DockerIgnore.load(self.context, Path(opts.dockerfile) if opts.dockerfile else None)
        self._ctx_files: dict[str, os.stat_result] | None = None
        self.tasks: dict[int, asyncio.Task[tuple[_State, Image | None]]] = {}
        self.run = 0
        self.cached = 0
        self.warnings: list[str] = []
        self.used_args: set[str] = set()
        self.name = parse_ref(opts.tag).name
        self.n_steps = 0
        self.step_no = 0
        self._host_dirs: list[Path] = []

    # ---- entry -----------------------------------------------------------------------------
    async def build(self) -> BuildResult:
        """Build the target stage and tag it."""
        t0 = time.monotonic()
        text = read_dockerfile(self.opts)
        self.stages, self.gargs, self.lex, self.warnings = split_stages(text, self.opts)
        target = self.stages[-1]
        if self.opts.target:
            found = [s for s in self.stages if s.name == self.opts.target.lower()]
            if not found:
                names = ", ".join(s.name for s in self.stages if s.name) or "none"
                raise InvalidRequest(f"target stage {self.opts.target!r} could not be found (stages: {names})")
            target = found[0]
        order = needed_stages(self.stages, target, self.lex, self.gargs)
        self.n_steps = sum(len(s.instructions) + 1 for s in order)
        # every needed stage starts now: independent stages build side by side, each waits for what it uses
        tasks = [self._start_stage(s) for s in order]
        try:
            # the first stage to fail fails the build at once (the others are cancelled below)
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            st, _img = await self._stage(target)
        finally:
            pending = [t for t in self.tasks.values() if not t.done()]
            for t in pending:
                t.cancel()
            for t in pending:
                with contextlib.suppress(BaseException):
                    await t
        unused = sorted(set(self.opts.build_args) - self.used_args - set(self.gargs))
        if unused:
            self.warnings.append(f"build args not consumed by the Dockerfile: {', '.join(unused)}")
        if not st.layers:
            st.layers = [self._empty_layer()]
        lineage = {"built_by": "dockerfile", "stages": [s.name or str(s.index) for s in order],
                   "target": target.name or str(target.index), "base_digest": st.base_digest,
                   "build_args": sorted(self.opts.build_args)}
        cfg = st.cfg
        if self.opts.labels:
            cfg.labels.update(self.opts.labels)
        img = self.store.put_image(self.opts.tag, st.layers, cfg, lineage=lineage)
        secs = time.monotonic() - t0
        self.log(f"built {img.ref} {img.digest[:19]}: {len(img.layers)} layers, {self.run} steps run, "
                 f"{self.cached} cached, {secs:.1f}s")
        return BuildResult(image=img, stages=[s.name or str(s.index) for s in order], steps_run=self.run,
                           steps_cached=self.cached, seconds=secs, warnings=self.warnings)

    def _empty_layer(self) -> str:
        with tempfile.TemporaryDirectory(dir=self.store.tmp_dir) as d:
            os.chmod(d, 0o755)
            return self.store.add_layer_from_dir(Path(d), {"type": "empty"}).digest

    # ---- stages ------------------------------------------------------------------------------
    def _stage_ref(self, name: str, before: int) -> Stage | None:
        low = name.lower()
        for s in self.stages[:before]:
            if s.name == low:
                return s
        if name.isdigit() and int(name) < before:
            return self.stages[int(name)]
        return None

    def _start_stage(self, stage: Stage) -> asyncio.Task[tuple[_State, Image | None]]:
        task = self.tasks.get(stage.index)
        if task is None:
            task = asyncio.ensure_future(self._build_stage(stage))
            self.tasks[stage.index] = task
        return task

    async def _stage(self, stage: Stage) -> tuple[_State, Image | None]:
        return await asyncio.shield(self._start_stage(stage))

    async def _stage_image(self, stage: Stage) -> Image:
        """A built stage as an (untagged) image, for FROM, COPY --from and mounts."""
        _, img = await self._stage(stage)
        if img is None:
            raise ImageBuildError(f"stage {stage.name or stage.index} has no image")
        return img

    async def _resolve_image(self, name: str, line: int) -> Image:
        mapped = self.opts.from_map.get(name, name)
        if self.resolve_base is not None:
            res = self.resolve_base(mapped)
            if asyncio.iscoroutine(res):
                res = await res
            return res  # type: ignore[no-any-return]
        try:
            # the store's image, or pulled from its registry per pull_policy (shoal.images.pull)
            return await self.node.resolve_image(mapped)
        except InvalidRequest as e:
            raise InvalidRequest(f"{self.where}:{line}: FROM {name}: {e.message}") from None
        except ImageNotFound as e:
            hint = (f" (from_map sent it to {mapped!r})" if mapped != name else
                    "; pull or import it (`shoal image pull`, `shoal image import`), or map the name to a shoal "
                    "image with from_map, e.g. {\"" + name + "\": \"base\"}")
            raise ImageNotFound(f"{self.where}:{line}: FROM {name}: {e.message}{hint}") from None

    async def _build_stage(self, stage: Stage) -> tuple[_State, Image | None]:
        label = stage.name or str(stage.index)
        dep = self._stage_ref(stage.base, stage.index)
        if dep is not None:
            parent_state, _ = await self._stage(dep)
            layers = list(parent_state.layers)
            cfg = parent_state.cfg.copy()
            shell = list(parent_state.shell)
            base_digest = parent_state.base_digest
        elif stage.base.lower() == "scratch":
            layers, cfg, shell, base_digest = [], ImageConfig(env={"PATH": DEFAULT_PATH}), list(DEFAULT_SHELL), ""
        else:
            base = await self._resolve_image(stage.base, stage.line)
            layers = [lay.digest for lay in base.layers]
            cfg = base.config.copy()
            shell = list(cfg.shell or DEFAULT_SHELL)
            base_digest = base.digest
            for lay in layers:
                self.store.touch_layer(lay)
        cfg.env.setdefault("PATH", DEFAULT_PATH)
        self._log_step(f"FROM {stage.base}" + (f" AS {stage.name}" if stage.name else ""), label)
        st = _State(layers=layers, cfg=cfg, args={}, shell=shell, base_digest=base_digest)
        for ins in stage.instructions:
            await self._dispatch(stage, st, ins)
        if st.pending_dirs:
            await self._layer_step(stage, st, {"mkdir": st.pending_dirs}, "WORKDIR (create)", self._do_nothing,
                                   network=False)
        st.cfg.shell = [] if st.shell == DEFAULT_SHELL else list(st.shell)
        img = None
        layers_for_img = st.layers or [self._empty_layer()]
        mdigest = self.store.put_manifest(layers_for_img, st.cfg, lineage={"build": self.opts.tag, "stage": label})
        img = self.store.resolve(f"{self.name}@{mdigest}")
        return st, img

    def _log_step(self, text: str, stage: str, suffix: str = "") -> None:
        self.step_no += 1
        self.log(f"[{stage} {self.step_no}/{self.n_steps}] {text[:300]}{suffix}")

    def _scope(self, st: _State) -> dict[str, str]:
        """What $VAR sees: the stage's args, then the config's env over them."""
        return {**st.args, **st.cfg.env}

    # ---- instructions ------------------------------------------------------------------------
    async def _dispatch(self, stage: Stage, st: _State, ins: Instruction) -> None:
        where = f"{self.where}:{ins.line}"
        label = stage.name or str(stage.index)
        lex = self.lex
        cmd = ins.cmd
        scope = self._scope(st)
        if cmd == "ARG":
            for k, v in _arg_pairs(ins, lex, scope, where):
                self.used_args.add(k)
                if k in self.opts.build_args:
                    val = self.opts.build_args[k]
                elif v is not None:
                    val = v
                elif k in self.gargs:
                    val = self.gargs[k]  # a global ARG redeclared in the stage takes its value
                else:
                    val = None  # declared without a value: unset
                if val is not None:
                    st.args[k] = val
                else:
                    st.args.pop(k, None)
            self._log_step(ins.original, label)
            return
        if cmd == "ENV":
            for k, v in _kv(ins, lex, scope, where, "ENV"):
                if not k or "=" in k:
                    raise InvalidRequest(f"{where}: ENV name {k!r} is not valid")
                st.cfg.env[k] = v
            self._log_step(ins.original, label)
            return
        if cmd == "LABEL":
            for k, v in _kv(ins, lex, scope, where, "LABEL"):
                st.cfg.labels[k] = v
            self._log_step(ins.original, label)
            return
        if cmd == "MAINTAINER":
            st.cfg.labels.setdefault("maintainer", ins.rest)
            self._log_step(ins.original, label)
            return
        if cmd == "WORKDIR":
            p = lex.word(ins.rest.strip(), scope)
            if not p:
                raise InvalidRequest(f"{where}: WORKDIR needs a path")
            wd = posixpath.normpath(posixpath.join(st.cfg.workdir or "/", p))
            st.cfg.workdir = wd
            if wd != "/":
                st.pending_dirs.append((wd, st.cfg.user or ""))
            self._log_step(ins.original, label)
            return
        if cmd == "USER":
            u = lex.word(ins.rest.strip(), scope)
            if not u or any(c.isspace() for c in u):
                raise InvalidRequest(f"{where}: USER needs one user: name, uid, name:group or uid:gid")
            st.cfg.user = u
            self._log_step(ins.original, label)
            return
        if cmd == "SHELL":
            if not ins.json:
                raise InvalidRequest(f"{where}: SHELL takes a JSON list, e.g. SHELL [\"/bin/bash\", \"-c\"]")
            st.shell = list(ins.json)
            self._log_step(ins.original, label)
            return
        if cmd in ("CMD", "ENTRYPOINT"):
            argv = list(ins.json) if ins.json is not None else ([*st.shell, ins.rest] if ins.rest else [])
            if cmd == "CMD":
                st.cfg.cmd = argv
            else:
                st.cfg.entrypoint = argv
                st.cfg.cmd = []  # as in Docker: a new ENTRYPOINT resets the CMD it inherited
            self._log_step(ins.original, label)
            return
        if cmd == "EXPOSE":
            for w in lex.words(ins.rest, scope):
                port, _, proto = w.partition("/")
                if not re.fullmatch(r"\d+(-\d+)?", port) or proto not in ("", "tcp", "udp", "sctp"):
                    raise InvalidRequest(f"{where}: EXPOSE {w!r}: give PORT[/tcp|udp|sctp]")
                key = f"{port}/{proto or 'tcp'}"
                if key not in st.cfg.exposed_ports:
                    st.cfg.exposed_ports.append(key)
            self._log_step(ins.original, label)
            return
        if cmd == "VOLUME":
            vols = ins.json if ins.json is not None else lex.words(ins.rest, scope)
            for v in vols:
                v = lex.expand(v, scope) if ins.json is not None else v
                if not v:
                    raise InvalidRequest(f"{where}: VOLUME needs a path")
                if v not in st.cfg.volumes:
                    st.cfg.volumes.append(v)
            self._log_step(ins.original, label)
            return
        if cmd == "STOPSIGNAL":
            sig = lex.word(ins.rest.strip(), scope)
            if not re.fullmatch(r"(SIG)?[A-Z0-9+-]+|\d+", sig):
                raise InvalidRequest(f"{where}: STOPSIGNAL {sig!r} is not a signal")
            st.cfg.stop_signal = sig
            self._log_step(ins.original, label)
            return
        if cmd == "HEALTHCHECK":
            st.cfg.healthcheck = _healthcheck(ins, st.shell, where)
            self._log_step(ins.original, label)
            return
        if cmd == "ONBUILD":
            st.cfg.onbuild.append(ins.rest)
            self._log_step(ins.original, label)
            return
        if cmd == "RUN":
            await self._run(stage, st, ins, where)
            return
        if cmd in ("COPY", "ADD"):
            await self._copy(stage, st, ins, where)
            return
        raise InvalidRequest(f"{where}: unknown instruction {cmd}")

    # ---- RUN -----------------------------------------------------------------------------------
    def _run_env(self, st: _State) -> dict[str, str]:
        """Build args a RUN sees as environment variables (never kept in the image); ENV wins."""
        out = {k: v for k, v in st.args.items() if k not in st.cfg.env}
        for k in PROXY_ARGS:
            if k in self.opts.build_args:
                out[k] = self.opts.build_args[k]
        return out

    async def _run(self, stage: Stage, st: _State, ins: Instruction, where: str) -> None:
        network: bool | list[str] = self.opts.network
        for k, v in ins.flags:
            if k == "network":
                if v in ("none",):
                    network = False
                elif v in ("default", "host", None, ""):
                    pass
                else:
                    raise InvalidRequest(f"{where}: RUN --network={v}: use none, default or host")
            elif k == "mount":
                pass
            elif k == "security":
                if v != "sandbox":
                    raise InvalidRequest(f"{where}: RUN --security={v} is not supported (sandboxes are never "
                                         "privileged)")
            else:
                raise InvalidRequest(f"{where}: RUN --{k} is not a RUN option (--mount, --network)")
        if ins.json is not None:
            argv = list(ins.json)
            if not argv:
                raise InvalidRequest(f"{where}: RUN needs a command")
        else:
            script = ins.rest
            if ins.heredocs:
                only = re.fullmatch(r"<<-?[\"']?([A-Za-z0-9_./-]+)[\"']?", script.strip())
                if only and len(ins.heredocs) == 1:
                    doc = ins.heredocs[0]
                    body = doc.content
                    if body.startswith("#!"):
                        # a script with its own interpreter runs as a file, as in BuildKit
                        argv = ["/bin/sh", "-c", 'f=$(mktemp) && cat > "$f" <<\'SHOAL_HEREDOC_EOF\'\n' + body +
                                'SHOAL_HEREDOC_EOF\nchmod +x "$f" && "$f"; r=$?; rm -f "$f"; exit $r']
                    else:
                        argv = [*st.shell, body]
                else:
                    # `RUN cmd <<EOF`: the shell gets the command and the documents, and does the heredocs itself
                    text = script
                    for doc in ins.heredocs:
                        text += "\n" + doc.content + doc.name
                    argv = [*st.shell, text + "\n"]
            else:
                if not script.strip():
                    raise InvalidRequest(f"{where}: RUN needs a command")
                argv = [*st.shell, script]
        mounts = [self._parse_mount(m, st, where) for m in ins.flag_all("mount")]
        env = self._run_env(st)
        mount_keys: list[Any] = [m.key() for m in mounts]
        holders: list[tempfile.TemporaryDirectory[str]] = []
        for m in mounts:
            if m.from_stage is not None:
                if m.kind != "bind":
                    raise InvalidRequest(f"{where}: --mount=type={m.kind},from=… is not supported (bind mounts only)")
                dep = self._stage_ref(m.from_stage, stage.index)
                img = await self._stage_image(dep) if dep is not None else await self._resolve_image(m.from_stage,
                                                                                                      ins.line)
                m.from_image = img
                tmp, got = await self._export(img, [m.source or "/"], where, "RUN --mount")
                holders.append(tmp)
                m.host_dir = got[0].path
                mount_keys.append({"from": [lay.digest for lay in img.layers], "source": m.source})
            elif m.kind == "bind":
                mount_keys.append({"ctx": await asyncio.to_thread(self._ctx_digest, [m.source or "."])})
        desc = {"run": argv, "env": sorted(env.items()), "network": network, "mounts": mount_keys}

        async def action(sid: str) -> None:
            await self._exec(sid, argv, st, env, ins, where)

        try:
            await self._layer_step(stage, st, desc, ins.original, action, network=network, mounts=mounts)
        finally:
            for t in holders:
                t.cleanup()

    async def _exec(self, sid: str, argv: list[str], st: _State, env: dict[str, str], ins: Instruction,
                    where: str) -> None:
        from shoal.images.recipe import _Tail

        tail = _Tail()
        pending = b""
        handle = await self.node.stream(sid, argv, timeout=self.opts.run_timeout, cwd=st.cfg.workdir or "/",
                                        env=env or None, user=st.cfg.user or "root")
        result = None
        async for ev in handle:
            if ev.kind in ("stdout", "stderr"):
                tail.add(ev.data)
                pending += ev.data
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    self.log("      " + line.decode("utf-8", "replace").rstrip("\r"))
            elif ev.kind == "exit":
                result = ev.result
        if pending:
            self.log("      " + pending.decode("utf-8", "replace"))
        what = f"{where}: `{ins.original[:200]}`"
        if result is None:
            raise ImageBuildError(f"{what}: the build sandbox stopped answering", output_tail=tail.text())
        if result.timed_out:
            raise ImageBuildError(f"{what} timed out after {self.opts.run_timeout:.0f}s; last output:\n{tail.text()}",
                                  exit_code=result.exit_code, output_tail=tail.text())
        if result.exit_code != 0:
            raise ImageBuildError(f"{what} failed with exit code {result.exit_code}; last output:\n{tail.text()}",
                                  exit_code=result.exit_code, output_tail=tail.text())

    def _parse_mount(self, spec: str, st: _State, where: str) -> BuildMount:
        f = _mount_fields(self.lex.word(spec, self._scope(st)) if "$" in spec else spec)
        kind = f.pop("type", "bind")
        target = f.pop("target", f.pop("dst", f.pop("destination", "")))
        if kind == "ssh":
            raise InvalidRequest(f"{where}: RUN --mount=type=ssh is not supported (no SSH agent forwarding into "
                                 "build sandboxes); fetch private sources with a secret mount")
        if kind == "secret":
            sid = f.get("id") or (posixpath.basename(target) if target else "")
            if not sid:
                raise InvalidRequest(f"{where}: --mount=type=secret needs id=")
            target = target or f"/run/secrets/{sid}"
            path = self.opts.secrets.get(sid)
            if path is None and f.get("required") in ("true", "1"):
                raise InvalidRequest(f"{where}: secret {sid!r} is required: pass it with --secret id={sid},src=FILE")
            return BuildMount(kind, target, secret_id=sid, secret_path=path, mode=int(f.get("mode", "0400"), 8),
                              uid=int(f.get("uid", "0")), gid=int(f.get("gid", "0")))
        if not target:
            raise InvalidRequest(f"{where}: --mount=type={kind} needs target=")
        if not target.startswith("/"):
            target = posixpath.join(st.cfg.workdir or "/", target)
        ro = f.get("ro", f.get("readonly", "false")) in ("true", "1") or ("rw" not in f and kind == "bind"
                                                                           and f.get("readwrite") != "true")
        if kind == "bind":
            return BuildMount(kind, target, source=f.get("source", f.get("src", "")), from_stage=f.get("from"),
                              readonly=ro)
        if kind == "cache":
            cid = f.get("id") or target
            return BuildMount(kind, target, cache_id=cid, from_stage=f.get("from"), source=f.get("source", ""),
                              mode=int(f.get("mode", "0755"), 8), uid=int(f.get("uid", "0")),
                              gid=int(f.get("gid", "0")), readonly=f.get("ro", "false") in ("true", "1"),
                              sharing=f.get("sharing", "shared"))
        if kind == "tmpfs":
            return BuildMount(kind, target, size=f.get("size", ""))
        if kind == "ssh":
            raise InvalidRequest(f"{where}: RUN --mount=type=ssh is not supported (no SSH agent forwarding into "
                                 "build sandboxes); fetch private sources with a secret mount")
        raise InvalidRequest(f"{where}: unknown mount type {kind!r} (bind, cache, secret, tmpfs)")

    # ---- COPY / ADD ----------------------------------------------------------------------------
    async def _copy(self, stage: Stage, st: _State, ins: Instruction, where: str) -> None:
        cmd = ins.cmd
        scope = self._scope(st)
        lex = self.lex
        for k, _ in ins.flags:
            if k not in ("from", "chown", "chmod", "link", "checksum", "keep-git-dir", "exclude", "parents"):
                raise InvalidRequest(f"{where}: {cmd} --{k} is not a {cmd} option")
            if k in ("parents", "exclude"):
                raise InvalidRequest(f"{where}: {cmd} --{k} (Dockerfile labs syntax) is not supported")
            if k in ("checksum", "keep-git-dir") and cmd != "ADD":
                raise InvalidRequest(f"{where}: COPY --{k}: only ADD has it")
        src_from = lex.word(ins.flag("from") or "", scope) or None
        chown = lex.word(ins.flag("chown") or "", scope)
        chmod_s = lex.word(ins.flag("chmod") or "", scope)
        chmod = None
        if chmod_s:
            if not re.fullmatch(r"[0-7]{3,4}", chmod_s):
                raise InvalidRequest(f"{where}: {cmd} --chmod={chmod_s}: give octal permissions like 755")
            chmod = int(chmod_s, 8)
        checksum = ins.flag("checksum")
        docs = ins.heredocs
        if ins.json is not None:
            words = [lex.expand(w, scope) for w in ins.json]
        elif docs:
            words = lex.words(re.sub(r"<<-?[\"']?([A-Za-z0-9_./-]+)[\"']?", lambda m: "<<" + m.group(1), ins.rest),
                              scope)
        else:
            words = lex.words(ins.rest, scope)
        if len(words) < 2:
            raise InvalidRequest(f"{where}: {cmd} needs a source and a destination")
        *srcs, dst = words
        if not dst.startswith("/"):
            dst = posixpath.join(st.cfg.workdir or "/", dst) + ("/" if dst.endswith("/") or dst in (".", "./")
                                                              else "")
        # where the sources come from: the context, a stage, an image, URLs or heredocs
        entries: list[_Src] = []
        content_key: Any
        keep_owner = False
        tmp_holder: list[tempfile.TemporaryDirectory[str]] = []
        dl_dirs: list[str] = []
        if src_from is not None:
            dep = self._stage_ref(src_from, stage.index)
            img = await self._stage_image(dep) if dep is not None else await self._resolve_image(src_from, ins.line)
            exported = await self._export(img, srcs, where, cmd)
            tmp_holder.append(exported[0])
            entries = exported[1]
            keep_owner = True
            # (a stage's manifest carries its creation time: its layers and config are what count)
            content_key = {"from": [lay.digest for lay in img.layers], "config": img.config.to_dict(), "srcs": srcs}
        else:
            for s in srcs:
                if s.startswith("<<") and any(d.name == s[2:] for d in docs):
                    d = next(d for d in docs if d.name == s[2:])
                    data = lex.expand(d.content, scope) if d.expand else d.content
                    entries.append(_Src(name=d.name, data=data.encode()))
                elif _URL.match(s):
                    if cmd != "ADD":
                        raise InvalidRequest(f"{where}: COPY of a URL ({s}): use ADD, or download it in a RUN step")
                    if _GIT.match(s):
                        raise InvalidRequest(f"{where}: ADD of a git repository ({s}) is not supported: clone it in a "
                                             "RUN step")
                    got = await self._download(s, checksum, where)
                    entries.append(got)
                    if got.tmpdir:
                        dl_dirs.append(got.tmpdir)
                else:
                    if checksum:
                        raise InvalidRequest(f"{where}: ADD --checksum is only for URL sources")
                    entries.extend(await asyncio.to_thread(self._context_sources, s, where, cmd))
            content_key = [e.key(self.ignore if e.rel or e.path == self.context else None) for e in entries]
        if not entries:
            raise InvalidRequest(f"{where}: {cmd}: no source files were specified")
        # BuildKit's rules: several source arguments need a directory destination ending in '/'; several
        # matches of a wildcard, or a trailing '/', make dst a directory
        if len(srcs) > 1 and not dst.endswith("/"):
            raise InvalidRequest(f"{where}: when using {cmd} with more than one source file, the destination must "
                                 "be a directory and end with a /")
        dir_dst = dst.endswith("/") or len(entries) > 1
        extract = cmd == "ADD"
        desc = {"copy": content_key, "dst": dst, "chown": chown, "chmod": chmod, "keep_owner": keep_owner,
                "add": extract}

        async def action(sid: str) -> Path | None:
            try:
                return await self._copy_into(sid, st, entries, dst, dir_dst, chown, chmod, keep_owner, extract,
                                             where, cmd)
            finally:
                for t in tmp_holder:
                    t.cleanup()

        try:
            await self._layer_step(stage, st, desc, ins.original, action, network=False)
        finally:
            for t in tmp_holder:
                t.cleanup()
            for dl in dl_dirs:
                shutil.rmtree(dl, ignore_errors=True)

    def _context_index(self) -> dict[str, os.stat_result]:
        if self._ctx_files is None:
            self._ctx_files = dict(context_files(self.context, self.ignore))
        return self._ctx_files

    def _context_sources(self, src: str, where: str, cmd: str) -> list[_Src]:
        files = self._context_index()
        rel = posixpath.normpath(src.lstrip("/")) if src.strip("/") else "."
        if rel == ".." or rel.startswith("../"):
            raise InvalidRequest(f"{where}: {cmd} {src}: forbidden path outside the build context")
        wildcard = any(c in rel for c in "*?[")
        if rel == ".":
            return [_Src(name=".", path=self.context, is_dir=True, rel="")]
        if wildcard:
            rx = _compile_glob(rel)
            names = sorted(r for r in files if rx.match(r))
            if not names:
                raise InvalidRequest(f"{where}: {cmd} {src}: no source files were specified (nothing in the build "
                                     "context matches)")
            return [self._ctx_src(n, wildcard=True) for n in names]
        st = files.get(rel)
        if st is None:
            p = self.context / rel
            if p.exists() or p.is_symlink():
                raise InvalidRequest(f"{where}: {cmd} {src}: the path is excluded by .dockerignore")
            raise InvalidRequest(f"{where}: {cmd} {src}: not found in the build context")
        return [self._ctx_src(rel)]

    def _ctx_src(self, rel: str, wildcard: bool = False) -> _Src:
        p = self.context / rel
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            # the top of a source is followed (as in Docker), within the context
            real = p.resolve()
            if real != self.context and self.context not in real.parents:
                raise InvalidRequest(f"{rel}: the symlink points outside the build context")
            st = os.stat(p)
            return _Src(name=posixpath.basename(rel), path=real, is_dir=stat.S_ISDIR(st.st_mode),
                        rel=real.relative_to(self.context).as_posix(), wildcard=wildcard)
        return _Src(name=posixpath.basename(rel), path=p, is_dir=stat.S_ISDIR(st.st_mode), rel=rel, wildcard=wildcard)

    def _ctx_digest(self, srcs: list[str]) -> str:
        h = hashlib.sha256()
        for s in srcs:
            for e in self._context_sources(s, "mount", "mount"):
                h.update(json.dumps(e.key(self.ignore)).encode())
        return h.hexdigest()

    async def _download(self, url: str, checksum: str | None, where: str) -> _Src:
        import httpx

        if checksum is not None and not re.fullmatch(r"sha256:[0-9a-f]{64}", checksum):
            raise InvalidRequest(f"{where}: ADD --checksum={checksum}: expected sha256:<64 hex digits>")
        tmpd = tempfile.mkdtemp(prefix="shoal-add-", dir=self.store.tmp_dir)
        name = posixpath.basename(url.split("?", 1)[0].split("#", 1)[0].rstrip("/")) or "index.html"
        path = Path(tmpd) / "data"
        h = hashlib.sha256()
        mtime = None
        try:
            async with httpx.AsyncClient(follow_redirects=True, timeout=300.0) as c, c.stream("GET", url) as r:
                if r.status_code >= 400:
                    raise InvalidRequest(f"{where}: ADD {url}: the server answered {r.status_code}")
                with open(path, "wb") as f:
                    async for chunk in r.aiter_bytes(1 << 20):
                        h.update(chunk)
                        f.write(chunk)
                lm = r.headers.get("last-modified")
                if lm:
                    from email.utils import parsedate_to_datetime
                    with contextlib.suppress(TypeError, ValueError):
                        mtime = parsedate_to_datetime(lm).timestamp()
                cd = r.headers.get("content-disposition", "")
                m = re.search(r'filename="?([^";]+)"?', cd)
                if m and "/" not in m.group(1):
                    name = m.group(1)
        except httpx.HTTPError as e:
            shutil.rmtree(tmpd, ignore_errors=True)
            raise InvalidRequest(f"{where}: ADD {url}: download failed: {e}") from None
        except BaseException:
            shutil.rmtree(tmpd, ignore_errors=True)
            raise
        digest = "sha256:" + h.hexdigest()
        if checksum is not None and digest != checksum:
            shutil.rmtree(tmpd, ignore_errors=True)
            raise InvalidRequest(f"{where}: ADD {url}: checksum mismatch: expected {checksum}, got {digest}")
        os.chmod(path, 0o600)
        if mtime is not None:
            os.utime(path, (mtime, mtime))
        return _Src(name=name, path=path, is_dir=False, rel="", url_digest=digest, tmpdir=tmpd, mtime=mtime)

    async def _export(self, img: Image, srcs: list[str], where: str, cmd: str
                      ) -> tuple[tempfile.TemporaryDirectory[str], list[_Src]]:
        """Copy the source paths out of `img` to a host temp dir (owners kept): COPY --from."""
        from shoal.spec import SandboxSpec

        tmp = tempfile.TemporaryDirectory(prefix="shoal-from-", dir=self.store.tmp_dir)
        out: list[_Src] = []
        spec = SandboxSpec(image=img.ref if img.tag else f"{img.name}@{img.digest}", network=False,
                           cpus=1.0, memory_mb=1024, disk_mb=1024, ttl_s=3600,
                           labels={"shoal.build": self.opts.tag[:1000]})
        info = await self.node.create(spec)
        try:
            for k, s in enumerate(srcs):
                pat = posixpath.normpath("/" + s)
                names = [pat]
                if any(c in pat for c in "*?["):
                    parent = posixpath.dirname(pat)
                    client = await self.node.client(info.id)
                    try:
                        ents = await client.list_dir(parent)
                    except ShoalError:
                        ents = []
                    names = sorted(posixpath.join(parent, e.name) for e in ents
                                   if fnmatch.fnmatchcase(e.name, posixpath.basename(pat)))
                    if not names:
                        raise InvalidRequest(f"{where}: {cmd} --from: {s}: no source files were specified")
                for n in names:
                    dest = Path(tmp.name) / f"{k}-{len(out)}"
                    dest.mkdir()
                    kind = await self._export_one(info.id, n, dest, where, cmd)
                    base = posixpath.basename(n) or "."
                    p = dest / base if base != "." else dest
                    out.append(_Src(name=base, path=p if base != "." else dest, is_dir=kind == "dir",
                                    rel="", wildcard=len(names) > 1 or n != pat))
        except BaseException:
            tmp.cleanup()
            raise
        finally:
            with contextlib.suppress(Exception):
                await self.node.close(info.id)
        return tmp, out

    async def _export_one(self, sid: str, path: str, dest: Path, where: str, cmd: str) -> str:
        """Stream `path` out of the sandbox as a tar, into `dest`/<basename>; returns its type."""
        parent, base = posixpath.split(path.rstrip("/") or "/")
        if not await self._has_tar(sid):
            return await self._export_walk(sid, path, dest / (base or "."), where, cmd, top=True)
        argv = ["tar", "-c", "-f", "-", "-C", parent or "/", base or "."]
        # the top of the source is followed when it is a symlink (-h only for the top would need GNU tar's
        # --dereference for all); resolve it first
        r = await self.node.exec(sid, ["readlink", "-f", path], cwd="/", user="0:0", timeout=60)
        if r.exit_code == 0 and r.stdout.strip():
            real = _text(r.stdout).strip()
            if real != path.rstrip("/"):
                rp, rb = posixpath.split(real)
                argv = ["tar", "-c", "-f", "-", "-C", rp or "/", "--transform", f"s|^{re.escape(rb)}|{base}|",
                        rb] if base else argv
        handle = await self.node.stream(sid, argv, cwd="/", user="0:0", timeout=3600)
        tar_path = dest.parent / (dest.name + ".tar")
        err = b""
        result = None
        with open(tar_path, "wb") as f:
            async for ev in handle:
                if ev.kind == "stdout":
                    f.write(ev.data)
                elif ev.kind == "stderr":
                    err += ev.data[-2000:]
                elif ev.kind == "exit":
                    result = ev.result
        if result is None or result.exit_code != 0:
            msg = err.decode(errors="replace").strip()
            if "No such file" in msg or "Cannot stat" in msg:
                raise InvalidRequest(f"{where}: {cmd} --from: {path}: not found in the source image")
            raise ImageBuildError(f"{where}: {cmd} --from: reading {path} from the source image failed: {msg}")
        kind = "file"
        try:
            await asyncio.to_thread(_safe_extract, tar_path, dest)
        finally:
            tar_path.unlink(missing_ok=True)
        top = dest / (base or ".")
        if top.is_dir() and not top.is_symlink():
            kind = "dir"
        return kind

    async def _export_walk(self, sid: str, path: str, host: Path, where: str, cmd: str, top: bool = False) -> str:
        """COPY --from an image without tar: its files through the agent (read, list, stat), owners kept."""
        client = await self.node.client(sid)
        try:
            s = await client.stat(path)
        except ShoalError:
            if top:
                raise InvalidRequest(f"{where}: {cmd} --from: {path}: not found in the source image") from None
            raise
        kind = s.get("type")
        if kind == "dir":
            host.mkdir(exist_ok=True)
            for e in await client.list_dir(path):
                await self._export_walk(sid, posixpath.join(path, e.name), host / e.name, where, cmd)
        elif kind == "file":
            host.write_bytes(await client.read_file(path))
        else:
            raise ImageBuildError(f"{where}: {cmd} --from: {path} is a {kind}: the source image has no tar, and "
                                  "only files and directories can be read from it without one")
        os.chown(host, int(s["uid"]), int(s["gid"]))
        os.chmod(host, int(s["mode"]) & 0o7777)
        os.utime(host, (float(s["mtime"]), float(s["mtime"])))
        return "dir" if kind == "dir" else "file"

    async def _copy_into(self, sid: str, st: _State, entries: list[_Src], dst: str, dir_dst: bool, chown: str,
                         chmod: int | None, keep_owner: bool, extract: bool, where: str, cmd: str) -> Path | None:
        client = await self.node.client(sid)
        uid = gid = 0
        if chown:
            uid, gid = await self._resolve_chown(client, chown, where, cmd)
        has_tar = await self._has_tar(sid)
        # a single file source goes *into* dst when dst is an existing directory (BuildKit)
        if not dir_dst and len(entries) == 1 and not entries[0].is_dir:
            with contextlib.suppress(ShoalError):
                if has_tar:
                    r = await self.node.exec(sid, ["test", "-d", dst], cwd="/", user="0:0", timeout=60)
                    dir_dst = r.exit_code == 0
                else:
                    dir_dst = (await client.stat(dst)).get("type") == "dir"
        tar_path = Path(tempfile.mkstemp(prefix="shoal-copy-", suffix=".tar", dir=self._local_tmp())[1])
        try:
            if dir_dst or len(entries) > 1 or entries[0].is_dir:
                root = dst.rstrip("/") or "/"
            else:
                root = posixpath.dirname(dst.rstrip("/")) or "/"
            await asyncio.to_thread(_write_copy_tar, tar_path, entries, dst, dir_dst, root,
                                    None if keep_owner and not chown else (uid, gid), chmod, extract, self)
            if not has_tar:
                # no GNU tar in the image (scratch, distroless): the layer is made on the host instead
                return await self._host_layer(sid, st, tar_path, root, (uid, gid) if chown else (0, 0), where, cmd)
            await self._mkdirs(sid, root, uid if chown else 0, gid if chown else 0)
            await self._untar(sid, tar_path, root, where, cmd)
        finally:
            tar_path.unlink(missing_ok=True)
        return None

    def _local_tmp(self) -> Path:
        d = self.node.paths.home / "tmp"
        d.mkdir(parents=True, exist_ok=True)
        return d

    async def _has_tar(self, sid: str) -> bool:
        """GNU tar in the image (COPY/ADD unpack with it; busybox's lacks --no-overwrite-dir)."""
        try:
            r = await self.node.exec(sid, ["tar", "--version"], cwd="/", user="0:0", timeout=60, max_output=4096)
        except ShoalError:
            return False
        return r.exit_code == 0 and "GNU tar" in _text(r.stdout)

    async def _host_layer(self, sid: str, st: _State, tar_path: Path, root: str, new_owner: tuple[int, int],
                          where: str, cmd: str) -> Path:
        """The layer of a COPY/ADD into an image without tar, built as a directory tree on the host: the files
        under `root`, and every directory on the way with the image's own metadata (an overlay layer's
        directory replaces the lower one's mode and owner) or, when new, 0755 and `new_owner`. A path that
        goes through a symlink in the image is refused (it cannot be followed safely from the host)."""
        client = await self.node.client(sid)
        d = Path(tempfile.mkdtemp(prefix="shoal-layer-", dir=self._local_tmp()))
        os.chmod(d, 0o755)
        self._host_dirs.append(d)

        async def image_stat(path: str) -> dict[str, Any] | None:
            try:
                return await client.stat(path)
            except ShoalError:
                return None

        def apply(h: Path, s: dict[str, Any] | None, owner: tuple[int, int]) -> None:
            if s is not None:
                os.chown(h, int(s["uid"]), int(s["gid"]))
                os.chmod(h, int(s["mode"]) & 0o7777)
                os.utime(h, (float(s["mtime"]), float(s["mtime"])))
            else:
                os.chown(h, *owner)
                os.chmod(h, 0o755)

        async def mirror(path: str, owner: tuple[int, int]) -> None:
            cur = ""
            for part in [p for p in path.split("/") if p]:
                cur += "/" + part
                h = d / cur.lstrip("/")
                if h.exists():
                    continue
                s = await image_stat(cur)
                if s is not None and s.get("type") != "dir":
                    raise ImageBuildError(f"{where}: {cmd}: {cur} is a {s.get('type')} in the image, which has no "
                                          "tar to copy through it; copy to a path without symlinks")
                h.mkdir()
                apply(h, s, owner)

        for path, user in st.pending_dirs:
            owner = (0, 0)
            if user and user not in ("root", "0", "0:0"):
                with contextlib.suppress(ShoalError, ValueError):
                    owner = await self._resolve_chown(client, user, "WORKDIR", "WORKDIR")
            await mirror(path, owner)
        await mirror(root, new_owner)
        base = d / root.lstrip("/")
        existing: dict[str, dict[str, Any]] = {}
        with tarfile.open(tar_path) as tf:
            for m in tf.getmembers():
                if m.isdir():
                    rel = posixpath.normpath(m.name)
                    full = posixpath.normpath(posixpath.join(root, rel))
                    s = await image_stat(full)
                    if s is not None and s.get("type") == "dir":
                        existing[rel] = s  # an existing directory keeps its metadata (tar --no-overwrite-dir)
        await asyncio.to_thread(_safe_extract, tar_path, base)
        for rel, s in existing.items():
            apply(base / rel if rel != "." else base, s, (0, 0))
        return d

    async def _mkdirs(self, sid: str, path: str, uid: int, gid: int) -> None:
        """mkdir -p `path`, the directories it creates owned by uid:gid (mode 0755)."""
        client = await self.node.client(sid)
        parts = [p for p in path.split("/") if p]
        created = []
        cur = ""
        for p in parts:
            cur += "/" + p
            try:
                await client.stat(cur)
            except ShoalError:
                created.append(cur)
        if not created:
            return
        await client.mkdir(path, parents=True, mode=0o755)
        if uid or gid:
            r = await self.node.exec(sid, ["chown", f"{uid}:{gid}", *created], cwd="/", user="0:0", timeout=60)
            if r.exit_code != 0:
                raise ImageBuildError(f"chown of {path} failed: {_text(r.stderr)[-500:]}")

    async def _untar(self, sid: str, tar_path: Path, root: str, where: str, cmd: str) -> None:
        from shoal.images.recipe import _Tail

        handle = await self.node.stream(sid, ["tar", "-x", "-p", "--same-owner", "--no-overwrite-dir", "-f", "-",
                                              "-C", root], stdin=True, cwd="/", user="0:0", timeout=3600)
        tail = _Tail()

        async def feed() -> None:
            with open(tar_path, "rb") as f:
                while chunk := f.read(1 << 20):
                    await handle.write_stdin(chunk)
            await handle.close_stdin()

        feeder = asyncio.create_task(feed())
        result = None
        try:
            async for ev in handle:
                if ev.kind in ("stdout", "stderr"):
                    tail.add(ev.data)
                elif ev.kind == "exit":
                    result = ev.result
        finally:
            if not feeder.done():
                feeder.cancel()
            with contextlib.suppress(asyncio.CancelledError, ShoalError, OSError):
                await feeder
        if result is None or result.exit_code != 0:
            code = None if result is None else result.exit_code
            raise ImageBuildError(f"{where}: {cmd}: unpacking in the build sandbox failed (exit {code}): "
                                  f"{tail.text()} (the image needs GNU tar for COPY/ADD)", exit_code=code,
                                  output_tail=tail.text())

    async def _resolve_chown(self, client: Any, chown: str, where: str, cmd: str) -> tuple[int, int]:
        """--chown=user[:group] with names looked up in the image's /etc/passwd and /etc/group."""
        user, _, group = chown.partition(":")

        async def table(path: str) -> list[list[str]]:
            try:
                data = await client.read_file(path)
            except ShoalError:
                return []
            return [ln.split(":") for ln in data.decode(errors="replace").splitlines() if ln.count(":") >= 2]

        if user.isdigit():
            uid = primary = int(user)  # a uid without a group: the same number as gid (Docker's rule)
        else:
            rows = [r for r in await table("/etc/passwd") if r[0] == user]
            if not rows:
                if user == "root":
                    uid = primary = 0
                else:
                    raise InvalidRequest(f"{where}: {cmd} --chown={chown}: no user {user!r} in the image's /etc/passwd")
            else:
                # a user name without a group: its primary group from /etc/passwd (BuildKit)
                uid, primary = int(rows[0][2]), int(rows[0][3])
        if not group:
            return uid, primary
        if group.isdigit():
            return uid, int(group)
        rows = [r for r in await table("/etc/group") if r[0] == group]
        if not rows:
            if group == "root":
                return uid, 0
            raise InvalidRequest(f"{where}: {cmd} --chown={chown}: no group {group!r} in the image's /etc/group")
        return uid, int(rows[0][2])

    async def _do_nothing(self, sid: str) -> None:
        return None

    # ---- one layer-making step ----------------------------------------------------------------
    async def _layer_step(self, stage: Stage, st: _State, desc: dict[str, Any], text: str,
                          action: Callable[[str], Any], *, network: bool | list[str],
                          mounts: list[BuildMount] | None = None) -> None:
        from shoal.fsutil import canonical_json
        from shoal.images.recipe import _cached_or_claim

        label = stage.name or str(stage.index)
        pending = list(st.pending_dirs)
        data = {"v": _KEY_VERSION, "parent": st.layers, "env": st.cfg.env, "workdir": st.cfg.workdir,
                "user": st.cfg.user, "mkdir": pending, "step": desc}
        key = hashlib.sha256(canonical_json(data)).hexdigest()
        head = text
        claim = None
        hit = None
        if not self.opts.no_cache:
            hit, claim = await _cached_or_claim(self.store, key, head, self.log)
        if hit is not None:
            lay = hit["layer"]
            if lay:
                self.store.touch_layer(lay)
                st.layers.append(lay)
            st.pending_dirs.clear()
            self.cached += 1
            self._log_step(text, label, "  (cached)")
            return
        self._log_step(text, label)
        t0 = time.monotonic()
        try:
            layer = await self._in_sandbox(st, pending, action, network, mounts or [], text)
            self.store.cache_put(STEP_CACHE, key, {"layer": layer, "step": text[:500], "created": time.time(),
                                                   "seconds": round(time.monotonic() - t0, 3)})
        finally:
            if claim is not None:
                await claim.release()
        if layer:
            st.layers.append(layer)
        st.pending_dirs.clear()
        self.run += 1
        self.log(f"      -> {layer[:19] if layer else 'no changes'} in {time.monotonic() - t0:.1f}s")

    async def _in_sandbox(self, st: _State, pending: list[tuple[str, str]], action: Callable[[str], Any],
                          network: bool | list[str], mounts: list[BuildMount], text: str) -> str | None:
        from shoal.images.pack import pack_upper, upper_is_empty
        from shoal.images.recipe import _freeze
        from shoal.spec import SandboxSpec

        layers = st.layers or [self._empty_layer()]
        mdigest = self.store.put_manifest(layers, st.cfg, lineage={"build": self.opts.tag})
        spec = SandboxSpec(image=f"{self.name}@{mdigest}", network=network, cpus=self.opts.cpus,
                           memory_mb=self.opts.memory_mb, disk_mb=self.opts.disk_mb,
                           ttl_s=self.opts.run_timeout + 900, labels={"shoal.build": self.opts.tag[:1000]})
        image = await self.node.resolve_image(spec.image)
        host_mounts, cleanup = await asyncio.to_thread(self._prepare_mounts, mounts)
        try:
            try:
                # the node's internals: a build sandbox carries bind mounts no user spec may ask for
                info = await self.node.core.start_sandbox(spec, image, extra={"build_mounts": host_mounts}
                                                          if host_mounts else None)
            except ShoalError as e:
                raise ImageBuildError(f"`{text[:200]}`: could not start a build sandbox: {e.message}") from None
            sid = info.id
            try:
                try:
                    if await self._has_tar(sid):
                        for path, user in pending:
                            await self._workdir(sid, path, user)
                    host_tree = await action(sid)
                except (ImageBuildError, InvalidRequest):
                    raise
                except ShoalError as e:
                    raise ImageBuildError(f"`{text[:200]}` could not run: {e.message}") from None
                source = {"type": "dockerfile-step", "image": self.opts.tag, "desc": text[:500]}
                if isinstance(host_tree, Path):
                    lay = await asyncio.to_thread(self.store.add_layer_from_dir, host_tree, source)
                    return lay.digest
                if pending and not await self._has_tar(sid):
                    # a WORKDIR alone in an image without tar: its directories, made on the host
                    tree = await self._host_layer_dirs(sid, st)
                    lay = await asyncio.to_thread(self.store.add_layer_from_dir, tree, source)
                    return lay.digest
                await _freeze(self.node, sid)
                rec = self.node.record(sid)
                upper = self.node.backend(rec.backend).upper_dir(rec)
                if upper is None:
                    raise ImageBuildError(f"the {rec.backend} backend has no writable layer to pack")
                if mounts:
                    await asyncio.to_thread(_drop_mount_stubs, Path(upper), [m.target for m in mounts],
                                            [d.split(":", 1)[1] for d in layers], self.node)
                if await asyncio.to_thread(upper_is_empty, Path(upper), bool(network)):
                    return None
                disk_mb = int(rec.spec.disk_mb or 4096)
                layer = await asyncio.to_thread(
                    lambda: pack_upper(self.store, Path(upper), source, clean=True, network=bool(network),
                                       max_bytes=disk_mb << 20, what=f"`{text[:80]}`",
                                       why=f"the build's disk_mb={disk_mb}"))
                return layer.digest
            finally:
                with contextlib.suppress(Exception):
                    await self.node.close(sid)
        finally:
            cleanup()
            for hd in self._host_dirs:
                shutil.rmtree(hd, ignore_errors=True)
            self._host_dirs.clear()

    async def _host_layer_dirs(self, sid: str, st: _State) -> Path:
        """The directories of pending WORKDIRs as a host tree (an image without tar)."""
        empty = Path(tempfile.mkstemp(prefix="shoal-empty-", suffix=".tar", dir=self._local_tmp())[1])
        try:
            with tarfile.open(empty, "w"):
                pass
            return await self._host_layer(sid, st, empty, "/", (0, 0), "WORKDIR", "WORKDIR")
        finally:
            empty.unlink(missing_ok=True)

    async def _workdir(self, sid: str, path: str, user: str) -> None:
        """WORKDIR: mkdir -p, new directories owned by the current USER (BuildKit)."""
        uid = gid = 0
        if user and user not in ("root", "0", "0:0"):
            client = await self.node.client(sid)
            try:
                uid, gid = await self._resolve_chown(client, user, "WORKDIR", "WORKDIR")
            except (ShoalError, ValueError):
                uid = gid = 0
        await self._mkdirs(sid, path, uid, gid)

    def _prepare_mounts(self, mounts: list[BuildMount]) -> tuple[list[dict[str, Any]], Callable[[], None]]:
        """Host directories/files for RUN --mount, as bind/tmpfs mounts for the build sandbox."""
        out: list[dict[str, Any]] = []
        temps: list[str] = []

        def cleanup() -> None:
            for t in temps:
                shutil.rmtree(t, ignore_errors=True)

        try:
            for m in mounts:
                if m.kind == "tmpfs":
                    opts = ["nosuid", "nodev", "mode=1777"]
                    if m.size:
                        opts.append(f"size={m.size}")
                    out.append({"destination": m.target, "type": "tmpfs", "source": "tmpfs", "options": opts})
                elif m.kind == "cache":
                    d = self.node.paths.home / "build-cache" / hashlib.sha256(m.cache_id.encode()).hexdigest()[:32]
                    if not d.exists():
                        d.mkdir(parents=True, exist_ok=True)
                        os.chmod(d, m.mode)
                        os.chown(d, m.uid, m.gid)
                    out.append({"destination": m.target, "type": "bind", "source": str(d),
                                "options": ["rbind", "ro" if m.readonly else "rw", "nosuid", "nodev"]})
                elif m.kind == "secret":
                    if m.secret_path is None:
                        continue
                    t = tempfile.mkdtemp(prefix="shoal-secret-", dir=self.node.paths.run)
                    temps.append(t)
                    f = Path(t) / "secret"
                    f.write_bytes(Path(m.secret_path).read_bytes())
                    os.chmod(f, m.mode)
                    os.chown(f, m.uid, m.gid)
                    out.append({"destination": m.target, "type": "bind", "source": str(f),
                                "options": ["bind", "ro", "nosuid", "nodev", "noexec"]})
                elif m.kind == "bind":
                    t = tempfile.mkdtemp(prefix="shoal-bind-", dir=self.store.tmp_dir)
                    temps.append(t)
                    src_dir = Path(t) / "src"
                    if m.host_dir is not None:
                        # exported from a stage or image (a private copy: rw writes are thrown away)
                        if m.host_dir.is_dir():
                            shutil.copytree(m.host_dir, src_dir, symlinks=True)
                        else:
                            src_dir = m.host_dir
                    else:
                        entries = self._context_sources(m.source or ".", "RUN --mount", "RUN --mount")
                        if len(entries) == 1 and not entries[0].is_dir and entries[0].path is not None:
                            src_dir = Path(t) / entries[0].name
                            shutil.copy2(entries[0].path, src_dir)
                        else:
                            _write_tree(entries, src_dir, self)
                    out.append({"destination": m.target, "type": "bind", "source": str(src_dir),
                                "options": ["rbind", "ro" if m.readonly else "rw", "nosuid", "nodev"]})
        except BaseException:
            cleanup()
            raise
        return out, cleanup


@dataclass
class BuildMount:
    """One RUN --mount."""

    kind: str
    target: str
    source: str = ""
    from_stage: str | None = None
    from_image: Image | None = None
    host_dir: Path | None = None
    readonly: bool = False
    cache_id: str = ""
    sharing: str = "shared"
    secret_id: str = ""
    secret_path: Path | None = None
    mode: int = 0o755
    uid: int = 0
    gid: int = 0
    size: str = ""

    def key(self) -> dict[str, Any]:
        """What of the mount keys the step's cache (never a secret's or a cache's content)."""
        return {"type": self.kind, "target": self.target, "source": self.source, "id": self.cache_id or
                self.secret_id, "ro": self.readonly, "mode": self.mode, "uid": self.uid, "gid": self.gid}


@dataclass
class _Src:
    """One COPY/ADD source: a host path (context, exported stage, download) or heredoc bytes."""

    name: str
    path: Path | None = None
    is_dir: bool = False
    rel: str = ""
    wildcard: bool = False
    data: bytes | None = None
    url_digest: str | None = None
    tmpdir: str | None = None
    mtime: float | None = None

    def key(self, ignore: DockerIgnore | None = None) -> Any:
        """What of the source keys the step's cache: names, types, permission bits, link targets and bytes
        of what is copied (after .dockerignore), or the heredoc's or the download's bytes."""
        if self.data is not None:
            return {"heredoc": self.name, "sha256": hashlib.sha256(self.data).hexdigest()}
        if self.url_digest:
            return {"url": self.name, "sha256": self.url_digest}
        assert self.path is not None
        return {"name": self.name, "dir": self.is_dir, "content": _tree_digest(self.path, self.rel, ignore)}


def _tree_digest(path: Path, rel: str, ignore: DockerIgnore | None) -> str:
    h = hashlib.sha256()
    top = os.stat(path)
    entries = [("", top)]
    if stat.S_ISDIR(top.st_mode):
        keep = None
        if ignore is not None and ignore.patterns:
            def keep(r: str) -> bool:
                return not ignore.excluded(f"{rel}/{r}" if rel else r)
        entries += _iter_tree(path, keep)
    for r, st in entries:
        p = path / r if r else path
        h.update(f"{r}\0{stat.S_IFMT(st.st_mode)}\0{st.st_mode & 0o7777}\0".encode())
        if stat.S_ISREG(st.st_mode):
            fh = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(1 << 20):
                    fh.update(chunk)
            h.update(fh.digest())
        elif stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(p).encode("utf-8", "surrogateescape"))
        h.update(b"\n")
    return "sha256:" + h.hexdigest()


def _text(b: bytes | str) -> str:
    return b if isinstance(b, str) else b.decode("utf-8", "replace")


def _safe_extract(tar_path: Path, dest: Path) -> None:
    """Unpack a tar from a build sandbox on the host: no absolute names, no '..', no links out, owners kept."""
    with tarfile.open(tar_path) as tf:
        tf.extractall(dest, filter="tar", numeric_owner=True)


def _iter_tree(root: Path, ctx_filter: Callable[[str], bool] | None) -> list[tuple[str, os.stat_result]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir
        dirnames.sort()
        keep = []
        for d in dirnames:
            rel = f"{rel_dir}/{d}" if rel_dir else d
            if ctx_filter is None or ctx_filter(rel):
                out.append((rel, os.lstat(os.path.join(dirpath, d))))
                keep.append(d)
            elif ctx_filter is not None:
                keep.append(d)  # an exception may bring back something inside
        dirnames[:] = keep
        for f in sorted(filenames):
            rel = f"{rel_dir}/{f}" if rel_dir else f
            if ctx_filter is None or ctx_filter(rel):
                out.append((rel, os.lstat(os.path.join(dirpath, f))))
    out.sort(key=lambda x: x[0])
    return out


def _is_archive(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(512)
    except OSError:
        return False
    if head[:2] == b"\x1f\x8b" or head[:3] == b"BZh" or head[:6] == b"\xfd7zXZ\x00" or head[:4] == b"\x28\xb5\x2f\xfd":
        return True
    return len(head) >= 262 and head[257:262] == b"ustar"


def _write_copy_tar(out: Path, entries: list[_Src], dst: str, dir_dst: bool, root: str,
                    owner: tuple[int, int] | None, chmod: int | None, extract: bool, build: DockerBuild) -> None:
    """The tar a COPY/ADD unpacks at `root` in the build sandbox. `owner` None keeps the files' owners."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tf:
        def add(name: str, path: Path | None, st: os.stat_result | None, data: bytes | None = None,
                mode: int | None = None, mtime: float | None = None) -> None:
            ti = tarfile.TarInfo(name)
            if data is not None:
                ti.size = len(data)
                ti.mode = 0o644 if chmod is None else chmod
                ti.mtime = int(time.time()) if mtime is None else mtime
                ti.uid, ti.gid = owner or (0, 0)
                tf.addfile(ti, io.BytesIO(data))
                return
            assert st is not None and path is not None
            ti.mode = (st.st_mode & 0o7777) if chmod is None else chmod
            if mode is not None:
                ti.mode = mode
            ti.mtime = st.st_mtime if mtime is None else mtime
            ti.uid, ti.gid = owner if owner is not None else (st.st_uid, st.st_gid)
            ti.uname = ti.gname = ""
            if stat.S_ISDIR(st.st_mode):
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            elif stat.S_ISLNK(st.st_mode):
                ti.type = tarfile.SYMTYPE
                ti.linkname = os.readlink(path)
                ti.mode = st.st_mode & 0o7777
                tf.addfile(ti)
            elif stat.S_ISREG(st.st_mode):
                ti.size = st.st_size
                with open(path, "rb") as f:
                    tf.addfile(ti, f)
            else:
                raise InvalidRequest(f"cannot copy {name}: only files, directories and symlinks can be copied")

        ign = build.ignore
        for e in entries:
            if e.data is not None:
                add(e.name if dir_dst else posixpath.basename(dst.rstrip("/")), None, None, data=e.data)
                continue
            assert e.path is not None
            if e.is_dir:
                # a directory's contents land in dst (the directory itself is not copied)
                from_ctx = e.rel != "" or e.path == build.context
                prefix = e.rel
                def keep(rel: str, prefix: str = prefix, from_ctx: bool = from_ctx) -> bool:
                    if not from_ctx:
                        return True
                    full = f"{prefix}/{rel}" if prefix else rel
                    return not ign.excluded(full)
                top = os.lstat(e.path) if not e.path.is_symlink() else os.stat(e.path)
                add(".", e.path, top)
                for rel, st in _iter_tree(e.path, keep if from_ctx and ign.patterns else None):
                    add(rel, e.path / rel, st)
                continue
            st = os.lstat(e.path)
            if extract and e.url_digest is None and _is_archive(e.path):
                # ADD of a local archive: its contents, unpacked into dst
                with tarfile.open(e.path) as src_tf:
                    for m in src_tf:
                        if m.name.startswith("/") or ".." in m.name.split("/"):
                            raise InvalidRequest(f"ADD {e.name}: member {m.name!r} would land outside the destination")
                        if m.islnk() or m.issym() or m.isdir():
                            tf.addfile(m)
                        elif m.isreg():
                            tf.addfile(m, src_tf.extractfile(m))
                        elif m.isfifo() or m.ischr() or m.isblk():
                            tf.addfile(m)
                continue
            name = e.name if dir_dst else posixpath.basename(dst.rstrip("/"))
            add(name, e.path, st, mtime=e.mtime)


def _write_tree(entries: list[_Src], dest: Path, build: DockerBuild) -> None:
    """A host copy of context sources (a bind mount's source; owners 0:0 as Docker sends the context)."""
    dest.mkdir(parents=True, exist_ok=True)
    for e in entries:
        assert e.path is not None
        if e.is_dir:
            def ignore(d: str, names: list[str], e: _Src = e) -> list[str]:
                rel_dir = os.path.relpath(d, e.path)
                out = []
                for n in names:
                    rel = n if rel_dir == "." else f"{rel_dir}/{n}"
                    full = f"{e.rel}/{rel}" if e.rel else rel
                    if build.ignore.excluded(full):
                        out.append(n)
                return out
            shutil.copytree(e.path, dest, symlinks=True, ignore=ignore, dirs_exist_ok=True)
        else:
            shutil.copy2(e.path, dest / e.name, follow_symlinks=False)


def _drop_mount_stubs(upper: Path, targets: list[str], lower_hexes: list[str], node: Any) -> None:
    """Remove the empty directories the runtime made in the writable layer as mountpoints of RUN --mount
    targets that no lower layer has (BuildKit ≥ 0.12 removes its mount stubs too)."""
    lowers = [node.layer_mounts.root / h for h in lower_hexes]
    for t in sorted(set(targets), key=lambda s: -s.count("/")):
        cur = t.rstrip("/")
        while cur and cur != "/":
            up = upper / cur.lstrip("/")
            try:
                st = os.lstat(up)
            except FileNotFoundError:
                break
            if stat.S_ISDIR(st.st_mode):
                if any(os.scandir(up)):
                    break
            elif not (stat.S_ISREG(st.st_mode) and st.st_size == 0 and cur == t.rstrip("/")):
                break  # (a file mount's stub is an empty file)
            if any(os.path.lexists(lo / cur.lstrip("/")) for lo in lowers):
                break
            with contextlib.suppress(OSError):
                if stat.S_ISDIR(st.st_mode):
                    os.rmdir(up)
                else:
                    os.unlink(up)
            cur = posixpath.dirname(cur)


def _healthcheck(ins: Instruction, shell: list[str], where: str) -> dict[str, Any]:
    rest = ins.rest.strip()
    if rest.upper() == "NONE":
        return {"Test": ["NONE"]}
    word, _, body = rest.partition(" ")
    if word.upper() != "CMD":
        raise InvalidRequest(f"{where}: HEALTHCHECK needs CMD or NONE")
    body = body.strip()
    from shoal.images.dockerfile_syntax import _json_list
    argv = _json_list(body)
    hc: dict[str, Any] = {"Test": ["CMD", *argv] if argv is not None else ["CMD-SHELL", body]}
    for k, v in ins.flags:
        key = {"interval": "Interval", "timeout": "Timeout", "start-period": "StartPeriod",
               "start-interval": "StartInterval", "retries": "Retries"}.get(k)
        if key is None:
            raise InvalidRequest(f"{where}: HEALTHCHECK --{k} is not an option")
        if key == "Retries":
            hc[key] = int(v or "0")
        else:
            hc[key] = _duration_ns(v or "", where)
    return hc


def _duration_ns(s: str, where: str) -> int:
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", s):
        total += float(num) * {"ns": 1, "us": 1e3, "µs": 1e3, "ms": 1e6, "s": 1e9, "m": 60e9, "h": 3600e9}[unit]
    if not re.fullmatch(r"((\d+(\.\d+)?)(ns|us|µs|ms|s|m|h))+", s):
        raise InvalidRequest(f"{where}: {s!r} is not a duration (like 30s, 1m30s)")
    return int(total)


# ---- entry points -----------------------------------------------------------------------------------
async def build_dockerfile(node: Node, opts: BuildOptions, log: Callable[[str], None] | None = None,
                           resolve_base: Callable[[str], Any] | None = None) -> BuildResult:
    """Build `opts.context` with its Dockerfile into `node`'s store as `opts.tag` (see the module doc)."""
    return await DockerBuild(node, opts, log=log, resolve_base=resolve_base).build()


def build_options(tag: str, context: Path, *, dockerfile: str | Path | None = None,
                  build_args: dict[str, str] | None = None, target: str | None = None, no_cache: bool = False,
                  platform: str | None = None, from_map: dict[str, str] | None = None,
                  network: bool | list[str] = True, secrets: dict[str, Path] | None = None) -> BuildOptions:
    """BuildOptions from the SDK's keyword arguments (a relative `dockerfile` is under the context)."""
    df = None
    if dockerfile:
        df = Path(dockerfile)
        if not df.is_absolute() and not df.exists():
            df = Path(context) / df
    opts = BuildOptions(tag=tag, context=Path(context), dockerfile=df, build_args=dict(build_args or {}),
                        target=target, no_cache=no_cache, platform=platform, from_map=dict(from_map or {}),
                        network=network, secrets=dict(secrets or {}))
    opts.check()
    return opts


#: the name a Dockerfile from outside the context gets in an uploaded context tarball
UPLOADED_DOCKERFILE = ".shoal-upload.Dockerfile"


def context_tarball(context: Path, dockerfile: str | Path | None = None) -> tuple[bytes, str]:
    """(the build context as a gzip tar, what is not .dockerignored; the Dockerfile's name inside it): what a
    client uploads to `POST /v1/images/dockerfile`, like the docker CLI does."""
    import gzip

    context = Path(context)
    if not context.is_dir():
        raise InvalidRequest(f"build context {context} is not a directory")
    df = Path(dockerfile) if dockerfile else context / "Dockerfile"
    if not df.is_absolute() and not df.exists():
        df = context / df
    if not df.is_file():
        raise InvalidRequest(f"{df}: no such Dockerfile")
    ign = DockerIgnore.load(context, Path(dockerfile) if dockerfile else None)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for rel, _st in context_files(context, ign):
            tf.add(context / rel, arcname=rel, recursive=False)
        try:
            df_rel = df.resolve().relative_to(context.resolve()).as_posix()
            inside = True
        except ValueError:
            df_rel, inside = UPLOADED_DOCKERFILE, False
        extra = [] if inside and not ign.excluded(df_rel) else [(df, df_rel)]
        if (context / ".dockerignore").is_file() and ign.excluded(".dockerignore"):
            extra.append((context / ".dockerignore", ".dockerignore"))
        for path, name in extra:
            tf.add(path, arcname=name, recursive=False)
    return gzip.compress(buf.getvalue(), compresslevel=3), df_rel


def extract_context(tar_path: Path, dest: Path) -> None:
    """Unpack an uploaded build context (plain or gzip tar) safely: nothing outside `dest`, no devices;
    owners are not kept (Docker sends the context as 0:0)."""
    try:
        with tarfile.open(tar_path) as tf:
            tf.extractall(dest, filter="data")
    except (tarfile.TarError, OSError, EOFError) as e:
        raise InvalidRequest(f"the build context is not a readable tar archive: {e}") from None


def shell_join(argv: list[str]) -> str:
    """A printable command line."""
    return shlex.join(argv)
