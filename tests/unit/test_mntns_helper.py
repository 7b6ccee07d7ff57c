"""The mount-namespace helper is built once, even when a burst of first creates asks from many threads."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from shoal.host import mntns


@pytest.mark.skipif(not (shutil.which("gcc") or shutil.which("cc")), reason="needs a C compiler")
def test_concurrent_first_calls_get_one_executable_helper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_MNTNS", "1")
    monkeypatch.setattr(mntns, "_built", {})
    with ThreadPoolExecutor(16) as ex:
        paths = list(ex.map(lambda _: mntns.helper_binary(tmp_path), range(32)))
    assert len(set(paths)) == 1 and paths[0] is not None
    helper = Path(paths[0])
    assert os.access(helper, os.X_OK) and helper.stat().st_size > 0
    assert [p.name for p in tmp_path.iterdir()] == [helper.name], "temporary build files were left behind"
