"""A rank killed outright (as the out-of-memory killer does): how long until the whole job has ended.

    python -m bench.kill_rank [--launchers mpirun torchrun ray] [--backends gloo ccl] [--runs 1]

Each run is ``python -m helpers.launch --nproc_per_node 2`` training the tiny model for many steps;
once rank 1 has reported step 3, it gets SIGKILL (its pid from its status report). Measured: the
seconds from the kill until the launcher has exited and every process it started is gone (the
target is 10 s on every launcher and backend), the exit code, and the one ``error:`` line it
printed. Writes ``kill_rank.json`` into this machine's results folder. Not part of ``make test``
(the tests check the same path without timing it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench import common, jobs
from helpers.ranks import oneccl


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.kill_rank", description=__doc__.split("\n")[0])
    parser.add_argument("--launchers", nargs="+", choices=("mpirun", "torchrun", "ray"),
                        default=["mpirun", "torchrun", "ray"])  # fmt: skip
    parser.add_argument("--backends", nargs="+", choices=("gloo", "ccl"), default=["gloo", "ccl"])
    parser.add_argument("--runs", type=int, default=1, help="runs of each launcher and backend")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds before a job counts as hung")
    parser.add_argument("--out", default=None, help="JSON results file (default: this machine's folder)")
    return parser.parse_args(argv)


def _step(path: Path) -> int:
    try:
        return json.loads(path.read_text()).get("step") or 0
    except (OSError, ValueError):
        return 0


def run_one(launcher: str, backend: str, timeout: float) -> dict[str, Any]:
    """One job: rank 1 killed at step 3; seconds until the launcher and its processes are gone."""
    with tempfile.TemporaryDirectory(prefix="bench-kill-") as tmp:
        out = Path(tmp) / "out"
        argv = [sys.executable, "-m", "helpers.launch", "--launcher", launcher, "--backend", backend,
                "--nproc_per_node", "2", "--threads_per_process", "1", "--",
                *jobs.tiny_train_args(out, steps=100_000)]  # fmt: skip
        proc = common.popen(argv, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        report, deadline = out / "launch" / "status" / "rank1.json", time.monotonic() + timeout
        try:
            while _step(report) < 3:
                if proc.poll() is not None or time.monotonic() > deadline:
                    return {"launcher": launcher, "backend": backend, "error": "did not reach step 3",
                            "stderr": proc.communicate(timeout=30)[1][-2000:] if proc.poll() is not None else ""}  # fmt: skip
                time.sleep(0.2)
            started = psutil.Process(proc.pid).children(recursive=True)
            os.kill(json.loads(report.read_text())["pid"], signal.SIGKILL)
            killed = time.monotonic()
            code = proc.wait(timeout=timeout)
            launcher_ended = time.monotonic() - killed
            _, alive = psutil.wait_procs(started, timeout=max(0.0, deadline - time.monotonic()))
            all_ended = time.monotonic() - killed
            err = [ln for ln in proc.stderr.read().splitlines() if ln.startswith("error: ")]
            return {"launcher": launcher, "backend": backend, "launcher_ended_s": round(launcher_ended, 2),
                    "all_ended_s": round(all_ended, 2), "left_running": len(alive), "returncode": code,
                    "error_lines": err}  # fmt: skip
        finally:
            jobs.kill_tree(proc.pid)


def main(args: argparse.Namespace) -> dict[str, Any]:
    backends = [b for b in args.backends if b != "ccl" or oneccl.available()[0]]
    runs = [run_one(la, b, args.timeout) for la in args.launchers for b in backends for _ in range(args.runs)]
    result = {"machine": common.machine(), "target_s": 10, "runs": runs}
    path = common.write_json(common.results_path("kill_rank.json", args.out), result)
    for r in runs:
        print(
            f"{r['launcher']:9s} {r['backend']:5s} {r.get('all_ended_s', '-')!s:>7} s  {r.get('error_lines') or r.get('error')}"
        )
    print(f"written: {path}")
    return result


if __name__ == "__main__":
    main(parse_args())
