"""Stress the launcher: K consecutive 2-process tiny runs with CPU and memory load beside them.

    python -m bench.stress_launch --runs 50 --cpu_load 2 --memory_gb 4 [--launcher mpirun|torchrun|both]

Each run is ``python -m helpers.launch --nproc_per_node 2`` on the tiny model (a few seconds when
the machine is idle) while ``--cpu_load`` busy processes and one process holding ``--memory_gb``
GiB (pages touched every second) run beside it. A run still going after ``--timeout`` seconds,
or whose rank helpers.launch had to stop ("did not end within"), is a hang; a non-zero exit is a
failure. Writes runs, failures, hangs, and p50/p95 wall time to ``bench/results/stress_launch.json``
(atomically) and prints it. Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench import common, jobs

_BURN = "while True: pass"
_HOLD = """
import sys, time
block = bytearray(int(float(sys.argv[1]) * 2**30))
while True:
    for i in range(0, len(block), 4096):
        block[i] = (block[i] + 1) % 256
    time.sleep(1)
"""


def stress_parser(name: str, runs: int, doc: str) -> argparse.ArgumentParser:
    """The flags of ``python -m bench.<name>`` (this module's and :mod:`bench.stress_ccl`'s)."""
    parser = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=doc.split("\n")[0])
    parser.add_argument("--runs", type=int, default=runs)
    parser.add_argument("--launcher", choices=("mpirun", "torchrun", "both"), default="both",
                        help="both: alternate run by run")  # fmt: skip
    parser.add_argument("--cpu_load", type=int, default=2, help="busy processes beside the runs")
    parser.add_argument("--memory_gb", type=float, default=4.0, help="GiB held (and touched) beside the runs")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a run counts as hung")
    parser.add_argument("--out", default=None,
                        help=f"JSON results file (default: {name}.json in this machine's bench/results folder)")  # fmt: skip
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return stress_parser("stress_launch", 50, __doc__).parse_args(argv)


@contextmanager
def load(cpu: int, memory_gb: float) -> Iterator[None]:
    """Busy processes and a memory holder for the duration (killed after)."""
    procs = [common.popen([sys.executable, "-c", _BURN]) for _ in range(cpu)]
    if memory_gb > 0:
        procs.append(common.popen([sys.executable, "-c", _HOLD, str(memory_gb)]))
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def stress(
    args: argparse.Namespace, name: str, backend: str | None = None, about: str | None = None
) -> dict[str, Any]:
    """``args.runs`` jobs under load (see the module docstring), ``--backend backend`` if given; the
    report (``about``: the backend's description, if given) written to ``args.out`` and printed."""
    launchers = ["mpirun", "torchrun"] if args.launcher == "both" else [args.launcher]
    backend_flags = ["--backend", backend] if backend else []
    rows = []
    with load(args.cpu_load, args.memory_gb):
        for i in range(args.runs):
            launcher = launchers[i % len(launchers)]
            flags = [
                "--launcher",
                launcher,
                *backend_flags,
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
            label = f"{launcher}, {backend}" if backend else launcher
            print(
                f"run {i + 1}/{args.runs} ({label}): {outcome.status} in {outcome.seconds:.1f} s", flush=True
            )
    seconds = [r["seconds"] for r in rows]
    report = {
        "benchmark": name,
        "machine": common.machine(),
        **({"backend": about} if about is not None else {}),
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
    common.write_json(common.results_path(f"{name}.json", args.out, report["machine"]), report)
    print(json.dumps({k: v for k, v in report.items() if k not in ("machine", "problems")}, indent=2))
    return report


def main(args: argparse.Namespace) -> dict[str, Any]:
    return stress(args, "stress_launch")


if __name__ == "__main__":
    main(parse_args())
