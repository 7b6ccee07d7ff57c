"""REST routes for images (list, get, remove, build, import, pull) and for fncall's run_code.

Images a project makes are stored as `projects/<project>/<name>` and shown to it without the prefix
(see `deps.Namespace`). Every image operation goes through the node front (`shoal.front.Front`: the
embedded node, or a cluster gateway); what a front or this build lacks answers 501.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from shoal.errors import Forbidden, ImageNotFound, InvalidRequest
from shoal.fsutil import tmp_name
from shoal.models import RunCodeResult
from shoal.server.codec import b64decode_field, encode_run_code_result
from shoal.server.deps import Namespace, ServerState, authorized, require_admin, state_of
from shoal.server.responses import errors
from shoal.server.schemas import (
    NEW_IMAGE_RE,
    BuildIn,
    EnvStep,
    ImageList,
    ImageRef,
    NewImageName,
    RunCodeIn,
    RunStep,
    WorkdirStep,
)
from shoal.server.store_quota import store_budget
from shoal.server.tokens import Principal

if TYPE_CHECKING:
    from shoal.images.oci import ImportReport

router = APIRouter(prefix="/v1", tags=["images"])
Who = Annotated[Principal, Depends(authorized)]
#: a Dockerfile build argument: NAME=VALUE, the value possibly empty (Docker's `--build-arg NAME` alone, taken from
#: the client's environment, is the client's business: the SDK sends NAME=VALUE)
BuildArg = Annotated[str, StringConstraints(max_length=100_000, pattern=r"^[^=]+=")]
RefPath = Annotated[str, PathParam(max_length=300, description="name[:tag] or name@sha256:…")]


class PullRefIn(BaseModel):
    """A registry image to pull by its reference, as `docker pull` takes it."""

    model_config = ConfigDict(extra="forbid")
    reference: ImageRef = Field(description="python:3.12-slim, ghcr.io/org/img:tag, name@sha256:…")


class PullImportIn(BaseModel):
    """The older skopeo import of `source` (docker://…) under `name` (admin tokens)."""

    model_config = ConfigDict(extra="forbid")
    source: str = Field(min_length=1, max_length=1000, description="docker://registry/name:tag (skopeo import)")
    name: NewImageName = Field(description="name[:tag] in the store")
    tls_verify: bool = True


#: one of the two shapes, never a mix (the schema says so: each forbids the other's fields)
PullIn = PullRefIn | PullImportIn


def _lookup(st: ServerState, ns: Namespace, ref: str) -> str:
    """The store name of an existing image the caller names; a malformed name cannot exist (404)."""
    try:
        return ns.for_read(st, ref)
    except InvalidRequest as e:
        raise ImageNotFound(f"image {ref!r} not found ({e.message})") from None


def _report(ns: Namespace, rep: ImportReport) -> dict[str, Any]:
    return {"format": rep.format, "layers_unpacked": rep.layers_unpacked, "layers_cached": rep.layers_cached,
            "seconds": rep.seconds, "notes": rep.notes, "image": ns.show_image(rep.image.to_dict())}


@router.get("/images", response_model=ImageList, responses=errors(), summary="List images")
async def list_images(request: Request, who: Who) -> dict[str, Any]:
    """Shared images plus the caller's project's own."""
    st = state_of(request)
    ns = Namespace(who)
    imgs = await st.node.images()
    return {"images": [ns.show_image(i.to_dict()) for i in imgs if ns.visible(i.name)]}


@router.get("/images/{ref:path}", response_model=dict[str, Any], responses=errors(404), summary="Get an image")
async def get_image(ref: RefPath, request: Request, who: Who) -> dict[str, Any]:
    """One image: its layers (bottom first), config and lineage."""
    st = state_of(request)
    ns = Namespace(who)
    img = await st.node.image(_lookup(st, ns, ref))
    return ns.show_image(img.to_dict())


@router.delete("/images/{ref:path}", status_code=204, responses=errors(403, 404), summary="Remove an image tag")
async def remove_image(ref: RefPath, request: Request, who: Who) -> Response:
    """Remove a tag of the caller's project (shared images: admin tokens only). Layers go at `gc`."""
    st = state_of(request)
    ns = Namespace(who)
    name = _lookup(st, ns, ref)
    if not ns.owns(name):
        if not await st.node.image_exists(name):
            raise ImageNotFound(f"image {ref} not found")
        raise Forbidden(f"image {ref} is shared: only an operator (admin token) removes it")
    await st.node.remove_image(name)
    return Response(status_code=204)


@router.post("/images/build", response_model=dict[str, Any], responses=errors(403, 404, 500, 501, 503),
             summary="Build an image")
async def build_image(body: BuildIn, request: Request, who: Who) -> dict[str, Any]:
    """Build an image from a recipe (run/env/workdir/user steps, each cached as a layer), or the built-in
    `base` (admin tokens). The image belongs to the caller's project."""
    st = state_of(request)
    ns = Namespace(who)
    if body.recipe is None:
        from shoal.images.refs import parse_ref

        if parse_ref(body.name).name != "base":
            raise ImageNotFound(f"no built-in recipe for {body.name!r}: only `base` builds without one; "
                                "send `recipe` for anything else")
        require_admin(who, "building the base image")
        ref = body.name if ":" in body.name else "base:latest"
        img = await st.node.build_base(ref)
        return ns.show_image(img.to_dict())
    from shoal.images import recipe as rmod
    rin = body.recipe
    steps: list[Any] = []
    for stp in rin.steps:
        if isinstance(stp, RunStep):
            steps.append(rmod.Run(stp.run, network=stp.network, timeout=stp.timeout))
        elif isinstance(stp, EnvStep):
            steps.append(rmod.Env(dict(stp.env)))
        elif isinstance(stp, WorkdirStep):
            steps.append(rmod.Workdir(stp.workdir))
        else:
            steps.append(rmod.User(stp.user))
    recipe = rmod.Recipe(ref=ns.for_write(body.name), base=ns.for_read(st, rin.from_), steps=steps,
                         network=rin.network, env=dict(rin.env), workdir=rin.workdir, user=rin.user, cpus=rin.cpus,
                         memory_mb=rin.memory_mb, disk_mb=rin.disk_mb)
    # each step runs in a sandbox of this size: it counts against the project's quota while it builds
    res = st.quotas.reserve(who, 1, rin.cpus, rin.memory_mb)
    try:
        async with store_budget(st.node.store, who, f"building {body.name}"):
            img = await st.node.build_recipe(recipe, no_cache=rin.no_cache)
    finally:
        res.release()
    return ns.show_image(img.to_dict())


@router.post("/images/dockerfile", response_model=dict[str, Any], responses=errors(403, 404, 503),
             summary="Build a Dockerfile (docker build)",
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string", "format": "binary",
                                                         "description": "the build context as a (gzip) tar"}}}}})
