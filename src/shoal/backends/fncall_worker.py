"""The in-container half of the fncall backend: a dispatcher and a zygote (stdlib only, Python >= 3.9).

The host starts it inside a pooled container, through the shoal agent, with the tiny bootstrap of
`fncall_zygote.py` (``python3 -I -c BOOTSTRAP ...``), which reads the zygote's source, the
configuration and this file's source from stdin, forks the zygote, then runs this file's `main`. The
process's stdin/stdout are then the channel to the host (agent STDIN/STDOUT frames), its stderr is a
diagnostic log. Two processes live in the container besides the agent:

* the **dispatcher** (this process, root) reads requests, writes the call's files, starts each step
  through the zygote, enforces the deadline, collects output and resource use, then cleans up: it
  kills every process other than PID 1 / itself / the zygote, removes the working dir, empties every
  world-writable directory of the image (/tmp, /var/tmp, /dev/shm, ...) and SysV IPC objects.
* the **zygote** (`fncall_zygote.py`, root) is forked before this file is even compiled and before
  any call data exists, imports the configured modules once and forks one child per step. It never
  sees call data — specs, code and stdin reach the child through file descriptors it passes on
  unread — so no call can find an earlier call's bytes in the memory it inherits.

Each child: own session (setsid), OOM-killer's first choice, rlimits, unprivileged uid/gid, fresh
working dir, fresh environment; a python step runs the code in the forked, pre-warmed interpreter,
any other step execs its argv.

Wire format (both directions): ``u32 header_len | header JSON | blobs``; the header's ``blobs`` lists
the byte length of each blob that follows, in order.

Never run this on a host: between calls it SIGKILLs every process it can see except PID 1 and its own.
"""

import json
import marshal
import os
import resource
import select
import shutil
import signal
import socket
import stat
import struct
import sys
import time

_U32 = struct.Struct(">I")
# the zygote's one answer per spawn (see fncall_zygote.py, which has the same struct)
_ZEXIT = struct.Struct("<ciiqqqq")
_SKIP_WALK = ("/proc", "/sys", "/dev", "/.shoal")
_READ = 1 << 16


def _log(msg):
    try:
        os.write(2, (f"fncall-worker[{os.getpid()}]: {msg}\n").encode("utf-8", "replace"))
    except OSError:
        pass


def _ms(t0):
    return round((time.monotonic() - t0) * 1000, 3)


def _cpu_s():
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# ---------------------------------------------------------------------------------------------- framing
def _read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_message(fd):
    """One message from ``fd``: (header dict, [blob bytes]) or None at EOF."""
    raw = _read_exact(fd, 4)
    if raw is None:
        return None
    (hlen,) = _U32.unpack(raw)
    hdr = json.loads(_read_exact(fd, hlen) or b"{}")
    blobs = []
    for size in hdr.get("blobs", []):
        data = _read_exact(fd, size) if size else b""
        if data is None:
            return None
        blobs.append(data)
    return hdr, blobs


def write_message(fd, hdr, blobs=()):
    """Send one message (header + blobs) on ``fd``."""
    blobs = [bytes(b) for b in blobs]
    hdr["blobs"] = [len(b) for b in blobs]
    h = json.dumps(hdr, separators=(",", ":")).encode()
    data = b"".join([_U32.pack(len(h)), h, *blobs])
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


