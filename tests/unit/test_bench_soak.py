"""`shoal bench soak`'s arithmetic: slopes per 1,000 cycles after the ramp, and no ratio for a slope."""

from __future__ import annotations

from shoal.bench.results import Metric
from shoal.bench.scenarios.soak import process_figures, slopes


def test_slopes_are_per_1000_cycles_and_skip_the_ramp() -> None:
    ramp = {"cycles": 0, "fds": 900, "threads": 30, "rss_mib": 10.0}  # the ramp's own peak is left out
    grow = [{"cycles": c, "fds": 100 + c // 100, "threads": 9, "rss_mib": 80.0 + c / 2000} for c in
            range(1000, 11000, 1000)]
    got = slopes([ramp, *grow], ["fds", "threads", "rss_mib", "missing"])
    assert got == {"fds": 10.0, "threads": 0.0, "rss_mib": 0.5, "missing": None}


def test_a_slope_gets_no_ratio_to_dockers() -> None:
    m = Metric("node descriptors: slope per 1,000 sandboxes", -47.1, -1524.0, "fds", better="neither")
    assert m.advantage is None and m.to_dict()["shoal_vs_docker"] is None
    assert Metric("cycles/s", 17.8, 1.9, "/s", better="higher").advantage == 17.8 / 1.9


def test_process_figures_of_this_process() -> None:
    f = process_figures(["self"])
    assert f["fds"] >= 3 and f["threads"] >= 1 and f["rss_mib"] > 1
