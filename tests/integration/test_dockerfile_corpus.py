"""Docker-equal, proven on a corpus: Dockerfiles shaped like real task sets' (dockerfile_corpus/*: Terminal-Bench
apt + pip, a SWE-bench-style repo, multi-stage with an unused stage, users and WORKDIRs, ARG/ENV/config,
.dockerignore, a WORKDIR-only evoeval task, RUN --mount of every kind, COPY/ADD edge cases) built by
`docker build` (a private dockerd from Debian's docker.io, BuildKit on) and by shoal FROM the same bytes
(a Debian tree from mmdebstrap, `docker load`ed and `shoal image import`ed), then compared: every path's
type, permission bits, owner, content and link target, and the configs (Env, WorkingDir, User, Entrypoint,
Cmd, Labels, ExposedPorts, StopSignal, Healthcheck, Volumes). Any difference fails, except the known ones
listed in docs/images.md ("Known differences from docker build"), which are named here per case.

The cases and the result of the last run: docs/images.md, "Docker-equal, on a corpus".

Runs only where `dockerd` is installed (apt-get install docker.io); the base is built with mmdebstrap from
the Debian mirror once and cached in /var/tmp.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.bench.docker import DockerEngine, find_dockerd
from shoal.config import NodeConfig, Paths
from shoal.images.dockerbuild import BuildOptions, build_dockerfile
from shoal.images.oci import import_archive
from shoal.images.store import ImageStore
from tests.dockerequal import (
    Docker,
    debian_rootfs,
    diff_trees,
    docker_archive,
    docker_config_view,
    shoal_config_view,
    shoal_tree,
    snapshot,
)

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.timeout(3600)]
CORPUS = Path(__file__).parent / "dockerfile_corpus"
BASE_TAR = Path("/var/tmp/shoal-corpus-rootfs.tar")
BASE_PACKAGES = ["ca-certificates", "python3", "python3-pip", "python3-venv", "tar", "passwd"]

#: files whose bytes depend on when (or on which inode) they were written, under Docker as under shoal:
#: logs, apt's and ldconfig's binary caches (stamped with the lists' times), byte-compiled Python (its
#: header holds the source's mtime), git's index (it caches each file's stat: mtimes, inode numbers).
#: Compared by type, permission bits and owner, not content
TIME_DEPENDENT = ("var/log/", "var/cache/ldconfig/aux-cache", "var/cache/debconf/", "var/lib/dpkg/status-old",
                  "var/lib/apt/extended_states", "var/cache/apt/")
TIME_DEPENDENT_SUFFIXES = (".pyc", ".git/index")

#: per case: paths that differ for a documented reason (docs/images.md, "Known differences")
KNOWN = {
    # Docker 20.10's BuildKit 0.8 leaves RUN --mount targets as empty directories/files; BuildKit >= 0.12 and
    # shoal remove them
    "mounts": {"root/.cache/pip", "root/.cache", "mnt/data", "mnt", "t", "scratch", "run/secrets",
               "run/secrets/token", "etc/ssl/certs/site-ca.crt"},
}


def _prepare(case: str, ctx: Path) -> None:
    """What git cannot keep (permission bits other than 644/755, a .git directory), and this machine's CA
    bundle for the cases that pip-install over HTTPS (sites whose HTTPS goes through a re-signing proxy)."""
    if case in ("tbench-apt-pip", "mounts"):
        shutil.copyfile("/etc/ssl/certs/ca-certificates.crt", ctx / "site-ca.crt")
    if case == "users-workdir":
        os.chmod(ctx / "project/pkg/mod.py", 0o640)
    if case == "copy-semantics":
        os.chmod(ctx / "file.txt", 0o600)
        os.chmod(ctx / "dir/sub", 0o711)
    if case == "dockerignore":
        (ctx / ".git").mkdir(exist_ok=True)
        (ctx / ".git" / "HEAD").write_text("ref: refs/heads/main\n")


@pytest.fixture(scope="module")
def docker() -> Iterator[Docker]:
    path, why = find_dockerd()
    if not path:
        pytest.skip(why)
    eng = DockerEngine()
    try:
        eng.start()
    except Exception as e:
        eng.stop()
        pytest.skip(f"dockerd did not start: {e}")
    try:
        yield Docker(eng.sock)
    finally:
        eng.stop()


@pytest.fixture(scope="module")
def corpus_store(docker: Docker, base_image: str, tmp_path_factory: pytest.TempPathFactory) -> ImageStore:
    """A private store holding the corpus base (imported from the same archive dockerd loads)."""
    rootfs = debian_rootfs(BASE_TAR, BASE_PACKAGES)
    work = tmp_path_factory.mktemp("corpus")
    arch = docker_archive(rootfs, work / "base.tar", "corpus-base:1")
    docker.run("load", "-i", str(arch))
    store = ImageStore(work / "store")
    import_archive(store, arch, "corpus-base:1", work_dir=Path("/var/tmp"))
    arch.unlink()
    return store


def _equal_snapshots(docker_tree: Path, shoal_root: Path, known: set[str]) -> list[str]:
    a, b = snapshot(docker_tree), snapshot(shoal_root)
    for snap in (a, b):
        for k in list(snap):
            if k in known:
                del snap[k]
            elif k.startswith(TIME_DEPENDENT) or k.endswith(TIME_DEPENDENT_SUFFIXES):
                snap[k] = snap[k][:4]  # type, mode, owner only
    return diff_trees(a, b, limit=60)


@pytest.mark.parametrize("case", sorted(p.name for p in CORPUS.iterdir() if (p / "Dockerfile").is_file()))
def test_corpus_case_equals_docker(case: str, docker: Docker, corpus_store: ImageStore, shoal_home: Path,
                                   tmp_path: Path) -> None:
    ctx = tmp_path / case
    shutil.copytree(CORPUS / case, ctx, symlinks=True)
    _prepare(case, ctx)
    extra: list[str] = []
    secrets = {}
    if case == "mounts":
        tok = tmp_path / "token"
        tok.write_text("s3cret-token")
        extra += ["--secret", f"id=token,src={tok}"]
        secrets["token"] = tok
    tag = f"corpus-{case}:1"
    docker.build(ctx, tag, *extra)

    async def build() -> None:
        from shoal.node.node import Node

        node = Node(NodeConfig(paths=Paths(home=shoal_home, store=corpus_store.root)))
        await node.start(reap=False, reconcile=False)
        try:
            # RUN steps reach the Debian mirror and PyPI only (egress rules of shoal's sandboxes, DNS through
            # the node's proxy); Docker's RUN gets the host's network
            await build_dockerfile(node, BuildOptions(tag=tag, context=ctx, secrets=secrets,
                                                      network=["debian", "pypi"]))
        finally:
            await node.stop()

    asyncio.run(build())
    with docker.tree(tag) as dtree, shoal_tree(corpus_store, tag) as stree:
        diffs = _equal_snapshots(dtree, stree, KNOWN.get(case, set()))
    assert diffs == [], f"{case}: the trees differ:\n" + "\n".join(diffs)
    assert shoal_config_view(corpus_store, tag) == docker_config_view(docker.config(tag))
