"""One front protocol (issue 27, item 4): the embedded Node and the cluster gateway both implement every
operation of shoal.front.Front, with parameters a caller written against the protocol can pass; what the
gateway cannot do raises a typed error; the server tells them apart by `kind`, not by probing attributes."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from shoal.cluster.gateway import ClusterFront
from shoal.errors import Unsupported
from shoal.front import Front
from shoal.node.node import Node

SRC = Path(__file__).resolve().parents[2] / "src" / "shoal"
OPERATIONS = sorted(n for n, v in vars(Front).items() if inspect.isfunction(v) and not n.startswith("_"))


def _accepts(impl: inspect.Signature, proto: inspect.Signature) -> list[str]:
    """What a call written against `proto` would pass that `impl` refuses."""
    params = impl.parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    problems = []
    for name, p in proto.parameters.items():
        if name == "self" or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        if name not in params and not var_kw:
            problems.append(f"no parameter {name!r}")
    # nothing the protocol does not pass may be required
    for name, p in params.items():
        if name != "self" and p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) \
                and name not in proto.parameters:
            problems.append(f"requires {name!r}, which the protocol does not pass")
    return problems


@pytest.mark.parametrize("impl", [Node, ClusterFront], ids=["node", "gateway"])
def test_both_fronts_implement_every_operation(impl: type) -> None:
    assert len(OPERATIONS) >= 25  # create, get, list, exec, stream, shells, files, pause, resume, snapshot …
    problems = []
    for name in OPERATIONS:
        mine = getattr(impl, name, None)
        if mine is None:
            problems.append(f"{name}: missing")
            continue
        proto = getattr(Front, name)
        if inspect.iscoroutinefunction(proto) != inspect.iscoroutinefunction(mine):
            problems.append(f"{name}: async in one, not the other")
        problems += [f"{name}: {p}" for p in _accepts(inspect.signature(mine), inspect.signature(proto))]
    assert not problems, "\n".join(problems)
    assert impl.kind in ("node", "cluster")


def test_the_check_can_fail() -> None:
    class Partial:
        kind = "node"

        async def get(self, sandbox_id: str, extra: int) -> None: ...

    assert _accepts(inspect.signature(Partial.get), inspect.signature(Front.get)) == [
        "requires 'extra', which the protocol does not pass"]


async def test_what_the_gateway_cannot_do_is_a_typed_error(tmp_path: Path) -> None:
    front = ClusterFront("ray://127.0.0.1:1", home=str(tmp_path / "h"), store=str(tmp_path / "s"))
    with pytest.raises(Unsupported, match="memory snapshot 'snap' needs the node that holds it"):
        await front.restore("snap")
    assert front.kind == "cluster" and Node.kind == "node"


async def test_the_gateway_relays_set_cpu_class_to_the_sandbox_node(tmp_path: Path) -> None:
    # routed by the sandbox ID's node prefix to that node agent's HTTP API; the node's answer and its typed
    # errors come back as they are
    from shoal.cluster.transport import _Agent
    from shoal.records import new_sandbox_id

    class NodeHttp:
        def __init__(self) -> None:
            self.calls: list[tuple[str, str]] = []

        async def set_cpu_class(self, sandbox_id: str, cpu_class: str) -> dict[str, object]:
            self.calls.append((sandbox_id, cpu_class))
            if cpu_class == "interactive":
                raise Unsupported("the fake backend cannot put sandboxes in CPU classes")
            return {"cpu_class": cpu_class}

    front = ClusterFront("ray://127.0.0.1:1", home=str(tmp_path / "h"), store=str(tmp_path / "s"))
    n1, n2 = NodeHttp(), NodeHttp()
    front.transport._agents.update({"n1": _Agent("n1", None, {}, n1), "n2": _Agent("n2", None, {}, n2)})
    sid = new_sandbox_id("n2")
    assert await front.set_cpu_class(sid, "batch") == {"cpu_class": "batch"}
    with pytest.raises(Unsupported, match="CPU classes"):
        await front.set_cpu_class(sid, "interactive")
    assert n2.calls == [(sid, "batch"), (sid, "interactive")] and n1.calls == []


# ---- the callers: typed against Front, never probing it -------------------------------------------------
#: the packages that hold "the node side": the HTTP server and compat APIs, the SDK's transports, the cluster
CALLER_PACKAGES = ("server", "sdk", "cluster")
PROBES = ("getattr", "hasattr", "setattr", "delattr")
#: a probe's first argument that is a front, a server state or an app state: never allowed (the front's
#: methods and `kind` say what it can do; ServerState and app state have typed fields and deps.front_of)
FRONTISH = re.compile(r"^(?:[\w.]*\.)?(?:node|front|_node|_front|st|state|shoal)$")
#: every other probe in those packages, by (module, probe, first argument): each on a result or a framework
#: object, with the reason it is not about the front. An entry no longer found fails the test (keep it short).
ALLOWED_PROBES = {
    ("server/api_images.py", "hasattr", "obj"):
        "jsonable(): run_code results of any fncall backend (dataclass, pydantic model, to_dict())",
    ("server/api_stream.py", "getattr", "h"):
        "a stream handle (StreamHandle) may offer aclose(): HTTP and cluster streams do, node streams not",
    ("server/compat/connect.py", "getattr", "it"):
        "an async iterator a handler returned may be a generator (aclose) or a plain iterator",
    ("server/app.py", "hasattr", "exc"): "starlette/pydantic exceptions: a body-size error carries `limit`",
    ("server/app.py", "getattr", "r"): "FastAPI's nested routers (original_router), not ours",
    ("server/app.py", "getattr", "route"): "starlette routes: Mount/WebSocketRoute lack path_regex/methods/path",
    ("server/observe.py", "getattr", "self"): "a SandboxQuery's own dataclass fields, by name",
    ("server/settings.py", "getattr", "s"): "Settings fields by name (FROM_SETTINGS table)",
    ("server/settings.py", "getattr", "self"): "ServerSettings' own dataclass fields",
    ("server/settings.py", "getattr", "settings()"): "a Settings field by name (the field's default)",
    ("server/tokens.py", "getattr", "self"): "a Quota's own fields, by name",
    ("server/tokens.py", "setattr", "merged"): "a Quota's own fields, by name",
    ("cluster/agent.py", "getattr", "spec"): "a SandboxSpec's own fields by name (the KV index's _INDEX_SPEC)",
    ("cluster/transport.py", "getattr", "last_refusal"):
        "the last refusal is a CapacityExceeded or another ShoalError; only the first has retry_after_s",
}
#: the node side held as something other than a Front, each with why (the name is `node` or `front`; a
#: node *id* typed str is not the node side)
ALLOWED_NODE_TYPES = {
    ("server/metrics.py", "_NodeCollector.__init__.node"):
        "the embedded node's own Prometheus collector (records, admission): fed Front.local_node()",
    ("server/observe.py", "SandboxIndex.__init__.node"):
        "the embedded node's sandbox index (its records on disk): fed Front.local_node()",
    ("server/observe.py", "NodeView.__init__.node"):
        "the dashboard of an embedded node (admission, cgroups): fed Front.local_node()",
    ("cluster/nodestate.py", "node_state.node"):
        "a node agent's placement report reads its own node's admission and mounts",
    ("cluster/agent.py", "NodeAgent.__init__:self.node"):
        "the agent makes and owns its Node (network blocks, records, teardown); cluster calls reach it as a "
        "Front (_control_op, the HTTP app)",
    ("cluster/local.py", "LocalCluster.remove_worker.node"): "a Ray test-cluster worker, not a shoal node",
}
#: where the node side must be declared as a Front (a rename cannot dodge the rule)
MUST_BE_FRONT = {
    ("server/deps.py", "ServerState:node"), ("server/app.py", "create_app.node"), ("server/run.py", "serve.node"),
    ("server/fusion.py", "bind_node.node"), ("server/fusion.py", "create_fusion_app.node"),
    ("server/metrics.py", "Metrics.__init__.front"), ("sdk/local.py", "LocalTransport.__init__.node"),
    ("sdk/local.py", "LocalTransport.__init__:self.node"),
}
_NOT_A_FRONT = {"Node", "Any", "ClusterFront", "object"}


def _caller_modules() -> list[tuple[str, ast.Module]]:
    out = []
    for pkg in CALLER_PACKAGES:
        for path in sorted((SRC / pkg).rglob("*.py")):
            out.append((str(path.relative_to(SRC)), ast.parse(path.read_text(), str(path))))
    return out


def _probes(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, probe, first argument) of every getattr/hasattr/setattr/delattr call (code only: the REPL
    driver's source, a string run inside sandboxes, is not code here)."""
    return [(n.lineno, n.func.id, ast.unparse(n.args[0])) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in PROBES and n.args]


