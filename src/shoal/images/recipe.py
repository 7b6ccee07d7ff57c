"""Recipes: build an image step by step, each step's filesystem diff becoming one cached layer.

    from shoal.images.recipe import Recipe, Run, Copy, Env, Workdir, build_recipe
    r = Recipe("proj:v1", base="base", steps=[Workdir("/work"), Copy(Path("src"), "/work/src"),
                                               Run("pip install -e /work/src")])
    img = await build_recipe(node, r)

A `Run` step runs `/bin/sh -c CMD` in a fresh sandbox on top of the layers built so far; a `Copy` step
streams host files into such a sandbox (as a tar through the agent, so symlinks in the image can
never redirect the write onto the host). The sandbox is then frozen, its upper dir packed into one
EROFS layer (nothing changed -> no layer), and the sandbox removed. `Env`, `Workdir` and `User` only
change the image config (and what later steps see).

Each step is cached in the store under `cache/steps/<key>.json`, the key being a hash of the parent
layer digests, the config the step runs with, the step itself and (for Copy) a hash of the copied
content. An unchanged rebuild therefore creates no sandbox at all; changing step k rebuilds k and
everything after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import hashlib
import os
import posixpath
import stat
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shoal.errors import ImageBuildError, InvalidRequest, ShoalError
from shoal.images.claims import CLAIM_TTL_S, Claim, break_stale
from shoal.images.claims import age_s as claim_age_s
from shoal.images.pack import pack_upper, upper_is_empty
from shoal.images.refs import parse_ref
from shoal.images.store import Image, ImageConfig, ImageStore

if TYPE_CHECKING:
    from shoal.node.node import Node

STEP_CACHE = "steps"
_KEY_VERSION = 1
_TAIL_BYTES = 4000
DEFAULT_RUN_TIMEOUT = 1800.0


# ---- steps ------------------------------------------------------------------------------------
@dataclass
class Run:
    """Run `cmd` with /bin/sh -c in the image so far; its file changes become a layer."""

    cmd: str
    network: bool | None = None  # None: the recipe's setting
    timeout: float = DEFAULT_RUN_TIMEOUT

    def describe(self) -> str:
        """One line for logs and lineage."""
        return f"RUN {self.cmd}"


@dataclass
class Copy:
    """Copy a host file or directory into the image. A directory's *contents* land in `dst`; a file
    lands at `dst` (or inside it when `dst` ends with '/'). Relative `dst` is under the workdir."""

    src: Path
    dst: str
    exclude: list[str] = field(default_factory=list)  # fnmatch patterns on relative paths / names
    owner: str = "0:0"  # uid:gid of the copied files

    def describe(self) -> str:
        """One line for logs and lineage (no host path: only the source's base name)."""
        return f"COPY {Path(self.src).name or '.'} {self.dst}"


@dataclass(init=False)
class Env:
    """Set environment variables for later steps and the image: `Env(A="1")` or `Env({"A": "1"})`."""

    vars: dict[str, str]

    def __init__(self, vars: dict[str, str] | None = None, /, **kw: str) -> None:
        self.vars = {**(vars or {}), **kw}

    def describe(self) -> str:
        """One line for logs and lineage."""
        return "ENV " + " ".join(f"{k}={v}" for k, v in self.vars.items())


@dataclass
class Workdir:
    """Set the working directory of later steps and of the image (created by the next Run/Copy)."""

    path: str

    def describe(self) -> str:
        """One line for logs and lineage."""
        return f"WORKDIR {self.path}"


@dataclass
class User:
    """Run later steps, and the image's commands, as this user (`name`, `uid` or `uid:gid`)."""

    name: str

    def describe(self) -> str:
        """One line for logs and lineage."""
        return f"USER {self.name}"


Step = Run | Copy | Env | Workdir | User


@dataclass
class Recipe:
    """How to build image `ref` from image `base`: an ordered list of steps."""

    ref: str
    base: str
    steps: list[Step] = field(default_factory=list)
    network: bool = True
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    user: str | None = None
    cpus: float = 2.0
    memory_mb: int = 2048
    disk_mb: int = 16384

    def validate(self) -> Recipe:
        """Raise InvalidRequest naming the first bad field or step."""
        r = parse_ref(self.ref)
        if r.digest:
            raise InvalidRequest(f"recipe target {self.ref!r} must be name[:tag], not a digest")
        parse_ref(self.base)
        _check_env(self.env, "recipe env")
        if self.workdir is not None:
            _check_abs(self.workdir, "recipe workdir")
        if self.user is not None:
            _check_user(self.user, "recipe user")
        if not isinstance(self.steps, list):
            raise InvalidRequest("recipe steps must be a list")
        for i, s in enumerate(self.steps, 1):
            where = f"step {i}"
            if isinstance(s, Run):
                if not isinstance(s.cmd, str) or not s.cmd.strip() or "\0" in s.cmd:
                    raise InvalidRequest(f"{where}: run needs a non-empty command")
                if not (0 < float(s.timeout) <= 7 * 86400):
                    raise InvalidRequest(f"{where}: timeout must be between 0 and 7 days")
            elif isinstance(s, Copy):
                src = Path(s.src)
                if not src.exists() and not src.is_symlink():
                    raise InvalidRequest(f"{where}: copy source {str(src)!r} does not exist")
                if not isinstance(s.dst, str) or not s.dst or "\0" in s.dst:
                    raise InvalidRequest(f"{where}: copy needs a destination path")
                _check_owner(s.owner, where)
            elif isinstance(s, Env):
                _check_env(s.vars, f"{where}: env")
            elif isinstance(s, Workdir):
                _check_abs(s.path, f"{where}: workdir")
            elif isinstance(s, User):
                _check_user(s.name, f"{where}: user")
            else:
                raise InvalidRequest(f"{where}: unknown step {s!r}; use Run, Copy, Env, Workdir or User")
        return self


def _check_env(env: Any, what: str) -> None:
    if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
            for k, v in env.items()):
        raise InvalidRequest(f"{what} must map non-empty names without '=' to strings")


