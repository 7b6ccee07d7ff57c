"""The layer store shared by several node agents (issue 14): on local disk and on a real MooseFS cluster
(master + 2 chunkservers in network namespaces, FUSE-mounted; the `moosefs` session fixture).

Several node agents = processes with their own SHOAL_HOME and one SHOAL_STORE, as on a cluster whose
nodes mount one shared filesystem (here they share a host, so the test can watch all of them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import pytest

from shoal.config import Paths
from shoal.images import leases
from shoal.images.gc import collect_garbage
from shoal.images.mounts import LayerMounts, mount_source
from shoal.images.store import ImageStore
from shoal.models import SandboxSpec
from tests.integration.storeutil import busybox_image, busybox_tree, private_node
from tests.waiting import wait_for

pytestmark = [pytest.mark.root, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
SHOAL = REPO / ".venv" / "bin" / "shoal"


# ---- the dev cluster itself ------------------------------------------------------------------------
def test_dev_moosefs_cli_up_status_down_leaves_nothing(moosefs: object) -> None:
    """`shoal store dev-moosefs up|status|down` on a second instance: the host reaches the master over its
    own veth (never the uplink), a file round-trips, and `down` removes daemons, mount, netns and files."""
    name = f"cli{os.getpid() % 100000}"
    base = Path(tempfile.mkdtemp(prefix="mfs-", dir="/var/tmp"))
    try:
        up = subprocess.run([SHOAL, "store", "dev-moosefs", "up", "--name", name, "--base", base, "--json"],
                            capture_output=True, text=True, timeout=120)
        assert up.returncode == 0, up.stderr
        st = json.loads(up.stdout)
        assert st["mounted"] and st["master"]["pid"] and all(cs["pid"] for cs in st["chunkservers"])
        assert len(st["chunkservers"]) == 2
        route = subprocess.run(["ip", "route", "get", st["master"]["ip"]], capture_output=True, text=True).stdout
        assert f"dev {st['host_veth']}" in route, route
        for cs in st["chunkservers"]:
            route = subprocess.run(["ip", "route", "get", cs["ip"]], capture_output=True, text=True).stdout
            assert f"dev {st['host_veth']}" in route, "chunkservers are reached through the master's namespace"
        f = Path(st["mountpoint"]) / "hello"
        f.write_bytes(b"x" * 100_000)
        assert f.read_bytes() == b"x" * 100_000
        pids = [st["master"]["pid"]] + [cs["pid"] for cs in st["chunkservers"]]
    finally:
        down = subprocess.run([SHOAL, "store", "dev-moosefs", "down", "--name", name, "--base", base],
                              capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    from shoal.images.moosefs import _gone, _mfsmount_pids

    for pid in pids:
        assert _gone(pid), f"daemon {pid} survived down"
    assert not _mfsmount_pids(Path(st["mountpoint"])), "the FUSE client survived down"
    assert not [n for n in os.listdir("/run/netns") if n.startswith(f"shoal-mfs-{name}-")]
    assert not (base / name).exists()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert st["host_veth"] not in links
    base.rmdir()


# ---- on demand, over the network ---------------------------------------------------------------------
async def test_a_layer_on_moosefs_mounts_in_place_and_runs(moosefs: object, tmp_path: Path) -> None:
    """A layer in a MooseFS store is mounted straight from the FUSE mount (file-backed on this kernel;
    a loop device over the same file elsewhere): nothing is copied to local disk before the sandbox runs."""
    root = Path(tempfile.mkdtemp(prefix="store-", dir=moosefs.mountpoint))  # type: ignore[attr-defined]
    store = ImageStore(root)
    img = busybox_image(store, "bb:on-demand", tmp_path)
    async with private_node(root) as node:
        info = await node.create(SandboxSpec(image="bb:on-demand", memory_mb=64))
        r = await node.exec(info.id, ["cat", "/data/tag"])
        assert r.exit_code == 0 and r.stdout.startswith(b"bb:on-demand-")
        mp = node.layer_mounts.mountpoint(img.layers[0].hex)
        src = mount_source(mp)
        layer_file = str(node.layer_mounts.daemon.file(img.layers[0].hex))
        backing = src if not src or not src.startswith("/dev/loop") else \
            Path(f"/sys/block/{Path(src).name}/loop/backing_file").read_text().strip()
        assert backing == layer_file, f"mounted from {src}, not from the node's reader of the store"
        # bytes allocated in SHOAL_HOME itself (not in the mounts below it; ~1.5 MiB: the agent and helper
        # binaries, records): far below a copy of the layer. The node's chunk cache holds exactly the chunks
        # fetched: what the sandbox read (busybox, /data/tag) and the read-ahead after it
        home_dev = node.paths.home.stat().st_dev
        cache_dir = str(node.layer_mounts.daemon.cache)
        allocated = cached = 0
        for dirpath, dirnames, filenames in os.walk(node.paths.home):
            dirnames[:] = [d for d in dirnames if os.lstat(os.path.join(dirpath, d)).st_dev == home_dev]
            for f in filenames:
                st = os.lstat(os.path.join(dirpath, f))
                # uppers.btrfs: the image of the writable layers' filesystem (btrfs metadata, not image data)
                if st.st_dev == home_dev and f != "uppers.btrfs":
                    if dirpath.startswith(cache_dir):
                        cached += st.st_size
                    else:
                        allocated += st.st_blocks * 512
        assert allocated < img.size // 8, f"{allocated} bytes on local disk for a {img.size}-byte layer"
        st = node.layer_mounts.daemon.stats()
        assert cached == st["cache_bytes"] == st["fetched_bytes"] < img.size // 4, (cached, st, img.size)
        await node.close(info.id)
    import shutil

    shutil.rmtree(root, ignore_errors=True)


# ---- safe concurrent publish -------------------------------------------------------------------------
_WORKER = r"""
import json, os, sys, time
from pathlib import Path
from shoal.images.store import ImageStore, ImageConfig
store_root, tree, idx = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
rounds, go = int(sys.argv[4]), Path(sys.argv[5])
store = ImageStore(store_root)
Path(f"{go}.ready.{os.getpid()}").touch()
while not go.exists():
    time.sleep(0.005)
