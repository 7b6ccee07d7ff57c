"""The fncall backend on real pooled containers: languages, compile vs run errors, timeouts, isolation
between consecutive calls (files, env, processes, IPC, memory), bad input, and pool growth/recovery."""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import signal
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from shoal.backends.fncall import FncallConfig, FncallManager
from shoal.backends.fncall_pool import POOL_LABEL
from shoal.errors import BackendUnavailable, ImageNotFound, InvalidRequest, SandboxNotFound
from tests.waiting import async_wait_for

pytestmark = [pytest.mark.root, pytest.mark.asyncio(loop_scope="module")]


def pooled(node) -> list:
    from shoal.records import list_records

    # this process's pools only: the session's API server (another process) keeps its own warm
    return [r for r in list_records(node.paths.sandboxes) if POOL_LABEL in r.labels and r.owner_pid == os.getpid()]


async def close_leaks(node) -> list[str]:
    """Close pooled sandboxes that are still there (so a failing test leaves the host clean); return them."""
    leaked = [r.id for r in pooled(node)]
    for sid in leaked:
        try:
            await node.close(sid)
        except SandboxNotFound:
            pass
    return leaked


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node(shoal_home, base_image) -> AsyncIterator:
    from shoal.node.node import Node

    n = Node()
    await n.start(reap=False)
    yield n
    await n.stop()
    assert await close_leaks(n) == [], "pooled containers outlived the node"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fncall_image(node) -> str:
    """The image with gcc/g++ (built once per store, ~30 s, when missing)."""
    from shoal.backends.fncall_image import ensure_fncall_image

    return await ensure_fncall_image(node)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fn(node, fncall_image) -> AsyncIterator[FncallManager]:
    m = FncallManager(node, FncallConfig(min_idle=1, max_size=2))
    yield m
    ids = set(m.sandbox_ids())
    await m.close()
    assert not ids & {r.id for r in pooled(node)}


@pytest_asyncio.fixture(loop_scope="module")
async def solo(node) -> AsyncIterator[FncallManager]:
    """A manager whose pools have exactly one container: consecutive calls share it."""
    m = FncallManager(node, FncallConfig(min_idle=1, max_size=1))
    yield m
    await m.close()


# ---- languages ---------------------------------------------------------------------------------------------
HELLO = {
    "python": "import sys\nname = sys.stdin.read().strip()\nprint(f'hello {name}')",
    "bash": 'read name; echo "hello $name"',
    "sh": 'read name; echo "hello $name"',
    "c": '#include <stdio.h>\nint main(){char s[64]; scanf("%63s", s); printf("hello %s\\n", s); return 0;}',
    "cpp": '#include <iostream>\n#include <string>\nint main(){std::string s; std::cin >> s; '
           'std::cout << "hello " << s << std::endl;}',
}


@pytest.mark.parametrize("language", list(HELLO))
async def test_each_language_reads_stdin_and_writes_stdout(fn, language) -> None:
    r = await fn.run_code(HELLO[language], language, stdin="shoal\n", timeout=20, compile_timeout=60)
    assert r.status == "success", r
    assert r.stdout == b"hello shoal\n"
    assert r.exit_code == 0 and not r.timed_out and r.language == language
    assert (r.compile is not None) == (language in ("c", "cpp"))
    if r.compile is not None:
        assert r.compile.exit_code == 0
    assert r.duration_s > 0 and r.total_s >= r.duration_s and r.max_rss_kb > 0


async def test_python_runs_as_a_script_in_a_fresh_working_dir(fn) -> None:
    code = ("import os, sys\n"
            "print(__name__, __file__, sys.argv)\n"
            "print(os.getcwd(), sorted(os.listdir('.')), os.getuid(), os.getgid())\n"
            "print(os.environ['HOME'], os.environ.get('X'))\n"
            "import data; print(data.VALUE)\n")
    r = await fn.run_code(code, files={"data.py": "VALUE = 42\n"}, env={"X": "y"}, args=["a1"])
    assert r.status == "success", r
    lines = r.stdout.decode().splitlines()
    assert lines[0] == "__main__ /sandbox/main.py ['/sandbox/main.py', 'a1']"
    assert lines[1] == "/sandbox ['data.py', 'main.py'] 65534 65534"
    assert lines[2] == "/sandbox y"
    assert lines[3] == "42"


