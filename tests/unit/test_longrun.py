"""A node that runs for days (issue 24), the parts that need no root: idle agent connections closed and
reopened (fake backend), capacity refusals naming the resource, the node's swap decision, the swap watch's
one-inotify-descriptor path (cgroup v2), and periodic passes racing creates and closes."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

from shoal.backends.container import swap, swapwatch
from shoal.errors import CapacityExceeded, SandboxError
from shoal.models import SandboxSpec
from shoal.node import capacity
from shoal.node.capacity import HostCapacity, Limits
from shoal.node.node import Node
from shoal.records import SandboxRecord

FAKE = {"image": "t:1", "backend": "fake"}


def spec(**kw: object) -> SandboxSpec:
    """A spec on the fake backend."""
    return SandboxSpec(**{**FAKE, **kw})  # type: ignore[arg-type]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---- idle agent connections ------------------------------------------------------------------------
async def test_idle_agent_connections_are_closed_and_reopened_on_the_next_request(node: Node) -> None:
    node.connections.idle_s = 0.2
    boxes = [await node.create(spec(memory_mb=64)) for _ in range(3)]
    assert len(node.connections) == 3  # the connections the creates opened
    held = _fds()
    # one is busy: a stream is open on its connection, so the sweep must leave it alone
    stream = await node.stream(boxes[0].id, "read x; echo got $x", stdin=True)
    await asyncio.sleep(0.3)
    assert await node.connections.sweep() == 2
    assert len(node.connections) == 1 and node.connections.get(boxes[0].id) is not None
    assert _fds() == held - 2  # each closed connection was one descriptor
    await stream.write_stdin(b"1\n")
    await stream.close_stdin()
    events = [ev async for ev in stream]
    assert events[-1].kind == "exit" and events[-1].result.exit_code == 0
    assert b"".join(ev.data for ev in events) == b"got 1\n"
    # the next request to an idle-closed sandbox opens a connection of its own, transparently
    r = await node.exec(boxes[1].id, "echo again")
    assert r.stdout == b"again\n" and node.connections.get(boxes[1].id) is not None
    assert node.connections.idle_closed == 2


async def test_a_request_racing_the_idle_sweep_gets_a_fresh_connection(node: Node) -> None:
    sb = await node.create(spec(memory_mb=64))
    c = node.connections.get(sb.id)
    assert c is not None
    calls = []

    async def fn(client):  # the sweep closes the connection after the node handed it to this request
        calls.append(client)
        if len(calls) == 1:
            node.connections.idle_s = 1e-6
            await asyncio.sleep(0.01)
            assert await node.connections.sweep() == 1
        return await client.exec(["echo", "ok"])

    r = await node.core.call(node.record(sb.id), fn)
    assert r.stdout == b"ok\n" and len(calls) == 2 and calls[0].closed_idle and calls[1] is not c


async def test_the_sweep_runs_in_the_background_and_stop_ends_it(fake_home: Path) -> None:
    from tests.unit.conftest import AGENT_BUILT, add_image, fake_config

    if not AGENT_BUILT:
        pytest.skip("the agent is not built: run `make agent`")
    n = Node(fake_config(fake_home, agent_idle_s=0.5))
    add_image(n.store, "t:1", {"/work/hello.txt": "hi\n"})
    await n.start()
    try:
        sb = await n.create(spec(memory_mb=64))
        assert len(n.connections) == 1
        deadline = time.monotonic() + 10
        while len(n.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert len(n.connections) == 0, "the background sweep never closed the idle connection"
        assert (await n.exec(sb.id, "true")).exit_code == 0
    finally:
        await n.close_all()
        await n.stop()
    assert n.connections._sweeper is None


# ---- capacity: refusals that name the resource ---------------------------------------------------------
def _limits(**kw: int) -> Limits:
    base = Limits.read()
    return Limits(**{**base.__dict__, **kw})


def test_descriptors_pids_watches_and_bridge_ports_are_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    cap = HostCapacity(bridge="shoal-test0", inotify_in_use=lambda: 10)
    assert cap.check(spec()) is None  # this host has room for one more
    fds = capacity.open_descriptors()
    cap.limits = _limits(nofile=fds + 10)
    cap._fds_at = 0.0
    err = cap.check(spec())
    assert isinstance(err, CapacityExceeded) and err.details["resource"] == "descriptors"
    assert err.details["reason"] == "resource" and "RLIMIT_NOFILE" in err.message and err.retry_after_s > 0
    cap.limits = _limits(pid_max=capacity.host_tasks() + 10)
    err = cap.check(spec())
    assert err is not None and err.details["resource"] == "pids" and "kernel.pid_max" in err.message
    cap.limits = _limits(inotify_watches=20)
    err = cap.check(spec())
    assert err is not None and err.details["resource"] == "inotify watches"
    cap.limits = Limits.read()
    assert cap.check(spec(network=True)) is None
    monkeypatch.setattr(capacity, "bridge_ports", lambda bridge: capacity.BRIDGE_PORTS - 1)
    err = cap.check(spec(network=True))
    assert err is not None and err.details["resource"] == "veths" and "1024" in err.message
    assert cap.check(spec()) is None  # a sandbox without a network takes no port


def test_loop_devices_are_counted_from_sysfs_and_loop_control(tmp_path: Path) -> None:
    block, dev, mod = tmp_path / "block", tmp_path / "dev", tmp_path / "module"
    for n in ("loop0", "loop1", "loop2", "loop3", "sda", "loop3p1"):
        (block / n).mkdir(parents=True)
    (block / "loop0" / "loop").mkdir()  # bound: the driver's loop/ directory (backing_file, …)
    dev.mkdir()
    for n in ("loop0", "loop1", "loop3"):
        (dev / n).touch()
    (mod / "parameters").mkdir(parents=True)
    (mod / "parameters" / "max_part").write_text("3\n")
    # loop2 has no node in this /dev: no mount can use it; no loop-control: nothing can be added
    assert capacity.loop_devices(dev, block, mod) == capacity.LoopDevices(bound=1, free=2, creatable=0)
    (dev / "loop-control").touch()  # a plain file is no loop-control
    assert capacity.loop_devices(dev, block, mod).creatable == 0
    if not capacity._is_loop_control(Path("/dev/loop-control")):
        return
    (dev / "loop-control").unlink()
    (dev / "loop-control").symlink_to("/dev/loop-control")
    # max_part=3: partition shift 2, each device takes 4 of the 2**20 minors
    lo = capacity.loop_devices(dev, block, mod)
    assert lo.creatable == (1 << 18) - 4 and lo.limit == 1 + 2 + (1 << 18) - 4


def test_loop_devices_are_refused_by_name_only_when_a_create_needs_more_than_are_left(tmp_path: Path) -> None:
    block, dev = tmp_path / "block", tmp_path / "dev"
    (block / "loop0" / "loop").mkdir(parents=True)
    (block / "loop1").mkdir()
    dev.mkdir()
    (dev / "loop1").touch()
    cap = HostCapacity(dev=dev, sys_block=block)
    assert cap.check(spec()) is None and cap.check(spec(), loops=1) is None
    err = cap.check(spec(), loops=2)
    assert isinstance(err, CapacityExceeded) and err.details["resource"] == "loop devices"
    assert err.details["used"] == 1 and err.details["limit"] == 2 and "loop-control" in err.message
    (dev / "loop1").unlink()
    assert cap.check(spec()) is None  # a create that mounts nothing new takes no loop device
    assert cap.check(spec(), loops=1) is not None


def test_creates_in_flight_count_against_the_limits() -> None:
    cap = HostCapacity()
    fds = capacity.open_descriptors()
    keep = capacity.reserve(fds + 200, 64)
    cap.limits = _limits(nofile=fds + 200)
    room = (fds + 200 - keep - fds) // capacity.FDS_PER_CREATE
    assert cap.check(spec(), n=room) is None
    cap.in_flight = room
    assert cap.check(spec()) is not None


def _has_cap_sys_resource() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> 24 & 1)
    return False


def test_raise_nofile_goes_as_far_as_the_host_allows() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        got = capacity.raise_nofile()
        nr_open = int(Path("/proc/sys/fs/nr_open").read_text())
        if _has_cap_sys_resource():  # root with CAP_SYS_RESOURCE raises the hard limit too, up to fs.nr_open
            assert got == (min(nr_open, capacity.NOFILE_CEILING),) * 2
        else:  # (this machine's root lacks it: the hard limit is what the host allows)
            assert got == (min(hard, capacity.NOFILE_CEILING), hard)
    finally:
        now = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, now[0]), now[1]))


def test_resource_errors_met_mid_create_become_capacity_refusals() -> None:
    e = OSError(errno.EMFILE, "Too many open files")
    got = capacity.from_oserror(e)
    assert got is not None and got.details["resource"] == "descriptors"
    wrapped = SandboxError("crun could not start the sandbox: open /proc/self/fd: Too many open files")
    got = capacity.from_oserror(wrapped)
    assert got is not None and got.details["resource"] == "descriptors"
    try:
        try:
            raise OSError(errno.ENOSPC, "inotify_add_watch /x: No space left on device")
        except OSError as inner:
            raise SandboxError("watch failed") from inner
    except SandboxError as outer:
        got = capacity.from_oserror(outer)
    assert got is not None and got.details["resource"] == "inotify watches"
    got = capacity.from_oserror(SandboxError("losetup: cannot find an unused loop device"))
    assert got is not None and got.details["resource"] == "loop devices"
    assert capacity.from_oserror(OSError(errno.ENOENT, "no such file")) is None
    assert capacity.from_oserror(SandboxError("the image is broken")) is None


async def test_a_refused_create_leaves_nothing_behind(node: Node) -> None:
    node.capacity.limits = _limits(nofile=capacity.open_descriptors() + 8)
    node.capacity._fds_at = 0.0
    with pytest.raises(CapacityExceeded) as ei:
        await node.create(spec(memory_mb=64))
    assert ei.value.details["resource"] == "descriptors"
    assert list(node.paths.sandboxes.iterdir()) == [] and node.admission.snapshot().pending == 0
    node.capacity.refresh()
    assert (await node.create(spec(memory_mb=64))).state == "running"


# ---- the node's swap decision -------------------------------------------------------------------------
@pytest.fixture
def swap_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """shoal.backends.container.swap against a private state directory and a pretend host (no real swap is touched)."""
    from shoal.backends.container import reclaim

    host: dict = {"areas": [], "made": [], "off": []}
    monkeypatch.setattr(swap, "STATE_DIR", tmp_path / "run")
    monkeypatch.setattr(reclaim, "swap_devices", lambda: [reclaim.SwapDevice(p, "partition", 1, 0, 100)
                                                         for p in host["areas"]])

    def setup(size: int) -> reclaim.ZramDevice:
        host["made"].append(size)
        host["areas"].append("/dev/zram7")
        return reclaim.ZramDevice("zram7", size, "zstd", swap=True)

    def teardown(devices: list[str] | None = None) -> list[str]:
        host["off"].append(devices)
        host["areas"].clear()
        return list(devices or [])

    monkeypatch.setattr(reclaim, "setup_zram_swap", setup)
    monkeypatch.setattr(reclaim, "teardown_zram_swap", teardown)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    return host


def test_auto_size_is_half_the_ram_at_most_8g() -> None:
    assert swap.auto_size(4 << 30) == 2 << 30
    assert swap.auto_size(24 << 30) == 8 << 30
    assert swap.auto_size((3 << 30) + 12345) == (3 << 30) // 2 >> 20 << 20
    assert swap.parse_setting("auto") == "auto" and swap.parse_setting("off") is None
    assert swap.parse_setting(None) is None and swap.parse_setting("16G") == "16G"


def test_a_host_without_swap_gets_zram_from_the_node_and_one_with_swap_keeps_its_own(swap_state: dict) -> None:
    d = swap.ensure("auto")
    assert d.action == "made" and d.device == "zram7" and swap_state["made"] == [swap.auto_size()]
    assert swap.made_by_node()["device"] == "zram7"
    again = swap.ensure("auto")  # a second node process: the swap is there now
    assert again.action == "kept" and swap_state["made"] == [swap.auto_size()]
    assert swap.ensure("off").action == "off"
    swap_state["areas"][:] = ["/swapfile"]
    assert swap.ensure("16G").action == "kept"  # the host's own swap is never replaced


def test_explicit_size_and_the_start_of_a_node_that_cannot_make_swap(swap_state: dict,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    d = swap.ensure("512M")
    assert d.action == "made" and swap_state["made"] == [512 << 20]
    swap_state["areas"].clear()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    d = swap.start_for_node("auto")  # auto is best effort: a warning, not a failed start
    assert d.action == "unavailable" and "root" in d.reason
    with pytest.raises(Exception, match="needs root"):
        swap.start_for_node("8G")  # an explicit size that cannot be honoured fails the start


def test_the_swap_a_node_made_is_turned_off_only_when_no_node_process_uses_it(swap_state: dict) -> None:
    import subprocess
    import sys

    swap.ensure("auto")
    assert swap.live_users() == [os.getpid()]
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        swap.register_user(other.pid)
        assert swap.release_unused(ignore_pid=os.getpid()) == []  # another node process relies on it
        assert swap_state["off"] == []
    finally:
        other.kill()
        other.wait()
    assert swap.release_unused(ignore_pid=os.getpid()) == ["zram7"]
    assert swap_state["off"] == [["zram7"]] and swap.made_by_node() is None
    assert swap.release_unused() == []  # nothing of ours is on any more
    # swap the host had of its own is never turned off
    swap_state["areas"][:] = ["/swapfile"]
    assert swap.release_unused() == [] and swap_state["off"] == [["zram7"]]


def test_node_swap_resize_replaces_a_zram_swap_of_another_size_and_keeps_one_of_the_same(
        swap_state: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """`shoal node swap --zram SIZE` / `--auto` (swap.resize) on the pretend host."""
    from shoal.backends.container import reclaim
    from shoal.errors import InvalidRequest

    def zram_devices() -> list[reclaim.ZramDevice]:
        on = "/dev/zram7" in swap_state["areas"]
        return [reclaim.ZramDevice("zram7", swap_state["made"][-1], "zstd", swap=True)] if on else []

    def setup(size: int, algorithm: str | None = None) -> reclaim.ZramDevice:  # idempotent, like the real one
        if zram_devices():
            return zram_devices()[0]
        swap_state["made"].append(size)
        swap_state["areas"].append("/dev/zram7")
        return reclaim.ZramDevice("zram7", size, algorithm or "zstd", swap=True)

    monkeypatch.setattr(reclaim, "zram_devices", zram_devices)
    monkeypatch.setattr(reclaim, "setup_zram_swap", setup)
    assert swap.ensure("auto").action == "made"
    d = swap.resize("512M")  # another size: the node's device is read back and made again
    assert d.action == "made" and d.size == 512 << 20 and swap_state["off"] == [["zram7"]]
    assert swap_state["made"] == [swap.auto_size(), 512 << 20]
    m = swap.made_by_node()
    assert m is not None and m["size"] == 512 << 20 and m["setting"] == "512M"
    swap.resize("512M")  # the same size: kept as it is, nothing read back
    assert swap_state["off"] == [["zram7"]] and swap_state["made"] == [swap.auto_size(), 512 << 20]
    assert swap.resize("auto").size == swap.auto_size() and len(swap_state["off"]) == 2
    for bad in ("0", "lots"):
        with pytest.raises(InvalidRequest):
            swap.resize(bad)
    assert swap.made_by_node() is not None  # a bad size changed nothing
    swap.turn_off()  # `--off`: every zram swap is read back and removed, and the note with it
    assert swap_state["off"][-1] is None and swap_state["areas"] == [] and swap.made_by_node() is None


# ---- the swap watch: one inotify descriptor for every sandbox (cgroup v2) ------------------------------------
def _v2_cgroup(root: Path, name: str, current: int = 1 << 20, swapped: int = 0) -> Path:
    d = root / "shoal" / name
    d.mkdir(parents=True)
    (d / "memory.current").write_text(f"{current}\n")
    (d / "memory.swap.current").write_text(f"{swapped}\n")
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    return d


async def _until(cond, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


async def test_v2_swap_watch_names_the_sandbox_through_one_inotify_descriptor(tmp_path: Path) -> None:
    """cgroup v2 is not what this host's memory controller runs (hybrid: v1), so the tree is plain files: the
    kernel notifies a write to a cgroup's memory.events as inotify IN_MODIFY, which a write to a file raises too.
    The watch, the inotify descriptor and the reads are the real ones."""
    fds0 = _fds()
    w = swapwatch.SwapWatch(root=tmp_path, mode="v2")
    crossed: dict[str, list[bool]] = {}
    dirs = {}
    for i in range(50):
        sid = f"n0-{i:04d}"
        dirs[sid] = _v2_cgroup(tmp_path, sid)
        assert w.watch(sid, f"/shoal/{sid}", 64 << 20, lambda over, sid=sid: crossed.setdefault(sid, []).append(over))
    assert w.descriptors() == 1 and _fds() == fds0 + 1  # one inotify descriptor for all 50
    bomb = dirs["n0-0007"]
    (bomb / "memory.current").write_text(f"{64 << 20}\n")
    (bomb / "memory.swap.current").write_text(f"{20 << 20}\n")  # 84 MiB: past 64 + 16
    (bomb / "memory.events").write_text("low 0\nhigh 0\nmax 1\noom 0\noom_kill 0\n")
    await _until(lambda: crossed.get("n0-0007") == [True])
    assert w.over("n0-0007") and list(crossed) == ["n0-0007"]
    assert w.descriptors() == 3  # past its line it keeps its two usage files open
    (bomb / "memory.swap.current").write_text("0\n")  # the OOM killer ended it
    await _until(lambda: crossed["n0-0007"] == [True, False])
    assert w.descriptors() == 1
    # page cache at the limit is not past the line
    quiet = dirs["n0-0003"]
    (quiet / "memory.current").write_text(f"{64 << 20}\n")
    (quiet / "memory.events").write_text("low 0\nhigh 0\nmax 5\noom 0\noom_kill 0\n")
    await asyncio.sleep(3 * swapwatch.RECHECK_S)
    assert "n0-0003" not in crossed and w.scans >= 2
    # a cgroup removed: the kernel drops its watch (IN_IGNORED) and the sandbox is no longer watched
    for f in bomb.iterdir():
        f.unlink()
    bomb.rmdir()
    await _until(lambda: not w.watching("n0-0007"))
    for sid in list(dirs):
        w.unwatch(sid)
    w.close()
    assert _fds() == fds0


async def test_v1_swap_watches_share_eventfds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cgroup v1's pressure_level registration is the kernel's (tests/integration checks it on real cgroups);
    here the control file is a plain file, to count the eventfds the watches share."""
    w = swapwatch.SwapWatch(root=tmp_path, mode="v1")
    n = swapwatch.BUCKET * 2 + 5
    for i in range(n):
        d = tmp_path / "memory" / "shoal" / f"s{i}"
        d.mkdir(parents=True)
        for f in ("memory.pressure_level", "cgroup.event_control"):
            (d / f).write_text("")
        (d / "memory.memsw.usage_in_bytes").write_text("1048576\n")
        assert w.watch(f"s{i}", f"/shoal/s{i}", 64 << 20, lambda over: None)
    assert w.descriptors() == 3  # ceil(133 / 64) eventfds
    for i in range(swapwatch.BUCKET):
        w.unwatch(f"s{i}")
    assert w.descriptors() == 2  # an emptied bucket closes its eventfd
    w.close()
    assert w.descriptors() == 0


