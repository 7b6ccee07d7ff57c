"""`shoal vm …`: the VM backends' own commands — KVM verdict, guest and image builds, memory snapshots.

Sandboxes themselves are made with the usual commands (`shoal create --backend microvm`, `shoal exec`,
`shoal rm`); memory snapshots live on the host that took them, so these commands use the embedded node.
"""

from __future__ import annotations

import json
import time
from typing import Annotated

import typer
from rich.table import Table

from shoal.cli.common import console, run_async

vm_app = typer.Typer(help="VM backends: KVM check, guest/image builds, memory snapshots and restore.",
                     no_args_is_help=True)


def _node():  # a Node, imported lazily to keep the CLI start fast
    from shoal.node.node import Node

    return Node()


@vm_app.command("kvm")
def kvm(refresh: Annotated[bool, typer.Option(help="probe again instead of using this boot's answer")] = False
        ) -> None:
    """Does a guest really run under KVM here (or do VMs fall back to TCG)?"""
    from shoal.host.kvm import kvm_status

    st = kvm_status(refresh=refresh)
    console.print(("[green]KVM usable[/green]: " if st.usable else "[yellow]KVM not usable[/yellow]: ") + st.detail)
    if st.fix:
        console.print(f"fix: {st.fix}")


@vm_app.command("build-guest")
def build_guest() -> None:
    """Build (or find cached) the microVM kernel + initramfs for this host's kernel and agent."""
    from shoal.agentbin import find_agent_binary
    from shoal.backends.vm_images import ensure_guest
    from shoal.config import Paths, settings

    g = ensure_guest(Paths.from_env(), find_agent_binary(), settings(), log=lambda s: console.print(s))
    console.print(f"kernel {g.kernel_version}: {g.kernel}\ninitramfs: {g.initrd}\nmodules: {' '.join(g.modules)}")


@vm_app.command("build-image")
def build_image(ref: Annotated[str, typer.Argument(help="tag to build")] = "debian-vm:latest") -> None:
    """Build a Debian image with its own kernel and systemd (for backend=vm) with mmdebstrap."""
    from shoal.backends.vm_images import build_vm_image
    from shoal.config import Paths
    from shoal.images.store import ImageStore

    img = build_vm_image(ImageStore(Paths.from_env().store), ref, log=lambda s: console.print(s))
    console.print(f"built {img.ref}")  # type: ignore[attr-defined]


@vm_app.command("snapshot")
def snapshot(sandbox_id: str, name: str) -> None:
    """Save a running VM's memory, devices and disks as the named snapshot."""
    async def go() -> None:
        async with _node() as node:
            info = await node.snapshot(sandbox_id, name, memory=True)
            console.print(f"saved {info['name']}: {info['memory_bytes'] / 2**20:.0f} MiB of memory "
                          f"in {info['save_s']:.2f}s")

    run_async(go)


@vm_app.command("snapshots")
def snapshots(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List the named VM snapshots on this host."""
    from shoal.backends.vm import list_vm_snapshots
    from shoal.config import Paths

    items = list_vm_snapshots(Paths.from_env())
    if as_json:
        print(json.dumps(items, indent=1))
        return
    t = Table(title="VM snapshots")
    for col in ("name", "backend", "image", "parent", "age", "memory", "on disk"):
        t.add_column(col)
    for s in items:
        t.add_row(s["name"], s["backend"], s["image"], s["parent"], f"{(time.time() - s['created']) / 60:.0f}m",
                  f"{(s['memory_bytes'] or 0) / 2**20:.0f} MiB", f"{s['disk_bytes'] / 2**20:.0f} MiB")
    console.print(t)


@vm_app.command("restore")
def restore(name: str, n: Annotated[int, typer.Option("-n", help="how many VMs")] = 1) -> None:
    """Start `n` VMs resumed from a named snapshot (their processes keep running); prints their IDs."""
    from shoal.errors import ShoalError

    async def go() -> None:
        async with _node() as node:
            items = await node.restore(name, n)
            bad = [x for x in items if isinstance(x, ShoalError)]
            for x in items:
                print(x if isinstance(x, ShoalError) else x.id)
            if bad:
                raise bad[0]

    run_async(go)


@vm_app.command("rm-snapshot")
def rm_snapshot(names: list[str]) -> None:
    """Delete named VM snapshots."""
    from shoal.backends.vm import remove_vm_snapshot
    from shoal.config import Paths

    paths = Paths.from_env()
    for name in names:
        remove_vm_snapshot(paths, name)
        console.print(f"removed {name}")
