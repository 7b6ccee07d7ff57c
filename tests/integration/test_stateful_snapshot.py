"""snapshot(name), fork(n) and create_many(snapshot, n) on real overlayfs + EROFS (issue 4, items 4-5)."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest

import shoal
from shoal.config import Paths
from shoal.images.store import ImageStore
from shoal.node.snapshot import snapshot_sandbox
from tests.conftest import runtime_containers

pytestmark = [pytest.mark.root]



def _name(names: list[str], stem: str = "snap") -> str:
    ref = f"test-stateful/{stem}-{secrets.token_hex(4)}:v1"
    names.append(ref)
    return ref


def _leftovers(sb_id: str) -> list[str]:
    out = [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/shoal/{sb_id}")]
    out += [c for c in runtime_containers() if sb_id in c]
    with open("/proc/self/mountinfo") as f:
        out += [ln.split()[4] for ln in f if sb_id in ln.split()[4]]
    return out


async def test_snapshot_is_a_new_image_with_lineage(client: shoal.Client, names: list[str]) -> None:
    sb = await client.create("base")
    await sb.exec("mkdir -p /work && echo v1 > /work/file && rm /etc/debian_version && "
                  "mkdir -p /opt/d && touch /opt/d/x && rm -rf /usr/share/common-licenses")
    parent = client.transport.node.record(sb.id)
    ref = _name(names)
    img = await sb.snapshot(ref)
    assert img["ref"] == ref
    assert img["layers"][:-1] == [f"sha256:{h}" for h in parent.layers]
    assert img["layers"][-1] == img["layer"]
    assert img["diff_bytes"] > 0
    lin = img["lineage"]
    assert lin["parent"] == parent.image_digest
    assert lin["sandbox"] == sb.id
    assert lin["parent_ref"] == parent.image
    assert lin["created"] > 0
    # the lineage is in the stored manifest, so any host that sees the store sees it
    manifest = ImageStore(Paths.from_env().store).manifest(img["digest"])
    assert manifest["lineage"]["sandbox"] == sb.id
    # the snapshot is usable like any image: files, deletions and removed trees are as they were
    child = await client.create(ref)
    r = await child.exec("cat /work/file; test -e /etc/debian_version; echo $?; ls /opt/d; "
                         "test -e /usr/share/common-licenses; echo $?; test -e /.shoal/shoal-agent; echo $?")
    assert r.stdout == b"v1\n1\nx\n1\n0\n", r
    # the parent keeps running, unchanged
    assert (await sb.refresh()).state == "running"
    assert (await sb.exec("cat /work/file")).stdout == b"v1\n"


async def test_snapshot_without_changes_adds_no_layer(client: shoal.Client, names: list[str]) -> None:
    sb = await client.create("base")
    img = await sb.snapshot(_name(names))
    assert img["layer"] is None
    assert img["layers"] == [f"sha256:{h}" for h in client.transport.node.record(sb.id).layers]


async def test_snapshot_of_paused_sandbox_stays_paused(client: shoal.Client, names: list[str]) -> None:
    sb = await client.create("base")
    await sb.exec("echo p > /root/p")
    await sb.pause()
    img = await sb.snapshot(_name(names))
    assert (await sb.refresh()).state == "paused"
    child = await client.create(img["ref"])
    assert (await child.exec("cat /root/p")).stdout == b"p\n"


async def test_snapshot_bad_input(client: shoal.Client, names: list[str]) -> None:
    sb = await client.create("base")
    for bad in ("", "UPPER:case", "x@sha256:" + "0" * 64, "a:b:c", "../etc"):
        with pytest.raises(shoal.InvalidRequest):
            await sb.snapshot(bad)
    with pytest.raises(shoal.SandboxNotFound):
        await snapshot_sandbox(client.transport.node.core, "n0-" + "b" * 26, _name(names))
    # nothing was left frozen by the refused requests
    assert (await sb.exec("echo ok")).stdout == b"ok\n"


async def test_fork_children_diverge_parent_unaffected(client: shoal.Client, names: list[str]) -> None:
    parent = await client.create("base", labels={"team": "rl"})
    await parent.exec("mkdir -p /work && echo base > /work/state && echo shared > /work/shared")
    kids = await parent.fork(8, name=_name(names, "fork"))
    assert len(kids) == 8 and len({k.id for k in kids}) == 8
    # each child writes its own state; nobody sees anyone else's writes
    await asyncio.gather(*(k.exec(f"echo child{i} > /work/state && touch /work/only-{i}") for i, k in enumerate(kids)))
    await parent.exec("echo parent-moved-on > /work/state && rm /work/shared")
    for i, k in enumerate(kids):
        r = await k.exec("cat /work/state /work/shared; ls /work")
        assert r.stdout == f"child{i}\nshared\nonly-{i}\nshared\nstate\n".encode(), r
    r = await parent.exec("cat /work/state; ls /work")
    assert r.stdout == b"parent-moved-on\nstate\n"
    info = await kids[0].refresh()
    assert info.labels["team"] == "rl" and info.labels["shoal.fork_of"] == parent.id
    assert info.spec["memory_mb"] == parent.info.spec["memory_mb"]
    ids = [k.id for k in kids]
    await asyncio.gather(*(k.close() for k in kids))
    for sid in ids:
        assert _leftovers(sid) == []


async def test_create_many_from_snapshot(client: shoal.Client, names: list[str]) -> None:
    sb = await client.create("base")
    await sb.exec("echo from-snapshot > /root/marker")
    ref = (await sb.snapshot(_name(names)))["ref"]
    many = await client.create_many(ref, n=6, return_errors=False, memory_mb=256)
    outs = await asyncio.gather(*(m.exec("cat /root/marker") for m in many))
    assert all(o.stdout == b"from-snapshot\n" for o in outs)


async def test_fork_options_and_memory_fork(client: shoal.Client, names: list[str]) -> None:
    sb = await client.create("base")
    node = client.transport.node
    with pytest.raises(shoal.InvalidRequest):
        await node.fork(sb.id, 0)
    with pytest.raises(shoal.InvalidRequest):
        await node.fork(sb.id, 2, no_such_option=1)
    # containers on crun/runc cannot carry processes and memory over: a clear, typed refusal
    with pytest.raises((shoal.BackendUnavailable, shoal.NotImplementedYet)) as ei:
        await sb.fork(2, memory=True)
    assert "files only" in ei.value.message or "gVisor" in ei.value.message
    kids = await sb.fork(2, name=_name(names), memory_mb=256, labels={"k": "v"})
    info = await kids[0].refresh()
    assert info.spec["memory_mb"] == 256 and info.labels["k"] == "v"


async def test_squashed_snapshot_has_one_layer_with_the_whole_tree(client: shoal.Client, names: list[str]) -> None:
    sb = await client.create("base")
    await sb.exec("echo sq > /root/sq && rm /etc/debian_version")
    img = await snapshot_sandbox(client.transport.node.core, sb.id, _name(names), squash=True)
    assert len(img["layers"]) == 1 and img["lineage"]["squashed"] is True
    child = await client.create(img["ref"])
    r = await child.exec("cat /root/sq; test -e /etc/debian_version; echo $?; python3 -c 'print(2+2)'")
    assert r.stdout == b"sq\n1\n4\n", r
    # no temporary mount of the squash is left
    with open("/proc/self/mountinfo") as f:
        assert not [ln for ln in f if "squash-" in ln]


async def test_snapshot_chain(client: shoal.Client, names: list[str]) -> None:
    """step1 -> step2 -> step3: each snapshot stacks one layer on its parent's image."""
    ref = "base"
    depth = len((await client.create("base")).info and client.transport.node.store.resolve("base").layers)
    for step in range(3):
        sb = await client.create(ref)
        await sb.exec(f"echo {step} >> /root/steps")
        img = await sb.snapshot(_name(names, f"chain{step}"))
        assert len(img["layers"]) == depth + step + 1
        ref = img["ref"]
        await sb.close()
    last = await client.create(ref)
    assert (await last.exec("cat /root/steps")).stdout == b"0\n1\n2\n"


