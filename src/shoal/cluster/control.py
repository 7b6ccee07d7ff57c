"""`shoal cluster up|status|down`: start, inspect and stop the node agents of a Ray cluster."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shoal.cluster.raylink import (
    KV_INDEX_PREFIX,
    NAMESPACE,
    RESOURCE,
    agent_name,
    agent_names,
    alive_ray_nodes,
    connect,
    kv_del,
    kv_keys,
    node_id_for,
    offers_shoal,
)
from shoal.errors import InvalidRequest, NodeUnavailable, error_from_dict

#: seconds `up` waits for a new agent to start its node (a big re-adoption takes a while)
START_TIMEOUT_S = 300.0


@dataclass
class UpReport:
    """What `cluster up` did."""

    started: list[dict[str, Any]] = field(default_factory=list)
    existing: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # Ray nodes without the shoal resource


def _actor_class() -> Any:
    import ray

    from shoal.cluster.agent import NodeAgent

    return ray.remote(NodeAgent)


def up(address: str, *, resource: str = RESOURCE, home: str | None = None, store: str | None = None,
       home_per_node: bool = False, env: dict[str, str] | None = None,
       start_timeout_s: float = START_TIMEOUT_S) -> UpReport:
    """Start a node agent on every live Ray node offering `resource` that has none yet (idempotent).

    `home_per_node` (several Ray nodes on one host): each agent's home is `home/nodes/<node id>` and, unless
    `store` is given, all of them use this host's layer store (SHOAL_STORE, else `<SHOAL_HOME>/store`) —
    a per-node home would otherwise give each node an empty store of its own."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    connect(address)
    if home_per_node and (not home or not store):
        from shoal.config import Paths

        here = Paths.from_env(home)
        home = str(here.home)
        store = store or str(here.store)
    # SHOAL_* variables are the agents' settings (resolved in each agent, see NodeAgent); any other variable
    # is the agent process's environment, which Ray sets when it starts the worker (runtime_env)
    from shoal.config import PREFIX

    settings_env = {k: v for k, v in (env or {}).items() if k.startswith(PREFIX)}
    process_env = {k: v for k, v in (env or {}).items() if not k.startswith(PREFIX)}
    extra_options: dict[str, Any] = {"runtime_env": {"env_vars": process_env}} if process_env else {}
    rep = UpReport()
    have = set(agent_names())
    actor_cls = _actor_class()
    pending: dict[str, Any] = {}
    for rid, n in sorted(alive_ray_nodes().items()):
        if not offers_shoal(n, resource):
            rep.skipped.append(rid)
            continue
        nid = node_id_for(n)
        name = agent_name(nid)
        if name in have:
            rep.existing.append(nid)
            continue
        node_home = str(Path(home) / "nodes" / nid) if home_per_node else home
        host = str(n.get("NodeManagerAddress") or "127.0.0.1")
        actor = actor_cls.options(
            name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            max_restarts=-1, max_task_retries=0, max_concurrency=10_000, num_cpus=0,
            resources={resource: 0.001},
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=rid, soft=False), **extra_options,
        ).remote(nid, node_home, store, host, settings_env)
        pending[nid] = actor.ensure_started.remote()
    deadline = time.monotonic() + start_timeout_s
    for nid, ref in pending.items():
        try:
            rep.started.append(ray.get(ref, timeout=max(1.0, deadline - time.monotonic())))
        except Exception as e:
            raise NodeUnavailable(f"the node agent {nid} did not start: {type(e).__name__}: {e}") from None
    return rep


def _agents() -> dict[str, Any]:
    import ray

    out = {}
    for name in agent_names():
        try:
            out[name[len("shoal-node-"):]] = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            continue  # gone between the listing and the lookup
    return out


def status(address: str, *, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """One row per node agent (and per Ray node offering shoal without one): health and state."""
    import ray

    connect(address)
    agents = _agents()
    refs = {nid: a.state.remote() for nid, a in agents.items()}
    alive = alive_ray_nodes()
    rows = []
    deadline = time.monotonic() + timeout_s
    for nid, ref in sorted(refs.items()):
        try:
            st = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            st["health"] = "ok" if st.get("ray_node_id") in alive else "node lost"
        except Exception as e:
            st = {"node_id": nid, "health": f"unreachable ({type(e).__name__})"}
        rows.append(st)
    with_agent = {r.get("ray_node_id") for r in rows}
    for rid, n in sorted(alive.items()):
        if offers_shoal(n) and rid not in with_agent:
            rows.append({"node_id": node_id_for(n), "ray_node_id": rid, "health": "no agent (run shoal cluster up)"})
    return rows


def down(address: str, *, force: bool = False, purge: bool = False, timeout_s: float = 600.0) -> dict[str, Any]:
    """Stop every node agent: close sandboxes (refused while any live, unless `force`), undo mounts, kill
    the actors, drop their indexes. Returns what was done per node."""
    import ray

    connect(address)
    agents = _agents()
    if not force:
        live = {}
        for nid, a in agents.items():
            st = ray.get(a.state.remote(fresh=True), timeout=timeout_s)
            if st.get("live"):
                live[nid] = st["live"]
        if live:
            total = sum(live.values())
            raise InvalidRequest(f"{total} sandbox(es) still live on {len(live)} node(s) "
                                 f"({', '.join(f'{k}: {v}' for k, v in sorted(live.items()))}); close them or "
                                 "pass --force", live=live)
    refs = {nid: a.teardown.remote(force, purge) for nid, a in agents.items()}
    out: dict[str, Any] = {}
    errors = []
    for nid, ref in refs.items():
        res = ray.get(ref, timeout=timeout_s)
        if "error" in res:
            errors.append(error_from_dict(res["error"]))
            out[nid] = res["error"]
            continue
        out[nid] = res["ok"]
        ray.kill(agents[nid], no_restart=True)
    # the indexes of nodes that are gone (their sandboxes were listed as lost)
    for key in kv_keys(KV_INDEX_PREFIX):
        nid = key[len(KV_INDEX_PREFIX):]
        if nid not in agents or (nid in out and "error" not in out[nid]):
            kv_del(key)
    if errors:
        raise errors[0]
    return out