async def test_compile_errors_are_reported_apart_from_runtime_errors(fn) -> None:
    ce = await fn.run_code("int main( {", "c", compile_timeout=60)
    assert ce.status == "compile_error" and ce.compile is not None
    assert ce.compile.exit_code != 0 and b"error" in ce.compile.stderr
    assert ce.stdout == b"" and ce.exit_code == -1

    rt = await fn.run_code("#include <stdlib.h>\nint main(){int *p = 0; return *p;}", "c", compile_timeout=60)
    assert rt.status == "failed" and rt.compile.exit_code == 0
    assert rt.signal == signal.SIGSEGV and rt.exit_code == 128 + signal.SIGSEGV

    ex = await fn.run_code("#include <cstdlib>\nint main(){ return 3; }", "cpp", compile_timeout=60)
    assert ex.status == "failed" and ex.exit_code == 3 and ex.compile.exit_code == 0

    py = await fn.run_code("def f(:\n  pass")
    assert py.status == "failed" and b"SyntaxError" in py.stderr and py.compile is None
    tb = await fn.run_code("def f():\n    raise ValueError('boom')\nf()\n")
    assert tb.status == "failed" and tb.exit_code == 1
    err = tb.stderr.decode()
    assert err.startswith("Traceback (most recent call last):\n  File \"/sandbox/main.py\", line 3")
    assert "ValueError: boom" in err and "shoal" not in err  # the runner's own frames are not shown
    se = await fn.run_code("import sys; print('partial'); sys.exit(7)")
    assert se.status == "failed" and se.exit_code == 7 and se.stdout == b"partial\n"


# ---- timeouts, bombs and bad input ---------------------------------------------------------------------------
async def test_timeout_kills_the_whole_tree_and_the_pool_keeps_serving(fn) -> None:
    r = await fn.run_code("import subprocess, time\n"
                          "subprocess.Popen(['sleep', '1000'])\n"
                          "print('started', flush=True)\n"
                          "while True: time.sleep(0.01)\n", timeout=1.5)
    assert r.status == "timeout" and r.timed_out and r.signal == signal.SIGKILL
    assert r.stdout == b"started\n"  # output before the deadline is kept
    assert r.duration_s >= 1.4  # not cut short (a correctness bound, not a speed one)
    busy = await fn.run_code("while True: pass", timeout=1)
    assert busy.status == "timeout"
    after = await fn.run_code("print('still here')")
    assert after.status == "success" and after.stdout == b"still here\n"


async def test_fork_bomb_is_contained(solo) -> None:
    # the classic returns at once (its work goes on in the background); the worker kills all of it
    quick = await solo.run_code(":(){ :|:& };:", "bash", timeout=3)
    assert quick.status == "success", quick
    r = await solo.run_code(":(){ :|:& };:\nsleep 30", "bash", timeout=3)
    assert r.status == "timeout", r
    after = await solo.run_code(PS)
    assert after.status == "success", after
    assert after.sandbox_id == r.sandbox_id or solo.stats()["pools"][0]["died"] >= 1
    assert after.stdout.decode().split() == ["1", "dispatcher", "zygote", "self"]


async def test_memory_limit(fn) -> None:
    r = await fn.run_code("x = bytearray(600 * 2**20)\nprint('allocated')", memory_mb=256)
    assert r.status == "failed" and b"MemoryError" in r.stderr
    ok = await fn.run_code("x = bytearray(100 * 2**20)\nprint('allocated')", memory_mb=256)
    assert ok.status == "success", ok
    # several processes together can exceed what each may use: the container's own limit stops them,
    # the kernel kills a call's process (never the worker), and the pool keeps working
    hog = ("import os, time\n"
           "for _ in range(4):\n"
           "    if os.fork() == 0:\n"
           "        x = bytearray(200 * 2**20)\n"
           "        for i in range(0, len(x), 4096): x[i] = 1\n"
           "        time.sleep(5); os._exit(0)\n"
           "for _ in range(4): os.wait()\n")
    h = await fn.run_code(hog, memory_mb=256, timeout=30)
    assert h.status in ("success", "failed", "timeout")
    again = await fn.run_code("print('fine')", memory_mb=256)
    assert again.status == "success", again


