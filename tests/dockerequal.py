"""Docker-equality helpers: one base image made here (a Debian tree from mmdebstrap, wrapped as a
`docker save` archive) loaded into a private dockerd *and* imported into shoal, so both build FROM the same
bytes; then both results' file trees and configs, compared entry by entry.

Used by tests/integration/test_dockerfile_corpus.py and `shoal bench build`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shoal.host import syscalls
from shoal.images.store import ImageStore

#: paths Docker's runtime adds to every container (`docker export` shows them) and shoal's build sandboxes
#: never keep: not part of what a Dockerfile made
RUNTIME_PATHS = {".dockerenv", "etc/hostname", "etc/hosts", "etc/resolv.conf", "etc/mtab", "dev", "proc", "sys"}


def docker_archive(rootfs_tar: Path, out: Path, repo_tag: str, env: list[str] | None = None,
                   cmd: list[str] | None = None) -> Path:
    """Wrap a root filesystem tar as a one-layer `docker save` archive tagged `repo_tag`."""
    h = hashlib.sha256()
    with open(rootfs_tar, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    diff_id = "sha256:" + h.hexdigest()
    config = {"architecture": "amd64", "os": "linux", "created": "2025-01-01T00:00:00Z",
              "config": {"Env": env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
                         "Cmd": cmd or ["bash"]},
              "rootfs": {"type": "layers", "diff_ids": [diff_id]},
              "history": [{"created": "2025-01-01T00:00:00Z", "created_by": "mmdebstrap (tests/dockerequal.py)"}]}
    cbytes = json.dumps(config, sort_keys=True).encode()
    cname = hashlib.sha256(cbytes).hexdigest() + ".json"
    manifest = [{"Config": cname, "RepoTags": [repo_tag], "Layers": ["layer/layer.tar"]}]
    with tarfile.open(out, "w") as tf:
        def add(name: str, data: bytes) -> None:
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mtime = 0
            tf.addfile(ti, io.BytesIO(data))
        add(cname, cbytes)
        add("manifest.json", json.dumps(manifest).encode())
        ti = tarfile.TarInfo("layer/layer.tar")
        ti.size = rootfs_tar.stat().st_size
        with open(rootfs_tar, "rb") as f:
            tf.addfile(ti, f)
    return out


def debian_rootfs(dest: Path, packages: list[str]) -> Path:
    """A Debian bookworm minbase tree with `packages`, as a tar from mmdebstrap (cached at `dest`)."""
    if dest.exists():
        return dest
    tmp = dest.with_suffix(".part.tar")
    subprocess.run(["mmdebstrap", "--variant=minbase", "--quiet", f"--include={','.join(packages)}",
                    "--customize-hook=rm -rf $1/var/cache/apt/*.bin $1/var/lib/apt/lists/*",
                    "bookworm", str(tmp), "http://deb.debian.org/debian"], check=True)
    tmp.rename(dest)
    return dest


class Docker:
    """The `docker` CLI of Debian's docker.io (20.10, BuildKit built in) against a private dockerd."""

    def __init__(self, sock: Path) -> None:
        self.sock = sock
        self.cli = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else shutil.which("docker") or "docker"

    def run(self, *args: str, input: bytes | None = None, timeout: float = 1800, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
        e = dict(os.environ, DOCKER_BUILDKIT="1", DOCKER_HOST=f"unix://{self.sock}", **(env or {}))
        e.pop("DOCKER_CONFIG", None)
        r = subprocess.run([self.cli, *args], input=input, capture_output=True, timeout=timeout, env=e)
        if check and r.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)} failed: {r.stderr.decode(errors='replace')[-3000:]}")
        return r

    def build(self, context: Path, tag: str, *extra: str) -> float:
        """`docker build` (BuildKit, host network for RUN like shoal's build sandboxes); returns seconds."""
        t0 = time.monotonic()
        self.run("build", "--network=host", "--progress=plain", "-t", tag, *extra, str(context))
        return time.monotonic() - t0

    def config(self, tag: str) -> dict[str, Any]:
        """The image config (`docker inspect` .Config)."""
        return json.loads(self.run("image", "inspect", tag).stdout)[0]["Config"]

    @contextlib.contextmanager
    def tree(self, tag: str) -> Iterator[Path]:
        """The image's files, from `docker export` of a created (never started) container, unpacked here."""
        cid = self.run("create", tag, "/nonexistent").stdout.decode().strip()
        work = Path(tempfile.mkdtemp(prefix="shoal-dockertree-", dir="/var/tmp"))
        try:
            tar = work / "fs.tar"
            with open(tar, "wb") as f:
                e = dict(os.environ, DOCKER_HOST=f"unix://{self.sock}")
                subprocess.run([self.cli, "export", cid], stdout=f, check=True, env=e, timeout=1800)
            root = work / "root"
            root.mkdir()
            subprocess.run(["tar", "-x", "-p", "--same-owner", "--numeric-owner", "-f", str(tar), "-C", str(root)],
                           check=True)
            tar.unlink()
            yield root
        finally:
            self.run("rm", "-f", cid, check=False)
            shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def shoal_tree(store: ImageStore, ref: str) -> Iterator[Path]:
    """The image's tree as a sandbox sees it: each EROFS layer mounted, stacked by a read-only overlay."""
    img = store.resolve(ref)
    work = Path(tempfile.mkdtemp(prefix="shoal-imgtree-", dir="/var/tmp"))
    mounted: list[str] = []
    try:
        lowers = []
        for i, lay in enumerate(img.layers):
            mp = work / f"l{i}"
            mp.mkdir()
            whole = store.export_layer(lay.digest, work / f"l{i}.erofs")  # every chunk checked on the way
            syscalls.mount(str(whole), str(mp), "erofs", syscalls.MS_RDONLY, None)
            mounted.append(str(mp))
            lowers.append(str(mp))
        empty = work / "empty"
        empty.mkdir()
        merged = work / "merged"
        merged.mkdir()
        syscalls.mount("overlay", str(merged), "overlay", syscalls.MS_RDONLY,
                       "lowerdir=" + ":".join([*reversed(lowers), str(empty)]))
        mounted.append(str(merged))
        yield merged
    finally:
        for mp in reversed(mounted):
            syscalls.umount(mp, detach=True)
        shutil.rmtree(work, ignore_errors=True)


