"""Pulling from a registry with skopeo, against Debian's `docker-registry` on loopback."""

from __future__ import annotations

import shutil
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from shoal.errors import ImageBuildError, InvalidRequest
from shoal.images.archive import image_config, layer_tar, write_docker_archive
from shoal.images.oci import pull_image
from shoal.images.store import ImageStore
from tests.waiting import wait_for

pytestmark = [pytest.mark.root, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    exe = shutil.which("docker-registry")
    if not exe or not shutil.which("skopeo"):
        pytest.skip("needs docker-registry and skopeo (apt-get install docker-registry skopeo)")
    root = tmp_path_factory.mktemp("registry")
    port = _free_port()
    cfg = root / "config.yml"
    cfg.write_text(f"""version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {root / "data"}
http:
  addr: 127.0.0.1:{port}
""")
    with open(root / "log", "wb") as log:
        proc = subprocess.Popen([exe, "serve", str(cfg)], stdout=subprocess.DEVNULL, stderr=log)
    try:
        def up() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=1) as r:
                return r.status == 200

        try:
            wait_for(up, 15, what="docker-registry to answer")
        except pytest.fail.Exception:
            pytest.skip(f"docker-registry did not start: {(root / 'log').read_text()[-500:]}")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _push(registry: str, tmp_path: Path, name: str, tars: list[bytes], **cfg: object) -> None:
    safe = name.replace("/", "_").replace(":", "_")  # skopeo's docker-archive:PATH must not contain ':'
    arch = write_docker_archive(tmp_path / f"{safe}.tar", tars, image_config(tars, **cfg))
    r = subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"docker-archive:{arch}",
                        f"docker://{registry}/{name}"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_pull_from_a_registry(registry: str, tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    base = layer_tar([("dir", "etc", 0o755), ("file", "etc/os-release", b"ID=reg\n", 0o644)])
    app = layer_tar([("dir", "app", 0o755), ("file", "app/x", b"x", 0o644), ("dir", "etc", 0o755),
                     ("whiteout", "etc/os-release")])
    _push(registry, tmp_path, "team/app:1", [base, app], env=["A=1"], workdir="/app", cmd=["serve"])
    rep = pull_image(store, f"docker://{registry}/team/app:1", "app:1", tls_verify=False)
    img = store.resolve("app:1")
    assert len(img.layers) == 2 and img.config.env["A"] == "1" and img.config.workdir == "/app"
    assert img.config.cmd == ["serve"]
    assert img.lineage["imported"] == f"docker://{registry}/team/app:1"
    assert rep.layers_unpacked == 2
    # a second image sharing the base layer: pulled, but the layer is not unpacked again
    _push(registry, tmp_path, "team/other:1", [base])
    rep2 = pull_image(store, f"docker://{registry}/team/other:1", "other:1", tls_verify=False)
    assert rep2.layers_cached == 1 and rep2.image.layers[0].digest == img.layers[0].digest
    assert list(store.tmp_dir.iterdir()) == []


def test_pull_errors_are_clear(registry: str, tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    with pytest.raises(ImageBuildError, match="could not pull"):
        pull_image(store, f"docker://{registry}/no/such:image", "x:1", tls_verify=False)
    with pytest.raises(InvalidRequest, match="docker://"):
        pull_image(store, "https://example.com/x", "x:1")
    with pytest.raises(InvalidRequest):
        pull_image(store, f"docker://{registry}/team/app:1", "Bad Name")
    assert store.list_images() == [] and list(store.tmp_dir.iterdir()) == []
