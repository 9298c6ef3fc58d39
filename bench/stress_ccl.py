"""Stress the ccl backend: K consecutive 2-process tiny runs on ``--backend ccl`` under CPU and memory load.

    python -m bench.stress_ccl --runs 20 --cpu_load 2 --memory_gb 4 [--launcher mpirun|torchrun|both]

Each run is ``python -m helpers.launch --backend ccl --nproc_per_node 2`` on the tiny model, with
:mod:`bench.stress_launch`'s load beside it (busy processes, a held and touched memory block). A
run still going after ``--timeout`` seconds (then killed with its whole process tree), or whose
rank helpers.launch had to stop ("did not end within"), is a hang; a non-zero exit is a failure.
oneCCL's hang risks on an oversubscribed machine are its spinning workers and its bootstrap, so
both launchers alternate by default. Writes runs, failures, hangs and p50/p95 wall time to
``bench/results/stress_ccl.json`` (atomically) and prints it. Not part of ``make test``; the issue's
target is 0 hangs in 20 runs. Exits 2 at once where ccl cannot be used (the reason printed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench import common, jobs
from bench.stress_launch import load, percentile
from helpers.ranks import oneccl


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.stress_ccl", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--launcher", choices=("mpirun", "torchrun", "both"), default="both",
                        help="both: alternate run by run")  # fmt: skip
    parser.add_argument("--cpu_load", type=int, default=2, help="busy processes beside the runs")
    parser.add_argument("--memory_gb", type=float, default=4.0, help="GiB held (and touched) beside the runs")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a run counts as hung")
    parser.add_argument("--out", default=str(common.RESULTS / "stress_ccl.json"))
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> dict[str, Any] | None:
    ok, reason = oneccl.available()
    if not ok:
        print(f"error: ccl cannot be used here: {reason}", file=sys.stderr)
        raise SystemExit(2)
    launchers = ["mpirun", "torchrun"] if args.launcher == "both" else [args.launcher]
    rows = []
    with load(args.cpu_load, args.memory_gb):
        for i in range(args.runs):
            launcher = launchers[i % len(launchers)]
            flags = [
                "--launcher",
                launcher,
                "--backend",
                "ccl",
                "--nproc_per_node",
                "2",
                "--main_process_port",
                "0",
            ]
            outcome = jobs.run_job(flags, timeout=args.timeout)
            if any("did not end within" in line for line in outcome.tail):
                outcome.status = "hung"  # helpers.launch had to stop a rank
            rows.append({"launcher": launcher, "status": outcome.status, "seconds": round(outcome.seconds, 2),
                         "tail": outcome.tail if outcome.status != "ok" else []})  # fmt: skip
            print(
                f"run {i + 1}/{args.runs} ({launcher}, ccl): {outcome.status} in {outcome.seconds:.1f} s",
                flush=True,
            )
    seconds = [r["seconds"] for r in rows]
    report = {
        "benchmark": "stress_ccl",
        "machine": common.machine(),
        "backend": reason,
        "load": {"cpu_processes": args.cpu_load, "memory_gb": args.memory_gb},
        "timeout_seconds": args.timeout,
        "runs": len(rows),
        "ok": sum(r["status"] == "ok" for r in rows),
        "failures": sum(r["status"] == "failed" for r in rows),
        "hangs": sum(r["status"] == "hung" for r in rows),
        "p50_seconds": percentile(seconds, 50),
        "p95_seconds": percentile(seconds, 95),
        "measured": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "problems": [r for r in rows if r["status"] != "ok"],
    }
    common.write_json(Path(args.out), report)
    print(json.dumps({k: v for k, v in report.items() if k not in ("machine", "problems")}, indent=2))
    return report


if __name__ == "__main__":
    main(parse_args())