def _node_side_declarations(tree: ast.AST) -> list[tuple[str, ast.expr | None]]:
    """(where, annotation) of every parameter named node/front and every annotated node/front attribute,
    `where` as Class.method.param or Class.method:self.attr."""
    found: list[tuple[str, ast.expr | None]] = []

    def visit(n: ast.AST, scope: list[str]) -> None:
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
            inner = [*scope, n.name]
            for a in [*n.args.posonlyargs, *n.args.args, *n.args.kwonlyargs]:
                if a.arg in ("node", "front"):
                    found.append((".".join(inner) + "." + a.arg, a.annotation))
            for c in ast.iter_child_nodes(n):
                visit(c, inner)
            return
        if isinstance(n, ast.ClassDef):
            for c in ast.iter_child_nodes(n):
                visit(c, [*scope, n.name])
            return
        if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) in ("node", "front", "self.node", "self.front"):
            found.append((".".join(scope) + ":" + ast.unparse(n.target), n.annotation))
        for c in ast.iter_child_nodes(n):
            visit(c, scope)

    visit(tree, [])
    return found


def _names(expr: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)} | \
        {n.value for n in ast.walk(expr) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_no_module_probes_the_front_or_the_server_state() -> None:
    """Rule: in server/, sdk/ and cluster/, no getattr/hasattr/setattr/delattr has a front, a server state or
    an app state as its object (by name: `node`, `front`, `st`, `state`, `*.node`, `app.state` …), and every
    other such call is listed in ALLOWED_PROBES with its reason."""
    offenders, seen = [], set()
    for mod, tree in _caller_modules():
        for line, probe, obj in _probes(tree):
            key = (mod, probe, obj)
            if FRONTISH.match(obj):
                offenders.append(f"{mod}:{line}: {probe}({obj}, …) probes a front/state: call the Front's methods")
            elif key not in ALLOWED_PROBES:
                offenders.append(f"{mod}:{line}: {probe}({obj}, …) is not in ALLOWED_PROBES (say why it is not "
                                 "about the front, or type it)")
            seen.add(key)
    stale = sorted(set(ALLOWED_PROBES) - seen)
    assert not offenders, "\n".join(offenders)
    assert not stale, f"ALLOWED_PROBES entries no longer found (remove them): {stale}"


def test_the_rule_catches_a_probe() -> None:
    tree = ast.parse("def f(st, request):\n    if hasattr(st.node, 'pull'):\n        pass\n"
                     "    getattr(request.app.state, 'shoal', None)\n")
    objs = [obj for _, _, obj in _probes(tree)]
    assert objs == ["st.node", "request.app.state"] and all(FRONTISH.match(o) for o in objs)


def test_the_node_side_is_held_as_a_front() -> None:
    """Rule: a parameter or annotated attribute named node/front in server/, sdk/, cluster/ is annotated,
    and its annotation names `Front` — not Node, ClusterFront or Any — unless ALLOWED_NODE_TYPES says why
    (a node id annotated str is not the node side)."""
    offenders, seen, fronts = [], set(), set()
    for mod, tree in _caller_modules():
        for where, ann in _node_side_declarations(tree):
            key = (mod, where)
            names = _names(ann) if ann is not None else set()
            if "Front" in names:
                fronts.add(key)
                continue
            if ann is None or names & _NOT_A_FRONT:
                seen.add(key)
                if key not in ALLOWED_NODE_TYPES:
                    shown = ast.unparse(ann) if ann is not None else "no annotation"
                    offenders.append(f"{mod} {where}: {shown} (annotate it as shoal.front.Front)")
    assert not offenders, "\n".join(offenders)
    assert not sorted(set(ALLOWED_NODE_TYPES) - seen), "stale ALLOWED_NODE_TYPES entries"
    assert not sorted(MUST_BE_FRONT - fronts), f"not declared as Front: {sorted(MUST_BE_FRONT - fronts)}"


# ---- image operations through the gateway ------------------------------------------------------------------
async def test_the_gateway_answers_image_operations_from_the_shared_store(tmp_path: Path) -> None:
    front = ClusterFront("ray://127.0.0.1:1", home=str(tmp_path / "h"), store=str(tmp_path / "s"))
    assert await front.images() == []
    assert await front.image_exists("python:3.12") is False
    from shoal.errors import ImageNotFound

    with pytest.raises(ImageNotFound):
        await front.image("nothing:here")


async def test_the_gateway_forwards_recipe_builds_to_a_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    from shoal.images.recipe import Env, Recipe, Run, User, Workdir
    from shoal.server.schemas import BuildIn

    front = ClusterFront("ray://127.0.0.1:1", home=str(tmp_path / "h"), store=str(tmp_path / "s"))
    sent: list[dict[str, object]] = []

    async def build(body: dict[str, object]) -> dict[str, object]:
        sent.append(body)
        return {"name": "projects/p/env"}

    async def image(ref: str) -> str:
        return f"image {ref}"

    monkeypatch.setattr(front.transport, "build", build)
    monkeypatch.setattr(front, "image", image)
    recipe = Recipe(ref="projects/p/env:1", base="base:latest", steps=[
        Run("pip install x", network=True, timeout=60.0), Env({"A": "1"}), Workdir("/w"), User("1000:1000")],
        cpus=1.0, memory_mb=512)
    assert await front.build_recipe(recipe, no_cache=True) == "image projects/p/env:1"
    # what the node agent's POST /v1/images/build accepts, step for step
    body = BuildIn.model_validate(sent[0])
    assert body.name == "projects/p/env:1" and body.recipe is not None and body.recipe.no_cache
    assert body.recipe.from_ == "base:latest" and len(body.recipe.steps) == 4
    assert await front.build_base("base:1") == "image base:1" and sent[1] == {"name": "base:1"}


async def test_what_the_gateway_does_not_relay_says_why(tmp_path: Path) -> None:
    from shoal.images.dockerbuild import BuildOptions

    front = ClusterFront("ray://127.0.0.1:1", home=str(tmp_path / "h"), store=str(tmp_path / "s"))
    for call in (front.watch("n0-x", "/"), front.open_port("n0-x", 80), front.shell_of(None),
                 front.set_ttl("n0-x", 60), front.snapshot("n0-x", "img", store_budget=1 << 20),
                 front.build_dockerfile(BuildOptions(tag="t", context=tmp_path))):
        with pytest.raises(Unsupported, match="gateway"):
            await call
    with pytest.raises(Unsupported, match="fncall"):
        front.fncall()
    c = await front.client("n0-x")  # shell streams are relayed; the agent's file-system calls are not
    for call in (c.stat("/a"), c.mkdir("/a"), c.remove("/a")):
        with pytest.raises(Unsupported, match="gateway does not relay"):
            await call
    assert front.local_node() is None and front.cluster_transport() is front.transport


def test_fusion_finds_its_front_through_a_typed_accessor() -> None:
    from types import SimpleNamespace

    from starlette.datastructures import State

    from shoal.errors import BackendUnavailable
    from shoal.server.deps import bind_front, front_of

    app = SimpleNamespace(state=State())
    with pytest.raises(BackendUnavailable, match="bind_node"):
        front_of(SimpleNamespace(app=app))
    marker = object()
    bind_front(app, marker)  # type: ignore[arg-type]
    assert front_of(SimpleNamespace(app=app)) is marker


#: server functions whose `st` is not a ServerState, and why
ALLOWED_ST = {("server/policy.py", "granted_priorities"): "reads only `tokens`: the CLI passes its token store"}


def test_server_functions_take_a_typed_server_state() -> None:
    """Rule: a parameter named `st` in server/ (the routes' name for the server state) is annotated with
    ServerState, so what it reaches of the front is type-checked against Front, unless ALLOWED_ST says why
    not. (`state` is also a sandbox-state query parameter: not covered.)"""
    offenders = []
    for mod, tree in _caller_modules():
        if not mod.startswith("server/"):
            continue
        for n in ast.walk(tree):
            if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for a in [*n.args.posonlyargs, *n.args.args, *n.args.kwonlyargs]:
                if a.arg == "st" and (mod, n.name) not in ALLOWED_ST:
                    names = _names(a.annotation) if a.annotation is not None else set()
                    if "ServerState" not in names:
                        shown = ast.unparse(a.annotation) if a.annotation is not None else "no annotation"
                        offenders.append(f"{mod} {n.name}({a.arg}: {shown})")
    assert not offenders, "\n".join(offenders)
