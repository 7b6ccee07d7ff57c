"""Container sandboxes side by side with Docker: create-to-ready and exec round trip (p50/p99), rates.

    sudo .venv/bin/python benchmarks/bench_containers.py                 # full sizes, Docker if installed
    sudo .venv/bin/python benchmarks/bench_containers.py --quick --json /tmp/c.json --plot /tmp/plots

The same work as `shoal bench create exec` (this script is a thin wrapper around shoal.bench): a private
node on a fresh SHOAL_HOME, and a private dockerd (apt-get install docker.io) started, fed the same base
image tree and stopped by the benchmark. Nothing here asserts timings.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, run the create and exec scenarios, print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (about a minute)")
    ap.add_argument("--no-docker", action="store_true", help="shoal only")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--plot", type=Path, default=None, help="write PNG figures into this directory")
    ap.add_argument("--only", default="create,exec", help="comma list of create,exec")
    args = ap.parse_args(argv)

    from shoal.bench.report import markdown_table
    from shoal.bench.runner import run_bench

    names = [n for n in args.only.split(",") if n]
    if not set(names) <= {"create", "exec"}:
        ap.error("--only takes create and/or exec (the other scenarios: `shoal bench`)")
    command = "python benchmarks/bench_containers.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    doc = asyncio.run(run_bench(names, json_path=args.json, plot_dir=args.plot, quick=args.quick,
                                no_docker=args.no_docker, command=command))
    print(markdown_table(doc))
    return 1 if doc.get("leaks") else 0


if __name__ == "__main__":
    sys.exit(main())