async def build_dockerfile_image(
        request: Request, who: Who,
        name: Annotated[str, Query(max_length=300, pattern=NEW_IMAGE_RE, description="name[:tag] to build")],
        dockerfile: Annotated[str, Query(max_length=1000, description="the Dockerfile's path in the context")] =
        "Dockerfile",
        build_arg: Annotated[list[BuildArg] | None, Query(max_length=1000, description="NAME=VALUE, repeatable")] =
        None,
        target: Annotated[str | None, Query(max_length=200)] = None,
        platform: Annotated[str | None, Query(max_length=100)] = None,
        no_cache: bool = False, network: bool = True,
        egress: Annotated[list[str] | None, Query(max_length=300, description="RUN steps reach only these "
                                                  "(egress rules, as a sandbox's network)")] = None) -> dict[str, Any]:
    """`docker build` on the server: the body is the build context (a tar, maybe gzip; the client leaves out
    what .dockerignore excludes), built with BuildKit's Dockerfile semantics into the caller's project. FROM
    names resolve like any image argument (the project's images, then shared ones)."""
    import shutil
    import tempfile

    from shoal.images.dockerbuild import BuildOptions, extract_context

    st = state_of(request)
    ns = Namespace(who)
    target_ref = ns.for_write(name)
    args: dict[str, str] = {}
    for it in build_arg or []:
        k, _, v = it.partition("=")  # the schema holds it to NAME=VALUE
        args[k] = v
    df = Path(dockerfile)
    if df.is_absolute() or ".." in df.parts:
        raise InvalidRequest(f"dockerfile {dockerfile!r} must be a path inside the build context")
    store = st.node.store
    work = Path(tempfile.mkdtemp(prefix="shoal-ctx-", dir=store.tmp_dir))
    try:
        async with store_budget(store, who, f"building {name}"):
            tar = work / "context.tar"
            fd = os.open(tar, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                async for chunk in request.stream():
                    f.write(chunk)
            ctx = work / "context"
            ctx.mkdir()
            await asyncio.to_thread(extract_context, tar, ctx)
            tar.unlink()
            opts = BuildOptions(tag=target_ref, context=ctx, dockerfile=ctx / df, build_args=args, target=target,
                                platform=platform, no_cache=no_cache,
                                network=list(egress) if egress and network else network)

            async def resolve(ref: str) -> Any:
                # the project's image, a shared one, or pulled per pull_policy
                return await st.node.resolve_image(_lookup(st, ns, ref))

            res = st.quotas.reserve(who, 1, opts.cpus, opts.memory_mb)
            try:
                out = await st.node.build_dockerfile(opts, resolve_base=resolve)
            finally:
                res.release()
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)
    d = out.to_dict()
    d["image"] = ns.show_image(d["image"])
    return d