async def test_a_node_that_refuses_new_containers_fails_the_call_instead_of_hanging(node) -> None:
    """Admission refuses every start (the pool's containers would commit more memory than the node
    allows): the waiting call gets that error within seconds, even while the pool keeps retrying to
    refill its min_idle workers."""
    from shoal.errors import CapacityExceeded

    m = FncallManager(node, FncallConfig(min_idle=4, max_size=8, max_memory_mb=1 << 30))
    # a commitment limit below one pool container (the default policy promises 1000x RAM)
    old_overcommit = node.config.memory_overcommit
    node.config.memory_overcommit = 64 / (os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20)
    try:
        huge = 1024
        with pytest.raises(CapacityExceeded):
            await asyncio.wait_for(m.run_code("print(1)", memory_mb=huge), 60)
    finally:
        node.config.memory_overcommit = old_overcommit
        await m.close()


async def test_bad_input_gets_clear_answers(fn) -> None:
    with pytest.raises(InvalidRequest, match="unknown language 'cobol'"):
        await fn.run_code("DISPLAY 'x'", "cobol")
    with pytest.raises(InvalidRequest, match="code is"):
        await fn.run_code("x" * (fn.config.max_code_bytes + 1))
    with pytest.raises(ImageNotFound, match="no-such-image"):
        await fn.run_code("print(1)", image="no-such-image")
    with pytest.raises(BackendUnavailable, match=r"has no g\+\+"):
        await fn.run_code("int main(){}", "cpp", image="base")
    big = await fn.run_code("import sys\nsys.stdout.write('y' * 5_000_000)\nprint('done', file=sys.stderr)",
                            max_output=1000)
    assert big.status == "success" and big.truncated and big.stdout == b"y" * 1000 and big.stderr == b"done\n"
    denied = await fn.run_code("print(1)", files={"/etc/evil": "x"})
    assert denied.status == "error" and "/etc/evil" in denied.error and "ermission" in denied.error
    nul = await fn.run_code("import sys; sys.stdout.buffer.write(bytes(range(256)))")
    assert nul.stdout == bytes(range(256))
    fetched = await fn.run_code("open('out.txt', 'w').write('result')", fetch_files=["out.txt", "missing.txt"])
    assert fetched.status == "success" and fetched.files == {"out.txt": b"result"}


async def test_run_code_many_returns_one_result_per_item_in_order(fn) -> None:
    items = ["print(1)", {"code": "exit(3)"}, {"code": "x", "language": "cobol"},
             {"code": "print(input())", "stdin": "echo"}, {"code": "echo sh", "language": "bash"},
             {"nope": 1}]
    rs = await fn.run_code_many(items, timeout=20)
    assert [r.status for r in rs] == ["success", "failed", "error", "success", "success", "error"]
    assert rs[0].stdout == b"1\n" and rs[3].stdout == b"echo\n" and rs[4].stdout == b"sh\n"
    assert "cobol" in rs[2].error and "nope" in rs[5].error
    many = await fn.run_code_many([f"print({i} * {i})" for i in range(40)])
    assert [r.stdout for r in many] == [f"{i * i}\n".encode() for i in range(40)]


# ---- isolation between consecutive calls ---------------------------------------------------------------------
# lists what a call can observe of its container: processes (named by role), and leftovers
PS = ("import os\n"
      "me = os.getpid()\n"
      "names = []\n"
      "for p in sorted(int(x) for x in os.listdir('/proc') if x.isdigit()):\n"
      "    if p == me: names.append('self'); continue\n"
      "    try: st = open(f'/proc/{p}/stat').read()\n"
      "    except OSError: continue\n"
      "    ppid = int(st[st.rfind(')') + 2:].split()[1])\n"
      "    names.append('1' if p == 1 else 'dispatcher' if ppid == 1 else 'zygote' if ppid != 0 and "
      "p == os.getppid() else f'other:{p}:{st[:60]}')\n"
      "print(' '.join(names))\n")

LEAVE_TRACES = """
import ctypes, json, os, subprocess, sys
open('/tmp/leak', 'w').write('x'); open('/var/tmp/leak', 'w').write('x'); open('/dev/shm/leak', 'w').write('x')
open('in-workdir', 'w').write('x'); os.mkdir('/tmp/dir'); open('/tmp/dir/f', 'w').write('x')
os.environ['LEAK'] = '1'; os.putenv('LEAK2', '1')
json.LEAK = 1; sys.modules['leaked_module'] = json
subprocess.Popen(['sleep', '1000'])
subprocess.Popen(['setsid', 'sleep', '1000'])
if os.fork() == 0:  # a daemon: double fork, own session, reparented away from the call
    os.setsid()
    if os.fork() == 0:
        import time
        while True: time.sleep(1)
    os._exit(0)
libc = ctypes.CDLL(None)
rt = ctypes.CDLL('librt.so.1')
print('mq', rt.mq_open(b'/leak', os.O_CREAT | os.O_RDWR, 0o600, None))
print('shm', libc.shmget(0, 4096, 0o1600))
"""

