"""Node's public surface is its users' API, declared here; its parts and backends get the core, not the Node.

`Node` (shoal.node.node) offers the front protocol (shoal.front.Front) plus the node-only extras below, each
with the reason it is public. What only the node's parts need (start a sandbox, count it created, the
reaper's chores, reaching an agent with a record in hand) is on `NodeCore` (shoal.node.core), which the
parts and backends are built with. A new public name on Node is a decision: add it here with its reason,
or put it on the core.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from shoal.front import Front
from shoal.node.core import NodeCore
from shoal.node.node import Node
from tests.unit.conftest import fake_config

#: Node's public methods beyond the front protocol, and why each is public
EXTRA_METHODS: dict[str, str] = {
    "close_all": "`shoal rm --all`, teardown, benchmarks and tests close every sandbox (of a project) at once",
    "close_many": "many closes with bounded concurrency (the soak benchmark's churn; close_all's own loop)",
    "reconcile": "`shoal gc` and teardown re-adopt or clean up what earlier node processes left",
    "pull": "`shoal image pull` and POST /images/pull ask the registry now (a create pulls only what is missing)",
    "backend": "image builds and task images read a sandbox's writable layer; benchmarks read backend figures",
    "network": "the cluster agent sets the cluster's protected addresses on the node's network",
    "runtime_statuses": "which OCI runtimes work here (cluster node state, the gVisor benchmark, tests)",
    "table_sizes": "per-sandbox table sizes that `shoal bench soak` checks stay flat under churn",
    "fncall": "the server's fusion endpoints warm and close the fncall pools",
    "write_file_stream": "uploads written chunk by chunk (the SWE-ReX compat API), never held whole",
    "open_port": "port forwarding to a port on the sandbox's loopback (compat ports API)",
    "watch": "inotify watches of a sandbox directory (the E2B compat watch API)",
    "shell_of": "the E2B envd compat API runs commands with the sandbox's shell",
}

#: Node's public attributes: the parts users and tools read (each is the core's object, or Node's own state)
PUBLIC_ATTRIBUTES: dict[str, str] = {
    "kind": "shoal.front.Front.kind",
    "core": "the node's internals, for node-side services (image builds' mounts) and tests",
    "config": "the node's settings (server, CLI, benchmarks)",
    "paths": "SHOAL_HOME's layout (CLI, server, benchmarks)",
    "store": "the image store (image API, builds, CLI)",
    "events": "the event and command log (server's events API, observability)",
    "layer_mounts": "mounted image layers (benchmarks, teardown, tests)",
    "store_health": "the store's probe state (dashboard, outage tests)",
    "reclaimed": "bytes the last pause reclaimed per sandbox (dashboard, metrics, cluster state)",
    "admission": "what fits (placement reports, dashboard, metrics)",
    "capacity": "descriptors, PIDs, inotify and bridge ports (doctor, dashboard)",
    "scheduling": "jobs, preemption, tides (dashboard, metrics)",
    "connections": "open agent connections (dashboard, benchmarks)",
    "locks": "per-sandbox state locks (the E2B compat API's pause-with-snapshot holds one)",
    "recovery": "reconcile, adopt, reap once (`shoal gc`, tests)",
    "pool": "warm pools: configure, status (CLI, server, benchmarks)",
    "nofile": "RLIMIT_NOFILE after start (doctor)",
    "protection": "what start did to keep the host out of the OOM killer's reach (doctor)",
}


def front_methods() -> set[str]:
    """The methods the front protocol declares."""
    return {n for n, v in vars(Front).items() if not n.startswith("_") and callable(v)}


def public_methods(cls: type) -> set[str]:
    """Public methods and properties of `cls`, its bases' included."""
    return {n for klass in cls.__mro__ if klass is not object for n, v in vars(klass).items()
            if not n.startswith("_") and (callable(v) or isinstance(v, property))}


def test_front_is_read() -> None:
    assert {"create", "exec", "pause", "record", "stop"} <= front_methods()


def test_node_public_methods_are_the_front_plus_declared_extras() -> None:
    have = public_methods(Node)
    want = front_methods() | set(EXTRA_METHODS)
    assert not want - have, f"declared but missing on Node: {sorted(want - have)}"
    assert not have - want, (f"public on Node but neither in shoal.front.Front nor declared in EXTRA_METHODS: "
                             f"{sorted(have - want)} — put what only the node's parts use on NodeCore "
                             "(shoal.node.core), or declare the extra here with its reason")
    assert not front_methods() & set(EXTRA_METHODS), "an extra that the front declares is not an extra"


def test_node_public_attributes_are_declared(tmp_path: Path) -> None:
    node = Node(fake_config(tmp_path))
    have = {n for n in vars(node) if not n.startswith("_")} | {"kind"}
    assert have == set(PUBLIC_ATTRIBUTES), (sorted(have - set(PUBLIC_ATTRIBUTES)),
                                            sorted(set(PUBLIC_ATTRIBUTES) - have))


def test_parts_and_backends_are_built_with_the_core_not_the_node(tmp_path: Path) -> None:
    node = Node(fake_config(tmp_path))
    assert isinstance(node.core, NodeCore)
    for part in (node.recovery, node.pool, node.scheduling):
        assert part.node is node.core, f"{type(part).__name__} was given {type(part.node).__name__}"
    assert node.backend("fake").ctx is node.core
    # the NodeContext's one door to the Node is its public sandbox API (fncall's pools)
    assert node.core.sandboxes is node


def test_node_py_hands_itself_to_nothing_but_the_core() -> None:
    """In node/node.py `self` is passed as an argument only as the core's `sandboxes` (a SandboxHost): every
    part, backend and snapshot function gets `self.core`."""
    src = Path(inspect.getfile(Node))
    offenders = []
    for call in (n for n in ast.walk(ast.parse(src.read_text())) if isinstance(n, ast.Call)):
        args = [*call.args, *(kw.value for kw in call.keywords if kw.arg != "sandboxes")]
        if any(isinstance(a, ast.Name) and a.id == "self" for a in args):
            offenders.append(f"line {call.lineno}: {ast.unparse(call)[:100]}")
    assert not offenders, "node.py hands the Node to something (give it self.core):\n" + "\n".join(offenders)