out = {"layers": set(), "manifests": []}
for i in range(rounds):
    lay = store.add_layer_from_dir(tree, {"type": "test", "by": idx})
    img = store.put_image("race:latest", [lay.digest], ImageConfig(env={"WRITER": idx, "ROUND": str(i)}))
    out["layers"].add(lay.digest)
    out["manifests"].append(img.digest)
out["layers"] = sorted(out["layers"])
print(json.dumps(out))
"""

_IMPORTER = r"""
import json, os, sys, time
from pathlib import Path
from shoal.images.oci import import_archive
from shoal.images.store import ImageStore
store_root, archive, home, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
store = ImageStore(store_root)
(home / "tmp").mkdir(parents=True, exist_ok=True)
Path(f"{go}.ready.{os.getpid()}").touch()
while not go.exists():
    time.sleep(0.005)
rep = import_archive(store, archive, "imported:latest", work_dir=home / "tmp")
img = store.resolve("imported:latest")
print(json.dumps({"layers": [l.digest for l in img.layers]}))
"""


def _checker(store: ImageStore, stop: threading.Event, problems: list[str]) -> None:
    """Watch the store while writers race: a visible layer (its .json exists) is always complete and
    intact, and the tag always names a readable manifest whose layers are all visible."""
    seen_ok: set[str] = set()
    while not stop.is_set():
        for h in store.chunks.list_hexes():
            if h in seen_ok:
                continue
            try:
                size = json.loads(store.chunks.meta_path(h).read_text())["size"]
                bad = store.chunks.verify(h)  # the table hashes to the digest, every chunk to its name
                if bad or store.layer_table(f"sha256:{h}").size != size:
                    problems.append(f"visible layer {h[:12]} is incomplete or wrong: {bad[:2]}")
                else:
                    seen_ok.add(h)
            except (OSError, ValueError, KeyError) as e:
                problems.append(f"visible layer {h[:12]} unreadable: {e!r}")
        for name in ("race", "imported"):
            tag = store.tags_dir / name / "latest"
            try:
                text = tag.read_text()
            except FileNotFoundError:
                continue
            if not (text.startswith("sha256:") and text.endswith("\n") and len(text) == 72):
                problems.append(f"torn tag file {name}: {text!r}")
                continue
            try:
                img = store.resolve(f"{name}:latest")
                assert all(store.has_layer(lay.digest) for lay in img.layers)
            except Exception as e:
                problems.append(f"tag {name} resolves to something broken: {e!r}")
        time.sleep(0.01)


def _race(argvs: list[list[str]], go: Path, env_homes: list[Path]) -> list[dict]:
    procs = []
    for argv, home in zip(argvs, env_homes, strict=True):
        env = dict(os.environ, SHOAL_HOME=str(home))
        procs.append(subprocess.Popen([sys.executable, "-c", *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    def ready() -> bool:
        if any(p.poll() is not None for p in procs):
            return True  # one ended early: its error is reported below
        return len(list(go.parent.glob(f"{go.name}.ready.*"))) == len(procs)

    # every racer is ready (imports done, its node started) before the go: they really start together
    wait_for(ready, timeout=120, what="every racer to be ready")
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


N_WRITERS = 4


def test_node_agents_racing_to_publish_one_layer_make_exactly_one(store_root: Path, tmp_path: Path) -> None:
    """4 processes (own SHOAL_HOMEs, one store) build the same layer and move one tag, 3 rounds each,
    while a checker watches: exactly one layer file, never a partial one visible, never a torn tag;
    the tag ends on one of the manifests written (last writer wins)."""
    store = ImageStore(store_root)
    tree = busybox_tree(tmp_path / "tree", "race", filler_mib=8)
    go = tmp_path / "go"
    homes = [tmp_path / f"home{i}" for i in range(N_WRITERS)]
    problems: list[str] = []
    stop = threading.Event()
    th = threading.Thread(target=_checker, args=(store, stop, problems), daemon=True)
    th.start()
    try:
        outs = _race([[_WORKER, str(store_root), str(tree), str(i), "3", str(go)] for i in range(N_WRITERS)],
                     go, homes)
    finally:
        stop.set()
        th.join(30)
    assert not problems, problems[:5]
    digests = {d for o in outs for d in o["layers"]}
    assert len(digests) == 1, f"one tree, one layer: {digests}"
    h = next(iter(digests))[7:]
    assert sorted(p.name for p in store.chunks.layers_dir.iterdir()) == [f"{h}.json", f"{h}.table"], \
        f"exactly one layer (table and record), no temp files: {sorted(os.listdir(store.chunks.layers_dir))}"
    assert not list(store.layers_dir.iterdir()), "no whole-file layer"
    assert sorted(x for x, _ in store.chunks.iter_chunk_files()) == sorted(store.layer_table(f"sha256:{h}").unique()), \
        "exactly the layer's chunks, each once"
    assert store.verify_layer(next(iter(digests)))
    written = {m for o in outs for m in o["manifests"]}
    assert store.tag_target("race:latest") in written
    assert not list(store.tmp_dir.iterdir()), "writers leave no temp files"


def test_node_agents_importing_one_archive_at_once(store_root: Path, tmp_path: Path) -> None:
    """3 processes import the same docker-archive into one store at once: one set of layers, one tag,
    the image runs; nothing partial was ever visible."""
    from shoal.images.archive import write_docker_archive

    tree = busybox_tree(tmp_path / "tree", "import", filler_mib=4)
    layer_tar = tmp_path / "layer.tar"
    with tarfile.open(layer_tar, "w", format=tarfile.PAX_FORMAT) as tf:
        for child in sorted(tree.iterdir()):
            tf.add(child, arcname=child.name)
    archive = write_docker_archive(tmp_path / "img.tar", [layer_tar.read_bytes()])
    store = ImageStore(store_root)
    go = tmp_path / "go"
    homes = [tmp_path / f"home{i}" for i in range(3)]
    problems: list[str] = []
    stop = threading.Event()
    th = threading.Thread(target=_checker, args=(store, stop, problems), daemon=True)
    th.start()
    try:
        outs = _race([[_IMPORTER, str(store_root), str(archive), str(h), str(go)] for h in homes], go, homes)
    finally:
        stop.set()
        th.join(30)
    assert not problems, problems[:5]
    assert len({tuple(o["layers"]) for o in outs}) == 1
    assert len(store.chunks.list_hexes()) == 1
    assert all(store.verify_layer(d) for d in outs[0]["layers"])


# ---- gc on a shared store: leases ----------------------------------------------------------------------
def test_gc_on_one_node_never_deletes_a_layer_another_node_uses(store_root: Path, tmp_path: Path) -> None:
    """Node A mounts a layer from the shared store; gc on node B (another SHOAL_HOME, grace 0) keeps it
    while A's lease is live, A's heartbeat renews it; once A is gone and its lease has not been renewed
    for the TTL, gc on B takes the lease as dead and collects the layer."""
    store = ImageStore(store_root)
    tree = tmp_path / "t"
    tree.mkdir()
    (tree / "f").write_text("leased")
    layer = store.add_layer_from_dir(tree, {"type": "test"})
    paths_a = Paths(home=tmp_path / "a", store=store_root)
    paths_b = Paths(home=tmp_path / "b", store=store_root)
    lm_a = LayerMounts(paths_a)
    old = time.time() - 10 * 86400
    for p in (store.chunks.meta_path(layer.hex), store.chunks.table_path(layer.hex)):
        os.utime(p, (old, old))
    lm_a.acquire([layer], "sb-a")
    try:
        lease = leases.lease_path(store_root, layer.hex, lm_a.lease_key)
        assert lease.exists(), "a mount takes a lease in the store"
        rep = collect_garbage(store, paths_b, grace_s=0)
        assert layer.digest in rep.kept_in_use and store.has_layer(layer.digest)
        # the heartbeat: an old lease is renewed; one removed (a gc took A for dead) is written again
        os.utime(lease, (old, old))
        assert lm_a.renew_leases() == 1
        assert leases.age_s(lease, leases.store_now(store_root)) < 60
        lease.unlink()
        assert lm_a.renew_leases() == 1 and lease.exists()
    finally:
        lm_a.release([layer.hex], "sb-a")
    assert not lease.exists(), "the last unmount drops the lease"
    # a node on another host that died with the layer mounted: its lease stays behind, never renewed.
    # (Simulated: this host cannot host a second kernel; the file is what that node would have left.)
    dead = leases.lease_path(store_root, layer.hex, "deadhost-0123456789ab")
    dead.parent.mkdir(parents=True, exist_ok=True)
    dead.write_text(json.dumps({"host": "deadhost", "mountpoint": "/var/lib/shoal/layers/x"}))
    rep = collect_garbage(store, paths_b, grace_s=0)
    assert layer.digest in rep.kept_in_use, "a fresh lease of another host protects the layer"
    stale = leases.store_now(store_root) - leases.ttl_s() - 60
    os.utime(dead, (stale, stale))
    rep = collect_garbage(store, paths_b, grace_s=0)
    assert rep.expired_leases == 1 and layer.digest in rep.removed_layers
    assert not store.has_layer(layer.digest)


_BUILDER = r"""
import asyncio, json, os, sys, time
from pathlib import Path
from shoal.config import NodeConfig, Paths
from shoal.images.recipe import Recipe, Run, build_recipe
from shoal.node.node import Node
store_root, home, go = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])