async def test_deep_chain_is_squashed_automatically(client: shoal.Client, names: list[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the overlayfs layer limit (lowered here to 3), a snapshot becomes one squashed layer."""
    import shoal.node.snapshot as snap

    monkeypatch.setattr(snap, "max_layers", lambda: 3)
    base_depth = len(client.transport.node.store.resolve("base").layers)
    assert base_depth <= 2
    ref, depths = "base", []
    for step in range(4 - base_depth):
        sb = await client.create(ref)
        await sb.exec(f"echo {step} >> /root/steps && rm -f /root/.bashrc")
        img = await sb.snapshot(_name(names, f"deep{step}"))
        depths.append((len(img["layers"]), img["lineage"]["squashed"]))
        ref = img["ref"]
        await sb.close()
    assert depths[-1] == (1, True), depths
    assert all(d <= 3 for d, _ in depths)
    last = await client.create(ref)
    r = await last.exec("cat /root/steps; test -e /root/.bashrc; echo $?")
    assert r.stdout == "".join(f"{i}\n" for i in range(4 - base_depth)).encode() + b"1\n", r


async def test_closing_the_parent_untags_its_automatic_fork_snapshots(client: shoal.Client,
                                                                      names: list[str]) -> None:
    """fork(n) without a name tags `forks/<parent id>:…`; closing the parent removes those tags (an RL loop
    forking every step must not grow the store without end) while its children run on, and a snapshot
    forked under a chosen name stays."""
    store = ImageStore(Paths.from_env().store)
    parent = await client.create("base")
    await parent.exec("echo v1 > /root/state")
    auto_kids = await parent.fork(2)
    auto_kids += await parent.fork(1)
    named_ref = _name(names, "kept")
    named_kids = await parent.fork(1, name=named_ref)
    auto = [i.ref for i in store.list_images() if i.name == f"forks/{parent.id}"]
    assert len(auto) == 2, auto
    await parent.close()
    assert [i for i in store.list_images() if i.name == f"forks/{parent.id}"] == []
    assert store.exists(named_ref), "a snapshot forked under a chosen name stays"
    for k in auto_kids + named_kids:  # the children keep their files: their layers stay mounted and in use
        assert (await k.exec("cat /root/state")).stdout == b"v1\n"
        await k.close()