def _check_abs(p: Any, what: str) -> None:
    if not isinstance(p, str) or not p.startswith("/") or "\0" in p:
        raise InvalidRequest(f"{what} {p!r} must be an absolute path")


def _check_user(u: Any, what: str) -> None:
    if not isinstance(u, str) or not u or any(c.isspace() for c in u) or "\0" in u:
        raise InvalidRequest(f"{what} {u!r} must be a user name, uid or uid:gid")


def _check_owner(o: Any, what: str) -> tuple[int, int]:
    try:
        uid, gid = (int(x) for x in str(o).split(":", 1))
        if uid < 0 or gid < 0:
            raise ValueError
        return uid, gid
    except ValueError:
        raise InvalidRequest(f"{what}: owner {o!r} must be numeric uid:gid like 0:0 or 1000:1000") from None


# ---- recipe files -----------------------------------------------------------------------------
_TOP_KEYS = {"name", "ref", "from", "base", "network", "env", "workdir", "user", "cpus", "memory_mb", "disk_mb",
             "steps", "step"}
_STEP_KINDS = ("run", "copy", "env", "workdir", "user")
_STEP_KEYS = {"run": {"run", "network", "timeout"}, "copy": {"copy", "to", "exclude", "owner"},
              "env": {"env"}, "workdir": {"workdir"}, "user": {"user"}}


