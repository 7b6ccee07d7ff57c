"""`shoal sim`: replay a trace through the real scheduler over simulated nodes in virtual time."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from shoal.cli.common import console, err_console

if TYPE_CHECKING:
    from shoal.sim.engine import SimResult
    from shoal.sim.trace import TraceRecord


def sim(trace: Annotated[str, typer.Option(help="'dsec' (a generated DSec-shaped day) or a JSONL trace file "
                                                "(sandbox lines or a node's SHOAL_TRACE_FILE event log)")] = "dsec",
        nodes: Annotated[int | None, typer.Option(help="simulated nodes [dsec: 160 × scale; a file: 160]")] = None,
        node_cpus: Annotated[float, typer.Option(help="cores per node")] = 190.0,
        node_memory_gb: Annotated[float, typer.Option(help="RAM per node, GiB")] = 1536.0,
        scale: Annotated[float, typer.Option(help="dsec: multiply every count and the node count")] = 1.0,
        hours: Annotated[float, typer.Option(help="dsec: hours of arrivals to generate")] = 24.0,
        seed: Annotated[int, typer.Option(help="random seed (trace and scheduler)")] = 0,
        preempt: Annotated[bool, typer.Option(help="pause idle lower-priority sandboxes for work that finds "
                                                   "no room")] = True,
        tides: Annotated[bool, typer.Option(help="pause idle sandboxes while a node's memory is tight")] = True,
        compare_preemption: Annotated[bool, typer.Option(
            "--compare-preemption", help="run twice, with and without preemption, and compare")] = False,
        overcommit: Annotated[float, typer.Option(help="memory promised per node, × its RAM")] = 4.0,
        cpu_overcommit: Annotated[float, typer.Option(help="CPUs promised per node, × its cores")] = 16.0,
        max_wait: Annotated[float, typer.Option(help="a request waiting longer (s) is rejected")] = 3600.0,
        out: Annotated[Path, typer.Option(help="directory for result.json, summary.txt and the figures")] = Path(
            "shoal-sim"),
        write_trace: Annotated[Path | None, typer.Option(help="also write the trace replayed as JSONL")] = None,
        bench: Annotated[bool, typer.Option("--bench", help="time scheduler decisions in isolation (160 nodes: "
                                                            "decisions/s, a 32k burst) and exit")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="print the result JSON instead of the summary")] = False,
        ) -> None:
    """Replay a trace through shoal's scheduler over simulated nodes: placement delays per priority, bursts,
    preemption, tides, memory, spreading, decisions/s. Writes JSON, PNG figures and a text summary."""
    from shoal.errors import InvalidRequest
    from shoal.sched import Policy
    from shoal.sim import report
    from shoal.sim.engine import SimConfig, Simulation

    if bench:
        from shoal.sim import bench as sbench

        res = sbench.run(nodes=nodes or 160, seed=seed)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res, indent=1) if as_json else sbench.text(res))
        return
    if scale <= 0 or hours <= 0 or node_cpus <= 0 or node_memory_gb <= 0 or max_wait <= 0:
        err_console.print("[red]error:[/red] --scale, --hours, --node-cpus, --node-memory-gb and --max-wait "
                          "must be positive")
        raise typer.Exit(2)
    try:
        policy = Policy(memory_overcommit=overcommit, cpu_overcommit=cpu_overcommit)
    except InvalidRequest as e:
        err_console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None

    def records() -> Iterable[TraceRecord]:
        if trace == "dsec":
            from shoal.sim.dsec import DsecShape, generate

            shape = DsecShape(scale=scale, duration_s=hours * 3600.0, seed=seed)
            return generate(shape)
        from shoal.sim.trace import read_trace

        return read_trace(trace)

    if trace != "dsec" and not Path(trace).is_file():
        err_console.print(f"[red]error:[/red] no trace file {trace!r}: give a JSONL file or --trace dsec")
        raise typer.Exit(2)
    n_nodes = nodes if nodes is not None else (max(2, round(160 * scale)) if trace == "dsec" else 160)
    if n_nodes < 1:
        err_console.print("[red]error:[/red] --nodes must be at least 1")
        raise typer.Exit(2)
    if write_trace is not None:
        from shoal.sim.trace import write_trace as _write

        with open(write_trace, "w") as f:
            n = _write(records(), f)
        console.print(f"wrote {n:,} sandboxes to {write_trace}")

    def one(pre: bool) -> SimResult:
        cfg = SimConfig(nodes=n_nodes, node_cpus=node_cpus, node_memory_mb=int(node_memory_gb * 1024),
                        policy=policy, preempt=pre, tides=tides, max_wait_s=max_wait, seed=seed)
        try:
            return Simulation(records(), cfg).run()
        except InvalidRequest as e:
            err_console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None

    t0 = time.perf_counter()
    cpu0 = time.process_time()
    res = one(preempt or compare_preemption)
    other = one(False) if compare_preemption else None
    extra = {"command": {"trace": trace, "nodes": n_nodes, "scale": scale, "hours": hours, "seed": seed,
                         "preempt": preempt, "tides": tides, "compare_preemption": compare_preemption,
                         "overcommit": overcommit, "cpu_overcommit": cpu_overcommit, "max_wait": max_wait},
             "total_wall_s": round(time.perf_counter() - t0, 2),
             "total_cpu_s": round(time.process_time() - cpu0, 2)}
    files = report.write(res, out, compare=other, extra=extra)
    if as_json:
        print(Path(files["json"]).read_text())
        return
    # plain print: the summary is pre-formatted and must not be re-wrapped to the terminal's width
    print(Path(files["summary"]).read_text(), end="")
    print(f"  total: {extra['total_wall_s']} s wall, {extra['total_cpu_s']} s CPU (trace generation, "
          f"simulation, scheduler); files in {out}/")
