"""The Python REPL driver that runs inside a sandbox for the E2B code interpreter (`run_code`).

It is sent as the `-c` program of `python3` (so it must stay self-contained, standard library only) and keeps
one namespace alive between executions, like a Jupyter kernel, with what E2B's kernel gives its users:

- Results like IPython's: the value of a last expression (`;` suppresses it) and every `display(...)` become
  `result` records with a MIME bundle per object: `text` (its repr), and from the IPython display protocol
  (`_repr_html_`, `_repr_png_`, `_repr_mimebundle_`, ...) `html`, `markdown`, `svg`, `png`, `jpeg`, `pdf`,
  `latex`, `json`, `javascript`; a pandas DataFrame adds `data` (its columns, as E2B's `e2b/data`); a dict or
  list as the last expression adds `json`. `display` is a builtin, and IPython's own `display` (when IPython is
  installed) is replaced by it, so `from IPython.display import display, HTML, Image` works.
- matplotlib: figures open at the end of a cell, or at `plt.show()`, are displayed as PNG (`text`
  `<Figure size ...>`) and closed, as IPython's inline backend does (MPLBACKEND defaults to Agg).
- Output streams as it is printed: `sys.stdout`/`sys.stderr` write whole lines (or what `flush()` pushes) as
  `stdout`/`stderr` records in the order they were written; what other processes write to fds 1 and 2 is read
  from pipes by a thread and sent the same way. Top-level `await` works.
- Errors: `name`, `value` and a traceback that starts at the cell (the driver's own frames are left out), with
  the cell's source lines (`File "<cell-N>", line L`).

Protocol. stdin: one JSON request per line, `{"id": "...", "code": "...", "env": {...}}`. stdout (a private
copy of the exec's stdout; fds 1 and 2 are pipes the driver reads): one JSON record per line, each carrying the
`id` of the request it belongs to: `number_of_executions`, then `stdout`/`stderr`/`result`/`error` in order,
then `end`. Output made between requests (a background thread or process) carries the previous request's id.
SIGINT interrupts the running code (KeyboardInterrupt is reported as its error); the driver lives on.
"""