FIND_TRACES = """
import json, os, sys
left = [p for p in ('/tmp/leak', '/var/tmp/leak', '/dev/shm/leak', '/tmp/dir', 'in-workdir', '/dev/mqueue/leak')
        if os.path.exists(p)]
print('files', left, sorted(os.listdir('.')), os.listdir('/tmp'))
print('env', os.environ.get('LEAK'), os.environ.get('LEAK2'))
print('modules', hasattr(json, 'LEAK'), 'leaked_module' in sys.modules)
print('shm', open('/proc/sysvipc/shm').read().count(chr(10)))
"""


async def test_nothing_leaks_between_consecutive_calls(solo) -> None:
    first = await solo.run_code(LEAVE_TRACES)
    assert first.status == "success", first
    assert int(first.stdout.split()[-1]) >= 0 and int(first.stdout.split()[-3]) >= 0  # SysV shm and mqueue made
    second = await solo.run_code(FIND_TRACES)
    ps = await solo.run_code(PS)
    assert first.sandbox_id == second.sandbox_id == ps.sandbox_id, "the test needs one container"
    assert second.stdout.decode().splitlines() == [
        "files [] ['main.py'] []", "env None None", "modules False False", "shm 1"]
    assert ps.stdout.decode().split() == ["1", "dispatcher", "zygote", "self"]

    # the same from bash: background jobs, nohup, setsid, files in HOME
    b1 = await solo.run_code("nohup sleep 1000 >/dev/null 2>&1 &\nsetsid sleep 1000 &\n"
                             "echo x > ~/dot; echo x > /tmp/b; export LEAK=1", "bash")
    assert b1.status == "success", b1
    b2 = await solo.run_code("ls -A ~ /tmp; echo \"[$LEAK]\"", "bash")
    assert b2.stdout == b"/sandbox:\nmain.sh\n\n/tmp:\n[]\n", b2
    assert (await solo.run_code(PS)).stdout.decode().split() == ["1", "dispatcher", "zygote", "self"]


SCAN = """
import hashlib, os, re, secrets
def scan(target):
    found = False
    with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
        for line in maps:
            addr, perms = line.split()[:2]
            if not perms.startswith('rw'):
                continue
            lo, hi = (int(x, 16) for x in addr.split('-'))
            try:
                mem.seek(lo); data = mem.read(hi - lo)
            except (OSError, ValueError, OverflowError):
                continue
            for m in re.finditer(rb'[0-9a-f]{64}', data):
                if hashlib.sha256(m.group()).hexdigest() == target:
                    found = True
    return found
mine = secrets.token_hex(32)  # positive control: a secret this process does hold must be found
print(scan(hashlib.sha256(mine.encode()).hexdigest()), scan(TARGET))
"""


async def test_a_call_cannot_find_an_earlier_calls_data_in_its_memory(solo) -> None:
    secret = secrets.token_hex(32)
    # the secret travels as code, stdin and output of the first call...
    first = await solo.run_code(f"import sys\nS = '{secret}'\nprint(sys.stdin.read(), S)", stdin=secret)
    assert first.stdout.decode().split() == [secret, secret]
    # ...and the next call, in the same container, searches its whole address space for it (by hash only)
    target = hashlib.sha256(secret.encode()).hexdigest()
    second = await solo.run_code(SCAN.replace("TARGET", repr(target)), timeout=60)
    assert first.sandbox_id == second.sandbox_id
    assert second.stdout == b"True False\n", second