async def main():
    # admission is not under test here: a busy shared machine must not refuse the build sandbox
    node = Node(NodeConfig(paths=Paths(home=home, store=store_root), memory_overcommit=1000.0,
                           min_free_memory_mb=0))
    await node.start()
    try:
        Path(f"{go}.ready.{os.getpid()}").touch()
        while not go.exists():
            await asyncio.sleep(0.005)
        # not reproducible: two builds of this step would make two different layers
        recipe = Recipe("built:1", base="bb:base", network=False, memory_mb=128,
                        steps=[Run("date +%s%N > /stamp && sleep 1")])
        img = await build_recipe(node, recipe)
        print(json.dumps({"layers": [l.digest for l in img.layers],
                          "cached": [h.get("cached") for h in img.lineage["steps"]]}))
    finally:
        await node.close_all()
        await node.stop()

asyncio.run(main())
"""


def test_node_agents_building_one_recipe_at_once_build_each_step_once(store_root: Path, tmp_path: Path) -> None:
    """Two node agents build the same recipe (a `run` step whose output differs per build) at once: one
    builds the step, the other waits for its layer (a build claim in the store) — one layer, one image."""
    from shoal.node.teardown import teardown_home
    from tests.integration.storeutil import busybox_image

    store = ImageStore(store_root)
    busybox_image(store, "bb:base", tmp_path, filler_mib=1)
    go = tmp_path / "go"
    homes = [Path(tempfile.mkdtemp(prefix="shb-", dir="/tmp")) for _ in range(2)]
    try:
        outs = _race([[_BUILDER, str(store_root), str(h), str(go)] for h in homes], go, homes)
    finally:
        import asyncio
        import shutil

        for h in homes:
            asyncio.run(teardown_home(Paths(home=h, store=store_root), close_sandboxes=True))
            shutil.rmtree(h, ignore_errors=True)
    assert outs[0]["layers"] == outs[1]["layers"], "both images end on the same step layer"
    assert sorted(o["cached"][0] for o in outs) == [False, True], "the step ran once"
    base_layers = {lay.digest for lay in store.resolve("bb:base").layers}
    step_layers = [d for d in store.chunks.list_hexes() if f"sha256:{d}" not in base_layers]
    assert len(step_layers) == 1, f"exactly one layer for the step: {step_layers}"
    assert not list((store.cache_dir / "steps").glob("*.claim")), "claims are released"
