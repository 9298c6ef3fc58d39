"""helpers.launching.supervise: a rank's lock says whether it runs, its beats whether it progresses."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from helpers.launching import supervise
from helpers.ranks import oneccl, status

RANK = """
from helpers.ranks import status
import sys, time
status.start()
status.beat(sys.argv[1], 7)
time.sleep(60)
"""


def start_rank(folder, rank: int, state: str) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), **{status.STATUS_DIR_ENV: str(folder)})
    proc = subprocess.Popen([sys.executable, "-c", RANK, state], env=env)
    deadline = time.monotonic() + 60
    while (
        not (folder / f"rank{rank}.json").is_file()
        or '"beats": 2' not in (folder / f"rank{rank}.json").read_text()
    ):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    return proc


def test_watcher_sees_exit_stall_and_waiting_ranks(tmp_path):
    folder = supervise.prepare(tmp_path / "status")
    ranks = {0: start_rank(folder, 0, "training"), 1: start_rank(folder, 1, status.WAITING)}
    try:
        watcher = supervise.Watcher(folder)
        watcher.poll(now=100.0)
        assert watcher.running() == [0, 1] and watcher.first_exit() is None
        report = watcher.ranks[0].status
        assert (report["rank"], report["pid"], report["state"], report["step"]) == (
            0,
            ranks[0].pid,
            "training",
            7,
        )
        assert watcher.verdict(130.0, 5, 30, launcher_running=True) is None  # 30 s: not yet more than 30
        assert watcher.stalled(131.0, 30) == [0]  # rank 1 waits (for rank 0)
        assert watcher.verdict(131.0, 5, 30, launcher_running=True) == (
            [0],
            "rank 0 made no progress for 30 s (last report: rank 0: training, step 7); helpers.launch stopped the job.",
        )
        ranks[0].kill()
        ranks[0].wait()
        watcher.poll(now=140.0)
        assert watcher.running() == [1] and watcher.first_exit() == (0, 140.0)
        assert watcher.stalled(200.0, 30) == [1]  # the only rank left, stale and waiting: named
        assert watcher.verdict(145.0, 5, 900, launcher_running=True) is None  # 5 s: not yet more than 5
        assert watcher.verdict(145.5, 5, 900, launcher_running=True) == (
            [1],
            "rank 1 did not end within 5 s of rank 0 exiting; helpers.launch stopped it.",
        )
    finally:
        for p in ranks.values():
            p.kill()
            p.wait()


def test_ranks_of_the_job_that_never_report_are_named_after_the_stall_limit(tmp_path):
    folder = supervise.prepare(tmp_path / "status")
    ranks = {r: start_rank(folder, r, "training") for r in (0, 2)}
    try:
        watcher = supervise.Watcher(folder, world_size=100, started=100.0)
        watcher.poll(now=100.0)
        assert watcher.missing() == [1, *range(3, 100)] and watcher.running() == [0, 2]
        assert watcher.verdict(130.0, 5, 30, launcher_running=True) is None  # 30 s: not yet more than 30
        assert watcher.verdict(130.5, 5, 30, launcher_running=True) == (
            [0, 2],
            "ranks 1, 3-99 of 100 did not start within 30 s of the job's start (no status report); "
            "helpers.launch stopped the job.",
        )
        assert supervise.Watcher(folder).missing() == []  # no world size: nothing is expected
    finally:
        for p in ranks.values():
            p.kill()
            p.wait()


def test_a_rank_that_exits_without_reporting_done_is_a_failure_one_that_reported_it_is_not(tmp_path):
    """A free lock after ``done`` is a rank that succeeded (the others get the exit grace); a free
    lock without it is a failure, SIGKILL included (the launcher stops the job at once)."""
    folder = supervise.prepare(tmp_path / "status")
    ranks = {0: start_rank(folder, 0, status.DONE), 1: start_rank(folder, 1, "training")}
    try:
        watcher = supervise.Watcher(folder)
        for rank in (1, 0):
            ranks[rank].kill()
            ranks[rank].wait()
            watcher.poll(now=10.0 + rank)
        assert watcher.running() == [] and watcher.failures() == watcher.first_failed() == [1]
        assert (watcher.ranks[0].failed, watcher.ranks[1].failed) == (False, True)
    finally:
        for p in ranks.values():
            p.kill()
            p.wait()


def test_outputs_complete_only_when_the_summary_was_written_by_this_run(tmp_path):
    summary = tmp_path / "run_summary.json"
    assert supervise.outputs(str(tmp_path), time.time()) == (
        False,
        f"Outputs incomplete: {summary} was not written.",
    )
    summary.write_text("{}")
    assert supervise.outputs(str(tmp_path), time.time()) == (
        True,
        f"Outputs complete: {summary} was written.",
    )
    assert supervise.outputs(str(tmp_path), time.time() + 60)[0] is False  # an earlier run's
    assert supervise.outputs(None, 0.0) == (None, "Outputs unknown: no output_dir known to helpers.launch.")


def test_ranks_one_poll_finds_failed_together_are_all_first(tmp_path):
    """Which of two ranks that died between two polls ended first is unknown: both are named, and
    the launcher's diagnosis picks the root cause among them, not the lower rank number."""
    folder = supervise.prepare(tmp_path / "status")
    ranks = {r: start_rank(folder, r, "training") for r in (0, 1, 2)}
    try:
        watcher = supervise.Watcher(folder)
        watcher.poll(now=1.0)
        for rank in (2, 1):
            ranks[rank].kill()
            ranks[rank].wait()
        watcher.poll(now=2.0)
        ranks[0].kill()
        ranks[0].wait()
        watcher.poll(now=3.0)
        assert (watcher.failures(), watcher.first_failed()) == ([1, 2, 0], [1, 2])
    finally:
        for p in ranks.values():
            p.kill()
            p.wait()