@router.post("/images/import", response_model=dict[str, Any], responses=errors(403, 501, 503),
             summary="Import a docker-archive or OCI-layout tarball",
             openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
async def import_image(request: Request, who: Who,
                       name: Annotated[str, Query(max_length=300, pattern=NEW_IMAGE_RE, description="name[:tag]")],
                       select: Annotated[str | None, Query(max_length=300)] = None) -> dict[str, Any]:
    """Import the tarball in the request body (`docker save` output or an OCI image layout) as `name`."""
    st = state_of(request)
    ns = Namespace(who)
    target = ns.for_write(name)
    tmp = Path(st.node.store.tmp_dir) / (tmp_name("upload-") + ".tar")
    try:
        async with store_budget(st.node.store, who, f"importing {name}"):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as f:
                async for chunk in request.stream():
                    f.write(chunk)
            rep = await st.node.import_image(tmp, target, select=select, source_label="upload")
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return _report(ns, rep)


class ExportIn(BaseModel):
    """An image to write out as a docker-archive."""

    model_config = ConfigDict(extra="forbid")
    image: ImageRef = Field(..., description="the image: name[:tag] or name@sha256:…")
    tags: list[NewImageName] | None = Field(None, max_length=64, description="RepoTags in the archive "
                                                                              "(default: the image's name:tag)")


class PushIn(BaseModel):
    """An image of the store to push to a registry."""

    model_config = ConfigDict(extra="forbid")
    image: ImageRef = Field(..., description="the image in the store")
    target: ImageRef = Field(..., description="registry/repository:tag to push to")


@router.post("/images/export", responses={**errors(404, 503), 200: {"content": {"application/x-tar": {}},
                                                                     "description": "a docker-archive"}},
             summary="Export an image as a docker-archive (docker load reads it)", response_class=Response)
async def export_image(body: ExportIn, request: Request, who: Who) -> Response:
    """The image as `docker save` writes it (`docker load -i` reads it); the caller's project's images and
    shared ones. The archive is made in a temp file on the server first (its size is the image's)."""
    from starlette.background import BackgroundTask
    from starlette.responses import FileResponse

    st = state_of(request)
    ns = Namespace(who)
    name = _lookup(st, ns, body.image)
    tmpd = Path(st.node.paths.home) / "tmp"
    tmpd.mkdir(parents=True, exist_ok=True)
    out = tmpd / (tmp_name("export-") + ".tar")
    tags = list(body.tags) if body.tags else [ns.show(name) if "@" not in name else body.image]
    try:
        await st.node.export_image(name, out, repo_tags=tags)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            out.unlink()
        raise
    return FileResponse(out, media_type="application/x-tar", background=BackgroundTask(out.unlink, missing_ok=True))


@router.post("/images/push", response_model=dict[str, Any], responses=errors(403, 404, 502, 503),
             summary="Push an image to a registry")
async def push_image(body: PushIn, request: Request, who: Who) -> dict[str, Any]:
    """Push an image to a registry with the server's credentials (admin tokens: the server writes where it is
    told, as itself). Blobs the registry has are not uploaded."""
    st = state_of(request)
    require_admin(who, "pushing to a registry with the server's credentials")
    ns = Namespace(who)
    name = _lookup(st, ns, body.image)
    rep = await st.node.push_image(name, body.target)
    return rep.to_dict()


@router.post("/images/pull", response_model=dict[str, Any], responses=errors(403, 404, 501, 502, 503),
             summary="Pull an image from a registry")
async def pull_image(body: PullIn, request: Request, who: Who) -> dict[str, Any]:
    """Pull `reference` from its registry into the shared store (what a create of a missing image does by
    itself), or import `source` (docker://…) with skopeo under `name` (admin tokens: any URL)."""
    st = state_of(request)
    ns = Namespace(who)
    if isinstance(body, PullRefIn):
        out = await st.node.pull(body.reference)
        out["image"] = ns.show_image(out["image"])
        return dict(out)
    require_admin(who, "importing from a registry URL")
    rep = await st.node.import_registry(body.source, ns.for_write(body.name), tls_verify=body.tls_verify)
    return _report(ns, rep)


def jsonable(obj: Any) -> Any:
    """Turn a result object (dataclass, pydantic model, bytes…) into JSON-friendly data."""
    if hasattr(obj, "to_dict"):
        obj = obj.to_dict()
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    elif hasattr(obj, "model_dump"):
        obj = obj.model_dump()
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj).decode("utf-8", "replace")
    return obj


@router.post("/run_code", response_model=dict[str, Any], responses=errors(403, 404, 500, 501, 503, 504),
             tags=["fncall"], summary="Run a code snippet on the fncall backend")
async def run_code(body: RunCodeIn, request: Request, who: Who) -> dict[str, Any]:
    """Run a short snippet in a warm pool (no sandbox to manage); extra fields go to the backend."""
    st = state_of(request)
    extra = body.model_dump(exclude_unset=True, exclude={"code", "language", "stdin_b64", "files_b64"})
    if body.stdin_b64 is not None:
        extra["stdin"] = b64decode_field(body.stdin_b64, "stdin_b64")
    if body.files_b64:
        files: dict[str, Any] = dict(extra.get("files") or {})
        for path, v in body.files_b64.items():
            files[path] = b64decode_field(v, f"files_b64.{path}")
        extra["files"] = files
    try:
        res = await st.node.run_code(body.code, language=body.language, **extra)
    except TypeError as e:
        raise InvalidRequest(f"bad run_code options: {e}") from None
    if isinstance(res, RunCodeResult):
        return {"result": encode_run_code_result(res)}
    return {"result": jsonable(res)}
