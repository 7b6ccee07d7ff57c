"""Fixtures for unit tests on the fake backend (shoal.backends.fake): a Node with NO isolation whose
sandboxes are directories and plain processes of the calling user, so Node, SDK, server and RL logic run
here without root. The in-sandbox agent is the real one (built by `make agent`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from shoal.config import NodeConfig, Paths
from shoal.images.store import ImageConfig, ImageStore
from shoal.node.node import Node

REPO = Path(__file__).resolve().parents[2]
AGENT_BUILT = (REPO / "build" / "shoal-agent").exists() or bool(os.environ.get("SHOAL_AGENT_BIN"))
needs_agent = pytest.mark.skipif(not AGENT_BUILT, reason="the agent is not built: run `make agent`")


def add_image(store: ImageStore, ref: str, files: dict[str, str | bytes], *, workdir: str = "/work",
              env: dict[str, str] | None = None) -> str:
    """Put a one-layer image holding `files` (path → content) into `store`; returns its ref."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="img-") as tmp:
        root = Path(tmp)
        (root / workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
        for path, content in files.items():
            p = root / path.lstrip("/")
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(content.encode() if isinstance(content, str) else content)
        layer = store.add_layer_from_dir(root, {"type": "test"})
    store.put_image(ref, [layer.digest], ImageConfig(workdir=workdir, env=dict(env or {})))
    return ref


def fake_config(home: Path, **kw: object) -> NodeConfig:
    """A node config on a private home and store, with the fake backend enabled."""
    cfg = NodeConfig(paths=Paths(home=home / "home", store=home / "store"), fake_backend=True, zram_swap=None,
                     protect_host=False)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def agents_under(home: Path) -> list[int]:
    """Live fake-sandbox agents started from this home (the node runs its copy of the agent binary)."""
    binary = str(home / "home" / "guest" / "shoal-agent").encode()
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if f.read().split(b"\0", 1)[0] == binary:
                        out.append(int(name))
            except OSError:
                continue
    return out


@pytest.fixture
def fake_home(tmp_path: Path) -> Iterator[Path]:
    """A private home; at the end no sandbox process of it may be left running."""
    yield tmp_path
    left = agents_under(tmp_path)
    for pid in left:
        from shoal.backends.fake import descendants

        for p in [pid, *descendants(pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, 9)
    assert not left, f"sandbox agents left running: {left}"


@pytest.fixture
async def node(fake_home: Path) -> AsyncIterator[Node]:
    """A started node on the fake backend with an image `t:1` (a file /work/hello.txt); every sandbox is
    closed afterwards."""
    if not AGENT_BUILT:
        pytest.skip("the agent is not built: run `make agent`")
    n = Node(fake_config(fake_home))
    add_image(n.store, "t:1", {"/work/hello.txt": "hi\n"})
    await n.start(reap=False)
    try:
        yield n
    finally:
        await n.close_all()
        await n.stop()
