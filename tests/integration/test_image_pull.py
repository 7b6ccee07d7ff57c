"""Pulling from registries (issue 25, items 2 and 3), against Debian's docker-registry on loopback serving
Docker Hub names through the mirror setting: media types, manifest lists, compression, digests checked
while streaming, layers fetched once, parallel and resumed downloads, auth, typed errors, pull_policy,
and one pull for many callers and for many processes sharing a store."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from shoal.errors import ImageNotFound, InvalidRequest, RegistryAuthFailed, RegistryUnavailable
from shoal.images.archive import layer_tar
from shoal.images.pull import ensure_image, ensure_image_sync, pull_image, resolve_local
from shoal.images.store import ImageConfig, ImageStore
from tests.registry import FaultProxy, LoopbackRegistry, available
from tests.waiting import wait_for

pytestmark = [pytest.mark.root, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def _layers(tag: str, n: int = 2, size: int = 4096) -> list[bytes]:
    """n distinct small layers (each its own file) whose content depends on `tag`."""
    out = [layer_tar([("dir", "etc", 0o755), ("file", "etc/os-release", f"ID={tag}\n".encode(), 0o644)], mtime=0)]
    for i in range(1, n):
        out.append(layer_tar([("dir", f"l{i}", 0o755),
                              ("file", f"l{i}/data", (f"{tag}-{i}-".encode() * size)[:size], 0o644)], mtime=0))
    return out


def _blob_gets(reg: LoopbackRegistry, mark: int) -> list[str]:
    return [r.uri.rsplit("/", 1)[1] for r in reg.since(mark) if r.is_blob and r.status in (200, 206)]


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store")


def test_pull_a_docker_hub_name_through_the_mirror(registry_env: LoopbackRegistry, store: ImageStore) -> None:
    reg = registry_env
    tars = _layers("hub", 3)
    mdigest = reg.push("library/pyhub:3.12-slim", tars, env=["A=1", "PATH=/usr/bin:/bin"], workdir="/app",
                       user="1000", entrypoint=["/bin/sh"], cmd=["-c", "echo hi"])
    events = []
    rep = pull_image(store, "pyhub:3.12-slim", progress=events.append)
    img = store.resolve("pyhub:3.12-slim")
    assert rep.image.digest == img.digest and len(img.layers) == 3
    assert img.config.env["A"] == "1" and img.config.workdir == "/app" and img.config.user == "1000"
    assert img.config.entrypoint == ["/bin/sh"] and img.config.cmd == ["-c", "echo hi"]
    assert img.lineage["pulled"] == "docker.io/library/pyhub:3.12-slim"
    assert img.lineage["manifest_digest"] == mdigest
    assert rep.layers_fetched == 3 and rep.layers_cached == 0 and rep.bytes_fetched > 0
    kinds = [e.kind for e in events]
    assert kinds[0] == "resolved" and kinds[-1] == "done" and kinds.count("layer-done") == 3
    assert sum(e.bytes for e in events if e.kind == "layer-bytes") > 0
    # every spelling of the name is the same image
    for spelling in ("docker.io/library/pyhub:3.12-slim", "index.docker.io/library/pyhub:3.12-slim"):
        assert ensure_image_sync(store, spelling, policy="never").digest == img.digest
    assert list(store.tmp_dir.iterdir()) == []


def test_a_layer_already_in_the_store_is_never_fetched_again(registry_env: LoopbackRegistry,
                                                             store: ImageStore) -> None:
    reg = registry_env
    base = _layers("shared-base", 2)
    reg.push("library/app-one:1", [*base, _layers("one", 2)[1]])
    reg.push("library/app-two:1", [*base, _layers("two", 2)[1]])
    pull_image(store, "app-one:1")
    mark = reg.mark()
    rep = pull_image(store, "app-two:1")
    assert rep.layers_cached == 2 and rep.layers_fetched == 1
    one, two = store.resolve("app-one:1"), store.resolve("app-two:1")
    assert [x.digest for x in one.layers[:2]] == [x.digest for x in two.layers[:2]]
    wait_for(lambda: len(_blob_gets(reg, mark)) >= 2, what="the registry to log the second pull")
    got = _blob_gets(reg, mark)
    assert len(got) == 2, f"only the config and the new layer may be fetched, got {got}"
    layer_blobs = {d["digest"] for d in json.loads(reg.manifest("library/app-one:1")[0])["layers"][:2]}
    assert not layer_blobs & set(got), "a layer already in the store (same diff id) was fetched again"


@pytest.mark.parametrize("compression", ["gzip", "zstd", None])
def test_oci_manifests_with_gzip_zstd_and_plain_layers(registry_env: LoopbackRegistry, store: ImageStore,
                                                       compression: str | None) -> None:
    reg = registry_env
    name = f"library/oci-{compression or 'plain'}:1"
    reg.push_oci(name, _layers(f"oci-{compression}", 2), compression=compression)
    doc = json.loads(reg.manifest(name)[0])
    assert doc["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert {x["mediaType"] for x in doc["layers"]} == {
        "application/vnd.oci.image.layer.v1.tar" + {"gzip": "+gzip", "zstd": "+zstd", None: ""}[compression]}
    rep = pull_image(store, name.removeprefix("library/"))
    assert rep.layers_fetched == 2 and rep.image.lineage["media_type"].startswith("application/vnd.oci")


@pytest.mark.parametrize("oci", [False, True])
def test_a_manifest_list_picks_linux_amd64(registry_env: LoopbackRegistry, store: ImageStore, oci: bool) -> None:
    reg = registry_env
    repo = f"library/multi-{'oci' if oci else 'docker'}"
    reg.push(f"{repo}:arm", _layers("arm64-content", 1), architecture="arm64")
    reg.push(f"{repo}:amd", _layers("amd64-content", 1), architecture="amd64")
    index = reg.put_index(f"{repo}:1", [(f"{repo}:arm", "linux", "arm64"), (f"{repo}:amd", "linux", "amd64")], oci=oci)
    rep = pull_image(store, f"{repo.removeprefix('library/')}:1")
    assert rep.index_digest == index and rep.manifest_digest == reg.manifest_digest(f"{repo}:amd")
    assert rep.image.lineage["architecture"] == "amd64"
    # an index without this platform: ImageNotFound naming what it has
    reg.put_index(f"{repo}:armonly", [(f"{repo}:arm", "linux", "arm64")], oci=oci)
    with pytest.raises(ImageNotFound, match=r"no image for linux/amd64.*linux/arm64"):
        pull_image(store, f"{repo.removeprefix('library/')}:armonly")


def test_digest_references_pull_once_and_resolve_offline(registry_env: LoopbackRegistry, store: ImageStore) -> None:
    reg = registry_env
    d = reg.push("library/pinned:3.13-slim-bookworm", _layers("pinned", 2))
    ref = f"pinned:3.13-slim-bookworm@{d}"
    img = ensure_image_sync(store, ref)
    assert img.lineage["manifest_digest"] == d
    assert store.resolve(f"pinned:sha256-{d[7:]}").digest == img.digest, "kept under its digest tag (gc keeps it)"
    assert not store.exists("pinned:3.13-slim-bookworm"), "a digest pull does not move the tag"
    mark = reg.mark()
    for again in (ref, f"pinned@{d}", f"docker.io/library/pinned@{d}"):
        assert ensure_image_sync(store, again, policy="always").digest == img.digest
    assert not [r for r in reg.since(mark) if r.is_manifest], "a digest reference never asks the registry again"
    # a digest the registry does not have: ImageNotFound with the registry's answer
    with pytest.raises(ImageNotFound, match=r"MANIFEST_UNKNOWN|manifest unknown"):
        ensure_image_sync(store, "pinned@sha256:" + "0" * 64)


def test_typed_errors_with_the_registrys_answer(registry_env: LoopbackRegistry, store: ImageStore,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ImageNotFound, match=r"NAME_UNKNOWN|MANIFEST_UNKNOWN|unknown") as e:
        ensure_image_sync(store, "no-such-image:1")
    assert e.value.details["answers"][0]["endpoint"] == registry_env.url
    # a mirror that does not answer, and no fallback: RegistryUnavailable (retried, then given up)
    from tests.registry import free_port

    monkeypatch.setenv("SHOAL_REGISTRY_MIRRORS", f"docker.io=http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("SHOAL_PULL_RETRIES", "2")
    with pytest.raises(RegistryUnavailable, match=r"ConnectError|refused"):
        ensure_image_sync(store, "anything:1")
    # a local-only shoal name, and pull_policy never: ImageNotFound without asking anyone
    with pytest.raises(ImageNotFound, match="never pulled"):
        ensure_image_sync(store, "my_._env")
    with pytest.raises(ImageNotFound, match="pull_policy is never"):
        ensure_image_sync(store, "python:3.12", policy="never")
    with pytest.raises(InvalidRequest, match="pull_policy"):
        ensure_image_sync(store, "python:3.12", policy="sometimes")
    assert store.list_images() == [] and list(store.tmp_dir.iterdir()) == []


def test_a_corrupt_blob_is_caught_while_streaming(registry_env: LoopbackRegistry, store: ImageStore) -> None:
    reg = registry_env
    tars = _layers("corrupt", 2)
    reg.push("library/corrupt:1", tars)
    layer = json.loads(reg.manifest("library/corrupt:1")[0])["layers"][1]["digest"]
    # flip the registry's stored bytes of one layer blob (same length): it serves them as they are
    data = reg.root / "data" / "docker/registry/v2/blobs/sha256" / layer[7:9] / layer[7:] / "data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(RegistryUnavailable, match="corrupt"):
        pull_image(store, "corrupt:1")
    assert not store.exists("corrupt:1") and list(store.tmp_dir.iterdir()) == []


def test_broken_downloads_resume_and_failing_requests_retry(loopback_registry: LoopbackRegistry, store: ImageStore,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    reg = loopback_registry
    tars = [layer_tar([("file", f"r{i}", os.urandom(300_000), 0o644)], mtime=0) for i in range(3)]
    reg.push_oci("library/resume:1", tars, compression=None)
    with FaultProxy(reg.host) as proxy:
        monkeypatch.setenv("SHOAL_REGISTRY_MIRRORS", f"docker.io={proxy.url}")
        monkeypatch.setenv("SHOAL_REGISTRY_FALLBACK", "0")
        proxy.cut_blobs = 2       # two layer downloads break in the middle
        proxy.cut_min_bytes = 100_000
        proxy.fail_manifests = 2  # the manifest answers 503 twice
        rep = pull_image(store, "resume:1")
        assert rep.layers_fetched == 3 and rep.resumes == 2
        ranged = [rng for _, _, rng in proxy.blob_requests() if rng]
        assert len(ranged) == 2 and all(r.startswith("bytes=") and r != "bytes=0-" for r in ranged)
        assert store.resolve("resume:1").layers


def test_layers_download_in_parallel(loopback_registry: LoopbackRegistry, store: ImageStore,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    reg = loopback_registry
    reg.push("library/parallel:1", _layers("parallel", 4))
    with FaultProxy(reg.host) as proxy:
        monkeypatch.setenv("SHOAL_REGISTRY_MIRRORS", f"docker.io={proxy.url}")
        monkeypatch.setenv("SHOAL_REGISTRY_FALLBACK", "0")
        monkeypatch.setenv("SHOAL_PULL_CONCURRENCY", "3")
        proxy.hold_blobs = 3  # blob answers wait until three are asked for at once
        proxy.hold_timeout = 3.0  # the image config is asked for alone: it waits this long, then goes through
        pull_image(store, "parallel:1")
        assert proxy.max_in_flight == 3


def test_basic_auth_with_docker_credentials(tmp_path: Path, store: ImageStore, monkeypatch: pytest.MonkeyPatch) -> None:
    if available():
        pytest.skip(available())
    with LoopbackRegistry(tmp_path / "reg", auth="basic") as reg:
        reg.push("team/private:1", _layers("basic", 1))
        monkeypatch.setenv("SHOAL_PULL_POLICY", "missing")
        ref = f"{reg.host}/team/private:1"  # a loopback registry named in the reference: HTTPS, then HTTP
        monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "empty"))
        with pytest.raises(RegistryAuthFailed, match="docker login"):
            ensure_image_sync(store, ref)
        monkeypatch.setenv("DOCKER_CONFIG", str(reg.docker_config(tmp_path / "wrong", password="nope")))
        with pytest.raises(RegistryAuthFailed, match="refused"):
            ensure_image_sync(store, ref)
        monkeypatch.setenv("DOCKER_CONFIG", str(reg.docker_config(tmp_path / "good")))
        img = ensure_image_sync(store, ref)
        assert img.name == f"{reg.host}/team/private" and store.exists(ref)


def test_bearer_token_auth(tmp_path: Path, store: ImageStore, monkeypatch: pytest.MonkeyPatch) -> None:
    if available():
        pytest.skip(available())
    with LoopbackRegistry(tmp_path / "reg", auth="token") as reg:
        reg.push("library/tokened:1", _layers("token", 1))
        monkeypatch.setenv("SHOAL_REGISTRY_MIRRORS", f"docker.io={reg.url}")
        monkeypatch.setenv("SHOAL_REGISTRY_FALLBACK", "0")
        monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "none"))
        with pytest.raises(RegistryAuthFailed):
            pull_image(store, "tokened:1")  # anonymous: a token without access, then 401
        monkeypatch.setenv("DOCKER_CONFIG", str(reg.docker_config(tmp_path / "bad", password="nope")))
        with pytest.raises(RegistryAuthFailed, match="refused the credentials"):
            pull_image(store, "tokened:1")
        monkeypatch.setenv("DOCKER_CONFIG", str(reg.docker_config(tmp_path / "good")))
        issued = reg.token.issued if reg.token else 0
        rep = pull_image(store, "tokened:1")
        assert rep.layers_fetched == 1 and reg.token is not None and reg.token.issued > issued


def test_pull_policy_missing_always_never(registry_env: LoopbackRegistry, store: ImageStore) -> None:
    reg = registry_env
    reg.push("library/moving:1", _layers("v1", 2))
    with pytest.raises(ImageNotFound):
        ensure_image_sync(store, "moving:1", policy="never")
    first = ensure_image_sync(store, "moving:1")  # missing (the setting)
    mark = reg.mark()
    assert ensure_image_sync(store, "moving:1").digest == first.digest
    assert ensure_image_sync(store, "moving:1", policy="never").digest == first.digest
    assert reg.since(mark) == [], "missing and never never ask the registry for an image in the store"
    # always: a manifest check, no layer fetched while the registry serves the same image
    assert ensure_image_sync(store, "moving:1", policy="always").digest == first.digest
    wait_for(lambda: any(r.is_manifest for r in reg.since(mark)), what="the manifest check in the registry log")
    assert _blob_gets(reg, mark) == []
    # the tag moves upstream: always pulls the new image, missing kept using the old one until then
    reg.push("library/moving:1", _layers("v2", 2))
    assert ensure_image_sync(store, "moving:1").digest == first.digest
    second = ensure_image_sync(store, "moving:1", policy="always")
    assert second.digest != first.digest and store.resolve("moving:1").digest == second.digest
    # an image made in shoal is never replaced by a pull, even under always
    lay = store.resolve("moving:1").layers
    store.put_image("moving:local", [x.digest for x in lay], ImageConfig())
    reg.push("library/moving:local", _layers("upstream-local", 1))
    mark = reg.mark()
    assert ensure_image_sync(store, "moving:local", policy="always").lineage == {}
    assert reg.since(mark) == []


async def test_a_burst_of_a_thousand_pulls_once(registry_env: LoopbackRegistry, store: ImageStore) -> None:
    reg = registry_env
    reg.push("library/burst:1", _layers("burst", 3))
    mark = reg.mark()
    imgs = await asyncio.gather(*(ensure_image(store, "burst:1") for _ in range(1000)))
    assert len({i.digest for i in imgs}) == 1
    wait_for(lambda: len(_blob_gets(reg, mark)) >= 4, what="the registry log")
    reqs = reg.since(mark)
    assert len([r for r in reqs if r.is_manifest]) == 1, "one manifest request for 1,000 callers"
    assert len(_blob_gets(reg, mark)) == 4, "config + 3 layers, each once"
    # threads (blocking callers) share one pull too
    reg.push("library/burst:2", _layers("burst2", 2))
    mark = reg.mark()
    out: list[str] = []
    ts = [threading.Thread(target=lambda: out.append(ensure_image_sync(store, "burst:2").digest)) for _ in range(20)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert len(out) == 20 and len(set(out)) == 1
    wait_for(lambda: len(_blob_gets(reg, mark)) >= 3, what="the registry log")
    assert len([r for r in reg.since(mark) if r.is_manifest]) == 1 and len(_blob_gets(reg, mark)) == 3


def test_nodes_sharing_a_store_pull_once(registry_env: LoopbackRegistry, tmp_path: Path) -> None:
    """Four processes (node agents sharing one store) pull one image at once: one fetches it, the others
    wait on its pull claim and use its result; each blob crosses the network once."""
    reg = registry_env
    reg.push("library/shared:1", _layers("shared", 3, size=200_000))
    root = tmp_path / "shared-store"
    ImageStore(root)
    mark = reg.mark()
    # each process does what a create does (ensure_image, policy missing), reporting what its pull did
    code = ("import json, sys; from shoal.images.store import ImageStore; from shoal.images import pull;"
            "reps = []; real = pull.pull_image;"
            "pull.pull_image = lambda *a, **k: reps.append(real(*a, **k)) or reps[-1];"
            "img = pull.ensure_image_sync(ImageStore(sys.argv[1]), 'shared:1');"
            "r = reps[0] if reps else None;"
            "print(json.dumps({'digest': img.digest, 'waited': bool(r is None or r.waited),"
            " 'fetched': r.layers_fetched if r else 0}))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              cwd=REPO) for _ in range(4)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
        outs.append(json.loads(out.decode().strip().splitlines()[-1]))
    assert len({o["digest"] for o in outs}) == 1, outs
    assert sum(o["fetched"] for o in outs) == 3 and sum(not o["waited"] for o in outs) == 1
    wait_for(lambda: len(_blob_gets(reg, mark)) >= 4, what="the registry log")
    assert len(_blob_gets(reg, mark)) == 4, "config + 3 layers, once for all four nodes"
    assert list((root / "cache" / "pulls").iterdir()) == [], "no claim left behind"


def test_resolve_local_knows_registry_digests(registry_env: LoopbackRegistry, store: ImageStore) -> None:
    reg = registry_env
    d = reg.push("library/known:1", _layers("known", 1))
    img = ensure_image_sync(store, "known:1")
    got = resolve_local(store, f"known@{d}")
    assert got is not None and got.digest == img.digest
    assert resolve_local(store, "known@sha256:" + "1" * 64) is None
    assert resolve_local(store, f"known@{img.digest}").digest == img.digest, "a store digest resolves as before"


def test_cli_pull_shows_progress_and_fails_in_one_line(registry_env: LoopbackRegistry, tmp_path: Path) -> None:
    reg = registry_env
    reg.push("library/clipull:1", _layers("cli", 2))
    env = {**os.environ, "SHOAL_STORE": str(tmp_path / "store"), "SHOAL_HOME": str(tmp_path / "home"),
           "COLUMNS": "200"}
    shoal = [str(Path(sys.executable).parent / "shoal")]
    r = subprocess.run([*shoal, "image", "pull", "clipull:1"], env=env, capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert "pulled clipull:1" in r.stdout and "2 layers fetched" in r.stdout
    assert "downloading" in r.stderr or "done" in r.stderr, "a progress bar per layer"
    r = subprocess.run([*shoal, "image", "pull", "--json", "clipull:1"], env=env, capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 0 and json.loads(r.stdout)["up_to_date"] is True
    r = subprocess.run([*shoal, "image", "pull", "clipull:nope"], env=env, capture_output=True, text=True,
                       timeout=300, cwd=REPO)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "not found" in r.stderr and "MANIFEST_UNKNOWN" in r.stderr.replace("\n", " ")
    r = subprocess.run([*shoal, "image", "pull", "Bad Ref"], env=env, capture_output=True, text=True, timeout=300,
                       cwd=REPO)
    assert r.returncode == 1 and "bad image reference" in r.stderr and "Traceback" not in r.stderr


async def test_create_pulls_a_missing_image_once(registry_env: LoopbackRegistry, tmp_path: Path, shoal_home: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`create("bbox:1")` of an image the store lacks pulls it (pull_policy missing) and runs it; a burst of
    creates and a batch pull it once. A private store: nothing is left in the shared one."""
    import shoal
    from tests.registry import busybox_layer

    reg = registry_env
    reg.push("library/bbox:1", [busybox_layer()], env=["PATH=/bin", "GREETING=hi"], workdir="/tmp")
    monkeypatch.setenv("SHOAL_STORE", str(tmp_path / "store"))
    mark = reg.mark()
    async with shoal.Client() as c:
        sbs = await asyncio.gather(*(c.create("bbox:1", memory_mb=128) for _ in range(4)))
        try:
            r = await sbs[0].exec(["/bin/sh", "-c", "echo $GREETING; pwd; cat /etc/passwd"])
            assert r.exit_code == 0, r.stderr
            assert r.stdout.decode().splitlines()[:2] == ["hi", "/tmp"]
            assert sbs[0].info.image == "bbox:1"
        finally:
            await asyncio.gather(*(sb.close() for sb in sbs))
        with pytest.raises(ImageNotFound, match=r"MANIFEST_UNKNOWN|manifest unknown"):
            await c.create("bbox:missing")
    wait_for(lambda: len(_blob_gets(reg, mark)) >= 2, what="the registry log")
    assert len([r for r in reg.since(mark) if r.is_manifest and r.status == 200]) == 1
    assert len(_blob_gets(reg, mark)) == 2, "config + one layer, once for four creates"


