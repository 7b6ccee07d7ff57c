"""The container essentials on every OCI runtime shoal knows (crun, runc, gVisor), so none breaks unseen.

crun is the default, so most tests only ever exercise it; runc is the fallback on hybrid cgroup hosts
where crun refuses, and once broke for every create without a test noticing (its rootfs path went
through the sandbox directory's symlink, and it refuses bind mounts inside /proc). Each test here runs
once per runtime of the registry: create, exec, files, pause/resume, snapshot, the /proc masks of
tests/security, and nothing left behind at close.

Which runtimes run is what `shoal doctor` reports (the same probe). A runtime that cannot run on this
host (not installed, or the host refuses it) is skipped with the probe's reason. One the host runs but
shoal cannot start a sandbox on (`host_ok` without `works`) fails: that is a shoal bug, not a host fact.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import shoal
from shoal.agentbin import find_agent_binary
from shoal.backends.container.oci import MASKED_PATHS
from shoal.backends.container.runtime import RuntimeStatus, probe_runtimes
from shoal.backends.registry import RUNTIMES, make_runtime
from shoal.config import Paths

pytestmark = [pytest.mark.root]

@pytest.fixture(scope="module")
def statuses(shoal_home: Path) -> dict[str, RuntimeStatus]:
    """What `shoal doctor` reports for each runtime (the probe is cached in the session's SHOAL_HOME)."""
    return probe_runtimes(Paths.from_env(), find_agent_binary())


@pytest.fixture(params=list(RUNTIMES))
def runtime(request: pytest.FixtureRequest, statuses: dict[str, RuntimeStatus], base_image: str) -> str:
    """Each runtime of the registry that works here; the others are skipped (or failed) with the reason."""
    name: str = request.param
    st = statuses[name]
    if st.works:
        return name
    if st.host_ok:
        pytest.fail(f"{name} runs a plain container on this host but shoal cannot start a sandbox on it: "
                    f"{st.reason}")
    pytest.skip(f"{name} cannot run here: {st.reason}" + (f" (fix: {st.fix})" if st.fix else ""))


@pytest.fixture
async def rclient(runtime: str) -> AsyncIterator[shoal.Client]:
    """An embedded client (its sandboxes are closed afterwards)."""
    async with shoal.Client() as c:
        yield c



def _leftovers(client: shoal.Client, runtime: str, sb_id: str) -> list[str]:
    """What of a closed sandbox the host still holds: its container, cgroups, mounts, directory."""
    node = client.transport.node
    st = node.runtime_statuses[runtime]
    out = [f"container shoal-{sb_id}" for c in make_runtime(runtime, st.binary or runtime).list_ids()
           if c == f"shoal-{sb_id}"]
    out += [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/shoal/{sb_id}")]
    out += [str(p) for p in Path("/sys/fs/cgroup").glob(f"shoal/{sb_id}")]
    with open("/proc/self/mountinfo") as f:
        out += [ln.split()[4] for ln in f if sb_id in ln.split()[4]]
    d = node.paths.sandboxes / sb_id
    if d.exists() or d.is_symlink():
        out.append(str(d))
    return out


async def test_create_exec_files_close(rclient: shoal.Client, runtime: str) -> None:
    """A sandbox starts on the runtime asked for; exec, env, cwd, stdin and files work; close leaves nothing."""
    sb = await rclient.create("base", runtime=runtime)
    assert (await sb.refresh()).runtime == runtime
    r = await sb.exec("echo out; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, b"out\n", b"err\n")
    r = await sb.exec("echo $FOO:$PWD", env={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout == b"bar:/tmp\n"
    assert (await sb.exec("cat", stdin=b"piped")).stdout == b"piped"
    await sb.write_file("/root/data.bin", bytes(range(256)) * 64)
    assert (await sb.read_file("/root/data.bin")) == bytes(range(256)) * 64
    assert (await sb.exec("wc -c < /root/data.bin")).stdout.strip() == b"16384"
    await sb.exec("echo from-exec > /root/b")
    assert await sb.read_file("/root/b") == b"from-exec\n"
    await sb.close()
    assert not _leftovers(rclient, runtime, sb.id)


async def test_pause_resume(rclient: shoal.Client, runtime: str) -> None:
    """pause() freezes every process (a background counter stops), resume() and any exec thaw it."""
    sb = await rclient.create("base", runtime=runtime)
    # (the counter lives in /root, not /tmp: gVisor mounts a tmpfs of its own kernel at an empty /tmp, which
    # the host never sees; docs/security.md lists the difference)
    await sb.exec("echo 1 > /root/n; nohup sh -c 'while :; do echo $(($(cat /root/n)+1)) > /root/n.new && "
                  "mv /root/n.new /root/n; sleep 0.02; done' >/dev/null 2>&1 &")
    node = rclient.transport.node
    rec = node.record(sb.id)
    rt = make_runtime(runtime, node.runtime_statuses[runtime].binary or runtime)
    await sb.pause()
    assert (await sb.refresh()).state == "paused"
    assert ((await rt.state(rec.cid)) or {}).get("status") == "paused"
    counter = Path(node.backend("container").upper_dir(rec)) / "root" / "n"
    frozen = counter.read_text()
    for _ in range(5):  # (no clock: five reads of the file a running loop rewrites every 20 ms)
        await rt.state(rec.cid)
        assert counter.read_text() == frozen
    await sb.resume()
    assert ((await rt.state(rec.cid)) or {}).get("status") == "running"
    n1 = int((await sb.exec("cat /root/n")).stdout)
    r = await sb.exec(f"for i in $(seq 200); do [ $(cat /root/n) -gt {n1} ] && break; sleep 0.05; done; cat /root/n")
    assert int(r.stdout) > n1, "the background loop did not run again after resume"
    # a request to a paused sandbox resumes it
    await sb.pause()
    assert (await sb.exec("echo hi")).stdout == b"hi\n"
    assert (await sb.refresh()).state == "running"


async def test_snapshot_and_create_from_it(rclient: shoal.Client, runtime: str, names: list[str]) -> None:
    """snapshot() of a sandbox is an image a new sandbox on the same runtime starts from, with its files."""
    sb = await rclient.create("base", runtime=runtime)
    await sb.exec("mkdir -p /work && echo v1 > /work/f && rm /etc/debian_version")
    ref = f"test-runtimes/{runtime}-{secrets.token_hex(4)}:v1"
    names.append(ref)
    img = await sb.snapshot(ref)
    assert img["ref"] == ref and img["layer"]
    child = await rclient.create(ref, runtime=runtime)
    assert (await child.refresh()).runtime == runtime
    r = await child.exec("cat /work/f; test -e /etc/debian_version; echo $?")
    assert r.stdout == b"v1\n1\n", r
    assert (await sb.exec("cat /work/f")).stdout == b"v1\n"  # the parent runs on


_MASK_PROBE = r"""
import json, os
out = {}
for p in json.loads(os.environ["MASKED"]):
    if os.path.isdir(p):
        out[p] = sorted(os.listdir(p))
    elif os.path.exists(p):
        try:
            with open(p, "rb") as f:
                out[p] = f.read(4096).decode(errors="replace")
        except OSError as e:
            out[p] = "error " + str(e.errno)
for f in ("/proc/self/mountinfo", "/proc/mounts", "/proc/cmdline", "/proc/meminfo"):
    with open(f) as fh:
        out[f] = fh.read()
print(json.dumps(out))
"""


async def test_proc_and_sys_masks(rclient: shoal.Client, runtime: str) -> None:
    """The masks of tests/security hold on every runtime: masked /proc and /sys entries read empty (or
    unreadable), /proc/cmdline is empty, /proc/meminfo reports the sandbox's limit, and mountinfo shows
    neither the node's paths nor the host's devices or devtmpfs (whose options tell the host's RAM)."""
    sb = await rclient.create("base", runtime=runtime, memory_mb=300)
    r = await sb.exec(["python3", "-c", _MASK_PROBE], env={"MASKED": json.dumps(MASKED_PATHS)})
    assert r.exit_code == 0, r.stderr
    seen = json.loads(r.stdout)
    for p in MASKED_PATHS:
        if p in seen:
            assert seen[p] in ("", []) or str(seen[p]).startswith("error "), f"{p} shows {seen[p]!r}"
    assert seen["/proc/cmdline"] == ""
    assert "MemTotal:" in seen["/proc/meminfo"]
    assert seen["/proc/meminfo"].split("MemTotal:")[1].split()[0] == str(300 * 1024)
    home = str(rclient.transport.node.paths.home)
    for f in ("/proc/self/mountinfo", "/proc/mounts"):
        for leak in (home, "/dev/vda", "/var/lib/shoal", "/tmp/", "devtmpfs", "/layers/", "/uppers/"):
            assert leak not in seen[f], f"{f} shows {leak!r}:\n{seen[f]}"
    r = await sb.exec("cat /proc/partitions /proc/diskstats /proc/swaps | wc -c; "
                      "find /sys/block /sys/class/block /sys/dev/block -mindepth 1 2>/dev/null | wc -l")
    assert r.stdout.split() == [b"0", b"0"], r


async def test_pause_returns_only_once_every_process_is_frozen(rclient: shoal.Client, runtime: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A runtime's pause can return while the freezer is still FREEZING (seen in CI on a busy host); the
    node then asks again until the freezer says FROZEN. Here the runtime's pause does nothing at all."""
    from shoal.backends.container.runtime import OciRuntime
    from shoal.host import cgroups

    if not make_runtime(runtime, runtime).freezes_cgroup:
        pytest.skip(f"{runtime} pauses inside its own kernel, not with the host's freezer")
    sb = await rclient.create("base", runtime=runtime)
    await sb.exec("nohup sh -c 'while :; do :; done' >/dev/null 2>&1 &")

    async def no_pause(self: OciRuntime, cid: str) -> None:
        return None

    monkeypatch.setattr(OciRuntime, "pause", no_pause)
    await sb.pause()
    cg = cgroups.SandboxCgroup(rclient.transport.node.record(sb.id).cgroup)
    if cg.mode == "v2":
        assert "frozen 1" in (cg.read("memory", "cgroup.events") or "")
    else:
        assert (cg.read("freezer", "freezer.state") or "").strip() == "FROZEN"
    monkeypatch.undo()
    await sb.resume()
    assert (await sb.exec("echo thawed")).stdout == b"thawed\n"
    await sb.close()
