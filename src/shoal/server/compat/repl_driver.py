"""The Python REPL driver that runs inside a sandbox for the E2B code interpreter (`run_code`).

It is sent as the `-c` program of `python3 -u` (so it must stay self-contained, standard library only) and
keeps one namespace alive between executions, like a Jupyter kernel. Protocol:

- stdin: one JSON request per line, `{"code": "...", "env": {...}}`.
- stdout/stderr: what the code prints, as it prints it (any process it starts writes there too).
- Protocol records are lines starting with RS (0x1e) + a nonce given as argv[1] (128 random bits, so code
  cannot forge one): `result`, `error`, `number_of_executions`, then `end` on stdout *and* on stderr, so
  the reader knows both streams are complete.
- SIGINT interrupts the running code (KeyboardInterrupt is reported as its error); the driver lives on.
"""

SOURCE = r'''
import ast, json, os, sys, traceback
MARK = "\x1e" + sys.argv[1]
proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8", errors="replace")
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
sys.stdin = open(os.devnull)
ns = {"__name__": "__main__", "__builtins__": __builtins__}
count = 0

def emit(obj, stream=None):
    stream = stream or sys.stdout
    sys.stdout.flush(); sys.stderr.flush()
    stream.write("\n" + MARK + json.dumps(obj) + "\n")
    stream.flush()

def run(code):
    tree = ast.parse(code, "<cell>", "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, "<cell>", "exec"), ns)
    if last is not None:
        value = eval(compile(last, "<cell>", "eval"), ns)
        if value is not None:
            ns["_"] = value
            emit({"type": "result", "text": repr(value), "is_main_result": True})

while True:
    try:
        line = proto_in.readline()
        if not line:
            break
        req = json.loads(line)
    except KeyboardInterrupt:
        continue
    count += 1
    saved = {}
    try:
        for k, v in (req.get("env") or {}).items():
            saved[k] = os.environ.get(k)
            os.environ[k] = v
        run(req.get("code") or "")
    except BaseException as e:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        try:
            emit({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": tb})
        except KeyboardInterrupt:
            pass
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    while True:
        try:
            emit({"type": "number_of_executions", "execution_count": count})
            emit({"type": "end"})
            emit({"type": "end"}, sys.stderr)
            break
        except KeyboardInterrupt:
            continue
'''
