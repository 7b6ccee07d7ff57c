"""The front protocol: the sandbox operations a server, a compat API or a transport asks of "the node side",
implemented by the embedded `shoal.node.node.Node` and by the cluster gateway's `shoal.cluster.gateway.
ClusterFront` (issue 27, item 4).

Callers use these methods and `kind` — never `hasattr`/`getattr` probing to tell the two apart. An operation
one side cannot do still exists there and raises a typed error saying why (`shoal.errors.Unsupported`):
the gateway's `restore`, `watch`, `open_port`, `fncall`, `set_ttl`, `build_dockerfile`.
tests/unit/test_front_protocol.py checks that both classes implement every method with compatible parameters,
and that the server, compat APIs, transports and cluster modules hold the node side as a `Front` and never
probe it with `hasattr`/`getattr`.

Image operations are front operations too: the store-only ones (list, look up, remove, import, export,
push) come from `shoal.images.frontops.StoreImages` on both fronts (the gateway works on the cluster's
shared store); a registry pull and a recipe or `base` build go to a node (the gateway forwards them to a
node agent); a Dockerfile build needs its context on the building node (the embedded node only).
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterable, Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from shoal.backends.fncall import FncallManager
    from shoal.cluster.transport import ClusterTransport
    from shoal.config import Paths
    from shoal.images.dockerbuild import BuildOptions, BuildResult
    from shoal.images.export import ExportReport
    from shoal.images.oci import ImportReport
    from shoal.images.recipe import Recipe
    from shoal.images.store import Image, ImageStore
    from shoal.models import DirEntry, ExecResult, SandboxInfo
    from shoal.node.node import Node
    from shoal.spec import SandboxSpec


class FrontConfig(Protocol):
    """What callers read of a front's configuration."""

    @property
    def node_id(self) -> str:
        """The node's id ("gateway" for a cluster gateway)."""
        ...


class SandboxClient(Protocol):
    """What callers use of `Front.client(id)`: the sandbox's agent connection (a node) or a relay to it (a
    gateway, which raises Unsupported for what it does not relay)."""

    async def shell_run_stream(self, shell_id: str, cmd: str, *, timeout: float | None = None,
                               max_output: int = ...) -> Any:
        """Run `cmd` in a persistent shell and stream its output (the exit event carries the result)."""
        ...

    async def stat(self, path: str) -> dict[str, Any]:
        """lstat of `path`: type, size, mode, mtime, uid, gid."""
        ...

    async def mkdir(self, path: str, parents: bool = True, mode: int = 0o755) -> None: ...

    async def remove(self, path: str, recursive: bool = False) -> None: ...


