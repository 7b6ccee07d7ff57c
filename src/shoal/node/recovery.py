"""Crash recovery and reaping: re-adopt live sandboxes, clean up dead, expired and half-made ones.

The node's only durable state is one record per sandbox, so a node process that starts (after a crash,
an upgrade, or next to another one) rebuilds everything from those records: `reconcile()` adopts each
live sandbox (`adopt(record)`: counted by admission, reachable again) and closes the dead ones; the
reaper then closes sandboxes past their TTL or whose init died, every few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.errors import SandboxError, SandboxNotFound, ShoalError
from shoal.host import heap
from shoal.limits import HEAP_TRIM_INTERVAL_S
from shoal.records import SandboxRecord, list_records

if TYPE_CHECKING:
    from shoal.models import SandboxInfo
    from shoal.node.ports import RecoveryHost

log = logging.getLogger(__name__)

#: a sandbox directory without a record is a half-made one once it is this old (seconds)
HALF_MADE_AGE_S = 60.0
#: how long stop_reaper waits for a close in progress before cancelling it (seconds)
STOP_WAIT_S = 30.0


class Recovery:
    """Reconcile, adopt and reap the sandboxes of one node (through the node's core, as a RecoveryHost)."""

    def __init__(self, node: RecoveryHost) -> None:
        self.node = node
        self._reaper: asyncio.Task[None] | None = None
        self._stopping = False
        self._wake = asyncio.Event()

    # ---- adopt ---------------------------------------------------------------------------------
    def alive(self, rec: SandboxRecord) -> bool:
        """True when the sandbox's init still runs (a backend that cannot tell counts as alive)."""
        try:
            return self.node.backend(rec.backend).alive(rec)
        except ShoalError:
            return True

    def adopt(self, rec: SandboxRecord) -> SandboxInfo:
        """Take over a live sandbox this process did not create: admission counts it from now on and
        requests reach it (its agent connection opens on first use). SandboxError when it is not live."""
        if rec.state not in ("running", "paused"):
            raise SandboxError(f"cannot adopt sandbox {rec.id}: it is {rec.state}")
        if not self.node.backend(rec.backend).alive(rec):
            raise SandboxError(f"cannot adopt sandbox {rec.id}: its init process is gone; close it")
        self.node.admission.adopt(rec)
        return self.node.describe(rec)

    # ---- reconcile -----------------------------------------------------------------------------
    async def reconcile(self) -> dict[str, int]:
        """Re-adopt live sandboxes left by earlier processes; clean up dead, expired and half-made ones."""
        node = self.node
        adopted = cleaned = 0
        live: list[SandboxRecord] = []
        for rec in list_records(node.paths.sandboxes):
            dead = False
            if rec.state in ("creating", "stopping"):
                dead = not rec.owner_alive() or rec.state == "stopping"
                if rec.state == "creating" and not dead:
                    live.append(rec)  # another process is making it right now
                    continue
            elif rec.state in ("running", "paused"):
                try:
                    dead = not node.backend(rec.backend).alive(rec)
                except ShoalError:
                    dead = False
            if rec.extra.get("pool") and not rec.owner_alive():
                dead = True  # a warm sandbox of a node process that is gone: nobody will hand it out
            if dead:
                if rec.state in ("running", "paused") and not rec.extra.get("pool"):
                    node.events.emit("lost", rec.id, rec.project, reason="its init process was gone at node start")
                with contextlib.suppress(Exception):
                    await node.close(rec.id, reason="lost" if rec.state in ("running", "paused") else "cleanup")
                cleaned += 1
            else:
                live.append(rec)
                adopted += 1
        self._sweep_leftovers({r.id for r in live})
        node.admission.recount([r for r in live if r.state in ("creating", "running", "paused")])
        return {"adopted": adopted, "cleaned": cleaned}

    def _sweep_leftovers(self, live_ids: set[str]) -> None:
        """Directories without a record (a crash between mkdir and the first save) and layer mounts nobody
        uses. (A backend's own host leftovers, such as orphaned writable layers, go in its host_reconcile.)"""
        from shoal.fsutil import remove_tree
        from shoal.host import syscalls

        node = self.node
        for entry in os.scandir(node.paths.sandboxes):
            if entry.is_symlink() and not os.path.exists(entry.path):
                # its directory was on the node's tmpfs, gone with a reboot
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
            elif entry.is_dir() and not (Path(entry.path) / "record.json").exists() \
                    and time.time() - entry.stat().st_mtime > HALF_MADE_AGE_S:
                # a half-made container sandbox may have its overlay mounted
                for mp in syscalls.mounts_under(entry.path):
                    with contextlib.suppress(OSError):
                        syscalls.umount(mp, detach=True)
                if not syscalls.mounts_under(entry.path):
                    remove_tree(Path(entry.path))
        with contextlib.suppress(Exception):
            node.layer_mounts.reconcile(live_ids)

    # ---- reap ----------------------------------------------------------------------------------
    def due(self, now: float) -> list[tuple[SandboxRecord, bool]]:
        """(record, its init died) of every sandbox to close now: past its TTL, or whose init died.
        Blocking (reads every record): `reap_once` runs it in a thread."""
        out = []
        for rec in list_records(self.node.paths.sandboxes):
            expired = rec.expires_at is not None and now >= rec.expires_at
            dead = rec.state in ("running", "paused") and not self.alive(rec)
            if (expired and rec.state in ("running", "paused", "failed")) or dead:
                out.append((rec, dead))
        return out

    async def reap_once(self) -> int:
        """Close sandboxes past their TTL and sandboxes whose init died. Returns how many were closed."""
        n = 0
        # in a thread: with 2,000 sandboxes the scan took 50-480 ms on a busy host, all of it an event-loop
        # stall for every request the node was serving (a probe's exec p99 during memory bombs)
        for rec, dead in await asyncio.to_thread(self.due, time.time()):
            if self._stopping:
                break  # the node stops: the next node process reaps the rest
            if not rec.extra.get("pool"):
                if dead:
                    self.node.events.emit("lost", rec.id, rec.project, reason="its init process is gone")
                else:
                    self.node.events.emit("timeout", rec.id, rec.project, ttl_s=rec.spec.ttl_s)
            try:
                await self.node.close(rec.id, reason="lost" if dead else "timeout")
                n += 1
            except SandboxNotFound:
                pass  # closed meanwhile (by its user, or a close_all)
            except ShoalError as e:
                log.warning("reaper could not close %s: %s", rec.id, e)
        return n

    def start_reaper(self) -> None:
        """Run `reap_once` in the background every `reap_interval_s` (longer when a scan is slow)."""
        if self._reaper is None:
            self._stopping = False
            self._wake = asyncio.Event()
            self._reaper = asyncio.create_task(self._reap_loop(), name="shoal-reaper")

    async def stop_reaper(self) -> None:
        """Stop the background reaper. A close it is doing finishes first (cancelling it half-way would leave
        a half-closed sandbox for the next reconcile); the rest of its round is left to the next node."""
        if self._reaper is not None:
            self._stopping = True
            self._wake.set()
            task, self._reaper = self._reaper, None
            try:
                await asyncio.wait_for(asyncio.shield(task), STOP_WAIT_S)
            except TimeoutError:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _reap_loop(self) -> None:
        interval = self.node.config.reap_interval_s
        pause = interval
        trimmed_at = time.monotonic()
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), pause)
            if self._stopping:
                return
            t0 = time.monotonic()
            with contextlib.suppress(Exception):
                await self.reap_once()
            with contextlib.suppress(Exception):
                await self.node.heartbeat_leases()
            with contextlib.suppress(Exception):
                await self.node.finish_start_records()
            # a scan reads every record: with thousands of sandboxes, keep it under ~5% of one core
            pause = max(interval, 20 * (time.monotonic() - t0))
            with contextlib.suppress(Exception):
                await self.node.watch_store()  # may wait up to the probe timeout: not part of the scan's cost
            if time.monotonic() - trimmed_at >= HEAP_TRIM_INTERVAL_S:
                trimmed_at = time.monotonic()
                await asyncio.to_thread(heap.trim)  # the node's RSS follows its live memory (host/heap.py)
