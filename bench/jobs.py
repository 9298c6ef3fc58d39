"""Short 2-process training jobs run through ``python -m helpers.launch``, each under a time limit.

Shared by ``bench/exit_deadlock.py`` and ``bench/stress_launch.py``. A job that outlives its limit
counts as hung; its whole process tree (launcher, mpirun/hydra, accelerate, ranks) is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from bench import common
from helpers.core import outputs
from helpers.ranks import status

ROOT = Path(__file__).resolve().parents[1]


def tiny_train_args(output_dir: str | os.PathLike, steps: int = 2) -> list[str]:
    """``helpers.train`` flags of a few-second fp32 run on the tiny model."""
    return [
        "--pretrained_model_name_or_path", "tiny",
        "--train_data_dir", str(ROOT / "helpers" / "assets" / "sample_concept"),
        "--placeholder_token", "<dicoo>", "--initializer_token", "toy", "--resolution", "64",
        "--max_train_steps", str(steps), "--seed", "0", "--mixed_precision", "no",
        "--save_steps", "1000", "--checkpointing_steps", "1000", "--output_dir", str(output_dir),
    ]  # fmt: skip


@dataclass
class Outcome:
    """How one job ended: ``ok``, ``failed`` (non-zero exit) or ``hung`` (killed at the limit)."""

    status: str
    seconds: float
    returncode: int | None
    tail: list[str]
    outputs_complete: bool  # outputs.SUMMARY (run_summary.json) written (a hung job may hang after finishing)
    summary_age: float | None = None  # at the kill: seconds since outputs.SUMMARY was written
    ranks_alive: list[int] | None = None  # at the kill, from the status locks (launchers that keep them)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (found before killing: orphans are re-parented)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def run_job(
    launch_flags: list[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike = ROOT,
    steps: int = 2,
    own_work_dir: bool = False,
) -> Outcome:
    """Run ``python -m helpers.launch <launch_flags> -- <tiny flags>`` from ``cwd``; kill it at ``timeout``.

    ``own_work_dir`` passes ``--work_dir`` in the job's temporary folder (launchers that would
    otherwise write ``launch/`` into ``cwd``).
    """
    with tempfile.TemporaryDirectory(prefix="bench-job-") as tmp:
        argv = [sys.executable, "-m", "helpers.launch", *launch_flags]
        argv += ["--work_dir", str(Path(tmp) / "launch"), "--"] if own_work_dir else ["--"]
        argv += tiny_train_args(Path(tmp) / "out", steps)
        full_env = {**os.environ, "PYTHONPATH": str(cwd), **(env or {})}  # the checkout in cwd, not .venv's
        log = Path(tmp) / "job.log"
        start = time.monotonic()
        with open(log, "w") as out:
            proc = common.popen(argv, cwd=cwd, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
            try:
                code: int | None = proc.wait(timeout=timeout)
                status = "ok" if code == 0 else "failed"
            except subprocess.TimeoutExpired:
                summary, status_dir = (
                    Path(tmp) / "out" / outputs.SUMMARY,
                    Path(tmp) / "out" / "launch" / "status",
                )
                age = time.time() - summary.stat().st_mtime if summary.is_file() else None
                alive = sorted(int(p.stem[4:]) for p in status_dir.glob("rank*.lock") if _lock_held(p))
                kill_tree(proc.pid)
                proc.wait()
                code, status = None, "hung"
        seconds = time.monotonic() - start
        tail = log.read_text(errors="replace").splitlines()[-8:]
        complete = (Path(tmp) / "out" / outputs.SUMMARY).is_file()
    if status != "hung":
        age, alive = None, None
    return Outcome(status, seconds, code, tail, complete, age, alive)


def _lock_held(path: Path) -> bool:  # run_one's own `status` is the outcome's word
    return status.lock_held(path)
