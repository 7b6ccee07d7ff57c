"""The fncall zygote: the warm interpreter every call is forked from (stdlib only, Python >= 3.9).

It is the first thing the fncall bootstrap runs in a pooled container, forked before the dispatcher's
much larger code is even compiled, so the memory every call's fork starts from — and the kernel copies
page tables of, and the call copies pages of — holds little besides the interpreter and the
configured preloaded modules. See `fncall_worker.py` for the whole design. Never run this on a host.
"""

import _socket
import marshal
import os
import resource
import signal
import struct
import sys

# the zygote's one answer per spawn: b"X", pid, wait status, utime_us, stime_us, maxrss_kb, minflt
# (or b"E", 0, errno, 0, 0, 0, 0 when fork failed); fncall_worker.py has the same struct
_ZEXIT = struct.Struct("<ciiqqqq")
_U32 = struct.Struct(">I")
_CMSG_SPACE = _socket.CMSG_SPACE(4 * 8)

#: what the host runs: ``python3 -I -c BOOTSTRAP <len(zygote source)> <len(config)> <len(worker source)>``
#: with those three blobs on stdin: the zygote is forked before the worker's code is read or compiled
BOOTSTRAP = (
    "import os,sys,marshal\n"
    "def r(n):\n"
    " b=bytearray()\n"
    " while len(b)<n:\n"
    "  c=os.read(0,n-len(b))\n"
    "  if not c:raise SystemExit(3)\n"
    "  b+=c\n"
    " return bytes(b)\n"
    "a=[int(x) for x in sys.argv[1:4]]\n"
    "z=r(a[0]);cfg=marshal.loads(r(a[1]))\n"
    "g={'__name__':'shoal_fncall_zygote'}\n"
    "exec(compile(z,'shoal-fncall-zygote','exec'),g)\n"
    "zy=g['start_zygote'](cfg)\n"
    "del z,g\n"
    "w={'__name__':'shoal_fncall_worker'}\n"
    "exec(compile(r(a[2]),'shoal-fncall-worker','exec'),w)\n"
    "w['main'](cfg,zy)\n"
)


def _refuse_outside_a_sandbox():
    try:
        with open("/proc/1/cmdline", "rb") as f:
            init = f.read()
    except OSError:
        init = b""
    if b"shoal-agent" not in init:
        sys.stderr.write("fncall worker: PID 1 is not shoal-agent; refusing to run outside a shoal sandbox\n")
        sys.exit(2)


def call_env(cfg):
    """The environment every call starts from: the image's, with HOME etc. pointing at the working dir."""
    workdir = cfg.get("workdir", "/sandbox")
    env = dict(os.environ)
    for k in ("HOSTNAME", "LD_BIND_NOW"):
        env.pop(k, None)
    env.update({"HOME": workdir, "PWD": workdir, "USER": "sandbox", "LOGNAME": "sandbox"})
    env.update(cfg.get("env") or {})
    return env


def start_zygote(cfg):
    """Fork the zygote; in this (the dispatcher's) process return (socket, zygote pid, call env, ready info)."""
    _refuse_outside_a_sandbox()
    env = call_env(cfg)
    workdir = cfg.get("workdir", "/sandbox")
    parent, child = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        parent.close()
        try:
            zygote_main(child, list(cfg.get("preload") or []), env, os.path.join(workdir, "main.py"), workdir,
                        int(cfg.get("fsize_mb", 256)))
        finally:
            os._exit(1)
    child.close()
    ready = marshal.loads(parent.recv(1 << 20) or marshal.dumps({}))
    return parent, pid, env, ready


def _recv_fds(sock):
    msg, anc, _flags, _addr = sock.recvmsg(16, _CMSG_SPACE)
    fds = []
    for level, kind, data in anc:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            n = len(data) - len(data) % 4
            fds += [int.from_bytes(data[i:i + 4], sys.byteorder, signed=True) for i in range(0, n, 4)]
    return msg, fds


