#!/usr/bin/env python3
"""Image benchmark: lazy reads, layer mount times, disk bytes written per sandbox vs `docker run`.

    sudo .venv/bin/python benchmarks/bench_image.py [--n 20] [--trials 3] [--no-docker] [--out DIR]

Prints a table and writes DIR/bench_image.json and DIR/bench_image.png (default DIR: benchmarks/results).
Needs root and the `base` image (`shoal image build base`). Starts and stops a private dockerd (installing
docker.io with apt when missing, unless --no-install-docker) for the side-by-side comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from shoal.images.bench import plot, run_image_bench


def _kib(x: float | None) -> str:
    return "-" if x is None else f"{x / 1024:,.1f} KiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image", default="base:latest")
    ap.add_argument("--n", type=int, default=20, help="sandboxes (and containers) for the write measurement")
    ap.add_argument("--trials", type=int, default=3, help="cold-cache trials for reads and mounts")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of --n creations for the write measurement")
    ap.add_argument("--no-docker", action="store_true", help="skip the Docker comparison")
    ap.add_argument("--no-install-docker", action="store_true", help="never apt-get install docker.io")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args()
    err = Console(stderr=True)
    res = asyncio.run(run_image_bench(image=args.image, n=args.n, trials=args.trials, rounds=args.rounds,
                                      docker=not args.no_docker,
                                      install_docker=not args.no_install_docker,
                                      log=lambda s: err.print(f"[dim]{s}[/dim]", highlight=False)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_image.json").write_text(json.dumps(res, indent=1) + "\n")
    png = plot(res, args.out / "bench_image.png")

    t = Table(title=f"shoal image benchmark — {res['image']} ({res['image_bytes'] / 2**20:.0f} MiB, "
                    f"{res['erofs_mount_mode']} EROFS)")
    t.add_column("metric")
    t.add_column("shoal", justify="right")
    t.add_column("docker", justify="right")
    t.add_column("target / ratio", justify="right")
    for mode, r in res["read_modes"].items():
        t.add_row(f"bytes read to start ({mode}, cold cache)",
                  f"{r['start_bytes'] / 2**20:.2f} MiB ({r['start_fraction']:.1%})", "", "")
        t.add_row(f"… and run {r['command']}",
                  f"{r['start_and_json_bytes'] / 2**20:.2f} MiB ({r['start_and_json_fraction']:.1%})", "",
                  f"≤ 10%: {'yes' if r['start_and_json_fraction'] <= 0.10 else 'NO'}")
    for mode, m in res["mount"].items():
        if "cold_ms" in m:
            t.add_row(f"mount a layer ({mode}) cold / warm", f"{m['cold_ms']:.2f} / {m['warm_ms']:.2f} ms", "", "")
    s = res["writes"]["shoal"]
    d = res["writes"].get("docker", {})
    ratios = res.get("ratios", {})

    def pct(key: str) -> str:
        v = ratios.get(key)
        return "-" if v is None else f"{v:.2%}"

    t.add_row("disk bytes written per new sandbox", _kib(s["bytes_written"]), _kib(d.get("bytes_written")),
              pct("written_shoal_over_docker") + " (≤ 1%)")
    t.add_row("  (raw, before idle correction)", _kib(s["bytes_written_raw"]), _kib(d.get("bytes_written_raw")),
              pct("written_raw_shoal_over_docker"))
    t.add_row("disk space allocated per sandbox", _kib(s["allocated_bytes"]), _kib(d.get("allocated_bytes")),
              pct("allocated_shoal_over_docker"))
    v = res["writes"].get("shoal_no_disk_limits")
    if v:
        dw = d.get("bytes_written")
        t.add_row("  written, without disk limits (SHOAL_DISK_LIMITS=0)", _kib(v["bytes_written"]), "",
                  "-" if not dw else f"{v['bytes_written'] / dw:.2%}")
    t.add_row("create one (median)", f"{s['create_s_median'] * 1000:.0f} ms",
              f"{d['docker_run_s_median'] * 1000:.0f} ms" if "docker_run_s_median" in d else "-", "")
    if "error" in d:
        t.add_row("docker", "", d["error"][:60], "")
    Console().print(t)
    print(f"wrote {args.out / 'bench_image.json'} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