async def test_pull_and_pull_on_demand_over_http(registry_env: LoopbackRegistry, tmp_path: Path,
                                                 shoal_home: Path) -> None:
    """The SDK over HTTP: client.pull(REF) (any project's token: the image goes to the shared store), a create
    of a missing image pulls it on the server, and the typed errors cross the wire."""
    import shoal
    from shoal.server.proc import ServerProcess
    from shoal.server.tokens import TokenStore
    from tests.registry import busybox_layer

    reg = registry_env
    reg.push("library/hpull:1", [busybox_layer()], env=["PATH=/bin"])
    reg.push("library/hcreate:1", [busybox_layer([("file", "etc/marker", b"on-demand", 0o644)])], env=["PATH=/bin"])
    token = TokenStore(shoal_home).create("pullers", name="test_image_pull")
    env = {**os.environ, "SHOAL_STORE": str(tmp_path / "store")}
    srv = ServerProcess(env=env, token=token, log_path=tmp_path / "serve.log").start()
    try:
        async with shoal.Client(srv.url, token=token) as c:
            rep = await c.pull("hpull:1")
            assert rep["layers_fetched"] == 1 and rep["image"]["name"] == "hpull"
            assert any(i["name"] == "hpull" for i in await c.images())
            sb = await c.create("hcreate:1", memory_mb=128)
            try:
                assert await sb.read_file("/etc/marker") == b"on-demand"
                assert (await sb.exec("echo $0")).stdout == b"/bin/sh\n"
            finally:
                await sb.close()
            with pytest.raises(ImageNotFound, match=r"MANIFEST_UNKNOWN|manifest unknown"):
                await c.pull("hpull:2")
            with pytest.raises(ImageNotFound):
                await c.create("hpull:3")
            with pytest.raises(InvalidRequest):
                await c.pull("Not A Ref")
            # and back out over HTTP: the archive is downloaded; a push needs an admin token
            await c.export_image("hpull:1", str(tmp_path / "h.tar"))
            from shoal.images.oci import import_archive

            back = import_archive(ImageStore(tmp_path / "back"), tmp_path / "h.tar", "h:1").image
            assert [x.digest for x in back.layers] == rep["image"]["layers"]
            with pytest.raises(ImageNotFound):
                await c.export_image("nope:1", str(tmp_path / "n.tar"))
            assert not (tmp_path / "n.tar").exists()
            from shoal.errors import Forbidden

            with pytest.raises(Forbidden):
                await c.push("hpull:1", f"{reg.host}/team/hpull:1")
        admin = TokenStore(shoal_home).create("ops", admin=True, name="test_image_pull admin")
        async with shoal.Client(srv.url, token=admin) as c:
            pushed = await c.push("hpull:1", f"{reg.host}/team/hpull:1")
            assert pushed["layers_uploaded"] == 1 and pushed["manifest_digest"] == reg.manifest_digest("team/hpull:1")
    finally:
        srv.stop()
    assert ImageStore(tmp_path / "store").exists("hcreate:1")