def _vm_size_kb():
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def zygote_main(sock, preload, base_env, main_path, cwd, fsize_mb):
    """Import `preload`, report, then fork one child per spawn request and report its exit.

    Everything that is the same for every call is done here once, so that a child runs as little
    Python as possible — each object it touches is a page the kernel must copy: the environment is
    the calls' base environment; stdio objects for fds 0-2, `__main__`, `sys.argv` and `sys.path`
    are what a call's script sees; the file-size and core-dump limits are set.
    """
    import atexit
    import io
    import types

    devnull = os.open("/dev/null", os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    # numeric libraries start thread pools at import; a forked child would inherit locks, not threads
    for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        os.environ.setdefault(k, "1")
    loaded, failed = [], {}
    for name in preload:
        try:
            __import__(name)
            loaded.append(name)
        except BaseException as e:  # a broken module must not kill the worker
            failed[name] = f"{type(e).__name__}: {e}"
    os.environ.clear()
    os.environ.update(base_env)
    # what a call's script finds, as `python /sandbox/main.py` would give it
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding="utf-8", errors="strict")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)),
                                                   encoding="utf-8", errors="strict")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)),
                                                   encoding="utf-8", errors="backslashreplace", line_buffering=True)
    main = types.ModuleType("__main__")
    main.__file__ = main_path
    main.__cached__ = None
    main.__builtins__ = __builtins__ if isinstance(__builtins__, dict) else __builtins__.__dict__
    sys.modules["__main__"] = main
    sys.argv = [main_path]
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        prctl = None
    base_vm_kb = _vm_size_kb()
    for res, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, fsize_mb << 20)):
        hard = resource.getrlimit(res)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(res, (value, value))  # inherited by every call, never raised again
    try:
        # inherited by every child: the OOM killer takes a call's process (or, failing that, the zygote),
        # never the dispatcher. Raising needs no privilege; doing it once here saves it per call.
        fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        os.write(fd, b"1000")
        os.close(fd)
    except OSError:
        pass
    run_exitfuncs = atexit._run_exitfuncs
    # last, after every import: an import would cache "no such directory" for the (absent) working dir
    sys.path.insert(0, cwd)
    sys.path_importer_cache.pop(cwd, None)
    import gc

    gc.collect()
    # objects made so far live as long as the zygote: keep the collector from touching (un-sharing) them
    if hasattr(gc, "freeze"):
        gc.freeze()
    sock.send(marshal.dumps({"loaded": loaded, "failed": failed, "vm_kb": base_vm_kb}))
    while True:
        try:
            msg, fds = _recv_fds(sock)
        except InterruptedError:
            continue
        except OSError:
            os._exit(0)
        if not msg or msg[:1] == b"Q":
            os._exit(0)
        if msg[:1] != b"S" or len(fds) != 4 or len(msg) != 5:
            for fd in fds:
                os.close(fd)
            continue
        try:
            pid = os.fork()
        except OSError as e:
            for fd in fds:
                os.close(fd)
            sock.send(_ZEXIT.pack(b"E", 0, e.errno or 0, 0, 0, 0, 0))
            continue
        if pid == 0:
            sock.close()
            _child(fds, _U32.unpack_from(msg, 1)[0], prctl, main, run_exitfuncs)  # never returns
        for fd in fds:
            os.close(fd)
        while True:
            try:
                _, status, ru = os.wait4(pid, 0)
                break
            except InterruptedError:
                continue
            except ChildProcessError:
                status, ru = 255 << 8, None
                break
        if ru is None:
            sock.send(_ZEXIT.pack(b"X", pid, status, 0, 0, 0, 0))
        else:
            sock.send(_ZEXIT.pack(b"X", pid, status, int(ru.ru_utime * 1e6), int(ru.ru_stime * 1e6),
                                  ru.ru_maxrss, ru.ru_minflt))


# ---------------------------------------------------------------------------------------------- child
def _child(fds, spec_size, prctl, main, run_exitfuncs):
    """In the forked child: become the call's process, then exec argv or run the python code."""
    spec_fd, stdin_fd, out_fd, err_fd = fds
    try:
        os.setsid()
        # (mode, argv, env, (uid, gid), cwd, cpu limit, address-space limit, code, file, args)
        mode, argv, env, ids, cwd, cpu, mem, code, path, args = marshal.loads(os.pread(spec_fd, spec_size, 0))
        resource.setrlimit(resource.RLIMIT_CPU, cpu)
        if mem is not None:
            resource.setrlimit(resource.RLIMIT_AS, mem)
        os.setgroups(())
        os.setgid(ids[1])
        os.setuid(ids[0])
        os.chdir(cwd)
        os.dup2(stdin_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.closerange(3, 1 << 20)
        for k in env:
            os.environ[k] = env[k]
        if mode != "python":
            # Python ignores these; an exec'd program must get the defaults back (like subprocess does)
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
            try:
                os.execvp(argv[0], argv)
            except OSError as e:
                os.write(2, f"shoal: cannot execute {argv[0]}: {e.strerror}\n".encode())
                os._exit(127)
        if prctl is not None:
            # changing uid made the process non-dumpable, so /proc/self/{fd,mem,...} would belong to root;
            # a program started by that user is dumpable (exec does this for the exec'd steps)
            prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE
        if cwd in sys.path_importer_cache:
            del sys.path_importer_cache[cwd]  # made by an import in the zygote while the dir did not exist
        if path != main.__file__:
            main.__file__ = path
            sys.argv[0] = path
        if args:
            sys.argv.extend(args)
    except BaseException as e:
        try:
            os.write(err_fd, f"shoal: could not start the call: {type(e).__name__}: {e}\n".encode())
        except OSError:
            pass
        os._exit(127)
    _run_python(path, code, main, run_exitfuncs)


def _run_python(path, src, main, run_exitfuncs):
    """Run `src` as `__main__` in this (forked, warm) interpreter, exiting like `python path` would."""
    code = 0
    try:
        exec(compile(src, path, "exec"), main.__dict__)
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as e:
        tb = e.__traceback__
        # drop this runner's own frame: the traceback starts in the user's file, as `python main.py` shows
        while tb is not None and tb.tb_frame.f_code.co_filename != path and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = None
        e.__traceback__ = tb
        try:
            sys.excepthook(type(e), e, tb)
        except BaseException:
            pass
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
    code = _shutdown(code, run_exitfuncs)
    os._exit(code)


def _exit_code(value):
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    try:
        sys.stderr.write(str(value) + "\n")
    except BaseException:
        pass
    return 1


def _shutdown(code, run_exitfuncs):
    """What the interpreter does at exit: join non-daemon threads, atexit handlers, flush stdio."""
    try:
        threading = sys.modules.get("threading")
        if threading is not None and len(threading._active) > 1:
            threading._shutdown()
    except BaseException:
        pass
    try:
        run_exitfuncs()
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            code = code or 120
    return code