def load_recipe(path: Path | str, ref: str | None = None) -> Recipe:
    """Read a TOML recipe file (see docs/images.md). Copy sources are relative to the file's directory;
    `ref` overrides the file's `name`."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidRequest(f"recipe file {path} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"recipe file {path} is not valid TOML: {e}") from None
    return recipe_from_dict(data, ref=ref, base_dir=path.parent, where=str(path))


def recipe_from_dict(data: dict[str, Any], ref: str | None = None, base_dir: Path | None = None,
                     where: str = "recipe", allow_copy: bool = True) -> Recipe:
    """A Recipe from the recipe-file structure as a dict (e.g. a JSON request body). Relative copy
    sources resolve against `base_dir`; `allow_copy=False` refuses copy steps (a server must not
    copy its own files into images on a client's behalf)."""
    if not isinstance(data, dict):
        raise InvalidRequest(f"{where}: a recipe is a table/object")
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise InvalidRequest(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    name = ref or data.get("name") or data.get("ref")
    if not name:
        raise InvalidRequest(f"{where}: give the image a name (`name = \"proj:v1\"` or on the command line)")
    base = data.get("from") or data.get("base")
    if not isinstance(base, str) or not base:
        raise InvalidRequest(f"{where}: `from = \"IMAGE\"` is required (the image to build on)")
    raw_steps = data.get("steps", data.get("step", []))
    if not isinstance(raw_steps, list):
        raise InvalidRequest(f"{where}: steps must be an array of tables ([[steps]])")
    steps: list[Step] = []
    ctx = base_dir or Path.cwd()
    for i, s in enumerate(raw_steps, 1):
        if not isinstance(s, dict):
            raise InvalidRequest(f"{where}: step {i} must be a table")
        kinds = [k for k in _STEP_KINDS if k in s]
        if len(kinds) != 1:
            raise InvalidRequest(f"{where}: step {i} must have exactly one of {', '.join(_STEP_KINDS)} "
                                 f"(has {kinds or 'none'})")
        kind = kinds[0]
        extra = set(s) - _STEP_KEYS[kind]
        if extra:
            raise InvalidRequest(f"{where}: step {i} ({kind}) has unknown keys {sorted(extra)}")
        try:
            if kind == "run":
                steps.append(Run(str(s["run"]), network=s.get("network"),
                                 timeout=float(s.get("timeout", DEFAULT_RUN_TIMEOUT))))
            elif kind == "copy":
                if not allow_copy:
                    raise InvalidRequest(f"{where}: step {i}: copy steps are not allowed here")
                if "to" not in s:
                    raise InvalidRequest(f"{where}: step {i} (copy) needs `to = \"/dest\"`")
                src = Path(s["copy"])
                steps.append(Copy(src if src.is_absolute() else ctx / src, str(s["to"]),
                                  exclude=[str(x) for x in s.get("exclude", [])], owner=str(s.get("owner", "0:0"))))
            elif kind == "env":
                if not isinstance(s["env"], dict):
                    raise InvalidRequest(f"{where}: step {i}: env must be a table of NAME = \"value\"")
                steps.append(Env({str(k): str(v) for k, v in s["env"].items()}))
            elif kind == "workdir":
                steps.append(Workdir(str(s["workdir"])))
            else:
                steps.append(User(str(s["user"])))
        except (TypeError, ValueError) as e:
            if isinstance(e, InvalidRequest):
                raise
            raise InvalidRequest(f"{where}: step {i} ({kind}): {e}") from None
    env = data.get("env", {})
    if not isinstance(env, dict):
        raise InvalidRequest(f"{where}: env must be a table")
    try:
        recipe = Recipe(ref=str(name), base=base, steps=steps, network=bool(data.get("network", True)),
                        env={str(k): str(v) for k, v in env.items()}, workdir=data.get("workdir"),
                        user=data.get("user"), cpus=float(data.get("cpus", 2.0)),
                        memory_mb=int(data.get("memory_mb", 2048)), disk_mb=int(data.get("disk_mb", 16384)))
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"{where}: {e}") from None
    try:
        return recipe.validate()
    except InvalidRequest as e:
        raise InvalidRequest(f"{where}: {e.message}") from None


# ---- copy sources -----------------------------------------------------------------------------
def _excluded(rel: str, patterns: list[str]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    return any(fnmatch.fnmatchcase(rel, p) or fnmatch.fnmatchcase(name, p) for p in patterns)


def _walk_source(src: Path, exclude: list[str]) -> list[tuple[str, os.stat_result]]:
    """(relative path, lstat) of everything to copy, sorted; '' is `src` itself when it is a file."""
    st = os.lstat(src)
    if not stat.S_ISDIR(st.st_mode):
        return [("", st)]
    out = []
    for dirpath, dirnames, filenames in os.walk(src):
        rel_dir = os.path.relpath(dirpath, src)
        rel_dir = "" if rel_dir == "." else rel_dir
        keep = []
        for d in sorted(dirnames):
            rel = f"{rel_dir}/{d}" if rel_dir else d
            if not _excluded(rel, exclude):
                keep.append(d)
                out.append((rel, os.lstat(os.path.join(dirpath, d))))
        dirnames[:] = keep  # os.walk does not descend into symlinked dirs: they are copied as links
        for f in sorted(filenames):
            rel = f"{rel_dir}/{f}" if rel_dir else f
            if not _excluded(rel, exclude):
                out.append((rel, os.lstat(os.path.join(dirpath, f))))
    out.sort(key=lambda x: x[0])
    return out


def content_digest(src: Path, exclude: list[str] | None = None) -> str:
    """sha256 over the names, types, permission bits, link targets and bytes of a file or tree
    (not mtimes or owners: a fresh checkout of the same commit hits the cache)."""
    src = Path(src)
    h = hashlib.sha256()
    for rel, st in _walk_source(src, exclude or []):
        p = src / rel if rel else src
        h.update(f"{rel}\0{stat.S_IFMT(st.st_mode)}\0{st.st_mode & 0o7777}\0".encode())
        if stat.S_ISREG(st.st_mode):
            fh = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(1 << 20):
                    fh.update(chunk)
            h.update(fh.digest())
        elif stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(p).encode("utf-8", "surrogateescape"))
        elif not stat.S_ISDIR(st.st_mode):
            raise InvalidRequest(f"cannot copy {p}: only files, directories and symlinks can be copied")
        h.update(b"\n")
    return "sha256:" + h.hexdigest()


def _copy_target(step: Copy, workdir: str) -> tuple[str, str | None]:
    """(directory to extract into, file name for a single-file source or None for a directory)."""
    dst = step.dst if step.dst.startswith("/") else posixpath.join(workdir or "/", step.dst)
    src_is_dir = Path(step.src).is_dir() and not Path(step.src).is_symlink()
    if src_is_dir:
        return posixpath.normpath(dst), None
    if dst.endswith("/"):
        return posixpath.normpath(dst), Path(step.src).name
    return posixpath.dirname(posixpath.normpath(dst)) or "/", posixpath.basename(posixpath.normpath(dst))


def _write_tar(step: Copy, fname: str | None, out: Path) -> int:
    """Write the copy's tar to `out`; returns the number of entries."""
    uid, gid = _check_owner(step.owner, "copy")
    src = Path(step.src)
    n = 0
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tf:
        for rel, st in _walk_source(src, step.exclude):
            p = src / rel if rel else src
            name = fname if fname is not None else rel
            ti = tarfile.TarInfo(name)
            ti.mode = st.st_mode & 0o7777
            ti.mtime = st.st_mtime
            ti.uid, ti.gid, ti.uname, ti.gname = uid, gid, "", ""
            if stat.S_ISDIR(st.st_mode):
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            elif stat.S_ISLNK(st.st_mode):
                ti.type = tarfile.SYMTYPE
                ti.linkname = os.readlink(p)
                tf.addfile(ti)
            elif stat.S_ISREG(st.st_mode):
                ti.size = st.st_size
                with open(p, "rb") as f:
                    tf.addfile(ti, f)
            else:
                raise InvalidRequest(f"cannot copy {p}: only files, directories and symlinks can be copied")
            n += 1
    return n


# ---- the build --------------------------------------------------------------------------------
def step_key(parent_layers: list[str], config: ImageConfig, step: Step, network: bool,
             content: str | None = None, copy_dir: str | None = None, copy_name: str | None = None) -> str:
    """The cache key of one layer-making step (hex sha256)."""
    from shoal.fsutil import canonical_json

    if isinstance(step, Run):
        desc: dict[str, Any] = {"run": step.cmd, "network": network}
    elif isinstance(step, Copy):
        desc = {"copy": content, "dir": copy_dir, "name": copy_name, "owner": step.owner,
                "exclude": sorted(step.exclude)}
    else:
        raise TypeError(step)
    data = {"v": _KEY_VERSION, "parent": parent_layers, "env": config.env, "workdir": config.workdir,
            "user": config.user, "step": desc}
    return hashlib.sha256(canonical_json(data)).hexdigest()


class _Tail:
    """The last few KiB of a step's output, for error messages."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def add(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > 2 * _TAIL_BYTES:
            del self.buf[: len(self.buf) - _TAIL_BYTES]

    def text(self) -> str:
        return bytes(self.buf[-_TAIL_BYTES:]).decode("utf-8", "replace")


async def build_recipe(node: Node, recipe: Recipe, *, no_cache: bool = False,
                       log: Callable[[str], None] | None = None) -> Image:
    """Build `recipe` into the store of `node`, step by step with caching; returns the tagged image.

    A failing step raises ImageBuildError carrying the step and its output tail; no sandbox and no
    half-made layer remain (layers of earlier, successful steps stay cached)."""
    recipe.validate()
    log = log or (lambda s: None)
    store: ImageStore = node.store
    t0 = time.monotonic()
    base = await node.resolve_image(recipe.base)  # a base not in the store is pulled (pull_policy)
    layers = [lay.digest for lay in base.layers]
    cfg = base.config.copy()
    cfg.env.update(recipe.env)
    if recipe.workdir:
        cfg.workdir = recipe.workdir
    if recipe.user:
        cfg.user = recipe.user
    n = len(recipe.steps)
    built = cached = 0
    history: list[dict[str, Any]] = []
    for i, step in enumerate(recipe.steps, 1):
        head = f"[{i}/{n}] {step.describe()}"
        if isinstance(step, Env):
            cfg.env.update(step.vars)
            log(head)
            history.append({"step": step.describe()})
            continue
        if isinstance(step, Workdir):
            cfg.workdir = step.path
            log(head)
            history.append({"step": step.describe()})
            continue
        if isinstance(step, User):
            cfg.user = step.name
            log(head)
            history.append({"step": step.describe()})
            continue
        network = recipe.network if not isinstance(step, Run) or step.network is None else bool(step.network)
        content = copy_dir = copy_name = None
        if isinstance(step, Copy):
            content = await asyncio.to_thread(content_digest, Path(step.src), step.exclude)
            copy_dir, copy_name = _copy_target(step, cfg.workdir)
            network = False  # copying needs no network
        key = step_key(layers, cfg, step, network, content, copy_dir, copy_name)
        claim = None
        if no_cache:
            hit = None
        else:
            # another node agent on this store may be building the very same step: wait for its layer
            hit, claim = await _cached_or_claim(store, key, head, log)
        if hit is not None:
            lay = hit["layer"]
            if lay:
                store.touch_layer(lay)
                layers.append(lay)
            cached += 1
            log(f"{head}  (cached{'' if lay else ', no changes'})")
            history.append({"step": step.describe(), "layer": lay, "cached": True})
            continue
        log(head)
        t_step = time.monotonic()
        try:
            layer = await _build_step(node, recipe, i, step, layers, cfg, network, log, copy_dir, copy_name)
            store.cache_put(STEP_CACHE, key, {"layer": layer, "step": step.describe(), "created": time.time(),
                                              "seconds": round(time.monotonic() - t_step, 3)})
        finally:
            if claim is not None:
                await claim.release()
        if layer:
            layers.append(layer)
        built += 1
        history.append({"step": step.describe(), "layer": layer, "cached": False})
        log(f"      -> {layer[:19] if layer else 'no changes'} in {time.monotonic() - t_step:.1f}s")
    lineage = {"built_by": "recipe", "base": base.ref, "base_digest": base.digest, "steps": history}
    img = store.put_image(recipe.ref, layers, cfg, lineage=lineage)
    log(f"built {img.ref} {img.digest[:19]}: {len(img.layers)} layers, {built} steps run, {cached} cached, "
        f"{time.monotonic() - t0:.1f}s")
    return img


def _usable(store: ImageStore, hit: dict[str, Any] | None) -> bool:
    return hit is not None and "layer" in hit and (hit["layer"] is None or _has(store, hit["layer"]))


async def _cached_or_claim(store: ImageStore, key: str, head: str, log: Callable[[str], None]
                           ) -> tuple[dict[str, Any] | None, Claim | None]:
    """(the step's cache entry, None) — maybe after waiting for another node that builds it — or
    (None, a claim of ours) when this node is to build it (shoal.images.claims)."""
    path = store.cache_dir / STEP_CACHE / f"{key}.claim"
    waited = False
    while True:
        hit = store.cache_get(STEP_CACHE, key)
        if _usable(store, hit):
            return hit, None
        claim = await asyncio.to_thread(Claim.try_take, path)
        if claim is not None:
            hit = store.cache_get(STEP_CACHE, key)  # it may have landed between the two looks
            if _usable(store, hit):
                await claim.release()
                return hit, None
            claim.start_heartbeat()
            return None, claim
        age = await asyncio.to_thread(claim_age_s, path)
        if age is not None and age > CLAIM_TTL_S:
            await asyncio.to_thread(break_stale, path)  # its builder died: take over
            continue
        if not waited:
            log(f"{head}  (another node agent is building this step: waiting for its layer)")
            waited = True
        await asyncio.sleep(0.5)


def _has(store: ImageStore, digest: Any) -> bool:
    try:
        return isinstance(digest, str) and store.has_layer(digest)
    except InvalidRequest:
        return False


async def _build_step(node: Node, recipe: Recipe, i: int, step: Run | Copy, layers: list[str],
                      cfg: ImageConfig, network: bool, log: Callable[[str], None],
                      copy_dir: str | None, copy_name: str | None) -> str | None:
    """Run one step in a fresh sandbox; return the digest of its layer (None: no changes)."""
    from shoal.models import SandboxSpec

    store: ImageStore = node.store
    name = parse_ref(recipe.ref).name
    mdigest = store.put_manifest(layers, cfg, lineage={"build": recipe.ref, "step": i})
    timeout = step.timeout if isinstance(step, Run) else 3600.0
    spec = SandboxSpec(image=f"{name}@{mdigest}", network=network, cpus=recipe.cpus, memory_mb=recipe.memory_mb,
                       disk_mb=recipe.disk_mb, ttl_s=timeout + 900, labels={"shoal.build": recipe.ref[:1000]})
    try:
        info = await node.create(spec)
    except ShoalError as e:
        raise ImageBuildError(f"step {i} `{step.describe()[:200]}`: could not start a build sandbox: {e.message}",
                              step=i) from None
    sid = info.id
    try:
        try:
            client = await node.client(sid)
            if isinstance(step, Run):
                if cfg.workdir not in ("", "/"):
                    await client.mkdir(cfg.workdir, parents=True)
                await _run(node, sid, i, step, cfg, log)
            else:
                assert copy_dir is not None
                await _copy(node, sid, i, step, copy_dir, copy_name)
        except ImageBuildError:
            raise
        except ShoalError as e:
            # e.g. the workdir is not reachable by the step's user, or the user does not exist
            raise ImageBuildError(f"step {i} `{step.describe()[:200]}` could not run: {e.message}", step=i) from None
        await _freeze(node, sid)
        rec = node.record(sid)
        upper = node.backend(rec.backend).upper_dir(rec)
        if upper is None:
            raise ImageBuildError(f"the {rec.backend} backend has no writable layer to pack")
        if await asyncio.to_thread(upper_is_empty, Path(upper), network):
            return None
        source = {"type": "recipe-step", "image": recipe.ref, "step": i, "desc": step.describe()[:500]}
        # a step's layer holds no more than the step's sandbox could store (sparse files count their holes)
        disk_mb = int(rec.spec.disk_mb or 4096)
        layer = await asyncio.to_thread(
            lambda: pack_upper(store, Path(upper), source, clean=True, network=network, max_bytes=disk_mb << 20,
                               what=f"step {i} of {recipe.ref}", why=f"the build's disk_mb={disk_mb}"))
        return layer.digest
    finally:
        with contextlib.suppress(Exception):
            await node.close(sid)


async def _freeze(node: Node, sid: str) -> None:
    # freeze background processes the step left behind, so the upper is stable while it is packed
    try:
        await node.pause(sid, reclaim=False)
    except TypeError:
        await node.pause(sid)


async def _run(node: Node, sid: str, i: int, step: Run, cfg: ImageConfig, log: Callable[[str], None]) -> None:
    tail = _Tail()
    pending = b""
    handle = await node.stream(sid, ["/bin/sh", "-c", step.cmd], timeout=step.timeout, cwd=cfg.workdir or "/")
    result = None
    async for ev in handle:
        if ev.kind in ("stdout", "stderr"):
            tail.add(ev.data)
            pending += ev.data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                log("      " + line.decode("utf-8", "replace").rstrip("\r"))
        elif ev.kind == "exit":
            result = ev.result
    if pending:
        log("      " + pending.decode("utf-8", "replace"))
    if result is None:
        raise ImageBuildError(f"step {i} `{step.describe()[:200]}`: the sandbox stopped answering", step=i,
                              output_tail=tail.text())
    if result.timed_out:
        raise ImageBuildError(f"step {i} `{step.describe()[:200]}` timed out after {step.timeout:.0f}s; "
                              f"last output:\n{tail.text()}", step=i, exit_code=result.exit_code,
                              output_tail=tail.text())
    if result.exit_code != 0:
        raise ImageBuildError(f"step {i} `{step.describe()[:200]}` failed with exit code {result.exit_code}; "
                              f"last output:\n{tail.text()}", step=i, exit_code=result.exit_code,
                              output_tail=tail.text())


async def _copy(node: Node, sid: str, i: int, step: Copy, copy_dir: str, copy_name: str | None) -> None:
    client = await node.client(sid)
    await client.mkdir(copy_dir, parents=True)
    with tempfile.TemporaryDirectory(prefix="shoal-copy-", dir=node.paths.run) as tmp:
        tar_path = Path(tmp) / "copy.tar"
        await asyncio.to_thread(_write_tar, step, copy_name, tar_path)
        try:
            await node.exec(sid, ["tar", "--help"], cwd="/", user="0:0", timeout=60, max_output=4096)
        except ShoalError:
            # no tar in this image (distroless, scratch): fall back to one agent call per file
            await _copy_without_tar(client, step, copy_dir, copy_name, i)
            return
        handle = await node.stream(sid, ["tar", "-x", "-f", "-", "-C", copy_dir], stdin=True, cwd="/",
                                   user="0:0", timeout=3600)
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
            raise ImageBuildError(f"step {i} `{step.describe()[:200]}`: tar in the sandbox failed "
                                  f"(exit {code}): {tail.text()}", step=i, exit_code=code, output_tail=tail.text())


async def _copy_without_tar(client: Any, step: Copy, copy_dir: str, copy_name: str | None, i: int) -> None:
    """Fallback for images without `tar`: one agent call per directory and file (no symlinks)."""
    src = Path(step.src)
    uid, gid = _check_owner(step.owner, f"step {i}")
    for rel, st in await asyncio.to_thread(_walk_source, src, step.exclude):
        name = copy_name if copy_name is not None else rel
        dst = posixpath.join(copy_dir, name)
        p = src / rel if rel else src
        if stat.S_ISDIR(st.st_mode):
            await client.mkdir(dst, parents=True, mode=st.st_mode & 0o7777)
        elif stat.S_ISREG(st.st_mode):
            data = await asyncio.to_thread(p.read_bytes)
            await client.write_file(dst, data, mode=st.st_mode & 0o7777, user=f"{uid}:{gid}")
        else:
            raise ImageBuildError(f"step {i} `{step.describe()}`: the image has no `tar`, and symlinks "
                                  f"({rel}) cannot be copied without it", step=i)


def recipe_from_cli(ref: str, base: str, steps: list[tuple[str, Any]], *, network: bool = True,
                    cwd: Path | None = None) -> Recipe:
    """A Recipe from CLI options in command-line order: ("run", cmd), ("copy", (src, dst)), ("env", "K=V"),
    ("workdir", path), ("user", name)."""
    out: list[Step] = []
    cwd = cwd or Path.cwd()
    for kind, val in steps:
        if kind == "run":
            out.append(Run(str(val)))
        elif kind == "copy":
            src, dst = val
            p = Path(src)
            out.append(Copy(p if p.is_absolute() else cwd / p, str(dst)))
        elif kind == "env":
            if "=" not in str(val) or str(val).startswith("="):
                raise InvalidRequest(f"--env {val!r} must look like NAME=VALUE")
            k, v = str(val).split("=", 1)
            out.append(Env({k: v}))
        elif kind == "workdir":
            out.append(Workdir(str(val)))
        elif kind == "user":
            out.append(User(str(val)))
        else:
            raise InvalidRequest(f"unknown step kind {kind!r}")
    return Recipe(ref=ref, base=base, steps=out, network=network).validate()