# ---------------------------------------------------------------------------------------------- zygote
# ---------------------------------------------------------------------------------------------- dispatcher
class Dispatcher:
    """Serves the host's requests one at a time; see the module docstring."""

    def __init__(self, cfg, zygote):
        self.cfg = cfg
        self.uid = int(cfg.get("uid", 65534))
        self.gid = int(cfg.get("gid", 65534))
        self.workdir = cfg.get("workdir", "/sandbox")
        self.fsize_mb = int(cfg.get("fsize_mb", 256))
        self.kill_grace_s = float(cfg.get("kill_grace_s", 5.0))
        self.zsock, self.zpid, self.base_env, self.zygote_ready = zygote
        self.clean_dirs = {}
        self.pid = os.getpid()
        self.infra = {1, self.pid, self.zpid}
        self.devnull = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        self.zygote_vm_kb = int(self.zygote_ready.get("vm_kb", 0))
        self.ipc_fds = []
        self.children_fds = ()
        self.expect_init_children = b""
        self.procs_clean = False
        self.hard_limits = {}
        self.calls = 0

    # ---- startup
    def start(self):
        t0 = time.monotonic()
        if os.path.lexists(self.workdir) and (not os.path.isdir(self.workdir) or os.listdir(self.workdir)):
            raise RuntimeError(f"the image already has {self.workdir}; choose another fncall workdir")
        self._find_clean_dirs()
        walk_ms = (time.monotonic() - t0) * 1000
        tools = {t: shutil.which(t, path=self.base_env.get("PATH")) for t in self.cfg.get("tools", [])}
        ready = self.zygote_ready
        return {"op": "ready", "pid": self.pid, "zygote": self.zpid, "python": sys.version.split()[0],
                "tools": tools, "preloaded": ready.get("loaded", []), "preload_failed": ready.get("failed", {}),
                "clean_dirs": sorted(self.clean_dirs), "walk_ms": round(walk_ms, 1)}

    def _find_clean_dirs(self):
        """Every directory a call's uid could write to: world-writable ones (and any it owns)."""
        found = set()
        for top in ("/dev/shm", "/dev/mqueue"):
            try:
                st = os.lstat(top)
                if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o002:
                    found.add(top)
            except OSError:
                pass
        for root, dirs, _files in os.walk("/", topdown=True):
            keep = []
            for d in dirs:
                p = os.path.join(root, d)
                if p in _SKIP_WALK or p == self.workdir:
                    continue
                try:
                    st = os.lstat(p)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    continue
                if st.st_mode & 0o002 or st.st_uid == self.uid or (st.st_gid == self.gid and st.st_mode & 0o020):
                    found.add(p)  # and look inside: a writable dir the image has there is cleaned on its own
                keep.append(d)
            dirs[:] = keep
        self.clean_dirs = {d: set(os.listdir(d)) for d in sorted(found)}
        self.expect_init_children = f"{self.pid} ".encode()
        try:
            self.children_fds = (os.open("/proc/1/task/1/children", os.O_RDONLY | os.O_CLOEXEC),
                                 os.open(f"/proc/{self.zpid}/task/{self.zpid}/children", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:  # a kernel without CONFIG_PROC_CHILDREN: always scan /proc
            self.children_fds = ()
        self.ipc_fds = []
        for kind in ("shm", "msg", "sem"):
            try:
                self.ipc_fds.append((kind, os.open("/proc/sysvipc/" + kind, os.O_RDONLY | os.O_CLOEXEC)))
            except OSError:
                pass

    # ---- main loop
    def serve(self):
        while True:
            msg = read_message(0)
            if msg is None:
                return
            hdr, blobs = msg
            op = hdr.get("op")
            if op == "run":
                try:
                    out_hdr, out_blobs = self.run(hdr, blobs)
                except ZygoteGone as e:
                    out_hdr, out_blobs = {"error": f"the worker's zygote died: {e}", "dirty": True, "fatal": True}, []
                except Exception as e:  # a bug here must not take the worker down silently
                    _log(f"run failed: {e!r}")
                    out_hdr, out_blobs = {"error": f"worker error: {type(e).__name__}: {e}", "dirty": True}, []
                    self.cleanup()
                out_hdr["id"] = hdr.get("id")
                write_message(1, out_hdr, out_blobs)
                if out_hdr.get("fatal"):
                    return
            elif op == "ping":
                write_message(1, {"id": hdr.get("id"), "ok": True, "calls": self.calls,
                                  "pids": len(self._other_pids())})
            elif op == "exit":
                return
            else:
                write_message(1, {"id": hdr.get("id"), "error": f"unknown op {op!r}"})

    # ---- one call
    def run(self, req, blobs):
        self.calls += 1
        t0 = time.monotonic()
        code, stdin = blobs[0], blobs[1] if req.get("has_stdin") else None
        file_blobs = blobs[2:]
        env = dict(req.get("env") or {})  # on top of the base environment the zygote already has
        cpu0 = _cpu_s()
        max_out = int(req.get("max_output", 1 << 20))
        resp = {"steps": [], "files": [], "missing": [], "error": None, "dirty": False}
        out_blobs = []
        marks = resp["marks"] = {}
        try:
            self._fresh_workdir()
            marks["workdir"] = _ms(t0)
            err = self._write_inputs(req, code, file_blobs)
            marks["inputs"] = _ms(t0)
            if err:
                resp["error"] = err
                resp["error_code"] = "input"
            else:
                for step in req["steps"]:
                    res, out, errb = self._run_step(step, env, stdin if step.get("stdin") else None, max_out, code)
                    resp["steps"].append(res)
                    if res.get("unkillable"):
                        resp["dirty"] = True
                    out_blobs += [out, errb]
                    if res.get("spawn_error") or (step.get("name") == "compile" and
                                                  (res["exit_code"] != 0 or res["timed_out"])):
                        break
                if req.get("fetch"):
                    fetched = self._fetch(req["fetch"], int(req.get("max_fetch", 64 << 20)))
                    for path, data in fetched:
                        if data is None:
                            resp["missing"].append(path)
                        else:
                            resp["files"].append(path)
                            out_blobs.append(data)
        finally:
            marks["steps"] = _ms(t0)
            t1 = time.monotonic()
            problems = self.cleanup()
            if problems:
                resp["dirty"] = True
                resp["cleanup_problems"] = problems
            resp["clean_ms"] = round((time.monotonic() - t1) * 1000, 3)
            resp["total_ms"] = round((time.monotonic() - t0) * 1000, 3)
            resp["worker_cpu_ms"] = round((_cpu_s() - cpu0) * 1000, 3)
        return resp, out_blobs

    def _fresh_workdir(self):
        try:
            os.mkdir(self.workdir, 0o755)
        except FileExistsError:  # only after a failed cleanup
            self._remove(self.workdir)
            os.mkdir(self.workdir, 0o755)
        os.chown(self.workdir, self.uid, self.gid)

    def _as_user(self):
        os.setegid(self.gid)
        os.seteuid(self.uid)

    def _as_root(self):
        os.seteuid(0)
        os.setegid(0)

    def _path(self, p):
        return p if p.startswith("/") else os.path.join(self.workdir, p)

    def _write_inputs(self, req, code, file_blobs):
        """Write the files with the call's uid (so permissions apply as to the call), then the source."""
        items = [(f["path"], f.get("mode", 0o644), data) for f, data in zip(req.get("files") or [], file_blobs)]  # noqa: B905 (3.9)
        err = self._write_files(items) if items else None
        if err is None and req.get("source"):
            # the fresh working dir is ours: write as root, then hand the file to the call's uid
            fd = os.open(os.path.join(self.workdir, req["source"]),
                         os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                view = memoryview(code)
                while view:
                    view = view[os.write(fd, view):]
                os.fchown(fd, self.uid, self.gid)
            finally:
                os.close(fd)
        return err

    def _write_files(self, items):
        self._as_user()
        try:
            for path, mode, data in items:
                full = self._path(path)
                try:
                    parent = os.path.dirname(full)
                    if parent:
                        os.makedirs(parent, exist_ok=True)
                    fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 mode & 0o7777)
                    try:
                        view = memoryview(data)
                        while view:
                            view = view[os.write(fd, view):]
                    finally:
                        os.close(fd)
                except OSError as e:
                    return f"cannot write file {path}: {e.strerror or e}"
        finally:
            self._as_root()
        return None

    def _fetch(self, paths, max_bytes):
        out = []
        self._as_user()
        try:
            for p in paths:
                full = self._path(p)
                try:
                    fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
                except OSError:
                    out.append((p, None))
                    continue
                try:
                    st = os.fstat(fd)
                    if not stat.S_ISREG(st.st_mode) or st.st_size > max_bytes:
                        out.append((p, None))
                        continue
                    chunks, n = [], 0
                    while n <= max_bytes:
                        c = os.read(fd, 1 << 20)
                        if not c:
                            break
                        chunks.append(c)
                        n += len(c)
                    out.append((p, b"".join(chunks) if n <= max_bytes else None))
                finally:
                    os.close(fd)
        finally:
            self._as_root()
        return out

    def _limit(self, res, value):
        """(soft, hard) = value, within the current hard limit: the call can never raise it."""
        hard = self.hard_limits.get(res)
        if hard is None:
            hard = self.hard_limits[res] = resource.getrlimit(res)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        return value, value

    def _memfd(self, name, data):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def _run_step(self, step, env, stdin, max_out, code):
        """Start one step through the zygote; wait for it under its deadline; collect output."""
        timeout = float(step.get("timeout") or 10.0)
        self.procs_clean = False
        mode = step.get("mode", "exec")
        mem = int(step.get("memory_mb") or 0)
        if mem:
            extra = self.zygote_vm_kb << 10 if mode == "python" else 0  # a fork starts with the zygote's memory
            mem = self._limit(resource.RLIMIT_AS, (mem << 20) + extra)
        spec = marshal.dumps((mode, step.get("argv") or [], env, (self.uid, self.gid), self.workdir,
                              self._limit(resource.RLIMIT_CPU, int(timeout) + 2), mem or None,
                              code if mode == "python" else None, step.get("file"), step.get("args") or []))
        spec_fd = self._memfd("spec", spec)
        stdin_fd = self._memfd("stdin", stdin) if stdin is not None else os.dup(self.devnull)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(out_r, False)  # only our ends: the call's program gets ordinary blocking pipes
        os.set_blocking(err_r, False)
        res = {"name": step.get("name", "run"), "exit_code": -1, "signal": 0, "timed_out": False,
               "truncated": False, "duration_ms": 0.0, "cpu_ms": 0.0, "maxrss_kb": 0}
        bufs = {out_r: bytearray(), err_r: bytearray()}
        try:
            try:
                socket.send_fds(self.zsock, [b"S" + _U32.pack(len(spec))], [spec_fd, stdin_fd, out_w, err_w])
            finally:
                for fd in (spec_fd, stdin_fd, out_w, err_w):
                    os.close(fd)
            t0 = time.monotonic()
            deadline = t0 + timeout
            poller = select.poll()
            for fd in bufs:
                poller.register(fd, select.POLLIN)
            zfd = self.zsock.fileno()
            poller.register(zfd, select.POLLIN)
            open_fds = set(bufs)
            exited = None
            drain_deadline = 0.0
            while exited is None or open_fds:
                now = time.monotonic()
                if exited is None:
                    wait_ms = 20 if res["timed_out"] else max(0, int((deadline - now) * 1000) + 1)
                else:
                    wait_ms = max(0, int((drain_deadline - now) * 1000) + 1)
                events = poller.poll(wait_ms)
                for fd, ev in events:
                    if fd == zfd:
                        data = self.zsock.recv(64)
                        if not data:
                            raise ZygoteGone("the zygote exited during a call")
                        exited = _ZEXIT.unpack(data)
                        if exited[0] == b"E":
                            res["spawn_error"] = f"fork failed: {os.strerror(exited[2])}"
                            return res, b"", b""
                        res["duration_ms"] = round((time.monotonic() - t0) * 1000, 3)
                        poller.unregister(zfd)
                        # the main process is gone: nothing of the call may outlive it
                        self.procs_clean = self.kill_others()
                        if not self.procs_clean:
                            res["unkillable"] = True
                        drain_deadline = time.monotonic() + self.kill_grace_s
                        continue
                    self._drain(fd, bufs[fd], max_out, res)
                    if ev & (select.POLLHUP | select.POLLERR) and not ev & select.POLLIN:
                        poller.unregister(fd)
                        open_fds.discard(fd)
                now = time.monotonic()
                if exited is None and now >= deadline and not res["timed_out"]:
                    res["timed_out"] = True
                    self.kill_others()
                elif exited is not None and open_fds and now >= drain_deadline:
                    res["unkillable"] = True  # someone still holds the pipes: the worker is not clean
                    break
            _, _, status, ut, st, rss, minflt = exited
            if os.WIFSIGNALED(status):
                res["signal"] = os.WTERMSIG(status)
                res["exit_code"] = 128 + res["signal"]
            else:
                res["exit_code"] = os.WEXITSTATUS(status)
            res["cpu_ms"] = round((ut + st) / 1000.0, 3)
            res["maxrss_kb"] = rss
            res["minflt"] = minflt
            return res, bytes(bufs[out_r]), bytes(bufs[err_r])
        finally:
            os.close(out_r)
            os.close(err_r)

    @staticmethod
    def _drain(fd, buf, cap, res):
        while True:
            try:
                chunk = os.read(fd, _READ)
            except BlockingIOError:
                return
            if not chunk:
                return
            room = cap - len(buf) if cap > 0 else len(chunk)
            if room > 0:
                buf += chunk[:room]
            if len(chunk) > max(room, 0):
                res["truncated"] = True

    # ---- cleanup
    def _other_pids(self):
        # fast path: every process of a finished call is reparented to PID 1 (the agent), so when PID 1's
        # only child is this dispatcher and the zygote has no child, nothing else runs
        if self.children_fds:
            try:
                init_fd, zyg_fd = self.children_fds
                if os.pread(init_fd, 256, 0) == self.expect_init_children and not os.pread(zyg_fd, 256, 0):
                    return []
            except OSError:
                pass
        out = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                pid = int(name)
                if pid not in self.infra:
                    out.append(pid)
        return out

    def kill_others(self):
        """SIGKILL every process except PID 1, the dispatcher and the zygote; wait until they are reaped."""
        deadline = time.monotonic() + self.kill_grace_s
        pause = 0.0002
        while True:
            pids = self._other_pids()
            if not pids:
                return True
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if time.monotonic() >= deadline:
                _log(f"processes survive SIGKILL: {pids[:20]}")
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def cleanup(self):
        """Return the container to its pristine state; returns a list of problems (empty = clean)."""
        problems = []
        # after a step whose processes were all found dead, none can have started since
        if not self.procs_clean and not self.kill_others():
            problems.append("processes survived SIGKILL")
        self.procs_clean = False
        try:
            if os.path.lexists(self.workdir):
                self._remove(self.workdir)
        except OSError as e:
            problems.append(f"cannot remove {self.workdir}: {e}")
        for d, baseline in self.clean_dirs.items():
            try:
                names = os.listdir(d)
            except OSError as e:
                problems.append(f"cannot list {d}: {e}")
                continue
            for n in names:
                if n not in baseline:
                    try:
                        self._remove(os.path.join(d, n))
                    except OSError as e:
                        problems.append(f"cannot remove {d}/{n}: {e}")
        problems += self._clean_sysv_ipc()
        return problems

    @staticmethod
    def _remove(path):
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            # the common case (a few plain files) without shutil.rmtree's per-entry machinery
            try:
                with os.scandir(path) as it:
                    for e in it:
                        if e.is_dir(follow_symlinks=False):
                            raise IsADirectoryError
                        os.unlink(e.path)
                os.rmdir(path)
                return
            except OSError:
                pass
            # a call may have left a directory it made unreadable/unwritable for root-with-caps: fix modes
            def onerror(fn, p, exc):
                try:
                    os.chmod(os.path.dirname(p) or "/", 0o700)
                    os.chmod(p, 0o700)
                except OSError:
                    pass
                if os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p)
                else:
                    os.unlink(p)

            shutil.rmtree(path, onerror=onerror)
        else:
            os.unlink(path)

    def _clean_sysv_ipc(self):
        """Remove SysV shared memory, semaphores and message queues (they outlive their processes)."""
        problems = []
        kinds = []
        for kind, fd in self.ipc_fds:
            try:
                data = os.pread(fd, 1 << 16, 0)
                if data.count(b"\n") <= 1:
                    continue  # the header line only: nothing to remove (the usual case)
                parts, off = [data], len(data)
                while True:
                    more = os.pread(fd, 1 << 16, off)
                    if not more:
                        break
                    parts.append(more)
                    off += len(more)
            except OSError:
                continue
            lines = b"".join(parts).decode().splitlines()[1:]
            ids = [int(line.split()[1]) for line in lines if line.strip()]
            if ids:
                kinds.append((kind, ids))
        if not kinds:
            return problems
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        ipc_rmid = 0

        def rm(kind, ident):
            if kind == "shm":
                return libc.shmctl(ident, ipc_rmid, None)
            if kind == "msg":
                return libc.msgctl(ident, ipc_rmid, None)
            return libc.semctl(ident, 0, ipc_rmid)

        for kind, ids in kinds:
            for ident in ids:
                # only the owner may remove an object (root here lacks CAP_IPC_OWNER): be the call's uid
                self._as_user()
                try:
                    rc = rm(kind, ident)
                finally:
                    self._as_root()
                if rc != 0:
                    rc = rm(kind, ident)
                if rc != 0:
                    problems.append(f"cannot remove SysV {kind} {ident}: errno {ctypes.get_errno()}")
        return problems


class ZygoteGone(Exception):
    """The zygote died: this worker cannot start calls any more."""


def main(cfg, zygote):
    """Entry point inside the container (called by the bootstrap once the zygote runs)."""
    # stray prints must never reach the channel to the host
    sys.stdout = sys.stderr
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    d = Dispatcher(cfg, zygote)
    try:
        info = d.start()
    except Exception as e:
        write_message(1, {"op": "ready", "error": f"{type(e).__name__}: {e}"})
        sys.exit(1)
    write_message(1, info)
    try:
        d.serve()
    except ZygoteGone as e:
        _log(str(e))
    finally:
        try:
            d.zsock.send(b"Q")
        except OSError:
            pass
