"""Mount each sandbox's overlay in its own mount namespace, never in the host's.

Every new container's mount namespace starts as a copy of its parent's. With the sandboxes' overlays
mounted in the host namespace, each `crun run` copied one mount per live sandbox, then unmounted them
again after pivot_root, and crun read them all in /proc/self/mountinfo: O(live sandboxes) per create
and per close, O(n²) for a node filling up (measured: `unshare -m` took 1.7 ms with 30 host mounts and
12.4 ms with 3,030; creating the 5,000th sandbox took ~12x as long as the first).

Instead a tiny static helper (C, compiled once per SHOAL_HOME with the host's gcc) unshares a mount namespace from
the small host one, makes it private, mounts the overlay at the sandbox's rootfs path and waits; the
runtime is told to *join* that namespace (OCI `linux.namespaces[mount].path`) and does its usual
setup and pivot_root there. The helper exits once the runtime returned; the namespace, and with it the
overlay, then lives exactly as long as the sandbox's processes. The host namespace keeps one mount per
image layer, however many sandboxes run. Without a C compiler (or with SHOAL_MNTNS=0) the overlay is
mounted in the host namespace as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

from shoal.errors import SandboxError

log = logging.getLogger(__name__)

SOURCE = r"""
/* shoal-mntns TARGET OPTIONS: new private mount namespace, overlay(OPTIONS) on TARGET, "ok" on stdout,
 * then wait until stdin closes (the caller's runtime joins /proc/<pid>/ns/mnt meanwhile). */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>
#include <sys/mount.h>

int main(int argc, char **argv) {
    char c;
    if (argc != 3) { fputs("usage: shoal-mntns TARGET OPTIONS\n", stderr); return 2; }
    if (unshare(CLONE_NEWNS) != 0) { fprintf(stderr, "unshare: %s\n", strerror(errno)); return 1; }
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) {
        fprintf(stderr, "make / private: %s\n", strerror(errno)); return 1; }
    if (mount("overlay", argv[1], "overlay", 0, argv[2]) != 0) {
        fprintf(stderr, "mount overlay on %s: %s\n", argv[1], strerror(errno)); return 1; }
    if (write(1, "ok\n", 3) != 3) return 1;
    while (read(0, &c, 1) > 0) {}
    return 0;
}
"""

_built: dict[str, str | None] = {}


def helper_binary(cache_dir: Path) -> str | None:
    """Path of the compiled helper (built on first use into `cache_dir`), or None when unavailable."""
    if os.environ.get("SHOAL_MNTNS", "1") == "0":
        return None
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    path = Path(cache_dir) / f"shoal-mntns-{digest}"
    key = str(path)
    if key in _built:
        return _built[key]
    result: str | None = None
    if path.is_file() and os.access(path, os.X_OK):
        result = str(path)
    else:
        cc = shutil.which("gcc") or shutil.which("cc")
        if cc:
            path.parent.mkdir(parents=True, exist_ok=True)
            src = path.with_suffix(f".{os.getpid()}.c")
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            try:
                src.write_text(SOURCE)
                r = subprocess.run([cc, "-O2", "-static", "-s", "-o", str(tmp), str(src)], capture_output=True,
                                   timeout=120)
                if r.returncode == 0:
                    os.replace(tmp, path)
                    result = str(path)
                else:
                    log.warning("cannot build the mount-namespace helper: %s", r.stderr.decode(errors="replace"))
            except (OSError, subprocess.SubprocessError) as e:
                log.warning("cannot build the mount-namespace helper: %s", e)
            finally:
                for p in (src, tmp):
                    with contextlib.suppress(OSError):
                        p.unlink()
        else:
            log.warning("no C compiler: sandbox overlays are mounted in the host mount namespace")
    _built[key] = result
    return result


class MountNamespace:
    """A helper holding a fresh mount namespace with one overlay mounted, until `release()`."""

    def __init__(self, pid: int, stdin_w: int) -> None:
        self.pid = pid
        self._stdin_w = stdin_w

    @property
    def path(self) -> str:
        """The namespace file for the OCI config (valid until release)."""
        return f"/proc/{self.pid}/ns/mnt"

    @classmethod
    async def start(cls, helper: str, target: str, options: str, timeout: float = 30.0) -> MountNamespace:
        """Spawn the helper and wait until the overlay is mounted in its namespace."""
        loop = asyncio.get_running_loop()
        in_r, in_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            pid = os.posix_spawn(helper, ["shoal-mntns", target, options], {}, file_actions=[
                (os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, out_w, 2)])
        except BaseException:
            for fd in (in_r, in_w, out_r, out_w):
                os.close(fd)
            raise
        os.close(in_r)
        os.close(out_w)
        self = cls(pid, in_w)
        buf = bytearray()
        done = loop.create_future()

        def readable() -> None:
            try:
                chunk = os.read(out_r, 4096)
            except BlockingIOError:
                return
            buf.extend(chunk)
            if (not chunk or b"\n" in buf) and not done.done():
                done.set_result(None)

        loop.add_reader(out_r, readable)
        try:
            await asyncio.wait_for(done, timeout)
        except BaseException:
            await self.release()
            raise
        finally:
            loop.remove_reader(out_r)
            os.close(out_r)
        if not buf.startswith(b"ok\n"):
            await self.release()
            raise SandboxError(f"could not mount the sandbox's root: {buf.decode(errors='replace').strip()}")
        return self

    async def release(self) -> None:
        """Let the helper exit (the namespace lives on in the sandbox's processes); it is reaped when it
        has exited, without waiting for it here."""
        if self._stdin_w < 0:
            return
        os.close(self._stdin_w)
        self._stdin_w = -1
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:
            return
        except OSError:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            return

        def reap() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)

        loop.add_reader(pidfd, reap)
