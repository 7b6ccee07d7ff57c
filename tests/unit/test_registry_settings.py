"""Mirrors like containerd's and Docker's credentials (issue 25, item 2), without a network: the setting's
grammar, where a reference is asked for in which order and over which scheme, and which config.json entry
answers for which registry. (Pulls against a real registry: tests/integration/test_image_pull.py.)"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from shoal.config import parse_registry_mirrors, reset, settings
from shoal.errors import RegistryAuthFailed
from shoal.images.reference import parse_reference
from shoal.images.registry import DockerCredentials, RegistryClient


def test_the_mirror_setting_as_the_issue_writes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_REGISTRY_MIRRORS", "docker.io=http://127.0.0.1:5000 ghcr.io=https://mirror.example")
    reset()
    try:
        assert settings().registry_mirrors == {"docker.io": ["http://127.0.0.1:5000"],
                                               "ghcr.io": ["https://mirror.example"]}
    finally:
        monkeypatch.delenv("SHOAL_REGISTRY_MIRRORS")
        reset()
    # Docker Hub's other names are docker.io; a registry named twice keeps both mirrors, in order; TOML tables
    assert parse_registry_mirrors("index.docker.io=http://a:1,docker.io=http://b:2/") == {
        "docker.io": ["http://a:1", "http://b:2"]}
    assert parse_registry_mirrors({"quay.io": ["https://q.example/v"], "*": "http://127.0.0.1:5000"}) == {
        "quay.io": ["https://q.example/v"], "*": ["http://127.0.0.1:5000"]}


@pytest.mark.parametrize(("value", "says"), [
    ("docker.io", "REGISTRY=URL"),
    ("docker.io=ftp://x", "http:// or https://"),
    ("bad_host=http://x", r"host\[:port\]"),
])
def test_bad_mirror_settings_say_what_is_wrong(value: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_registry_mirrors(value)


def test_mirrors_first_then_the_registry_over_https() -> None:
    mirrors = parse_registry_mirrors("docker.io=http://127.0.0.1:5000 ghcr.io=https://mirror.example")
    with RegistryClient(mirrors=mirrors) as rc:
        hub = rc.endpoints(parse_reference("python:3.12-slim"))
        assert [(e.base, e.mirror, e.http_fallback) for e in hub] == [
            ("http://127.0.0.1:5000", True, False),          # plain HTTP only because the mirror says http://
            ("https://registry-1.docker.io", False, False)]  # the registry itself: HTTPS, never downgraded
        assert hub[0].url("library/python", "manifests", "3.12-slim") == (
            "http://127.0.0.1:5000/v2/library/python/manifests/3.12-slim")
        ghcr = rc.endpoints(parse_reference("ghcr.io/org/env:1"))
        assert [(e.base, e.http_fallback) for e in ghcr] == [("https://mirror.example", False),
                                                             ("https://ghcr.io", False)]
        # a registry without mirrors: itself; loopback registries may fall back to plain HTTP (Docker's rule)
        assert [e.base for e in rc.endpoints(parse_reference("quay.io/a/b:1"))] == ["https://quay.io"]
        local = rc.endpoints(parse_reference("127.0.0.1:5000/x:1"))
        assert [(e.base, e.http_fallback) for e in local] == [("https://127.0.0.1:5000", True)]
    with RegistryClient(mirrors={"*": ["http://127.0.0.1:6000"]}, fallback=False,
                        insecure=["reg.internal:5000"]) as rc:
        # `*` mirrors every registry; without fallback only the mirrors are asked
        assert [e.base for e in rc.endpoints(parse_reference("ghcr.io/o/e:1"))] == ["http://127.0.0.1:6000"]
        assert rc.registry_endpoint(parse_reference("reg.internal:5000/x:1")).http_fallback is True


def _config(tmp_path: Path, doc: dict) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(doc))
    return tmp_path / "config.json"


def test_docker_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b64 = base64.b64encode(b"hubuser:hubpass").decode()
    path = _config(tmp_path / "d", {"auths": {
        "https://index.docker.io/v1/": {"auth": b64},                      # what `docker login` writes for Hub
        "ghcr.io": {"username": "gh", "password": "tok"},
        "127.0.0.1:5000": {"auth": base64.b64encode(b"a:b:c").decode()},   # passwords may hold ':'
    }})
    creds = DockerCredentials(path)
    assert creds.get("docker.io") == creds.get("registry-1.docker.io") == ("hubuser", "hubpass")
    assert creds.get("ghcr.io") == ("gh", "tok")
    assert creds.get("127.0.0.1:5000") == ("a", "b:c")
    assert creds.get("quay.io") is None  # anonymous
    # where Docker looks: DOCKER_CONFIG, else ~/.docker; the setting wins over both
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "d"))
    assert DockerCredentials.default_path() == path
    assert DockerCredentials.default_path(tmp_path / "x.json") == tmp_path / "x.json"
    monkeypatch.delenv("DOCKER_CONFIG")
    assert DockerCredentials.default_path() == Path.home() / ".docker" / "config.json"
    assert DockerCredentials(tmp_path / "missing.json").get("docker.io") is None
    # broken files and entries are typed errors, never a traceback
    with pytest.raises(RegistryAuthFailed, match="not valid base64"):
        DockerCredentials(_config(tmp_path / "b", {"auths": {"ghcr.io": {"auth": "YQ"}}})).get("ghcr.io")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text("{not json")
    with pytest.raises(RegistryAuthFailed, match="cannot read Docker's credentials file"):
        DockerCredentials(tmp_path / "c" / "config.json")