# ---- pool sizing and recovery --------------------------------------------------------------------------------
async def test_pool_grows_under_load_and_shrinks_when_idle(node) -> None:
    m = FncallManager(node, FncallConfig(min_idle=0, max_size=3, idle_timeout_s=0.5, keep_warm_s=1.0,
                                         maintain_interval_s=0.2))
    try:
        rs = await m.run_code_many(["import time; time.sleep(1)"] * 6)
        assert all(r.status == "success" for r in rs)
        (p,) = m.stats()["pools"]
        assert 2 <= p["started"] <= 3, p
        assert len({r.sandbox_id for r in rs}) >= 2
        await async_wait_for(lambda: not m.stats()["pools"] or m.stats()["pools"][0]["idle"] == 0,
                             what="the idle pool to shrink to nothing")
        used = {r.sandbox_id for r in rs}
        # retired containers are destroyed in the background
        await async_wait_for(lambda: not {r.id for r in pooled(node)} & used,
                             what="the retired containers to be destroyed")
    finally:
        await m.close()


def _container_pids(node, sandbox_id: str) -> dict[int, str]:
    rec = node.record(sandbox_id)
    out = {}
    for root in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/unified", "/sys/fs/cgroup"):
        path = f"{root}{rec.cgroup}/cgroup.procs"
        if os.path.exists(path):
            with open(path) as f:
                procs = f.read().split()
            for pid in procs:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    out[int(pid)] = f.read().replace(b"\0", b" ").decode(errors="replace")
            break
    return out


async def test_a_container_killed_mid_call_gives_a_clear_error_and_is_replaced(solo) -> None:
    warm = await solo.run_code("print('warm')")
    victim = warm.sandbox_id
    call = asyncio.create_task(solo.run_code("import time; time.sleep(60)", timeout=120))
    # the call runs once a third python (forked from the zygote) is up beside the dispatcher and the zygote
    await async_wait_for(lambda: len([c for c in _container_pids(solo.node, victim).values()
                                      if c.startswith("python3")]) >= 3, what="the call to run in the container")
    rec = solo.node.record(victim)
    os.kill(rec.init_pid, signal.SIGKILL)  # the whole container goes
    r = await asyncio.wait_for(call, 60)
    assert r.status == "error" and r.sandbox_id == victim
    assert "died" in r.error and "replaced" in r.error
    after = await solo.run_code("print('healed')")
    assert after.status == "success" and after.stdout == b"healed\n" and after.sandbox_id != victim
    assert solo.stats()["pools"][0]["died"] >= 1
    def record_gone() -> bool:
        try:
            solo.node.record(victim)
        except SandboxNotFound:
            return True
        return False

    # the dead container's leftovers are removed in the background
    await async_wait_for(record_gone, what="the dead container's record to be cleaned up")


async def test_a_worker_killed_while_idle_is_replaced_before_the_next_call(solo) -> None:
    warm = await solo.run_code("print('warm')")
    pids = _container_pids(solo.node, warm.sandbox_id)
    workers = [pid for pid, cmd in pids.items() if cmd.startswith("python3")]
    assert len(workers) == 2, pids  # dispatcher and zygote
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    (pool,) = solo.pools.values()
    # the agent reports the exit; the pool marks the idle worker dead (before the next call, not by it)
    await async_wait_for(lambda: all(w.dead for w in pool.idle), what="the pool to mark the killed worker dead")
    r = await solo.run_code("print('ok')")
    assert r.status == "success" and r.sandbox_id != warm.sandbox_id


async def test_closing_the_manager_closes_every_pooled_container(node) -> None:
    m = FncallManager(node, FncallConfig(min_idle=2, max_size=2))
    try:
        await m.warm("python", 2)
        await m.warm("bash", 1, memory_mb=300)
        ids = set(m.sandbox_ids())
        assert len(ids) >= 3 and ids <= {r.id for r in pooled(node)}
    finally:
        await m.close()
    assert not ids & {r.id for r in pooled(node)}


# ---- the SDK surface -----------------------------------------------------------------------------------------
async def test_client_run_code_and_run_code_many(shoal_home, base_image) -> None:
    import shoal
    from shoal.models import RunCodeResult
    from shoal.records import list_records

    async with shoal.Client() as client:
        r = await client.run_code("print(6 * 7)")
        assert isinstance(r, RunCodeResult) and r.ok and r.stdout == b"42\n"
        rs = await client.run_code_many(["print(1)", {"code": "echo 2", "language": "bash"}], timeout=20)
        assert [x.stdout for x in rs] == [b"1\n", b"2\n"]
        node = client.transport.node
    # closing the client closed its node's pools
    assert [x for x in list_records(node.paths.sandboxes)
            if POOL_LABEL in x.labels and x.owner_pid == os.getpid() and x.id == r.sandbox_id] == []

