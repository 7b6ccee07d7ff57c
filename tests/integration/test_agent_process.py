"""The real shoal-agent binary, started as a normal process, driven through AgentClient.

Nothing is built here: run `make -C agent` first (the test module is skipped otherwise).
Every test kills the agent and every process it started, whatever the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.agentproto import AgentClient
from shoal.agentproto import frames as F
from shoal.errors import (
    FileNotFound,
    InvalidRequest,
    SandboxError,
    SandboxFileError,
    ShellNotFound,
    Unauthorized,
)
from tests.waiting import async_wait_for, wait_for

REPO = Path(__file__).resolve().parents[2]
# SHOAL_AGENT_BIN (as in shoal.agentbin) lets the suite run against another build, e.g. one with
# sanitizers.
AGENT = Path(os.environ.get("SHOAL_AGENT_BIN") or REPO / "build" / "shoal-agent")

pytestmark = [
    pytest.mark.skipif(not AGENT.exists(), reason=f"{AGENT} is missing: run `make -C agent` first"),
    pytest.mark.skipif(shutil.which("bash") is None, reason="bash is needed for shells"),
    pytest.mark.timeout(120),
]


# ---------------------------------------------------------------------------- helpers


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, state) for every process."""
    out: dict[int, tuple[int, str]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                data = f.read()
        except OSError:
            continue
        rest = data[data.rfind(")") + 2 :].split()
        out[int(d)] = (int(rest[1]), rest[0])
    return out


def descendants(pid: int) -> set[int]:
    """Every live descendant of pid (by parent links)."""
    table = _proc_table()
    kids: dict[int, list[int]] = {}
    for p, (pp, _) in table.items():
        kids.setdefault(pp, []).append(p)
    found: set[int] = set()
    todo = [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            if k not in found:
                found.add(k)
                todo.append(k)
    return found


def alive(pid: int) -> bool:
    """True if pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(")") + 2] not in "ZX"


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Wait until none of pids is alive; return those still alive at the deadline (for the assertion)."""
    left = list(pids)

    def gone() -> bool:
        left[:] = [p for p in pids if alive(p)]
        return not left

    with contextlib.suppress(pytest.fail.Exception):
        wait_for(gone, timeout, what=f"processes {pids} to end")
    return left


def _comm(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/comm").read_text().strip()
    return ""


def _wchan(pid: int) -> str:
    """The kernel function a sleeping process waits in (e.g. pipe_write)."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/wchan").read_text().strip()
    return ""


async def _sleeping(client: AgentClient, arg: str | None = None) -> list[dict]:
    """The agent's `sleep` processes (those whose command line holds `arg`, when given)."""
    return [p for p in await client.ps() if p["comm"] == "sleep" and (arg is None or arg in _cmdline(p["pid"]))]


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


def rss_kib(pid: int, field: str = "VmHWM") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def assert_memory_below(pid: int, mib: int, field: str = "VmHWM") -> None:
    """Memory bound of the agent; meaningless for sanitizer builds (shadow memory), so only checked
    for the real static binary."""
    if os.environ.get("SHOAL_AGENT_BIN"):
        return
    kib = rss_kib(pid, field)
    assert kib < mib * 1024, f"agent {field} {kib} KiB >= {mib} MiB"


@dataclass
class Agent:
    proc: subprocess.Popen[bytes]
    sock: str
    dir: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def connect(self, token: str | None = None) -> AgentClient:
        return await AgentClient.connect_unix(self.sock, token=token, timeout=15)


def start_agent(
    extra: list[str] | None = None, env: dict[str, str] | None = None, prefix: list[str] | None = None
) -> Agent:
    # A short path: Unix socket names are limited to 108 bytes.
    d = Path(tempfile.mkdtemp(prefix="sa-", dir="/tmp"))
    sock = str(d / "a.sock")
    proc = subprocess.Popen(
        [*(prefix or []), str(AGENT), "--listen", sock, *(extra or [])],
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        wait_for(lambda: os.path.exists(sock) or proc.poll() is not None, 15, what="the agent's socket")
    finally:
        if not os.path.exists(sock):
            proc.kill()
    if proc.poll() is not None:
        raise RuntimeError(f"agent did not start (exit {proc.poll()})")
    return Agent(proc, sock, d)


def stop_agent(a: Agent) -> None:
    """Kill the agent and everything below it (collected first: orphans re-parent away)."""
    tree = descendants(a.pid)
    if a.proc.poll() is None:
        a.proc.send_signal(signal.SIGTERM)
        try:
            a.proc.wait(5)
        except subprocess.TimeoutExpired:
            a.proc.kill()
            a.proc.wait()
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(a.dir, ignore_errors=True)


@pytest.fixture
def agent() -> Iterator[Agent]:
    a = start_agent()
    try:
        yield a
    finally:
        stop_agent(a)


@pytest.fixture
async def client(agent: Agent) -> AsyncIterator[AgentClient]:
    c = await agent.connect()
    try:
        yield c
    finally:
        await c.close()


class RawConn:
    """A plain blocking socket speaking frames by hand, for what AgentClient never sends."""

    def __init__(self, path: str) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(10)
        self.s.connect(path)
        self.dec = F.FrameDecoder()
        self.pending: list[F.Frame] = []

    def send(self, raw: bytes) -> None:
        self.s.sendall(raw)

    def req(self, sid: int, op: str, **fields: object) -> None:
        self.send(F.encode_request(sid, op, **fields))

    def frame(self) -> F.Frame | None:
        """Next frame, or None at EOF."""
        while not self.pending:
            data = self.s.recv(1 << 16)
            if not data:
                return None
            self.pending += self.dec.feed(data)
        return self.pending.pop(0)

    def until_end(self, sid: int) -> tuple[F.Frame, bytes]:
        """Collect stream sid's output up to its RESP/ERR."""
        out = bytearray()
        while True:
            fr = self.frame()
            assert fr is not None, "connection closed before the stream ended"
            if fr.stream != sid:
                continue
            if fr.type in (F.RESP, F.ERR):
                return fr, bytes(out)
            out += fr.payload

    def close(self) -> None:
        self.s.close()


# ---------------------------------------------------------------------------- exec


async def test_exec_exit_codes_stdout_stderr(client: AgentClient) -> None:
    r = await client.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (r.exit_code, r.stdout, r.stderr, r.signal, r.timed_out) == (3, b"out\n", b"err\n", 0, False)
    assert (await client.exec(["true"])).ok
    assert (await client.exec(["false"])).exit_code == 1


async def test_exec_killed_by_signal_reports_128_plus_n(client: AgentClient) -> None:
    r = await client.exec(["sh", "-c", "kill -9 $$"])
    assert (r.exit_code, r.signal) == (137, 9)


async def test_exec_env_cwd_and_binary_output(client: AgentClient, agent: Agent) -> None:
    r = await client.exec(["sh", "-c", 'printf "%s|%s|" "$FOO" "$PWD"; printf "\\000\\377"'],
                          env={"FOO": "bar baz"}, cwd=str(agent.dir))
    assert r.stdout == f"bar baz|{agent.dir}|".encode() + b"\x00\xff"
    # The agent's own environment is inherited (PATH at least) and can be overridden.
    r = await client.exec(["sh", "-c", "echo $PATH"], env={"PATH": "/bin:/usr/bin"})
    assert r.stdout == b"/bin:/usr/bin\n"


async def test_exec_as_root_and_as_other_users(client: AgentClient) -> None:
    if os.geteuid() != 0:
        pytest.skip("switching users needs root")
    r = await client.exec(["id", "-u"])
    assert r.stdout == b"0\n"
    r = await client.exec(["sh", "-c", "id -u; id -g; id -G"], user="65534")
    assert r.stdout.split() == [b"65534", b"65534", b"65534"]
    r = await client.exec(["sh", "-c", "id -u; id -g; echo $HOME $USER"], user="nobody")
    assert r.stdout.split()[:2] == [b"65534", b"65534"]
    assert r.stdout.split()[2:] == [b"/nonexistent", b"nobody"]
    r = await client.exec(["sh", "-c", "id -u; id -g"], user="1234:4321")
    assert r.stdout.split() == [b"1234", b"4321"]
    # Supplementary groups come from /etc/group (sync's primary group is 65534, member of none).
    r = await client.exec(["id", "-G"], user="root")
    assert r.stdout.split()[0] == b"0"


async def test_exec_request_errors(client: AgentClient) -> None:
    with pytest.raises(InvalidRequest, match="cwd"):
        await client.exec(["true"], cwd="/definitely/not/here")
    with pytest.raises(InvalidRequest, match="no such user"):
        await client.exec(["true"], user="no-such-user-xyz")
    with pytest.raises(InvalidRequest, match="execvp: No such file or directory"):
        await client.exec(["/no/such/binary"])
    with pytest.raises(InvalidRequest, match="execvp"):
        await client.exec(["no-such-command-xyz"])
    with pytest.raises(InvalidRequest):
        await client.exec([])
    # The connection is still fine after errors.
    assert (await client.exec(["true"])).ok


async def test_children_get_clean_fds_signals_and_limits(client: AgentClient) -> None:
    r = await client.exec(["python3", "-c", "import os; print(sorted(int(x) for x in os.listdir('/proc/self/fd')))"])
    # 3 is listdir's own directory fd.
    assert r.stdout == b"[0, 1, 2, 3]\n"
    r = await client.exec(["grep", "-E", "^(SigBlk|SigIgn)", "/proc/self/status"])
    for line in r.stdout.decode().splitlines():
        assert set(line.split()[1]) == {"0"}, line
    soft = (await client.exec(["sh", "-c", "ulimit -n"])).stdout.strip()
    assert soft == str(__import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE)[0]).encode()


# Ignores signals 32 and 33 through the raw syscall (glibc's signal() refuses them), then
# execs the agent: some CI runners hand their children exactly this disposition.
_IGNORE_GLIBC_INTERNAL = """
import ctypes, os, sys
class KSigaction(ctypes.Structure):
    _fields_ = [("handler", ctypes.c_void_p), ("flags", ctypes.c_ulong),
                ("restorer", ctypes.c_void_p), ("mask", ctypes.c_ulong)]
ignore = KSigaction(1, 0, None, 0)  # SIG_IGN
libc = ctypes.CDLL(None, use_errno=True)
for sig in (32, 33):
    assert libc.syscall(13, sig, ctypes.byref(ignore), None, 8) == 0  # rt_sigaction
os.execvp(sys.argv[1], sys.argv[1:])
"""


@pytest.mark.parametrize(
    "prefix",
    [
        ["sh", "-c", 'trap "" INT HUP QUIT USR1; exec "$@"', "sh"],
        [sys.executable, "-c", _IGNORE_GLIBC_INTERNAL],
    ],
    ids=["posix-signals", "glibc-internal-32-33"],
)
async def test_children_reset_signals_the_agent_inherited_as_ignored(prefix: list[str]) -> None:
    a = start_agent(prefix=prefix)
    try:
        with open(f"/proc/{a.pid}/status") as f:
            assert any(line.startswith("SigIgn:") and line.split()[1] != "0" * 16 for line in f)
        c = await a.connect()
        try:
            r = await c.exec(["grep", "-E", "^(SigBlk|SigIgn)", "/proc/self/status"])
            assert [line.split()[1] for line in r.stdout.decode().splitlines()] == ["0" * 16] * 2
        finally:
            await c.close()
    finally:
        stop_agent(a)


async def test_exec_stdin_round_trip(client: AgentClient) -> None:
    data = os.urandom(3 << 20)
    r = await client.exec(["cat"], stdin=data, max_output=0)
    assert r.stdout == data
    h = await client.exec_stream(["sh", "-c", "read a; echo got:$a; cat"], stdin=True)
    await h.write_stdin(b"first\n")
    first = await h.__anext__()
    assert first.kind == "stdout" and first.data == b"got:first\n"
    await h.write_stdin(b"rest")
    await h.close_stdin()
    r = await h.wait()
    assert r.stdout == b"rest" and r.exit_code == 0


async def test_big_stdin_to_a_slow_reader_is_buffered_within_bounds(client: AgentClient, agent: Agent) -> None:
    data = os.urandom(24 << 20)
    other = asyncio.ensure_future(client.exec(["sh", "-c", "sleep 0.2; echo other"]))
    r = await client.exec(["sh", "-c", "sleep 1; sha256sum"], stdin=data, timeout=60)
    assert r.stdout.split()[0].decode() == hashlib.sha256(data).hexdigest()
    assert (await other).stdout == b"other\n"
    # 24 MiB went through, but the agent never held more than its few-MiB stdin window.
    assert_memory_below(agent.pid, 16)
    # A process that never reads its stdin: the exec still ends and the connection recovers.
    r = await client.exec(["true"], stdin=os.urandom(8 << 20), timeout=30)
    assert r.ok
    assert (await client.exec(["echo", "after"])).stdout == b"after\n"


async def test_script_without_shebang_runs_under_sh(client: AgentClient, agent: Agent) -> None:
    script = agent.dir / "noshebang"
    script.write_text("echo from-sh $1\n")
    script.chmod(0o755)
    r = await client.exec([str(script), "arg"])
    assert r.stdout == b"from-sh arg\n"


async def test_non_utf8_arguments_and_env_round_trip(client: AgentClient) -> None:
    arg = os.fsdecode(b"caf\xe9")
    r = await client.exec(["printf", "%s|%s", arg, "\u00e9"], env={"V": os.fsdecode(b"\xff")})
    assert r.stdout == b"caf\xe9|\xc3\xa9"
    r = await client.exec(["sh", "-c", 'printf %s "$V"'], env={"V": os.fsdecode(b"\xff\xfe")})
    assert r.stdout == b"\xff\xfe"


async def test_exec_without_stdin_reads_dev_null(client: AgentClient) -> None:
    r = await client.exec(["cat"], timeout=5)
    assert r.ok and r.stdout == b""


async def test_cancelled_wait_can_be_retried(client: AgentClient) -> None:
    h = await client.exec_stream(["sh", "-c", "echo early; sleep 0.5; echo late"])
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(h.wait(), 0.2)
    r = await h.wait()
    assert r.stdout == b"early\nlate\n" and r.ok


async def test_exec_stream_events_then_exit(client: AgentClient) -> None:
    h = await client.exec_stream(["sh", "-c", "echo a; sleep 0.2; echo b >&2; exit 7"])
    events = [ev async for ev in h]
    assert [(e.kind, e.data) for e in events[:-1]] == [("stdout", b"a\n"), ("stderr", b"b\n")]
    assert events[-1].kind == "exit" and events[-1].result is not None
    assert events[-1].result.exit_code == 7
    with pytest.raises(InvalidRequest):
        await (await client.exec_stream(["/nope"])).wait()


async def test_timeout_kills_the_whole_tree_but_not_the_agent(client: AgentClient, agent: Agent) -> None:
    pidfile = agent.dir / "pids"
    script = f"""
        sleep 100 & echo $! >> {pidfile}
        nohup sleep 101 > /dev/null 2>&1 & echo $! >> {pidfile}
        (sleep 102 & echo $! >> {pidfile}) # double fork: orphaned, same session
        sh -c 'trap "" TERM INT HUP; sleep 103' & echo $! >> {pidfile}
        sleep 104
    """
    r = await client.exec(["bash", "-c", script], timeout=0.5)
    assert r.timed_out and r.exit_code == 137 and r.signal == 9
    pids = [int(x) for x in pidfile.read_text().split()]
    assert len(pids) == 4
    assert wait_gone(pids) == []
    assert agent.proc.poll() is None
    assert (await client.exec(["echo", "still here"])).stdout == b"still here\n"


def _procs_mentioning(text: str) -> list[int]:
    """Processes with `text` anywhere in their command line."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{d}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(d))
    return found


def _procs_with_arg(arg: str) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if arg.encode() in f.read().split(b"\0"):
                        found.append(int(d))
            except OSError:
                pass
    return found


async def test_timeout_wins_against_a_fork_loop(client: AgentClient) -> None:
    marker = f"3600.{os.getpid()}{int(time.time() * 1000) % 100000}"
    # Forks as fast as it can (double forks: every child is orphaned at once) until killed.
    r = await client.exec(["sh", "-c", f"while :; do (sleep {marker} &); done"], timeout=0.5)
    assert r.timed_out
    left = wait_gone(_procs_with_arg(marker), 10)
    assert left == [], f"{len(left)} processes escaped the timeout"
    # none of the loop's shells is left either (one would fork new sleeps): the loop cannot come back
    await async_wait_for(lambda: not _procs_mentioning(marker), what="every process of the fork loop to end")
    assert _procs_with_arg(marker) == []


async def test_background_server_survives_and_serves_later_execs(client: AgentClient, agent: Agent) -> None:
    sock = agent.dir / "srv.sock"
    server = (
        "import socket\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"s.bind({str(sock)!r}); s.listen()\n"
        "while True:\n"
        "    c, _ = s.accept(); c.sendall(b'pong'); c.close()\n"
    )
    # the exec returns while the server it started runs on (timed out: it waited for it)
    r = await client.exec(["sh", "-c", f"python3 -c \"{server}\" > /dev/null 2>&1 &"], timeout=10)
    assert r.ok and not r.timed_out
    client_code = (
        "import socket, time\n"
        "for _ in range(200):\n"
        "    try:\n"
        f"        s = socket.socket(socket.AF_UNIX); s.connect({str(sock)!r}); break\n"
        "    except OSError: time.sleep(0.02)\n"
        "print(s.recv(10).decode())\n"
    )
    r = await client.exec(["python3", "-c", client_code], timeout=10)
    assert r.stdout == b"pong\n"


async def test_background_job_holding_the_pipes_does_not_hold_the_exec(client: AgentClient, agent: Agent) -> None:
    go = agent.dir / "go"
    # the background job holds stdout until the test creates `go`, which it does only after the exec
    # returned: an exec waiting for the pipes to close would time out instead
    r = await client.exec(["sh", "-c", f"echo started; (while [ ! -e {go} ]; do sleep 0.01; done; echo late) & exit 0"],
                          timeout=30)
    assert r.ok and not r.timed_out and r.stdout == b"started\n"
    go.touch()


async def test_output_cap_truncates_and_agent_memory_stays_bounded(client: AgentClient, agent: Agent) -> None:
    r = await client.exec(["sh", "-c", "yes | head -c 50000000; yes 2>/dev/null | head -c 3000000 >&2"],
                          max_output=1 << 20, timeout=60)
    assert r.truncated and r.ok
    assert len(r.stdout) == 1 << 20 and len(r.stderr) == 1 << 20
    assert r.stdout.startswith(b"y\ny\n")
    r = await client.exec(["head", "-c", "1000", "/dev/zero"], max_output=1000)
    assert not r.truncated and len(r.stdout) == 1000
    assert_memory_below(agent.pid, 16)


async def test_slow_client_gets_backpressure_not_agent_bloat(agent: Agent) -> None:
    total = 200 << 20
    raw = RawConn(agent.sock)
    try:
        raw.req(1, "hello", version=1)
        assert raw.until_end(1)[0].type == F.RESP
        raw.req(2, "exec", argv=["head", "-c", str(total), "/dev/zero"], max_output=0)
        # not reading: the agent must stop reading the pipe, so `head` ends up blocked writing to it
        head = await async_wait_for(lambda: [p for p in descendants(agent.pid) if _comm(p) == "head"],
                                    what="the agent to start head")
        await async_wait_for(lambda: _wchan(head[0]).endswith("pipe_write"),
                             what="head to block on a full pipe (the agent stopped reading it)")
        assert_memory_below(agent.pid, 24, "VmRSS")
        got = 0
        while True:
            fr = raw.frame()
            assert fr is not None
            if fr.type == F.STDOUT:
                assert len(fr.payload) <= F.CHUNK
                got += len(fr.payload)
            elif fr.type in (F.RESP, F.ERR):
                break
        assert fr.type == F.RESP and got == total
        assert_memory_below(agent.pid, 32)
    finally:
        raw.close()


async def test_tty_exec(client: AgentClient) -> None:
    r = await client.exec(["tty"], tty=True)
    assert re.fullmatch(rb"/dev/pts/\d+\r\n", r.stdout), r.stdout
    r = await client.exec(["stty", "size"], tty=True, rows=33, cols=101)
    assert r.stdout == b"33 101\r\n"


async def _read_until(h: object, needle: bytes, timeout: float = 10) -> bytes:
    buf = b""
    async def go() -> bytes:
        nonlocal buf
        async for ev in h:  # type: ignore[attr-defined]
            buf += ev.data
            if needle in buf:
                return buf
        raise AssertionError(f"stream ended before {needle!r}: {buf!r}")
    return await asyncio.wait_for(go(), timeout)


async def test_tty_interactive_bash_round_trip_resize_and_ctrl_c(client: AgentClient) -> None:
    h = await client.exec_stream(["bash", "--norc", "--noprofile", "-i"], tty=True, env={"PS1": "$ "})
    await h.write_stdin(b"echo $((6*7))\n")
    await _read_until(h, b"42")
    await h.resize(40, 120)
    await h.write_stdin(b"stty size\n")
    await _read_until(h, b"40 120")
    # SIGINT goes to the terminal's foreground job (sleep); bash -i survives it.
    await h.write_stdin(b"sleep 100\n")
    sleeper = await async_wait_for(lambda: _sleeping(client, "100"), what="bash to start `sleep 100`")
    await h.send_signal(signal.SIGINT)
    await h.write_stdin(b"echo status-$?\n")
    await _read_until(h, b"status-130")
    assert wait_gone([sleeper[0]["pid"]]) == [], "SIGINT did not reach the foreground job"
    await h.write_stdin(b"exit 5\n")
    r = await asyncio.wait_for(h.wait(), 10)
    assert r.exit_code == 5


async def test_tty_python_repl(client: AgentClient) -> None:
    h = await client.exec_stream(["python3", "-i", "-q"], tty=True)
    await h.write_stdin(b"print(6*7)\n")
    # Wait for the next prompt: a ^D typed while readline switches terminal modes is lost
    # by the kernel's line discipline (as it would be for a human typing that fast).
    await _read_until(h, b"42\r\n>>> ")
    await h.close_stdin()  # ^D at an empty prompt ends the REPL
    r = await asyncio.wait_for(h.wait(), 10)
    assert r.exit_code == 0


async def test_signals_reach_the_process_group(client: AgentClient) -> None:
    h = await client.exec_stream(["sh", "-c", "sleep 100 & sleep 100; echo never"])
    sleepers = await async_wait_for(lambda: _two(_sleeping(client, "100")), what="both sleeps to start")
    await h.send_signal(signal.SIGTERM)
    r = await asyncio.wait_for(h.wait(), 5)
    assert (r.exit_code, r.signal) == (143, 15)
    # the background sleep is in the group too
    assert wait_gone([p["pid"] for p in sleepers]) == []


async def _two(procs: Awaitable[list[dict]]) -> list[dict]:
    got = await procs
    return got if len(got) == 2 else []


async def test_many_concurrent_execs_on_one_connection(client: AgentClient) -> None:
    async def one(i: int) -> None:
        r = await client.exec(["sh", "-c", 'echo "$0"; echo "e$0" >&2', str(i)])
        assert (r.stdout, r.stderr, r.exit_code) == (f"{i}\n".encode(), f"e{i}\n".encode(), 0)

    await asyncio.gather(*(one(i) for i in range(200)))


async def test_no_output_is_lost_when_hundreds_of_execs_end_at_once(client: AgentClient) -> None:
    # More ready fds than one epoll_wait returns: a pipe's last bytes may still be unread when
    # the 100 ms grace after its process's exit ends. The agent must drain it, not drop it.
    async def one(i: int) -> bool:
        r = await client.exec(["sh", "-c", 'echo "$0"; echo "e$0" >&2', str(i)])
        return (r.stdout, r.stderr) == (f"{i}\n".encode(), f"e{i}\n".encode())

    for _ in range(2):
        results = await asyncio.gather(*(one(i) for i in range(500)))
        assert results.count(False) == 0


async def test_detached_exec_returns_pid_at_once(client: AgentClient, agent: Agent) -> None:
    marker, go = agent.dir / "detached", agent.dir / "go"
    # the command waits for `go`, made only once the call returned: a call waiting for it would time out
    pid = await asyncio.wait_for(client.exec_detached(
        ["sh", "-c", f"while [ ! -e {go} ]; do sleep 0.01; done; echo ok > {marker}; sleep 100"]), 30)
    assert alive(pid) and not marker.exists()
    go.touch()
    await async_wait_for(lambda: marker.exists() and marker.read_text() == "ok\n", what="the detached command's output")
    pid2 = await client.exec_detached(["sleep", "100"], timeout=0.2)
    assert wait_gone([pid2], 3) == []


async def test_closing_the_connection_does_not_kill_processes(agent: Agent) -> None:
    marker, started, go = agent.dir / "done", agent.dir / "started", agent.dir / "go"
    c = await agent.connect()
    h = await c.exec_stream(["sh", "-c", f"touch {started}; while [ ! -e {go} ]; do sleep 0.01; done; "
                                         f"echo x; echo done > {marker}"])
    await async_wait_for(started.exists, what="the command to start")
    await c.close()
    with pytest.raises(SandboxError):
        await h.wait()
    go.touch()  # only now may the command go on: it must have outlived the connection
    await async_wait_for(lambda: marker.exists() and marker.read_text() == "done\n",
                         what="the command to finish after its connection closed")
    c2 = await agent.connect()
    try:
        assert (await c2.exec(["true"])).ok
    finally:
        await c2.close()


async def test_agent_death_fails_pending_requests_promptly(agent: Agent) -> None:
    c = await agent.connect()
    orphans: set[int] = set()
    try:
        pending = asyncio.ensure_future(c.exec(["sleep", "100"]))
        # re-parented away once the agent dies: collected now, killed at the end
        orphans = await async_wait_for(lambda: descendants(agent.pid), what="the agent to start sleep")
        os.kill(agent.pid, signal.SIGKILL)
        with pytest.raises(SandboxError, match="connection lost"):
            await asyncio.wait_for(pending, 3)
        with pytest.raises(SandboxError):
            await c.exec(["true"])
    finally:
        await c.close()
        for p in orphans:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)


async def test_sigterm_kills_everything_and_exits_0(agent: Agent) -> None:
    c = await agent.connect()
    try:
        pid = await c.exec_detached(["sleep", "100"])
        sh = await c.shell_open()
        r = await c.shell_run(sh, "sleep 100 & echo $!")
        bg = int(r.stdout)
    finally:
        await c.close()
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.proc.wait(5) == 0
    assert wait_gone([pid, bg]) == []
    assert not os.path.exists(agent.sock)


async def test_zombies_are_reaped(client: AgentClient, agent: Agent) -> None:
    # Orphans (the double-forked children) re-parent to the agent, which must reap them.
    await asyncio.gather(*(client.exec(["sh", "-c", "(true &) ; (sleep 0.05 &) ; true"]) for _ in range(100)))
    # every orphan ends within 50 ms; then none may stay as the agent's child (alive or zombie)
    await async_wait_for(lambda: not [p for p, (pp, _st) in _proc_table().items() if pp == agent.pid],
                         what="the agent to reap every orphan")


async def test_ps_lists_processes(client: AgentClient) -> None:
    h = await client.exec_stream(["sleep", "5"])
    await async_wait_for(lambda: _sleeping(client), what="ps to list the running sleep")
    procs = await client.ps()
    assert all({"pid", "ppid", "comm", "state"} <= p.keys() for p in procs)
    await h.send_signal(signal.SIGKILL)
    await h.wait()


# ---------------------------------------------------------------------------- shells


async def test_shell_state_persists(client: AgentClient, agent: Agent) -> None:
    sh = await client.shell_open(cwd=str(agent.dir), env={"GREETING": "hi"})
    (agent.dir / "venv" / "bin").mkdir(parents=True)
    (agent.dir / "venv" / "bin" / "activate").write_text(
        'export VIRTUAL_ENV=/fake/venv\nexport PATH="$VIRTUAL_ENV/bin:$PATH"\ndeactivate() { unset VIRTUAL_ENV; }\n'
    )
    for cmd in [
        "cd /tmp",
        "export X=42; Y=local",
        "greet() { echo \"$GREETING $1\"; }",
        "alias ll='echo aliased'",
        f"source {agent.dir}/venv/bin/activate",
    ]:
        r = await client.shell_run(sh, cmd)
        assert r.exit_code == 0 and r.alive, (cmd, r)
    r = await client.shell_run(sh, 'pwd; echo $X $Y; greet world; ll; echo $VIRTUAL_ENV; type -t deactivate')
    assert r.stdout == b"/tmp\n42 local\nhi world\naliased\n/fake/venv\nfunction\n"
    r = await client.shell_run(sh, "false")
    assert r.exit_code == 1 and r.alive
    r = await client.shell_run(sh, "echo to-stderr >&2; (exit 9)")
    assert (r.stderr, r.exit_code) == (b"to-stderr\n", 9)
    await client.shell_close(sh)


async def test_shell_cannot_be_confused_by_output(client: AgentClient) -> None:
    sh = await client.shell_open()
    # Status-looking text on stdout/stderr, writes to the (closed) fds 3 and 4, NUL bytes,
    # and the nonce itself printed: none of it may end the command early.
    cmd = (
        'printf "%s 0\\n" "$__shoal_nonce"; printf "%s 0\\n" "$__shoal_nonce" >&2; '
        "echo 0 >&4; echo 'x' >&3; printf 'deadbeef 0\\n\\0\\0'; "
        "sleep 0.3; echo after"
    )
    r = await client.shell_run(sh, cmd)
    assert r.stdout.endswith(b"after\n") and r.alive  # the fake end markers did not end the command
    assert b"Bad file descriptor" in r.stderr
    r = await client.shell_run(sh, "ls /proc/$BASHPID/fd | sort -n | head -5; python3 -c "
                               "\"import os; print(sorted(int(x) for x in os.listdir('/proc/self/fd')))\"")
    # A command's processes see only 0, 1, 2 (and listdir's own fd).
    assert r.stdout.splitlines()[-1] == b"[0, 1, 2, 3]"
    r = await client.shell_run(sh, "echo next")
    assert r.stdout == b"next\n"
    await client.shell_close(sh)


async def test_shell_timeout_interrupts_command_and_shell_lives(client: AgentClient) -> None:
    sh = await client.shell_open()
    r = await client.shell_run(sh, "export KEEP=1; sleep 300 & echo $!")
    bg = int(r.stdout)
    r = await client.shell_run(sh, "sleep 100", timeout=0.3)
    assert r.timed_out and r.exit_code == 130 and r.alive
    # An INT-ignoring command is SIGKILLed a second later.
    r = await client.shell_run(sh, "trap '' INT; sleep 100", timeout=0.3)
    assert r.timed_out and r.exit_code == 137 and r.alive
    r = await client.shell_run(sh, "echo $KEEP")
    assert r.stdout == b"1\n"
    assert alive(bg), "a background job of an earlier command must survive a later timeout"
    await client.shell_close(sh)
    assert wait_gone([bg]) == []


async def test_shell_busy_loop_in_bash_itself_ends_the_shell(client: AgentClient) -> None:
    sh = await client.shell_open()
    r = await client.shell_run(sh, "while :; do :; done", timeout=0.2)
    assert r.timed_out and not r.alive
    with pytest.raises(ShellNotFound):
        await client.shell_run(sh, "true")


async def test_shell_exit_reports_dead_shell(client: AgentClient) -> None:
    sh = await client.shell_open()
    r = await client.shell_run(sh, "echo bye; exit 3")
    assert (r.stdout, r.exit_code, r.alive) == (b"bye\n", 3, False)
    with pytest.raises(ShellNotFound):
        await client.shell_run(sh, "true")
    sh = await client.shell_open()
    r = await client.shell_run(sh, "set -e; false; echo unreachable")
    assert not r.alive and r.stdout == b""
    sh = await client.shell_open()
    r = await client.shell_run(sh, "exec sh -c 'exit 4'")
    assert (r.exit_code, r.alive) == (4, False)


async def test_two_shells_at_once_and_busy(client: AgentClient, agent: Agent) -> None:
    a, b = await client.shell_open(), await client.shell_open()
    assert a != b
    d = agent.dir
    # each command waits for the other's file: they finish only if both run at the same time
    ra, rb = await asyncio.wait_for(asyncio.gather(
        client.shell_run(a, f"touch {d}/A; while [ ! -e {d}/B ]; do sleep 0.01; done; echo a", timeout=30),
        client.shell_run(b, f"touch {d}/B; while [ ! -e {d}/A ]; do sleep 0.01; done; echo b", timeout=30)), 60)
    assert (ra.stdout, rb.stdout) == (b"a\n", b"b\n") and not (ra.timed_out or rb.timed_out)
    first = asyncio.ensure_future(client.shell_run(a, f"touch {d}/S; while [ ! -e {d}/G ]; do sleep 0.01; done"))
    await async_wait_for((d / "S").exists, what="the first command to run in shell a")
    with pytest.raises(InvalidRequest, match="busy"):
        await client.shell_run(a, "true")
    (d / "G").touch()
    assert (await first).ok
    await client.shell_close(a)
    await client.shell_close(b)
    with pytest.raises(ShellNotFound):
        await client.shell_close(a)


async def test_shell_output_cap_signal_and_user(client: AgentClient) -> None:
    sh = await client.shell_open(user="65534" if os.geteuid() == 0 else None)
    r = await client.shell_run(sh, "head -c 100000 /dev/zero; echo done >&2", max_output=1000)
    assert r.truncated and len(r.stdout) == 1000 and r.stderr == b"done\n"
    if os.geteuid() == 0:
        assert (await client.shell_run(sh, "id -u")).stdout == b"65534\n"
    h = await client.shell_run_stream(sh, "sleep 100; echo rc=$?")
    await async_wait_for(lambda: _sleeping(client, "100"), what="the shell to start sleep")
    await h.send_signal(signal.SIGTERM)
    r = await asyncio.wait_for(h.wait(), 5)
    assert r.stdout == b"rc=143\n" and r.alive


async def test_shell_survives_client_reconnect(agent: Agent) -> None:
    c1 = await agent.connect()
    sh = await c1.shell_open()
    await c1.shell_run(sh, "export SURVIVOR=yes")
    await c1.close()
    c2 = await agent.connect()
    try:
        assert (await c2.shell_run(sh, "echo $SURVIVOR")).stdout == b"yes\n"
    finally:
        await c2.close()


async def test_long_command_text(client: AgentClient) -> None:
    sh = await client.shell_open()
    body = "x" * 300_000
    r = await client.shell_run(sh, f"v='{body}'; echo ${{#v}}")
    assert r.stdout == b"300000\n"


# ---------------------------------------------------------------------------- files


async def test_file_round_trip_5mib(client: AgentClient, agent: Agent) -> None:
    data = os.urandom(5 << 20)
    path = str(agent.dir / "sub" / "dir" / "blob.bin")
    assert await client.write_file(path, data) == len(data)
    assert await client.read_file(path) == data
    assert await client.read_file(path, offset=100, limit=50) == data[100:150]
    assert Path(path).read_bytes() == data


async def test_file_errors(client: AgentClient, agent: Agent) -> None:
    with pytest.raises(FileNotFound):
        await client.read_file(str(agent.dir / "missing"))
    with pytest.raises(SandboxFileError, match="directory"):
        await client.read_file(str(agent.dir))
    with pytest.raises(InvalidRequest):
        await client.read_file("relative/path")
    with pytest.raises(SandboxFileError):
        await client.write_file(str(agent.dir), b"x")
    with pytest.raises(FileNotFound):
        await client.write_file(str(agent.dir / "nodir" / "f"), b"x", mkdirs=False)
    with pytest.raises(FileNotFound):
        await client.stat(str(agent.dir / "missing"))
    with pytest.raises(FileNotFound):
        await client.remove(str(agent.dir / "missing"))
    (agent.dir / "full").mkdir()
    (agent.dir / "full" / "f").write_text("x")
    with pytest.raises(SandboxFileError):
        await client.remove(str(agent.dir / "full"))
    with pytest.raises(SandboxFileError):
        await client.mkdir(str(agent.dir / "full"), parents=False)


async def test_write_file_with_a_maximal_name(client: AgentClient, agent: Agent) -> None:
    p = agent.dir / ("n" * 255)
    await client.write_file(str(p), b"long")
    assert p.read_bytes() == b"long"
    assert sorted(x.name for x in agent.dir.iterdir()) == ["a.sock", "n" * 255]


async def test_write_modes_append_and_owner(client: AgentClient, agent: Agent) -> None:
    p = agent.dir / "m.txt"
    await client.write_file(str(p), b"one\n", mode=0o600)
    assert (p.stat().st_mode & 0o777) == 0o600
    await client.write_file(str(p), b"two\n", append=True)
    assert p.read_bytes() == b"one\ntwo\n"
    if os.geteuid() == 0:
        await client.write_file(str(agent.dir / "owned" / "f"), b"x", user="65534")
        st = await client.stat(str(agent.dir / "owned" / "f"))
        assert (st["uid"], st["gid"]) == (65534, 65534)
        assert (agent.dir / "owned").stat().st_uid == 65534
    await client.write_file(str(p), b"")
    assert p.read_bytes() == b""


async def test_write_is_atomic_when_the_client_disconnects_mid_upload(agent: Agent) -> None:
    target = agent.dir / "atomic.txt"
    target.write_bytes(b"old content")
    raw = RawConn(agent.sock)
    raw.req(1, "hello", version=1)
    raw.until_end(1)
    raw.req(2, "write_file", path=str(target))
    raw.send(F.encode_frame(F.DATA, 2, b"new" * 100_000))
    raw.req(3, "stat", path=str(target))
    raw.until_end(3)  # the agent has processed the DATA frame by now
    assert len(list(agent.dir.iterdir())) == 3  # a.sock, target, the temporary file
    raw.close()
    c = await agent.connect()  # the agent is alive and has handled the disconnect
    try:
        await async_wait_for(lambda: sorted(x.name for x in agent.dir.iterdir()) == ["a.sock", "atomic.txt"],
                             what="the agent to remove the partial file of the dropped connection")
        assert target.read_bytes() == b"old content"
    finally:
        await c.close()


async def test_list_dir_stat_mkdir_remove(client: AgentClient, agent: Agent) -> None:
    d = agent.dir / "tree"
    await client.mkdir(str(d / "a" / "b"))
    await client.write_file(str(d / "f.txt"), b"hello")
    os.symlink("/etc/passwd", d / "link")
    os.mkfifo(d / "fifo")
    weird = os.fsdecode(b"bad\xffname")
    await client.write_file(str(d) + "/" + weird, b"w")
    entries = await client.list_dir(str(d))
    assert [e.name for e in entries] == sorted(["a", "f.txt", "link", "fifo", weird])
    kinds = {e.name: e.type for e in entries}
    assert kinds == {"a": "dir", "f.txt": "file", "link": "symlink", "fifo": "other", weird: "file"}
    f = next(e for e in entries if e.name == "f.txt")
    assert f.size == 5 and f.mode == 0o644 and abs(f.mtime - time.time()) < 60
    assert os.path.exists(os.fsencode(str(d)) + b"/bad\xffname")
    st = await client.stat(str(d / "link"))
    assert st["type"] == "symlink"
    assert (await client.stat(str(d / "a")))["type"] == "dir"
    assert len(await client.list_dir(str(d), limit=2)) == 2
    with pytest.raises(SandboxFileError):
        await client.list_dir(str(d / "f.txt"))
    await client.remove(str(d / "f.txt"))
    await client.remove(str(d / "a" / "b"))
    (d / "a" / "deep" / "er").mkdir(parents=True)
    (d / "a" / "deep" / "er" / "x").write_text("x")
    os.symlink("/etc", d / "a" / "deep" / "etc-link")  # must not be followed
    await client.remove(str(d), recursive=True)
    assert not d.exists() and os.path.exists("/etc/passwd")
    await client.sync()


async def test_read_file_on_fifo_does_not_hang(client: AgentClient, agent: Agent) -> None:
    os.mkfifo(agent.dir / "p")
    with pytest.raises(SandboxFileError):
        await asyncio.wait_for(client.read_file(str(agent.dir / "p")), 3)


# ---------------------------------------------------------------------------- protocol


def test_token_auth() -> None:
    d = Path(tempfile.mkdtemp(prefix="sa-tok-", dir="/tmp"))
    tok = d / "token"
    tok.write_text("s3cret-token\n")
    a = start_agent(["--token-file", str(tok)])
    try:
        wait_for(lambda: not tok.exists(), what="the agent to unlink its token file")

        async def go() -> None:
            with pytest.raises(Unauthorized):
                await a.connect()
            with pytest.raises(Unauthorized):
                await a.connect(token="wrong")
            raw = RawConn(a.sock)
            raw.req(1, "exec", argv=["true"])
            fr, _ = raw.until_end(1)
            assert fr.type == F.ERR and F.decode_json(fr.payload)["code"] == "unauthorized"
            raw.close()
            c = await a.connect(token="s3cret-token")
            try:
                assert (await c.exec(["echo", "ok"])).stdout == b"ok\n"
            finally:
                await c.close()

        asyncio.run(go())
    finally:
        stop_agent(a)
        shutil.rmtree(d, ignore_errors=True)


async def test_malformed_frames(agent: Agent) -> None:
    raw = RawConn(agent.sock)
    raw.send(F.encode_frame(F.REQ, 1, b"{not json"))
    fr, _ = raw.until_end(1)
    assert fr.type == F.ERR and F.decode_json(fr.payload)["code"] == "bad_request"
    raw.send(F.encode_frame(F.REQ, 2, b'{"op":"frobnicate"}'))
    fr, _ = raw.until_end(2)
    assert F.decode_json(fr.payload)["code"] == "unknown_op"
    raw.send(F.encode_frame(F.REQ, 3, b'{"op":"exec","argv":"true"}'))
    fr, _ = raw.until_end(3)
    assert F.decode_json(fr.payload)["code"] == "bad_request"
    raw.send(F.encode_frame(F.REQ, 4, b"[1,2,3]"))
    assert F.decode_json(raw.until_end(4)[0].payload)["code"] == "bad_request"
    raw.send(F.encode_frame(F.REQ, 0, b'{"op":"hello"}'))
    assert F.decode_json(raw.until_end(0)[0].payload)["code"] == "bad_request"
    # Frames for streams that do not exist are ignored.
    raw.send(F.encode_frame(F.STDIN, 77, b"x") + F.encode_frame(F.DATA_END, 78) + F.encode_frame(0x7F, 1, b""))
    raw.req(5, "hello")
    assert raw.until_end(5)[0].type == F.RESP
    # An oversized length: ERR on stream 0, then the agent closes the connection.
    raw.send(struct.pack(">IBI", F.MAX_PAYLOAD + 6, F.REQ, 6))
    fr = raw.frame()
    assert fr is not None and fr.type == F.ERR and fr.stream == 0
    assert raw.frame() is None
    raw.close()
    # Random garbage: closed or answered, never a crash.
    for seed in range(5):
        raw = RawConn(agent.sock)
        raw.send(os.urandom(4096 + seed))
        raw.s.shutdown(socket.SHUT_WR)
        while raw.frame() is not None:
            pass
        raw.close()
    assert agent.proc.poll() is None
    c = await agent.connect()
    try:
        assert (await c.exec(["true"])).ok
    finally:
        await c.close()


async def test_connect_stream_and_concurrent_clients(agent: Agent) -> None:
    reader, writer = await asyncio.open_unix_connection(agent.sock)
    c1 = await AgentClient.connect_stream(reader, writer)
    c2 = await agent.connect()
    try:
        r1, r2 = await asyncio.gather(c1.exec(["echo", "1"]), c2.exec(["echo", "2"]))
        assert (r1.stdout, r2.stdout) == (b"1\n", b"2\n")
    finally:
        await c1.close()
        await c2.close()


async def _hello_until_answered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                dec: F.FrameDecoder) -> None:
    sid = 100
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        sid += 1
        writer.write(F.encode_request(sid, "hello", version=1))
        with contextlib.suppress(TimeoutError):
            while True:
                for fr in dec.feed(await asyncio.wait_for(reader.read(4096), 0.5)):
                    if fr.type == F.RESP:
                        return
    pytest.fail("the agent answered no hello on the serial line after a framing error")


async def test_serial_mode_over_a_pty(tmp_path: Path) -> None:
    """--serial: one byte stream (here a PTY pair standing in for a virtio-serial port)."""
    master, slave = os.openpty()
    name = os.ttyname(slave)
    proc = subprocess.Popen([str(AGENT), "--serial", name], start_new_session=True)
    a = Agent(proc, "", tmp_path)
    try:
        # Our slave fd stays open: a PTY master reads EIO whenever no slave is open, and the
        # agent opens its own only once it has started.
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        rfile = os.fdopen(os.dup(master), "rb", buffering=0)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), rfile)
        wfile = os.fdopen(os.dup(master), "wb", buffering=0)
        wt, wp = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, wfile)
        writer = asyncio.StreamWriter(wt, wp, reader, loop)
        # The agent switches the line to raw mode on open: talk once it has (echo would reflect our bytes)
        await async_wait_for(lambda: not termios.tcgetattr(slave)[3] & (termios.ICANON | termios.ECHO),
                             what="the agent to put the line in raw mode")
        # A framing error ends the logical connection but not the line: after ERR on stream 0
        # the agent drops what it had buffered, and a new hello works on the same device.
        writer.write(struct.pack(">IBI", F.MAX_PAYLOAD + 6, F.REQ, 9))
        dec = F.FrameDecoder()
        got: list[F.Frame] = []
        while not any(f.type == F.ERR and f.stream == 0 for f in got):
            got += dec.feed(await asyncio.wait_for(reader.read(4096), 5))
        # The agent drops what was unread when it saw the error, then reads again after a pause: a hello
        # sent in the instant before the drop is lost, so hello is repeated until one is answered.
        await _hello_until_answered(reader, writer, dec)
        c = await AgentClient.connect_stream(reader, writer, timeout=5)
        data = bytes(range(256)) * 64
        r = await c.exec(["cat"], stdin=data, max_output=0)
        assert r.stdout == data
        await c.close()
    finally:
        os.close(master)
        os.close(slave)
        stop_agent(a)


# The exec round trip to this agent (a host process) is a benchmark figure, not a test: `shoal bench exec`
# ("exec round trip p50, agent alone").


async def test_shell_pipe_fallback_without_memfd() -> None:
    a = start_agent(env={"SHOAL_AGENT_NO_MEMFD": "1"})
    try:
        c = await a.connect()
        try:
            sh = await c.shell_open()
            assert (await c.shell_run(sh, "X=1; echo $X")).stdout == b"1\n"
            body = "y" * 200_000
            assert (await c.shell_run(sh, f"v='{body}'; echo ${{#v}}")).stdout == b"200000\n"
            r = await c.shell_run(sh, "sleep 100", timeout=0.2)
            assert r.timed_out and r.alive
        finally:
            await c.close()
    finally:
        stop_agent(a)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
async def test_as_pid_1_of_a_pid_namespace() -> None:
    """The real thing: PID 1 reaps orphans, ignores SIGTERM from inside, dies cleanly on the host's."""
    a = start_agent(prefix=["unshare", "--fork", "--pid", "--mount-proc"])
    try:
        c = await a.connect()
        try:
            if c.agent_info["pid"] != 1:
                pytest.skip("could not become PID 1 of a new PID namespace here")
            await asyncio.gather(*(c.exec(["sh", "-c", "(sleep 0.05 &) ; true"]) for _ in range(50)))
            await c.exec(["sh", "-c", "setsid sleep 100 > /dev/null 2>&1 < /dev/null &"])
            await c.exec_detached(["sleep", "100"])

            async def settled() -> bool:  # the short-lived orphans ended and were reaped: two sleeps left
                procs = await c.ps()
                return not [p for p in procs if p["state"] == "Z"] and \
                    len([p for p in procs if p["comm"] == "sleep"]) == 2

            await async_wait_for(settled, what="PID 1 to reap every orphan (two `sleep 100` left, no zombie)")
            # Root inside the sandbox cannot stop the agent.
            r = await c.exec(["sh", "-c", "kill -TERM 1; kill -INT 1; sleep 0.2; echo alive"])
            assert r.stdout == b"alive\n"
            assert (await c.hello())["pid"] == 1
        finally:
            await c.close()
        tree = descendants(a.pid)
        assert len(tree) >= 3  # the agent and two sleeps
        agent_host_pid = next(p for p in tree if _proc_table().get(p, (0, ""))[0] == a.pid)
        os.kill(agent_host_pid, signal.SIGTERM)
        assert a.proc.wait(5) == 0  # unshare passes on the agent's exit status
        assert wait_gone(list(tree)) == []
    finally:
        stop_agent(a)


# Requests with random shapes, restricted to harmless ops (no exec, write or remove).
_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=20))
_json = st.recursive(
    _json_leaf,
    lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=20,
)
_safe_ops = st.sampled_from(["hello", "stat", "list_dir", "read_file", "ps", "shell_run", "shell_close", "nope"])
_fields = st.dictionaries(
    st.sampled_from(["path", "offset", "limit", "shell", "cmd", "timeout_ms", "token", "version", "x"]),
    _json,
    max_size=5,
)


@pytest.fixture(scope="module")
def fuzz_agent() -> Iterator[Agent]:
    a = start_agent()
    try:
        yield a
    finally:
        stop_agent(a)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    payloads=st.lists(
        st.one_of(
            st.binary(max_size=200),
            _json.map(lambda v: F.encode_json({"v": v})),
            st.builds(lambda op, f: F.encode_json({**f, "op": op}), _safe_ops, _fields),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_fuzzed_requests_get_an_answer_and_never_hurt_the_agent(
    fuzz_agent: Agent, payloads: list[bytes]
) -> None:
    raw = RawConn(fuzz_agent.sock)
    try:
        for i, p in enumerate(payloads, start=1):
            raw.send(F.encode_frame(F.REQ, i, p))
        seen = set()
        while len(seen) < len(payloads):
            fr = raw.frame()
            assert fr is not None, "the agent closed a connection that only sent well-framed requests"
            if fr.type in (F.RESP, F.ERR):
                body = F.decode_json(fr.payload)
                if fr.type == F.ERR:
                    assert isinstance(body["code"], str) and isinstance(body["message"], str)
                seen.add(fr.stream)
    finally:
        raw.close()
    assert fuzz_agent.proc.poll() is None


async def test_append_to_a_fifo_fails_instead_of_hanging(client: AgentClient, agent: Agent) -> None:
    os.mkfifo(agent.dir / "fifo")
    with pytest.raises(SandboxFileError):
        await asyncio.wait_for(client.write_file(str(agent.dir / "fifo"), b"x", append=True), 5)
    assert (await client.exec(["true"])).ok


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
async def test_hostile_etc_passwd_fifo_does_not_hang_the_agent() -> None:
    d = Path(tempfile.mkdtemp(prefix="sa-pw-", dir="/tmp"))
    os.mkfifo(d / "fifo")
    # A private mount namespace: the FIFO hides /etc/passwd for this agent only.
    wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'mount --bind {d}/fifo /etc/passwd && exec "$@"', "sh"]
    a = start_agent(prefix=wrap)
    try:
        c = await a.connect()
        try:
            r = await asyncio.wait_for(c.exec(["id", "-u"], user="12345"), 5)
            assert r.stdout == b"12345\n"
            with pytest.raises(InvalidRequest, match="no such user"):
                await asyncio.wait_for(c.exec(["true"], user="nobody"), 5)
        finally:
            await c.close()
    finally:
        stop_agent(a)
        shutil.rmtree(d, ignore_errors=True)


async def test_agent_leaks_no_fds_or_processes_after_a_mixed_workload(agent: Agent) -> None:
    def fds() -> int:
        return len(os.listdir(f"/proc/{agent.pid}/fd"))

    c = await agent.connect()
    baseline = fds() - 1  # minus this connection
    try:
        await asyncio.gather(*(c.exec(["sh", "-c", "echo x; echo y >&2"]) for _ in range(50)))
        await c.exec(["cat"], stdin=b"abc")
        await c.exec(["tty"], tty=True)
        await c.exec(["sleep", "10"], timeout=0.1)
        await c.exec(["sh", "-c", "sleep 0.3 > /dev/null 2>&1 &"])
        for bad in (["/nope"], ["true"]):
            with contextlib.suppress(Exception):
                await c.exec(bad, cwd="/nope" if bad == ["true"] else None)
        h = await c.exec_stream(["sleep", "10"], stdin=True)
        await h.send_signal(signal.SIGKILL)
        await h.wait()
        pid = await c.exec_detached(["sleep", "0.2"])
        for _ in range(3):
            sh = await c.shell_open()
            await c.shell_run(sh, "cd /tmp; echo hi")
            await c.shell_close(sh)
        sh = await c.shell_open()
        await c.shell_run(sh, "exit 0")
        await c.write_file(str(agent.dir / "f"), os.urandom(300_000))
        await c.read_file(str(agent.dir / "f"))
        with contextlib.suppress(Exception):
            await c.read_file(str(agent.dir / "missing"))
        await c.list_dir(str(agent.dir))
        await c.ps()
        raw = RawConn(agent.sock)
        raw.req(1, "write_file", path=str(agent.dir / "g"))
        raw.send(F.encode_frame(F.DATA, 1, b"partial"))
        raw.close()
        assert wait_gone([pid]) == []
    finally:
        await c.close()
    with contextlib.suppress(pytest.fail.Exception):
        await async_wait_for(lambda: fds() <= baseline, what="the agent to close the fds of ended work")
    assert fds() == baseline, os.listdir(f"/proc/{agent.pid}/fd")
    # the `sleep 0.3 &` orphan ends and must be reaped: then the agent has no child left
    await async_wait_for(lambda: not [p for p, (pp, _st) in _proc_table().items() if pp == agent.pid],
                         what="the agent to reap the orphan")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
async def test_users_and_supplementary_groups_from_the_sandboxes_own_files() -> None:
    d = Path(tempfile.mkdtemp(prefix="sa-users-", dir="/tmp"))
    (d / "passwd").write_text(
        "root:x:0:0:root:/root:/bin/sh\n"
        "# a comment line and a broken one\n"
        "broken:x:notanumber:1::/:/bin/sh\n"
        "alice:x:4242:4300:Alice:/home/alice:/bin/bash\n"
    )
    (d / "group").write_text(
        "root:x:0:\n"
        "alicegrp:x:4300:\n"
        "dev:x:5000:bob,alice\n"
        "ops:x:5001:alice\n"
        "notmine:x:5002:malice,alice2\n"
    )
    wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'mount --bind {d}/passwd /etc/passwd && mount --bind {d}/group /etc/group && exec "$@"', "sh"]
    a = start_agent(prefix=wrap)
    try:
        c = await a.connect()
        try:
            r = await c.exec(["sh", "-c", 'id -u; id -g; id -G; echo "$HOME $USER $LOGNAME"'], user="alice")
            lines = r.stdout.decode().splitlines()
            assert lines[:2] == ["4242", "4300"]
            assert sorted(lines[2].split()) == ["4300", "5000", "5001"]
            assert lines[3] == "/home/alice alice alice"
            # A uid with a passwd entry gets that user's groups too (as `docker run --user` does).
            r = await c.exec(["sh", "-c", "id -u; id -g; id -G"], user="4242")
            out = r.stdout.decode().split()
            assert out[:2] == ["4242", "4300"] and sorted(out[2:]) == ["4300", "5000", "5001"]
            r = await c.exec(["sh", "-c", "id -u; id -g; id -G"], user="4242:7")
            out = r.stdout.decode().split()
            assert out[:2] == ["4242", "7"] and sorted(out[2:]) == ["5000", "5001", "7"]
            r = await c.exec(["sh", "-c", "id -u; id -g; id -G"], user="31337")
            assert r.stdout.decode().split() == ["31337", "31337", "31337"]
            r = await c.exec(["sh", "-c", "echo $HOME"], user="alice", env={"HOME": "/custom"})
            assert r.stdout == b"/custom\n"
            with pytest.raises(InvalidRequest):
                await c.exec(["true"], user="broken")
            sh = await c.shell_open(user="alice")
            assert (await c.shell_run(sh, "id -un; pwd")).stdout == b"alice\n/\n"
        finally:
            await c.close()
    finally:
        stop_agent(a)
        shutil.rmtree(d, ignore_errors=True)
