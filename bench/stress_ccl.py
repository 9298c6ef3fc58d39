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
import sys
from typing import Any

from bench.stress_launch import stress, stress_parser
from helpers.ranks import oneccl


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return stress_parser("stress_ccl", 20, __doc__).parse_args(argv)


def main(args: argparse.Namespace) -> dict[str, Any] | None:
    ok, reason = oneccl.available()
    if not ok:
        print(f"error: ccl cannot be used here: {reason}", file=sys.stderr)
        raise SystemExit(2)
    return stress(args, "stress_ccl", backend="ccl", about=reason)


if __name__ == "__main__":
    main(parse_args())