SOURCE = r'''
import ast, base64, codecs, io, json, linecache, os, select, signal, sys, threading, time, traceback
import importlib.abc, importlib.util

# SIGINT ignored or blocked by whatever started us (both are inherited across exec) would make the cell
# uninterruptible: the driver owns its interrupts
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

_PROTO = os.dup(1)          # the channel to the server (non-inheritable: children never see it)
_LOCK = threading.Lock()
_REQ = {"id": ""}

def _after_fork():
    # a child forked while the output thread held the lock would wait for it forever
    global _LOCK
    _LOCK = threading.Lock()

os.register_at_fork(after_in_child=_after_fork)

def _json_default(o):
    item = getattr(o, "item", None)          # numpy scalars
    if callable(item):
        try:
            return item()
        except Exception:
            pass
    iso = getattr(o, "isoformat", None)      # datetimes, pandas Timestamps
    if callable(iso):
        return iso()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if isinstance(o, bytes):
        return o.decode("utf-8", "replace")
    return str(o)

def _send(obj):
    obj["id"] = _REQ["id"]
    data = (json.dumps(obj, default=_json_default) + "\n").encode("ascii")
    main = threading.current_thread() is threading.main_thread()
    # a record is never cut by an interrupt: SIGINT waits until it is written
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT}) if main else None
    try:
        with _LOCK:
            view = memoryview(data)
            while view:
                view = view[os.write(_PROTO, view):]
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

def _stream(name, text):
    if text:
        _send({"type": name, "text": text, "timestamp": time.time_ns()})

class _Binary:
    def __init__(self, text):
        self._text = text
    def write(self, b):
        self._text.write(bytes(b).decode("utf-8", "replace"))
        return len(b)
    def flush(self):
        self._text.flush()

class _Out(io.TextIOBase):
    """sys.stdout / sys.stderr: whole lines become records at once, a partial line on flush()."""
    def __init__(self, name, fd):
        self.name, self._fd, self._buf = name, fd, ""
        self.buffer = _Binary(self)
    encoding = "utf-8"
    errors = "replace"
    def writable(self):
        return True
    def isatty(self):
        return False
    def fileno(self):
        return self._fd
    def write(self, s):
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        self._buf += s
        cut = self._buf.rfind("\n") + 1
        if cut or len(self._buf) > 8192:
            cut = cut or len(self._buf)
            out, self._buf = self._buf[:cut], self._buf[cut:]
            _stream(self.name, out)
        return len(s)
    def flush(self):
        out, self._buf = self._buf, ""
        _stream(self.name, out)

class _FdReader:
    """Reads what processes write to fds 1 and 2 (pipes now) and sends it; `sync()` returns once everything
    written before the call has been sent."""
    def __init__(self):
        self.fds = {}
        for fd, name in ((1, "stdout"), (2, "stderr")):
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            os.set_blocking(r, False)
            self.fds[r] = [name, codecs.getincrementaldecoder("utf-8")("replace"), ""]
        self.wake_r, self.wake_w = os.pipe()
        self.done = threading.Event()
        threading.Thread(target=self._run, name="shoal-output", daemon=True).start()

    def _read(self, fd, final=False):
        st = self.fds[fd]
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not data:
                del self.fds[fd]
                final = True
                break
            st[2] += st[1].decode(data)
            if not final:
                break
        cut = len(st[2]) if final else st[2].rfind("\n") + 1
        out, st[2] = st[2][:cut], st[2][cut:]
        _stream(st[0], out)

    def _run(self):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        poller = select.poll()
        for fd in (*self.fds, self.wake_r):
            poller.register(fd, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self.wake_r:
                    os.read(self.wake_r, 64)
                    for r in list(self.fds):
                        self._read(r, final=True)
                    self.done.set()
                elif fd in self.fds:
                    self._read(fd)
                    if fd not in self.fds:
                        poller.unregister(fd)
                else:
                    poller.unregister(fd)

    def sync(self):
        self.done.clear()
        os.write(self.wake_w, b"s")
        self.done.wait()

# ---- display -------------------------------------------------------------------------------------
_MIME = (("_repr_html_", "html"), ("_repr_markdown_", "markdown"), ("_repr_svg_", "svg"),
         ("_repr_png_", "png"), ("_repr_jpeg_", "jpeg"), ("_repr_pdf_", "pdf"), ("_repr_latex_", "latex"),
         ("_repr_json_", "json"), ("_repr_javascript_", "javascript"))
_KEYS = {"text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
         "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
         "application/json": "json", "application/javascript": "javascript", "e2b/data": "data"}
_shown = set()

def _b64(v):
    return base64.b64encode(v).decode() if isinstance(v, (bytes, bytearray)) else v

def _text(obj):
    try:
        from IPython.lib.pretty import pretty
        return pretty(obj)
    except ImportError:
        return repr(obj)

def _figure(obj):
    mpl = sys.modules.get("matplotlib.figure")
    return mpl is not None and isinstance(obj, mpl.Figure)

def _bundle(obj):
    out = {}
    if _figure(obj):
        buf = io.BytesIO()
        obj.savefig(buf, format="png", bbox_inches="tight")
        out["png"] = base64.b64encode(buf.getvalue()).decode()
        _shown.add(id(obj))
    else:
        mb = getattr(obj, "_repr_mimebundle_", None)
        if callable(mb) and not isinstance(obj, type):
            try:
                got = mb(include=None, exclude=None)
                if isinstance(got, tuple):
                    got = got[0]
                for mime, v in (got or {}).items():
                    if mime in _KEYS:
                        out[_KEYS[mime]] = _b64(v)
                    else:
                        out.setdefault("extra", {})[mime] = _b64(v)
            except Exception:
                pass
        for meth, key in _MIME:
            if key in out:
                continue
            fn = getattr(obj, meth, None)
            if not callable(fn) or isinstance(obj, type):
                continue
            try:
                v = fn()
            except Exception:
                continue
            if isinstance(v, tuple):
                v = v[0]
            if v is not None:
                out[key] = _b64(v)
        pd = sys.modules.get("pandas")
        if pd is not None and isinstance(obj, pd.DataFrame):
            try:
                out["data"] = json.loads(json.dumps(obj.to_dict(orient="list"), default=_json_default))
            except Exception:
                pass
        if "json" not in out and isinstance(obj, (dict, list)):
            try:
                out["json"] = json.loads(json.dumps(obj, default=_json_default))
            except (TypeError, ValueError):
                pass
    if "text" not in out:
        try:
            text = _text(obj)
        except Exception as e:
            text = f"<{type(obj).__name__} object (repr failed: {e})>"
        if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
            text = text[1:-1]  # as E2B's kernel gives a string result: without its quotes
        out["text"] = text
    return out

def display(*objs, raw=False, include=None, exclude=None, metadata=None, transient=None, display_id=None,
            clear=False, **kwargs):
    """Show objects as rich results (IPython's display)."""
    for obj in objs:
        if raw and isinstance(obj, dict):
            fields = {}
            for mime, v in obj.items():
                if mime in _KEYS:
                    fields[_KEYS[mime]] = _b64(v)
                else:
                    fields.setdefault("extra", {})[mime] = _b64(v)
        else:
            fields = _bundle(obj)
        _send({"type": "result", "is_main_result": False, **fields})

def _show_figures(*args, **kwargs):
    """plt.show(), and the end of every cell: display the open figures, then close them."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for num in plt.get_fignums():
        fig = plt.figure(num)
        if id(fig) not in _shown:
            display(fig)
    plt.close("all")

class _Patch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """After IPython's display module or matplotlib.pyplot is imported, point them at the driver."""
    targets = {"IPython.core.display_functions": "display", "IPython.core.display": "display",
               "matplotlib.pyplot": "pyplot"}
    def find_spec(self, name, path, target=None):
        if name not in self.targets:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self.real = getattr(self, "real", {})
        self.real[name] = spec.loader
        spec.loader = self
        return spec
    def create_module(self, spec):
        return self.real[spec.name].create_module(spec)
    def exec_module(self, module):
        self.real[module.__name__].exec_module(module)
        if self.targets[module.__name__] == "display":
            if hasattr(module, "display"):
                module.display = display
        else:
            module.show = _show_figures

# ---- running cells -------------------------------------------------------------------------------
os.environ.setdefault("MPLBACKEND", "Agg")
sys.meta_path.insert(0, _Patch())
_reader = _FdReader()
sys.stdout, sys.stderr = _Out("stdout", 1), _Out("stderr", 2)
_proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8", errors="replace")
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
sys.stdin = open(os.devnull)
import builtins, types
builtins.display = display
# the cells run in a real __main__ module, as in IPython: functions they define pickle by reference
# (multiprocessing, joblib, concurrent.futures)
_main = types.ModuleType("__main__")
_main.__dict__.update({"__builtins__": builtins, "display": display})
sys.modules["__main__"] = _main
ns = _main.__dict__
_count = 0
_loop = None
_FLAGS = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT

def _eval(code_obj):
    global _loop
    if code_obj.co_flags & 0x80:  # CO_COROUTINE: the cell awaits at top level
        import asyncio
        if _loop is None:
            _loop = asyncio.new_event_loop()
        return _loop.run_until_complete(eval(code_obj, ns))
    return eval(code_obj, ns)

def _run(code, name):
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    tree = ast.parse(code, name, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not code.rstrip().endswith(";"):
        last = ast.Expression(tree.body.pop().value)
    _eval(compile(tree, name, "exec", flags=_FLAGS))
    if last is not None:
        value = _eval(compile(last, name, "eval", flags=_FLAGS))
        if value is not None:
            ns["_"] = value
            _send({"type": "result", "is_main_result": True, **_bundle(value)})

def _user_tb(tb):
    while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
        tb = tb.tb_next
    return tb

def _error(e):
    if isinstance(e, SyntaxError):
        lines = traceback.format_exception_only(type(e), e)
    else:
        lines = traceback.format_exception(type(e), e, _user_tb(e.__traceback__))
    _send({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": "".join(lines)})

def _finish():
    for out in (sys.stdout, sys.stderr):
        try:
            out.flush()
        except Exception:
            pass
    try:
        _show_figures()
    except Exception as e:
        _error(e)
    _reader.sync()
    _send({"type": "end"})

def _handle(req):
    global _count
    _REQ["id"] = str(req.get("id") or "")
    _count += 1
    _shown.clear()
    saved = {}
    try:
        _send({"type": "number_of_executions", "execution_count": _count})
        for k, v in (req.get("env") or {}).items():
            saved[k] = os.environ.get(k)
            os.environ[k] = v
        _run(req.get("code") or "", f"<cell-{_count}>")
    except BaseException as e:
        try:
            _error(e)
        except KeyboardInterrupt:
            pass
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        _finish()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)  # an interrupt that came meanwhile lands here

while True:
    try:
        line = _proto_in.readline()
        if not line:
            break
        req = json.loads(line)
        if isinstance(req, dict):
            _handle(req)
    except (KeyboardInterrupt, ValueError):
        continue
'''