class Front(Protocol):
    """What every node front offers (parameters beyond these are extras of one implementation)."""

    #: "node": one host's sandboxes, with their records and admission here; "cluster": a gateway whose
    #: node agents hold the records (observability and metrics ask them)
    kind: Literal["node", "cluster"]

    @property
    def config(self) -> FrontConfig:
        """Its configuration (`node_id`)."""
        ...

    @property
    def paths(self) -> Paths:
        """Its SHOAL_HOME and store paths (a gateway's own home: tokens, temp files)."""
        ...

    @property
    def store(self) -> ImageStore:
        """The image store it reads: the node's, or the cluster's shared store (project scoping, budgets)."""
        ...

    async def create(self, spec: SandboxSpec) -> SandboxInfo: ...

    async def create_many(self, spec: SandboxSpec, n: int, concurrency: int | None = None, *,
                          all_or_nothing: bool = False) -> builtins.list[Any]:
        """`n` sandboxes, an info or an error each (`concurrency`: a bound on local parallelism, which a
        front that spreads them over nodes may ignore; `all_or_nothing`: a gang)."""
        ...

    async def list(self, project: str | None = None, labels: dict[str, str] | None = None
                   ) -> builtins.list[SandboxInfo]: ...

    async def get(self, sandbox_id: str) -> SandboxInfo: ...

    async def close(self, sandbox_id: str) -> None: ...

    async def exec(self, sandbox_id: str, cmd: str | builtins.list[str], *, timeout: float | None = ...,
                   cwd: str | None = None, env: dict[str, str] | None = None, user: str | None = None,
                   stdin: bytes | None = None, max_output: int | None = None) -> ExecResult: ...

    async def stream(self, sandbox_id: str, cmd: str | builtins.list[str], *, timeout: float | None = ...,
                     cwd: str | None = None, env: dict[str, str] | None = None, user: str | None = None,
                     tty: bool = False, stdin: bool = False, max_output: int | None = None) -> Any: ...

    async def client(self, sandbox_id: str) -> SandboxClient: ...

    async def read_file(self, sandbox_id: str, path: str) -> bytes: ...

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None: ...

    async def write_file_stream(self, sandbox_id: str, path: str, chunks: AsyncIterable[bytes],
                                mode: int = 0o644) -> None: ...

    async def watch(self, sandbox_id: str, path: str, *, recursive: bool = False) -> Any:
        """A stream of file-system events under `path` in the sandbox."""
        ...

    async def open_port(self, sandbox_id: str, port: int, *, timeout: float | None = 10.0) -> Any:
        """A byte stream to a TCP port inside the sandbox."""
        ...

    async def shell_of(self, rec: Any) -> str:
        """The shell string commands of this sandbox run with (/bin/bash, else the image's /bin/sh)."""
        ...

    async def set_ttl(self, sandbox_id: str, seconds: float, *, only_extend: bool = False) -> None:
        """Make the sandbox expire `seconds` from now."""
        ...

    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[DirEntry]: ...

    async def shell_open(self, sandbox_id: str, *, cwd: str | None = None, env: dict[str, str] | None = None,
                         user: str | None = None) -> str: ...

    async def shell_run(self, sandbox_id: str, shell_id: str, cmd: str, *, timeout: float | None = ...,
                        max_output: int | None = None) -> ExecResult: ...

    async def shell_close(self, sandbox_id: str, shell_id: str) -> None: ...

    async def pause(self, sandbox_id: str) -> None: ...

    async def resume(self, sandbox_id: str) -> None: ...

    async def snapshot(self, sandbox_id: str, name: str, *, store_budget: int | None = None) -> dict[str, Any]:
        """Pack the sandbox's writable layer into image `name` (`store_budget`: bytes the project may
        still add to the store)."""
        ...

    async def fork(self, sandbox_id: str, n: int, **kw: Any) -> builtins.list[Any]: ...

    async def restore(self, name: str, n: int = 1, *, backend: str = "microvm") -> builtins.list[Any]:
        """`n` new sandboxes resumed from the named VM memory snapshot of this node (per-item errors)."""
        ...

    async def set_cpu_class(self, sandbox_id: str, cpu_class: str) -> dict[str, Any]: ...

    async def resolve_image(self, ref: str) -> Image | None:
        """Make sure `ref` can be used by a create (pulled or found); raises ImageNotFound otherwise. The
        image, or None from a front that only checks that its nodes can get it (a gateway)."""
        ...

    # ---- images ----------------------------------------------------------------------------------
    async def images(self) -> builtins.list[Image]:
        """Every image of the store."""
        ...

    async def image(self, ref: str) -> Image:
        """The stored image `ref` names (ImageNotFound; nothing is pulled)."""
        ...

    async def image_exists(self, ref: str) -> bool: ...

    async def remove_image(self, ref: str) -> None: ...

    async def pull(self, ref: str) -> dict[str, Any]:
        """Pull `ref` from its registry into the store now (the PullReport as a dict)."""
        ...

    async def import_image(self, path: Path | str, ref: str, *, select: str | None = None,
                           source_label: str | None = None) -> ImportReport: ...

    async def import_registry(self, source: str, ref: str, *, tls_verify: bool = True) -> ImportReport: ...

    async def export_image(self, ref: str, out: Path | str | IO[bytes], *,
                           repo_tags: builtins.list[str] | None = None) -> ExportReport: ...

    async def push_image(self, ref: str, target: str) -> ExportReport: ...

    async def build_base(self, ref: str = "base:latest") -> Image: ...

    async def build_recipe(self, recipe: Recipe, *, no_cache: bool = False) -> Image: ...

    async def build_dockerfile(self, opts: BuildOptions, *, log: Callable[[str], None] | None = None,
                               resolve_base: Callable[[str], Any] | None = None) -> BuildResult: ...

    def fncall(self) -> FncallManager:
        """This front's fncall service (warm pools for run_code)."""
        ...

    async def run_code(self, code: str, **kw: Any) -> Any: ...

    async def run_code_many(self, items: builtins.list[Any], **kw: Any) -> builtins.list[Any]: ...

    def record(self, sandbox_id: str) -> Any:
        """What the front knows of a sandbox here (at least `.project` and `.spec`)."""
        ...

    async def record_async(self, sandbox_id: str) -> Any:
        """`record`, asking the sandbox's node when the front does not know it yet (a gateway)."""
        ...

    # ---- what observability reads beneath the front (shoal.server.observe, metrics) ---------------
    def local_node(self) -> Node | None:
        """The embedded Node itself, whose records, admission and cgroups a node's dashboard and metrics
        read; None for a gateway."""
        ...

    def cluster_transport(self) -> ClusterTransport | None:
        """A gateway's transport to the node agents, whose own APIs a gateway's dashboard asks; None for
        an embedded node."""
        ...

    async def start(self, reap: bool = True) -> Any: ...

    async def stop(self) -> None: ...
