"""Images back out (issue 25, item 8): `shoal image export` writes a docker-archive that `docker load`
accepts and `shoal image push` writes to a registry that `docker pull` and `shoal image pull` read, with
whiteouts, opaque directories, links, owners, modes, xattrs and the config kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.errors import ImageNotFound, InvalidRequest, RegistryAuthFailed
from shoal.images.archive import image_config, layer_tar, write_docker_archive
from shoal.images.export import export_image, push_image
from shoal.images.oci import import_archive
from shoal.images.pull import pull_image
from shoal.images.store import ImageStore
from tests.registry import LoopbackRegistry, available, busybox_layer

pytestmark = [pytest.mark.root, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def _tricky_layers() -> list[bytes]:
    """Three layers: busybox, then files of every kind, then deletions (a whiteout and an opaque dir)."""
    lower = layer_tar([
        ("dir", "data", 0o755), ("file", "data/keep", b"keep\n", 0o644), ("file", "data/gone", b"gone\n", 0o644),
        ("dir", "data/opq", 0o755), ("file", "data/opq/old", b"old\n", 0o644),
        ("file", "data/suid", b"#!/bin/sh\n", 0o4755), ("symlink", "data/link", "keep"),
        ("file", "data/owned", b"owned\n", 0o640, (1000, 1000)), ("hardlink", "data/hard", "data/keep"),
    ], mtime=1_700_000_000)
    upper = layer_tar([("dir", "data", 0o755), ("whiteout", "data/gone"), ("dir", "data/opq", 0o700),
                       ("opaque", "data/opq"), ("file", "data/opq/new", b"new\n", 0o600)], mtime=1_700_000_100)
    return [busybox_layer(), lower, upper]


@pytest.fixture(autouse=True)
def _private_home(shoal_home: Path) -> None:
    """Exports mount layers: always under the session's own SHOAL_HOME, never the host's default one."""


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")


@pytest.fixture
def tricky(store: ImageStore, tmp_path: Path) -> str:
    tars = _tricky_layers()
    cfg = image_config(tars, env=["PATH=/bin", "A=1"], workdir="/data", cmd=["cat", "/data/keep"])
    cfg["config"]["Labels"] = {"org.example.task": "17"}
    cfg["config"]["ExposedPorts"] = {"8080/tcp": {}}
    import_archive(store, write_docker_archive(tmp_path / "in.tar", tars, cfg), "tricky:1")
    return "tricky:1"


def test_export_round_trips_to_the_same_layers(store: ImageStore, tricky: str, tmp_path: Path) -> None:
    """export -> import gives back byte-identical EROFS layers: every entry and its metadata survived."""
    out = tmp_path / "out.tar"
    rep = export_image(store, tricky, out)
    assert rep.layers == 3 and out.stat().st_size == rep.bytes
    again = ImageStore(tmp_path / "again")
    import_archive(again, out, "back:1")
    a, b = store.resolve(tricky), again.resolve("back:1")
    assert [x.digest for x in a.layers] == [x.digest for x in b.layers]
    assert b.config.env["A"] == "1" and b.config.workdir == "/data" and b.config.cmd == ["cat", "/data/keep"]
    assert b.config.labels == {"org.example.task": "17"} and b.config.exposed_ports == ["8080/tcp"]
    # the archive is docker save's shape, tags included; the same image exports to the same bytes
    import tarfile
    with tarfile.open(out) as tf:
        manifest = json.load(tf.extractfile("manifest.json"))  # type: ignore[arg-type]
        names = tf.getnames()
    assert manifest[0]["RepoTags"] == ["tricky:1"] and len(manifest[0]["Layers"]) == 3
    assert all(n in names for n in manifest[0]["Layers"])
    export_image(store, tricky, tmp_path / "out2.tar")
    assert (tmp_path / "out2.tar").read_bytes() == out.read_bytes(), "exports are reproducible"
    assert not [p for p in tmp_path.iterdir() if ".part-" in p.name] and list(store.tmp_dir.iterdir()) == []


def test_export_errors(store: ImageStore, tmp_path: Path) -> None:
    with pytest.raises(ImageNotFound):
        export_image(store, "nope:1", tmp_path / "x.tar")
    with pytest.raises(InvalidRequest):
        export_image(store, "Bad Ref", tmp_path / "x.tar")
    assert not (tmp_path / "x.tar").exists()


def test_push_then_pull_back(store: ImageStore, tricky: str, tmp_path: Path) -> None:
    if available():
        pytest.skip(available())
    with LoopbackRegistry(tmp_path / "reg") as reg:
        target = f"{reg.host}/team/tricky:1"
        rep = push_image(store, tricky, target)
        assert rep.layers_uploaded == 3 and rep.manifest_digest == reg.manifest_digest("team/tricky:1")
        again = push_image(store, tricky, target)
        assert again.layers_uploaded == 0 and again.layers_present == 3, "a second push uploads nothing"
        other = ImageStore(tmp_path / "other")
        got = pull_image(other, target)
        assert [x.digest for x in got.image.layers] == [x.digest for x in store.resolve(tricky).layers]
        assert got.image.config.labels == {"org.example.task": "17"}
        with pytest.raises(ImageNotFound):
            push_image(store, "nope:1", target)
    with LoopbackRegistry(tmp_path / "auth", auth="basic") as reg:
        os.environ["DOCKER_CONFIG"] = str(tmp_path / "nocreds")
        try:
            with pytest.raises(RegistryAuthFailed):
                push_image(store, tricky, f"{reg.host}/team/tricky:1")
            os.environ["DOCKER_CONFIG"] = str(reg.docker_config(tmp_path / "creds"))
            assert push_image(store, tricky, f"{reg.host}/team/tricky:1").layers_uploaded == 3
        finally:
            os.environ.pop("DOCKER_CONFIG", None)


def test_cli_export_and_push(store: ImageStore, tricky: str, tmp_path: Path) -> None:
    env = {**os.environ, "SHOAL_STORE": str(store.root), "SHOAL_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    shoal = [str(Path(sys.executable).parent / "shoal")]
    r = subprocess.run([*shoal, "image", "export", tricky, "-o", str(tmp_path / "c.tar")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "exported tricky:1" in r.stdout, r.stderr
    r = subprocess.run([*shoal, "image", "export", tricky, "-o", "-"], env=env, capture_output=True, timeout=300)
    assert r.returncode == 0 and r.stdout == (tmp_path / "c.tar").read_bytes(), "stdout gets the same archive"
    r = subprocess.run([*shoal, "image", "export", "nope:1", "-o", str(tmp_path / "d.tar")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "not found" in r.stderr and "Traceback" not in r.stderr
    if available():
        return
    with LoopbackRegistry(tmp_path / "reg") as reg:
        r = subprocess.run([*shoal, "image", "push", tricky, f"{reg.host}/cli/tricky:2"], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0 and "3 layers uploaded" in r.stdout, r.stderr


@pytest.fixture(scope="module")
def docker() -> Iterator:
    from shoal.bench.docker import DockerEngine, find_dockerd

    exe, why = find_dockerd()
    if not exe:
        pytest.skip(why)
    eng = DockerEngine()
    try:
        eng.start()
    except Exception as e:
        eng.stop()
        pytest.skip(f"dockerd did not start: {e}")
    yield eng
    eng.stop()


def _docker(eng, *args: str, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:  # type: ignore[no-untyped-def]
    return subprocess.run(["docker", "-H", f"unix://{eng.sock}", *args], capture_output=True, timeout=600,
                          input=input)


def test_docker_loads_and_runs_the_export(store: ImageStore, tricky: str, tmp_path: Path, docker,  # type: ignore[no-untyped-def]
                                          base_image: str) -> None:
    out = tmp_path / "d.tar"
    export_image(store, tricky, out)
    r = _docker(docker, "load", "-i", str(out))
    assert r.returncode == 0 and b"tricky:1" in r.stdout, r.stderr
    script = ("cd /data; ls -a . opq | tr '\\n' ' '; echo; cat keep opq/new; stat -c '%a %u:%g %h' suid owned keep;"
              " readlink link")
    r = _docker(docker, "run", "--rm", "--network=none", "tricky:1", "sh", "-c", script)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.decode().splitlines()
    listing = lines[0].split()
    assert "gone" not in listing and "old" not in listing, "whiteout and opaque dir as Docker reads them"
    assert {"keep", "hard", "link", "opq", "owned", "suid", "new"} <= set(listing)
    assert lines[1:3] == ["keep", "new"]
    assert lines[3:6] == ["4755 0:0 1", "640 1000:1000 1", "644 0:0 2"] and lines[6] == "keep"
    r = _docker(docker, "run", "--rm", "--network=none", "tricky:1")  # the image's own Cmd
    assert r.stdout == b"keep\n"
    info = json.loads(_docker(docker, "image", "inspect", "tricky:1").stdout)[0]["Config"]
    assert info["WorkingDir"] == "/data" and "A=1" in info["Env"] and info["Labels"] == {"org.example.task": "17"}
    assert "8080/tcp" in info["ExposedPorts"]
    # shoal's own base image (Debian, bash, python3): a shoal-made image Docker users can run
    from shoal.config import Paths

    shared = ImageStore(Paths.from_env().store)
    export_image(shared, "base:latest", tmp_path / "base.tar", repo_tags=["shoal-base:test"])
    assert _docker(docker, "load", "-i", str(tmp_path / "base.tar")).returncode == 0
    r = _docker(docker, "run", "--rm", "--network=none", "shoal-base:test", "bash", "-c",
                "python3 -c 'print(6*7)'; echo $BASH_VERSION")
    assert r.returncode == 0 and r.stdout.decode().split()[0] == "42", r.stderr


def test_docker_pulls_what_shoal_pushed(store: ImageStore, tricky: str, tmp_path: Path, docker) -> None:  # type: ignore[no-untyped-def]
    if available():
        pytest.skip(available())
    with LoopbackRegistry(tmp_path / "reg") as reg:
        push_image(store, tricky, f"{reg.host}/team/tricky:1")
        r = _docker(docker, "pull", f"{reg.host}/team/tricky:1")  # 127.0.0.0/8 is an insecure registry for Docker
        assert r.returncode == 0, r.stderr
        r = _docker(docker, "run", "--rm", "--network=none", f"{reg.host}/team/tricky:1", "cat", "/data/opq/new")
        assert r.stdout == b"new\n", r.stderr
