"""Image references follow Docker's grammar (issue 25, item 1): every form Docker accepts parses, into the
registry, repository, tag and digest Docker would use, and maps to one store name; shoal's own names keep
working; bad references name their bad part."""

from __future__ import annotations

import re

import pytest

from shoal.errors import InvalidRequest
from shoal.images.reference import NEW_NAME_PATTERN, REFERENCE_PATTERN, parse_reference
from shoal.images.refs import parse_ref

D = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(("text", "registry", "repository", "tag", "digest", "name"), [
    ("python", "docker.io", "library/python", "latest", None, "python"),
    ("python:3.12-slim", "docker.io", "library/python", "3.12-slim", None, "python"),
    (f"python:3.13-slim-bookworm@{D}", "docker.io", "library/python", "3.13-slim-bookworm", D, "python"),
    (f"python@{D}", "docker.io", "library/python", None, D, "python"),
    ("docker.io/library/python:3.12", "docker.io", "library/python", "3.12", None, "python"),
    ("docker.io/python:3.12", "docker.io", "library/python", "3.12", None, "python"),
    ("index.docker.io/library/ubuntu:24.04", "docker.io", "library/ubuntu", "24.04", None, "ubuntu"),
    ("ubuntu:24.04", "docker.io", "library/ubuntu", "24.04", None, "ubuntu"),
    ("team/app:1", "docker.io", "team/app", "1", None, "team/app"),
    ("ghcr.io/laude-institute/t-bench/python-3-13:20250620", "ghcr.io", "laude-institute/t-bench/python-3-13",
     "20250620", None, "ghcr.io/laude-institute/t-bench/python-3-13"),
    ("localhost:5000/x/y:1", "localhost:5000", "x/y", "1", None, "localhost:5000/x/y"),
    ("localhost/foo", "localhost", "foo", "latest", None, "localhost/foo"),
    ("127.0.0.1:5000/app", "127.0.0.1:5000", "app", "latest", None, "127.0.0.1:5000/app"),
    (f"quay.io/org/img:v1@{D}", "quay.io", "org/img", "v1", D, "quay.io/org/img"),
    ("team/a.b_c__d-e--f", "docker.io", "team/a.b_c__d-e--f", "latest", None, "team/a.b_c__d-e--f"),
    ("my-reg.example:443/a/b/c:v", "my-reg.example:443", "a/b/c", "v", None, "my-reg.example:443/a/b/c"),
])
def test_docker_forms_parse_as_docker_reads_them(text: str, registry: str, repository: str, tag: str | None,
                                                 digest: str | None, name: str) -> None:
    r = parse_reference(text)
    assert (r.registry, r.repository, r.tag, r.digest, r.name) == (registry, repository, tag, digest, name)
    assert not r.local_only and r.pullable
    assert re.match(REFERENCE_PATTERN, text), "the schema pattern must let every valid reference through"


def test_canonical_and_familiar_forms() -> None:
    r = parse_reference(f"python:3.12@{D}")
    assert r.canonical == f"docker.io/library/python:3.12@{D}"
    assert r.familiar == f"python:3.12@{D}"
    assert r.store_ref == f"python@{D}", "the digest decides, as in Docker"
    assert r.remote_ref == D and r.digest_tag == "sha256-" + D[7:]
    g = parse_reference("ghcr.io/org/img")
    assert g.canonical == "ghcr.io/org/img:latest" and g.store_ref == "ghcr.io/org/img:latest"
    assert g.explicit_registry and not parse_reference("org/img").explicit_registry


def test_one_image_under_every_spelling() -> None:
    names = {parse_ref(t).name for t in ("python:3", "docker.io/library/python:3", "index.docker.io/library/python:3",
                                          "registry-1.docker.io/library/python:3")}
    assert names == {"python"}


def test_shoal_names_keep_working() -> None:
    for text, name, tag in [("base", "base", "latest"), ("base:v1", "base", "v1"),
                            ("task-17:step3", "task-17", "step3"), ("projects/p/env:v1", "projects/p/env", "v1"),
                            ("fncall-python", "fncall-python", "latest")]:
        r = parse_ref(text)
        assert (r.name, r.tag) == (name, tag)
    # names shoal always allowed but Docker's grammar does not: local only, never pulled
    for text in ("my_._env", "a/-b:1", "x_-y"):
        r = parse_reference(text)
        assert r.local_only and not r.pullable
        assert parse_ref(text).name == text.split(":")[0]


@pytest.mark.parametrize(("text", "says"), [
    ("", "non-empty"),
    ("Python", "lowercase"),
    ("python:", "tag"),
    ("python:-x", "tag"),
    ("python@sha256:abc", "digest"),
    ("python@sha512:" + "a" * 128, "only sha256"),
    ("a b", "spaces"),
    ("x//y", "path components"),
    ("-x", "path components"),
    ("foo:bar:baz", "path components"),
    ("a" * 64, "64-hex"),
    ("bad_host.io/x:1", "registry host"),
])
def test_bad_references_name_the_bad_part(text: str, says: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(says)):
        parse_reference(text)


def test_the_issue_reference_that_was_refused() -> None:
    # issue 25: `FROM python:3.13-slim-bookworm@sha256:…` was "bad image name"
    r = parse_ref(f"python:3.13-slim-bookworm@{D}")
    assert (r.name, r.tag, r.digest) == ("python", None, D)


def test_new_image_names_take_a_tag_never_a_digest() -> None:
    assert re.match(NEW_NAME_PATTERN, "localhost:5000/team/app:1")
    assert re.match(NEW_NAME_PATTERN, "app")
    assert not re.match(NEW_NAME_PATTERN, f"app@{D}")


def test_the_spec_accepts_docker_references() -> None:
    from shoal.spec import SandboxSpec

    assert SandboxSpec(image=f"python:3.13-slim-bookworm@{D}").image.endswith(D)
    assert SandboxSpec(image="ghcr.io/org/img:1").image == "ghcr.io/org/img:1"
    assert SandboxSpec(image="localhost:5000/x:1").image == "localhost:5000/x:1"
    with pytest.raises(InvalidRequest, match="image"):
        SandboxSpec(image="Bad Name")
    with pytest.raises(InvalidRequest, match="image"):
        SandboxSpec(image="python@sha256:abc")


def test_a_name_too_long_for_the_store_is_refused() -> None:
    long = "/".join(["abcdefghij"] * 23)  # 252 chars, ~300 once '/' is quoted
    assert parse_reference(long).name == long
    with pytest.raises(InvalidRequest, match="too long for the store"):
        parse_ref(long)
