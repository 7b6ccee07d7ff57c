"""Undo what a node set up in its SHOAL_HOME: sandboxes (on request), layer mounts, the backends' host-wide
setup (the container's upper pool and tmpfs of sandbox directories); optionally the directory itself. Used
by `shoal node teardown`, the benchmarks' private homes and the tests'."""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from shoal.config import NodeConfig, Paths
from shoal.errors import InvalidRequest


@dataclass
class TeardownReport:
    """What a teardown did."""

    closed: int
    pool_unmounted: bool


async def teardown_home(paths: Paths, *, close_sandboxes: bool = False) -> TeardownReport:
    """Close the home's sandboxes (only with `close_sandboxes`; otherwise live ones make this raise
    InvalidRequest and touch nothing), unmount every layer mount and the upper pool."""
    from shoal.backends.registry import host_backend_names
    from shoal.node.node import Node
    from shoal.records import list_records

    node = Node(NodeConfig(paths=paths))
    await node.start(reap=False, reconcile=False)
    try:
        await node.reconcile()  # dead and expired ones go; live ones are re-adopted
        left = list_records(paths.sandboxes)
        if left and not close_sandboxes:
            raise InvalidRequest(f"{len(left)} sandbox(es) still exist in {paths.home} (e.g. {left[0].id}); "
                                 "close them, or pass --close-sandboxes", sandboxes=[r.id for r in left])
        closed = await node.close_all() if left else 0
        node.layer_mounts.reconcile(set())  # no user left: every layer mount goes
    finally:
        await node.stop()
    stop_readers(paths)
    # the backends' host-wide setup (the container's upper pool), once nothing uses it
    unmounted = [node.backend(name).host_teardown() for name in host_backend_names()]
    return TeardownReport(closed=closed, pool_unmounted=any(unmounted))


def stop_readers(paths: Paths) -> int:
    """Stop the home's layer readers (shoal-chunkd, one per store it used) that serve no mounted layer."""
    from shoal.images.chunkd import readers_of

    n = 0
    for r in readers_of(paths.home):
        if r.pid() is not None and not r.mounted_files():
            n += r.stop()
    return n


def mounts_under(paths: Paths) -> list[str]:
    """Mount points below SHOAL_HOME on this host (in this mount namespace)."""
    with open("/proc/self/mountinfo") as f:
        return [mp for mp in (line.split()[4] for line in f) if mp.startswith(f"{paths.home}/")]


def purge_home(paths: Paths) -> None:
    """Delete SHOAL_HOME; refuses (InvalidRequest) while anything is still mounted below it."""
    busy = mounts_under(paths)
    if busy:
        raise InvalidRequest(f"still mounted under {paths.home}: {busy[:3]}; not deleting it")
    shutil.rmtree(paths.home, ignore_errors=True)