def test_shared_memory_left_by_gone_ranks_here_is_removed_before_and_after_a_job(tmp_path):
    """libfabric's shm transport (ccl on one node) keeps a rank's endpoint in /dev/shm (RAM) as
    ``<pid>:<uid>:<n>``; a rank killed outright leaves it. Removed: the files of this user's ranks of
    this machine that are gone. Kept: a live rank's, another host's rank's, names of another form."""
    uid, host = os.getuid(), socket.gethostname()
    dead = []
    for _ in range(3):
        proc = subprocess.Popen(["true"])
        proc.wait()
        dead.append(proc.pid)
    reports = {0: (host, dead[0]), 1: (host, os.getpid()), 2: ("node7", dead[1]), 3: ("localhost", dead[2])}
    names = [f"{dead[0]}:{uid}:0", f"{dead[0]}:{uid}:0:77", f"{dead[2]}:{uid}:1", f"{dead[0]}:{uid}:x",
             f"{os.getpid()}:{uid}:0", f"{dead[1]}:{uid}:0"]  # fmt: skip
    folder = tmp_path / "status"

    def job_left_them() -> None:
        for name in names:
            (oneccl.SHM_FOLDER / name).write_bytes(b"x")
        folder.mkdir(exist_ok=True)
        for rank, (where, pid) in reports.items():
            (folder / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "host": where, "pid": pid}))

    try:
        job_left_them()  # the job's end: run_job removes them
        assert sorted(supervise.remove_shared_memory(folder)) == sorted(names[:3])
        assert sorted(n for n in names if (oneccl.SHM_FOLDER / n).exists()) == sorted(names[3:])
        job_left_them()  # its launcher was killed outright: the next job's prepare() removes them
        assert supervise.prepare(folder) == folder and list(folder.iterdir()) == []
        assert sorted(n for n in names if (oneccl.SHM_FOLDER / n).exists()) == sorted(names[3:])
    finally:
        for name in names:
            (oneccl.SHM_FOLDER / name).unlink(missing_ok=True)
