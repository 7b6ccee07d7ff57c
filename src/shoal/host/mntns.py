"""Mount each sandbox's overlay in its own mount namespace, never in the host's.

Every new container's mount namespace starts as a copy of its parent's. With the sandboxes' overlays
mounted in the host namespace, each `crun run` copied one mount per live sandbox, then unmounted them
again after pivot_root, and crun read them all in /proc/self/mountinfo: O(live sandboxes) per create
and per close, O(n²) for a node filling up (measured: `unshare -m` took 1.7 ms with 30 host mounts and
12.4 ms with 3,030; creating the 5,000th sandbox took ~12x as long as the first).

Instead `crun run` is started through a tiny static helper (C, compiled once per SHOAL_HOME with the
host's gcc) that unshares a mount namespace from the small host one, makes it private, mounts the
overlay at the sandbox's rootfs path and execs the runtime: the container's namespace is a copy of that
small one, and the overlay lives exactly as long as the sandbox's processes (the runtime's own
namespace goes away when it exits). The host namespace keeps one mount per image layer, however many
sandboxes run. Without a C compiler (or with SHOAL_MNTNS=0) the overlay is
mounted in the host namespace as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

from shoal.config import settings

log = logging.getLogger(__name__)

SOURCE = r"""
/* shoal-mntns TARGET OPTIONS PROGRAM ARGV0 [ARGS...]: in a new private mount namespace, mount an overlay
 * with OPTIONS on TARGET, then exec PROGRAM (the OCI runtime), whose container namespace copies this one.
 * Relative paths in OPTIONS are resolved from TARGET's parent directory: the sandbox reads the option
 * string back in /proc/self/mountinfo, and relative names there say nothing about the host. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <libgen.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <unistd.h>
#include <sys/mount.h>
#include <sys/resource.h>

int main(int argc, char **argv) {
    if (argc < 5) { fputs("usage: shoal-mntns TARGET OPTIONS PROGRAM ARGV0 [ARGS...]\n", stderr); return 2; }
    if (unshare(CLONE_NEWNS) != 0) { fprintf(stderr, "unshare: %s\n", strerror(errno)); return 1; }
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) {
        fprintf(stderr, "make / private: %s\n", strerror(errno)); return 1; }
    int here = open(".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    char *t = strdup(argv[1]);
    if (!t || chdir(dirname(t)) != 0) {
        fprintf(stderr, "chdir to %s's parent: %s\n", argv[1], strerror(errno)); return 1; }
    if (mount("overlay", argv[1], "overlay", 0, argv[2]) != 0) {
        fprintf(stderr, "mount overlay on %s: %s\n", argv[1], strerror(errno)); return 1; }
    if (here < 0 || fchdir(here) != 0) { if (chdir("/") != 0) return 1; }
    /* the runtime and the sandbox run at the default priority, whatever the node agent's own */
    setpriority(PRIO_PROCESS, 0, 0);
    execv(argv[3], argv + 4);
    fprintf(stderr, "exec %s: %s\n", argv[3], strerror(errno));
    return 127;
}
"""
_built: dict[str, str | None] = {}
# A burst of first creates asks from many threads at once: one of them builds, the others wait for it.
# (Concurrent builds shared one temporary file, and a rename could publish another thread's half-linked,
# not yet executable output: EACCES at exec.)
_build_lock = threading.Lock()


def helper_binary(cache_dir: Path) -> str | None:
    """Path of the compiled helper (built on first use into `cache_dir`), or None when unavailable."""
    if not settings().mntns:
        return None
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    path = Path(cache_dir) / f"shoal-mntns-{digest}"
    key = str(path)
    if key in _built:
        return _built[key]
    with _build_lock:
        if key in _built:
            return _built[key]
        _built[key] = _build(path)
        return _built[key]


def _build(path: Path) -> str | None:
    result: str | None = None
    if path.is_file() and os.access(path, os.X_OK):
        result = str(path)
    else:
        cc = shutil.which("gcc") or shutil.which("cc")
        if cc:
            path.parent.mkdir(parents=True, exist_ok=True)
            # unique per process and thread: other node processes on this SHOAL_HOME may build it too
            tag = f"{os.getpid()}-{threading.get_ident()}"
            src = path.with_name(f"{path.name}.{tag}.c")
            tmp = path.with_name(f"{path.name}.{tag}.tmp")
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
    return result


def wrap(helper: str, target: str, options: str, program: str, argv: list[str]) -> tuple[str, list[str]]:
    """(executable, argv) that run `program` with `argv` in a fresh mount namespace holding an overlay with
    `options` on `target`."""
    return helper, ["shoal-mntns", target, options, program, *argv]
