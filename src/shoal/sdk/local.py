"""The in-process transport: the SDK drives an embedded node agent on this machine."""

from __future__ import annotations

import builtins
from typing import TYPE_CHECKING, Any

from shoal.config import NodeConfig, Paths
from shoal.errors import ShoalError
from shoal.front import Front
from shoal.models import DirEntry, ExecResult, SandboxInfo
from shoal.sdk.transport import Cmd, StreamHandle, Transport

if TYPE_CHECKING:
    from shoal.node.events import SandboxEvent
    from shoal.spec import SandboxSpec


class LocalTransport(Transport):
    """Runs a node front inside this process (no server to start): a `Node` made from `config` (or
    `home`/`store`), or the front given (shoal.front.Front)."""

    def __init__(self, node: Front | None = None, *, home: str | None = None, store: str | None = None,
                 config: NodeConfig | None = None, reap: bool = True) -> None:
        if node is None:
            from shoal.node.node import Node

            cfg = config or NodeConfig()
            if home or store:
                cfg.paths = Paths.from_env(home, store)
            node = Node(cfg)
        self.node: Front = node
        self._reap = reap

    async def start(self) -> None:
        await self.node.start(reap=self._reap)

    async def aclose(self) -> None:
        await self.node.stop()

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        return await self.node.create(spec)

    async def create_many(self, spec: SandboxSpec, n: int, *, all_or_nothing: bool = False
                          ) -> list[SandboxInfo | ShoalError]:
        return await self.node.create_many(spec, n, all_or_nothing=all_or_nothing)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await self.node.get(sandbox_id)

    async def list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        return await self.node.list(labels=labels)

    async def close(self, sandbox_id: str) -> None:
        await self.node.close(sandbox_id)

    async def exec(self, sandbox_id: str, cmd: Cmd, **kw: Any) -> ExecResult:
        return await self.node.exec(sandbox_id, cmd, **kw)

    async def stream(self, sandbox_id: str, cmd: Cmd, **kw: Any) -> StreamHandle:
        handle: StreamHandle = await self.node.stream(sandbox_id, cmd, **kw)
        return handle

    async def read_file(self, sandbox_id: str, path: str) -> bytes:
        return await self.node.read_file(sandbox_id, path)

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        await self.node.write_file(sandbox_id, path, data, mode)

    async def list_dir(self, sandbox_id: str, path: str) -> builtins.list[DirEntry]:
        return await self.node.list_dir(sandbox_id, path)

    async def shell_open(self, sandbox_id: str, **kw: Any) -> str:
        return await self.node.shell_open(sandbox_id, **kw)

    async def shell_run(self, sandbox_id: str, shell_id: str, cmd: str, **kw: Any) -> ExecResult:
        return await self.node.shell_run(sandbox_id, shell_id, cmd, **kw)

    async def shell_close(self, sandbox_id: str, shell_id: str) -> None:
        await self.node.shell_close(sandbox_id, shell_id)

    async def pause(self, sandbox_id: str) -> None:
        await self.node.pause(sandbox_id)

    async def resume(self, sandbox_id: str) -> None:
        await self.node.resume(sandbox_id)

    async def set_cpu_class(self, sandbox_id: str, cpu_class: str) -> dict[str, Any]:
        return await self.node.set_cpu_class(sandbox_id, cpu_class)

    async def snapshot(self, sandbox_id: str, name: str) -> dict[str, Any]:
        return await self.node.snapshot(sandbox_id, name)

    async def fork(self, sandbox_id: str, n: int, **kw: Any) -> builtins.list[SandboxInfo | ShoalError]:
        return await self.node.fork(sandbox_id, n, **kw)

    async def restore(self, name: str, n: int = 1, *, backend: str = "microvm"
                      ) -> builtins.list[SandboxInfo | ShoalError]:
        return await self.node.restore(name, n, backend=backend)

    async def images(self) -> builtins.list[dict[str, Any]]:
        return [img.to_dict() for img in await self.node.images()]

    async def image(self, ref: str) -> dict[str, Any]:
        img = await self.node.resolve_image(ref)  # pulled per pull_policy when missing
        if img is None:  # a front that only checked its nodes can get it
            img = await self.node.image(ref)
        return img.to_dict()

    async def build_image(self, tag: str, context: str, **opts: Any) -> dict[str, Any]:
        from pathlib import Path

        from shoal.images.dockerbuild import build_options

        log = opts.pop("log", None)
        res = await self.node.build_dockerfile(build_options(tag, Path(context), **opts), log=log)
        return res.to_dict()

    async def pull(self, reference: str) -> dict[str, Any]:
        return await self.node.pull(reference)

    async def export_image(self, image: str, path: str, tags: builtins.list[str] | None = None) -> None:
        await self.node.export_image(image, path, repo_tags=tags)

    async def push(self, image: str, target: str) -> dict[str, Any]:
        rep = await self.node.push_image(image, target)
        return rep.to_dict()

    async def events(self, sandbox_id: str | None = None, *, commands: bool = False,
                     kinds: builtins.list[str] | None = None, since: float | None = None,
                     limit: int = 200) -> builtins.list[SandboxEvent]:
        """From this node's event log files ($SHOAL_HOME/events)."""
        import asyncio

        from shoal.node.events import EXEC, LIFECYCLE, read_events
        from shoal.records import check_sandbox_id

        if sandbox_id is not None:
            check_sandbox_id(sandbox_id)
        want = [EXEC] if commands else list(kinds or LIFECYCLE)
        return await asyncio.to_thread(read_events, self.node.paths.home, sandbox_id=sandbox_id, kinds=want,
                                       since=since, limit=limit)

    async def run_code(self, code: str, **kw: Any) -> Any:
        return await self.node.run_code(code, **kw)

    async def run_code_many(self, items: builtins.list[Any], **kw: Any) -> builtins.list[Any]:
        return await self.node.run_code_many(items, **kw)
