"""Shared fixtures: a private SHOAL_HOME per test session (short path: Unix sockets live in it), the
shared image store (so `base` is built once per machine), and a leak check at the end."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

IS_ROOT = os.geteuid() == 0
# hermetic: a host's /etc/shoal/config.toml must not change what the tests see (set SHOAL_CONFIG to test one)
os.environ.setdefault("SHOAL_CONFIG", "/dev/null")
# hermetic: no test pulls from a registry on the internet. Tests of pulling use `registry_env` (a loopback
# registry serving Docker Hub names through the mirror setting, policy missing, no fallback to the internet)
os.environ.setdefault("SHOAL_PULL_POLICY", "never")
REPO = Path(__file__).resolve().parents[1]
AGENT_BIN = REPO / "build" / "shoal-agent"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `root` are skipped (with the reason) when not running as root."""
    if IS_ROOT:
        return
    skip = pytest.mark.skip(reason="needs root: real crun/runc, mounts and cgroups")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Undo what killed sessions left on the host; note whether the host had swap before the suite (nodes
    set up zram swap when it has none)."""
    if IS_ROOT:
        from shoal.backends.container.reclaim import swap_active
        from tests import sessions

        for home, left in sessions.reap_dead().items():  # what killed sessions left (tests.sessions)
            print(f"removed what a killed test session left in {home}" + (f"; still there: {left}" if left else ""))
        session.config.stash[_HAD_SWAP] = swap_active()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Leave swap as the suite found it: the zram swap a node of this suite made goes again, once no other
    node process on the host relies on it (shoal.backends.container.swap)."""
    if IS_ROOT and session.config.stash.get(_HAD_SWAP, True) is False:
        from shoal.backends.container import swap

        try:
            swap.release_unused(ignore_pid=os.getpid())
        except Exception as e:
            print(f"\nswap made during the tests was not turned off: {e}")


_HAD_SWAP = pytest.StashKey[bool]()


def _mounts_under(prefix: str) -> list[str]:
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4]
            if mp.startswith(prefix):
                out.append(mp)
    return out


@pytest.fixture(scope="session")
def shoal_home() -> Iterator[Path]:
    """A fresh SHOAL_HOME for the session; at the end nothing it made may remain mounted or running."""
    from tests import sessions

    home = sessions.new_home()  # owned by this process: a killed session's home is reaped by the next
    old = {k: os.environ.get(k) for k in ("SHOAL_HOME", "SHOAL_STORE")}
    os.environ["SHOAL_HOME"] = str(home)
    os.environ.setdefault("SHOAL_STORE", os.environ.get("SHOAL_TEST_STORE", "/var/lib/shoal/store"))
    yield home
    if IS_ROOT:
        from shoal.backends.container.disk import UpperPool
        from shoal.config import Paths, settings
        from shoal.node.teardown import stop_readers

        UpperPool(Paths.from_env(home), settings()).teardown()
        stop_readers(Paths.from_env(home))  # the layer readers of stores the session used
    leaks = _mounts_under(str(home))
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    if not leaks:
        shutil.rmtree(home, ignore_errors=True)
    assert not leaks, f"mounts leaked under {home}: {leaks}"


@pytest.fixture(scope="session")
def base_image(shoal_home: Path) -> str:
    """Make sure the `base` image exists in the store (built with mmdebstrap on first use)."""
    if not IS_ROOT:
        pytest.skip("needs root")
    from shoal.config import Paths
    from shoal.images.base import ensure_base
    from shoal.images.store import ImageStore

    store = ImageStore(Paths.from_env().store)
    ensure_base(store)
    return "base"


@pytest.fixture
async def client(shoal_home: Path, base_image: str) -> AsyncIterator:
    """An embedded async client; every sandbox it made is closed afterwards."""
    import shoal

    async with shoal.Client() as c:
        yield c


def runtime_containers() -> list[str]:
    """IDs of shoal containers that crun/runc still know (for leak checks)."""
    ids = []
    for rt in ("crun", "runc"):
        if shutil.which(rt):
            r = subprocess.run([rt, "list", "-q"], capture_output=True, text=True)
            ids += [x for x in r.stdout.split() if x.startswith("shoal-")]
    return ids


# ---- the HTTP API (issue 6): one `shoal serve` per session; `any_client` runs a test on both transports
API_PROJECT = "suite"


@pytest.fixture(scope="session")
def api_server(shoal_home: Path, base_image: str) -> Iterator:
    """A real `shoal serve` child process on a free loopback port, sharing the session's SHOAL_HOME, with a
    token of project `suite` (no quota, every priority class granted). Attributes: `.url`, `.token`.
    Stopped (SIGTERM) at session end."""
    from shoal.config import settings
    from shoal.server.proc import ServerProcess
    from shoal.server.tokens import ProjectPolicy, TokenStore

    token = TokenStore(shoal_home).create(API_PROJECT, name="pytest any_client")
    # the suite's project may use every priority class (a project gets the default one and below unless
    # the operator grants more: shoal.server.policy), so job tests run alike on both transports
    TokenStore(shoal_home).set_policy(API_PROJECT, ProjectPolicy(priorities=list(settings().priorities)))
    srv = ServerProcess(log_path=shoal_home / "api-server.log", token=token)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(params=["local", "http"])
