"""Reproduce issue 11's exit deadlock: N short 2-process runs with the teardown delay injected.

    python -m bench.exit_deadlock --runs 10 --timeout 60 [--launcher mpirun] [--checkout DIR]

Each run is ``python -m helpers.launch --nproc_per_node 2`` on the tiny model with
``WORKSHOP_TEST_EXIT_DELAY`` set (see :mod:`helpers.ranks.faults`); a run still going after
``--timeout`` seconds is a hang and is killed with its whole process tree; so is one whose
rank helpers.launch had to stop ("did not end within" in its last lines). ``--checkout`` runs
another checkout's code (e.g. a ``git worktree`` of an older commit) with this machine's
environment. Prints one JSON object: runs, ok, failed, hung (of which hung_after_outputs: killed
with ``run_summary.json`` written, i.e. hung at exit, not slow), seconds per run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from bench import jobs
from helpers.ranks import faults


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.exit_deadlock", description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a run counts as hung")
    parser.add_argument("--delay", type=float, default=3.0, help="seconds of WORKSHOP_TEST_EXIT_DELAY")
    parser.add_argument("--launcher", choices=("mpirun", "torchrun"), default="mpirun")
    parser.add_argument("--checkout", default=str(jobs.ROOT), help="the code to run (default: this one)")
    parser.add_argument("--out", help="also write the JSON here")
    return parser.parse_args(argv)


def main(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["--launcher", args.launcher, "--nproc_per_node", "2", "--main_process_port", "0"]
    outcomes = []
    for i in range(args.runs):
        outcome = jobs.run_job(flags, timeout=args.timeout, cwd=args.checkout,
                               env={faults.EXIT_DELAY: str(args.delay)}, own_work_dir=True)  # fmt: skip
        if any("did not end within" in line for line in outcome.tail):  # helpers.launch stopped a hung rank
            outcome.status = "hung"
        done = "outputs complete" if outcome.outputs_complete else "outputs incomplete"
        print(f"run {i + 1}/{args.runs}: {outcome.status} after {outcome.seconds:.1f} s, {done}", flush=True)
        outcomes.append(outcome)
    report = {
        "benchmark": "exit_deadlock",
        "checkout": str(Path(args.checkout).resolve()),
        "launcher": args.launcher,
        "delay_seconds": args.delay,
        "timeout_seconds": args.timeout,
        "runs": args.runs,
        **{s: sum(o.status == s for o in outcomes) for s in ("ok", "failed", "hung")},
        "hung_after_outputs": sum(o.status == "hung" and o.outputs_complete for o in outcomes),
        "seconds": [round(o.seconds, 1) for o in outcomes],
        "failed_tails": [o.tail for o in outcomes if o.status == "failed"],
        "hung_detail": [
            {"summary_age_seconds": o.summary_age, "ranks_alive": o.ranks_alive, "tail": o.tail}
            for o in outcomes
            if o.status == "hung"
        ],  # fmt: skip
    }
    print(json.dumps(report, indent=2))
    if args.out:
        from bench import common

        common.write_json(args.out, report)
    return report


if __name__ == "__main__":
    main(parse_args())