def snapshot(root: Path, skip: set[str] | None = None) -> dict[str, tuple[Any, ...]]:
    """Every entry's type, permission bits, owner, content digest or link target (not times)."""
    skip = RUNTIME_PATHS | (skip or set())
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir != "." and (rel_dir in skip or rel_dir.split("/")[0] in skip):
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if rel in skip:
                if name in dirnames:
                    dirnames.remove(name)
                continue
            s = os.lstat(p)
            if stat.S_ISREG(s.st_mode):
                h = hashlib.sha256()
                with open(p, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
                body: object = h.hexdigest()[:16]
            elif stat.S_ISLNK(s.st_mode):
                body = os.readlink(p)
            else:
                body = None
            out[rel] = (stat.S_IFMT(s.st_mode), oct(stat.S_IMODE(s.st_mode)), s.st_uid, s.st_gid, body)
    return out


def diff_trees(a: dict[str, tuple[Any, ...]], b: dict[str, tuple[Any, ...]], limit: int = 40) -> list[str]:
    """Human-readable differences between two snapshots (docker = a, shoal = b)."""
    out = []
    for k in sorted(set(a) | set(b)):
        if k not in b:
            out.append(f"only in docker: {k} {a[k]}")
        elif k not in a:
            out.append(f"only in shoal: {k} {b[k]}")
        elif a[k] != b[k]:
            out.append(f"differs: {k} docker={a[k]} shoal={b[k]}")
        if len(out) >= limit:
            out.append("…")
            break
    return out


def docker_config_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """The parts of a Docker image config the corpus compares."""
    return {"Env": sorted(cfg.get("Env") or []), "WorkingDir": cfg.get("WorkingDir") or "/",
            "User": "" if cfg.get("User") in (None, "", "root") else cfg["User"],
            "Entrypoint": cfg.get("Entrypoint") or [], "Cmd": cfg.get("Cmd") or [],
            "Labels": cfg.get("Labels") or {}, "ExposedPorts": sorted(cfg.get("ExposedPorts") or {}),
            "StopSignal": cfg.get("StopSignal") or "", "Healthcheck": cfg.get("Healthcheck"),
            "Volumes": sorted(cfg.get("Volumes") or {})}


def shoal_config_view(store: ImageStore, ref: str) -> dict[str, Any]:
    """The same parts of a shoal image's config."""
    c = store.resolve(ref).config
    return {"Env": sorted(f"{k}={v}" for k, v in c.env.items()), "WorkingDir": c.workdir or "/",
            "User": "" if c.user == "root" else c.user,  # shoal keeps an unset user as "root"
            "Entrypoint": c.entrypoint, "Cmd": c.cmd, "Labels": c.labels, "ExposedPorts": sorted(c.exposed_ports),
            "StopSignal": c.stop_signal, "Healthcheck": c.healthcheck, "Volumes": sorted(c.volumes)}