def any_transport(request: pytest.FixtureRequest, shoal_home: Path, base_image: str):
    """Which transport `any_client` uses: None (embedded) or the session's API server."""
    if request.param == "http":
        return request.getfixturevalue("api_server")
    return None


@pytest.fixture
async def any_client(any_transport) -> AsyncIterator:
    """An async client over each transport in turn (embedded, then HTTP with a token): a test written
    against it runs twice with the same assertions. Sandboxes it made are closed afterwards."""
    import shoal

    if any_transport is None:
        async with shoal.Client() as c:
            yield c
    else:
        async with shoal.Client(any_transport.url, token=any_transport.token) as c:
            yield c


# ---- a real distributed filesystem for the store tests (issue 14): MooseFS in network namespaces
@pytest.fixture(scope="session")
def moosefs() -> Iterator:
    """A MooseFS cluster (master + 2 chunkservers, each in its own netns) FUSE-mounted on this host for the
    session; torn down at the end, and nothing of it may remain (mounts, namespaces, daemons, files).
    Skipped without root or without the packages — except in CI, where setup.sh installs them."""
    if not IS_ROOT:
        pytest.skip("needs root")
    from shoal.errors import BackendUnavailable
    from shoal.images import moosefs as mfs

    try:
        mfs.check_installed()
    except BackendUnavailable as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(e.message)
    name = f"pt{os.getpid()}"
    cluster = mfs.up(name, chunkservers=2)
    yield cluster
    mfs.down(name)
    left = [ns for ns in os.listdir("/run/netns") if ns.startswith(f"shoal-mfs-{name}-")] \
        if os.path.isdir("/run/netns") else []
    assert not left, f"network namespaces leaked: {left}"
    assert not mfs.is_mounted(Path(cluster.mountpoint)), "the MooseFS mount leaked"
    assert not mfs._mfsmount_pids(Path(cluster.mountpoint)), "the MooseFS client process leaked"
    assert not Path(cluster.base).exists(), f"{cluster.base} was not removed"


@pytest.fixture(params=["local", "moosefs"])
def store_root(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """An empty store directory on local disk, then on the session's MooseFS mount (removed afterwards)."""
    if request.param == "local":
        yield tmp_path / "store"
        return
    cluster = request.getfixturevalue("moosefs")
    root = Path(tempfile.mkdtemp(prefix="store-", dir=cluster.mountpoint))
    yield root
    shutil.rmtree(root, ignore_errors=True)


# ---- RL: generated tasks shared by the RL and trainer-integration tests
@pytest.fixture(scope="session")
def rl_tasks(shoal_home: Path, base_image: str) -> list:
    """Two generated tasks of the `inflection` project (images cached in the shared store)."""
    import asyncio

    import shoal
    from shoal.rl.taskgen.config import load_task_recipe
    from shoal.rl.taskgen.generate import generate_tasks

    tr = load_task_recipe().select(["inflection"])
    tr.mutations.tasks_per_project = 2
    tr.mutations.max_candidates = 8

    async def go() -> list:
        async with shoal.Client() as c:
            return await generate_tasks(c.transport.node, tr)

    tasks = asyncio.run(go())
    assert len(tasks) == 2
    return tasks


@pytest.fixture
def names() -> Iterator[list[str]]:
    """Image refs (`name:tag`) a test makes; every tag of those names is removed afterwards (their layers go
    at the store's gc). Names must be unique to the test (a random part)."""
    from shoal.config import Paths
    from shoal.images.store import ImageStore

    made: list[str] = []
    yield made
    if not made:
        return
    store = ImageStore(Paths.from_env().store)
    wanted = {ref.split(":")[0] for ref in made}
    for img in store.list_images():
        if img.name in wanted:
            store.remove_image(img.ref)


# ---- registries (issue 25): a real docker-registry on loopback, Docker Hub names served through mirrors
@pytest.fixture(scope="session")
def loopback_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Debian's docker-registry on 127.0.0.1 for the session (tests.registry.LoopbackRegistry); push images
    with `.push("library/python:3.12-slim", [layer_tar(...)])`. Skipped when docker-registry/skopeo are
    missing."""
    from tests.registry import LoopbackRegistry, available

    missing = available()
    if missing:
        pytest.skip(missing)
    with LoopbackRegistry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture
def registry_env(loopback_registry, monkeypatch: pytest.MonkeyPatch):
    """The loopback registry as the mirror of docker.io, ghcr.io and quay.io, pull_policy missing, and no
    fallback to the real registries (nothing leaves the machine). Yields the registry."""
    for k, v in loopback_registry.env().items():
        monkeypatch.setenv(k, v)
    yield loopback_registry