# ---- periodic passes racing creates and closes ------------------------------------------------------------
async def test_periodic_passes_read_snapshots_while_creates_and_closes_change_the_tables(
        node: Node, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The tide loop's working-set sample runs in a thread; it once iterated `last_used` itself and died with
    "dictionary changed size during iteration" under churn (issue 24). Here the node's real tide loop runs
    (a pass every few milliseconds, memory counted as tight) and the idle sweep too, while tens of thousands
    of sandboxes come and go through the node's own bookkeeping calls, as creates and closes make them."""
    from shoal.node import scheduling

    sch = node.scheduling
    monkeypatch.setattr(scheduling, "PRESSURE_QUIET_S", 0.0)
    sch.tide_interval_s = 0.001
    sch.tides_enabled = True
    sch.policy = dataclasses.replace(sch.policy, tide_high=1e-6, tide_low=1e-6)
    sampled = 0
    real_sample = sch.sample_working_sets

    def sample(*a: object) -> int:
        nonlocal sampled
        sampled += 1
        return real_sample(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(sch, "sample_working_sets", sample)

    def rec(i: int) -> SandboxRecord:
        return SandboxRecord(id=f"n0-churn{i:06d}", backend="fake", image="t:1", image_digest="", layers=[],
                             spec=SandboxSpec(memory_mb=64, cpus=1.0), dir=str(node.paths.sandboxes / f"churn{i}"))

    sch.start()
    node.connections.idle_s = 0.001
    node.connections.start()
    alive: list[SandboxRecord] = []
    # switch threads every few microseconds, not every 5 ms: a pass in a thread that iterated a table the
    # loop changes would be caught mid-way nearly every time (as it was, rarely, on a busy node)
    old_switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        for i in range(60_000):
            r = rec(i)
            sch.created(r)
            node.admission._add(r.id, 64, 1.0)
            alive.append(r)
            if len(alive) > 5000:
                gone = alive.pop(0)
                sch.closed(gone)
                node.admission.release(gone.id)
            if i % 200 == 0:
                await asyncio.sleep(0.001)  # let the passes run between batches of changes
    finally:
        sys.setswitchinterval(old_switch)
        await sch.stop()
        await node.connections.stop()
        for r in alive:
            sch.closed(r)
            node.admission.release(r.id)
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert not failed, failed
    assert sampled >= 3 and sch.tide_totals["passes"] >= 3, (sampled, sch.tide_totals)


def test_records_of_closed_sandboxes_leave_the_parse_cache(tmp_path: Path) -> None:
    from shoal import records

    d = tmp_path / "n0-x"
    d.mkdir()
    r = SandboxRecord(id="n0-x", backend="fake", image="t:1", image_digest="", layers=[], spec=SandboxSpec(),
                      dir=str(d))
    r.save()
    SandboxRecord.load(d)
    key = os.path.join(d, "record.json")
    assert key in records._parsed
    records.forget_record(d)
    assert key not in records._parsed


def test_swap_marker_is_json(swap_state: dict) -> None:
    swap.ensure("auto")
    m = json.loads((swap.STATE_DIR / "zram-swap.json").read_text())
    assert m["setting"] == "auto" and m["pid"] == os.getpid()


def test_node_swap_cli_shows_what_a_node_would_make() -> None:
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "shoal.cli.main", "node", "swap", "--json"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["auto_size"] == swap.auto_size() and "made_by_node" in doc and isinstance(doc["swap"], list)
    r = subprocess.run([sys.executable, "-m", "shoal.cli.main", "node", "swap", "--auto", "--off"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "one of --zram SIZE, --auto or --off" in r.stderr


async def test_connections_are_given_back_early_when_descriptors_run_short(node: Node) -> None:
    boxes = [await node.create(spec(memory_mb=64)) for _ in range(3)]
    await asyncio.sleep(1.1)
    assert len(node.connections) == 3  # idle 1 s, far from SHOAL_AGENT_IDLE_S: kept
    node.capacity.limits = _limits(nofile=capacity.open_descriptors() + 1)
    node.capacity._fds_at = 0.0
    assert node.capacity.descriptors_short() and node.capacity.check(spec()) is not None
    node.connections.forget(boxes[0].id)  # (dropped without closing: the next request connects anew)
    assert (await node.exec(boxes[0].id, "true")).exit_code == 0
    assert len(node.connections) == 1  # the two idle ones were closed to make room
    node.capacity.refresh()


def test_only_layers_not_mounted_yet_take_loop_devices_and_only_when_mounts_go_through_loops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.config import Paths
    from shoal.host import syscalls
    from shoal.images import mounts
    from shoal.images.store import Layer

    lm = mounts.LayerMounts(Paths(home=tmp_path / "home", store=tmp_path / "store"), mode="loop")
    layers = [Layer(digest=f"sha256:{c * 64}", path=tmp_path / c, size=1) for c in "abc"]
    mounted = {str(lm.mountpoint("a" * 64))}
    monkeypatch.setattr(syscalls, "is_mountpoint", lambda p: p in mounted)
    assert lm.loop_devices_needed(layers + layers[1:2]) == 2  # b and c (once each); a is mounted
    lm.mode = "file"
    assert lm.loop_devices_needed(layers) == 0
    lm.mode = "auto"  # what the first mount found decides; before it, the kernel's version
    monkeypatch.setattr(mounts, "_file_backed_ok", False)
    assert lm.loop_devices_needed(layers) == 2
    monkeypatch.setattr(mounts, "_file_backed_ok", True)
    assert lm.loop_devices_needed(layers) == 0
    monkeypatch.setattr(mounts, "_file_backed_ok", None)
    monkeypatch.setattr(mounts, "_kernel", lambda: (6, 1))
    assert lm.loop_devices_needed(layers) == 2
    monkeypatch.setattr(mounts, "_kernel", lambda: (6, 12))
    assert lm.loop_devices_needed(layers) == 0
