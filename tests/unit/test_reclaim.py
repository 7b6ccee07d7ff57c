"""Unit tests of shoal.backends.container.reclaim: sizes, /proc/swaps, pagemap runs, working-set record and prefetch."""

from __future__ import annotations

import subprocess
import sys
from array import array
from pathlib import Path

import pytest

from shoal.backends.container import reclaim
from shoal.errors import InvalidRequest


def test_parse_size() -> None:
    assert reclaim.parse_size("8G") == 8 << 30
    assert reclaim.parse_size("512m") == 512 << 20
    assert reclaim.parse_size("1.5GiB") == 3 << 29
    assert reclaim.parse_size("4096") == 4096
    assert reclaim.parse_size(10) == 10
    for bad in ("", "G", "-1G", "8X", "0", "1 2"):
        with pytest.raises(InvalidRequest):
            reclaim.parse_size(bad)


def test_parse_swaps() -> None:
    body = ["/dev/zram0                              partition\t4194300\t1024\t100",
            "/swap\\040file                         file\t1000\t0\t-2", "garbage"]
    devs = reclaim.parse_swaps(body)
    assert [d.path for d in devs] == ["/dev/zram0", "/swap file"]
    assert devs[0].size_kb == 4194300 and devs[0].used_kb == 1024 and devs[0].priority == 100
    assert devs[1].priority == -2


def test_runs_of_present_or_swapped_pages() -> None:
    p, s = 1 << 63, 1 << 62
    entries = array("Q", [0, p, p, 0, s, p | 5, 0, 0, p])
    assert reclaim._runs(memoryview(entries.tobytes()).cast("Q"), 100) == [[101, 2], [104, 2], [108, 1]]
    assert reclaim._runs(memoryview(array("Q", [0, 0]).tobytes()).cast("Q"), 0) == []


def test_working_set_record_and_prefetch_of_a_real_process(tmp_path: Path) -> None:
    # a child holding 8 MiB it touched: its working set covers them
    child = subprocess.Popen([sys.executable, "-c",
                              "import mmap, sys; m = mmap.mmap(-1, 8 << 20); m[::4096] = b'a' * 2048; "
                              "print('ready', flush=True); sys.stdin.readline(); m.madvise(mmap.MADV_DONTNEED); "
                              "print('dropped', flush=True); sys.stdin.readline()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        ws = reclaim.record_working_set([child.pid, 999_999_999])
        assert list(ws["procs"]) == [str(child.pid)]
        assert reclaim.working_set_pages(ws) * reclaim.PAGE >= 8 << 20
        reclaim.save_working_set(tmp_path, ws)
        back = reclaim.load_working_set(tmp_path)
        assert back == ws
        # everything is still resident: prefetch has nothing to read
        assert reclaim.prefetch_working_set(back) < 64
        # dropped (not swapped) pages come back on demand for a minor fault: prefetch leaves them alone
        # (reading swapped pages back is tested on real zram in tests/integration/test_stateful_pause.py)
        child.stdin.write(b"drop\n")
        child.stdin.flush()
        assert child.stdout.readline() == b"dropped\n"
        assert reclaim.prefetch_working_set(back) == 0
        reclaim.drop_working_set(tmp_path)
        assert reclaim.load_working_set(tmp_path) is None
    finally:
        child.kill()
        child.wait()
    # the process is gone: prefetch skips it instead of failing
    assert reclaim.prefetch_working_set(ws) == 0


def test_sandbox_swap_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reclaim, "swap_active", lambda: False)
    assert reclaim.sandbox_swap_mb(256) is None  # no swap: leave the runtime's default
    monkeypatch.setattr(reclaim, "swap_active", lambda: True)
    monkeypatch.setattr(reclaim, "_memsw_supported", lambda: True)
    from shoal.config import Settings

    def policy(value: str | None) -> str:  # the setting as the node resolves it
        return Settings.load(env={} if value is None else {"SHOAL_SANDBOX_SWAP": value}).sandbox_swap

    assert reclaim.sandbox_swap_mb(256, policy(None)) == 256
    assert reclaim.sandbox_swap_mb(256, policy("0")) == 0
    assert reclaim.sandbox_swap_mb(256, policy("64M")) == 64
    monkeypatch.setattr(reclaim, "_memsw_supported", lambda: False)
    assert reclaim.sandbox_swap_mb(256) is None


def test_swap_status_shape() -> None:
    st = reclaim.swap_status()
    assert set(st) == {"swap", "zram", "zswap"}
    assert all(isinstance(s["size_kb"], int) for s in st["swap"])