def test_a_build_from_a_missing_image_pulls_it(registry_env: LoopbackRegistry, tmp_path: Path,
                                               shoal_home: Path) -> None:
    """A recipe's `--from` (as a Dockerfile FROM) of an image the store lacks pulls it; the RUN step runs with
    the image's /bin/sh (busybox: no bash)."""
    from tests.registry import busybox_layer

    reg = registry_env
    reg.push("library/bbase:1", [busybox_layer()], env=["PATH=/bin"])
    env = {**os.environ, "SHOAL_STORE": str(tmp_path / "store"), "SHOAL_HOME": str(shoal_home), "COLUMNS": "200"}
    shoal = [str(Path(sys.executable).parent / "shoal")]
    r = subprocess.run([*shoal, "image", "build", "built:1", "--from", "bbase:1", "--no-network",
                        "--run", "echo built-on-$(cat /etc/passwd | head -c 4) > /marker"],
                       env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    store = ImageStore(tmp_path / "store")
    assert store.exists("bbase:1") and store.resolve("bbase:1").lineage["pulled"] == "docker.io/library/bbase:1"
    built = store.resolve("built:1")
    assert len(built.layers) == 2 and built.layers[0].digest == store.resolve("bbase:1").layers[0].digest
    # `shoal run` of a digest-pinned Docker Hub reference the store lacks: pulled, then run
    d = reg.push("library/brun:1", [busybox_layer([("file", "etc/marker", b"run-pulled", 0o644)])], env=["PATH=/bin"])
    r = subprocess.run([*shoal, "run", f"docker.io/library/brun:1@{d}", "--", "/bin/cat", "/etc/marker"],
                       env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0 and r.stdout == "run-pulled", r.stderr[-2000:]
    pulled = resolve_local(store, f"brun@{d}")
    assert pulled is not None and pulled.lineage["manifest_digest"] == d


def test_e2b_templates_are_registry_references(registry_env: LoopbackRegistry, tmp_path: Path,
                                               shoal_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The unmodified E2B SDK (`Sandbox.create(template=…)`) with a Docker reference as the templateID, by tag
    and by digest: the server pulls it through the mirror on demand. The image is busybox (no bash): the
    SDK's `/bin/bash -l -c CMD` runs with the image's /bin/sh, as shoal's own string commands do."""
    e2b = pytest.importorskip("e2b", reason="the compat extra brings the E2B SDK")
    from shoal.server.proc import ServerProcess
    from shoal.server.tokens import TokenStore
    from tests.registry import busybox_layer

    reg = registry_env
    d = reg.push("library/ebox:1", [busybox_layer([("file", "etc/marker", b"from-the-registry", 0o644)])],
                 env=["PATH=/bin"], workdir="/tmp")
    token = TokenStore(shoal_home).create("e2b-pulls", name="test_image_pull e2b")
    store = tmp_path / "store"
    srv = ServerProcess(env={**os.environ, "SHOAL_STORE": str(store)}, token=token,
                        log_path=tmp_path / "serve.log").start()
    monkeypatch.setenv("E2B_API_URL", srv.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", srv.url)
    monkeypatch.setenv("E2B_API_KEY", token)
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    mark = reg.mark()
    try:
        for template in ("ebox:1", f"docker.io/library/ebox@{d}"):
            sb = e2b.Sandbox.create(template=template, timeout=120)
            try:
                r = sb.commands.run("cat /etc/marker; echo; echo ${BASH_VERSION:-no-bash} $(pwd)")
                assert r.exit_code == 0 and r.stdout == "from-the-registry\nno-bash /tmp\n", (r.stdout, r.stderr)
            finally:
                sb.kill()
        with pytest.raises(Exception, match=r"(?i)not found|MANIFEST_UNKNOWN"):
            e2b.Sandbox.create(template="ebox:missing", timeout=60)
    finally:
        srv.stop()
    wait_for(lambda: len(_blob_gets(reg, mark)) >= 2, what="the registry log")
    assert len(_blob_gets(reg, mark)) == 2, "config + one layer: the digest reference reused the tag's pull"
    assert ImageStore(store).exists("ebox:1")
