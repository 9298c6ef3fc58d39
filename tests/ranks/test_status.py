"""helpers.ranks.status: a rank's lock never follows a link planted at its known name, and the
launcher never sees it free while the rank lives."""

from __future__ import annotations

import fcntl
import os

import pytest

from helpers.core.errors import InputError
from helpers.launching import supervise
from helpers.ranks import status
from helpers.training.engine.command import run_command


@pytest.fixture
def rank0(tmp_path, monkeypatch):
    """This process as rank 0 of a job whose status folder is ``tmp_path/status``; its lock freed after."""
    folder = tmp_path / "status"
    folder.mkdir()
    monkeypatch.setenv(status.STATUS_DIR_ENV, str(folder))
    monkeypatch.setenv("RANK", "0")
    yield folder
    status.finish()


def test_a_link_planted_at_the_ranks_lock_is_replaced_and_its_target_untouched(tmp_path, rank0):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (rank0 / "rank0.lock").symlink_to(victim)
    status.start()
    assert victim.read_text() == "precious" and not (rank0 / "rank0.lock").is_symlink()
    assert sorted(p.name for p in rank0.iterdir()) == ["rank0.json", "rank0.lock"]


def test_a_folder_at_the_ranks_lock_is_one_line_and_exit_2(rank0, capsys):
    lock = rank0 / "rank0.lock"
    lock.mkdir()
    with pytest.raises(InputError) as err:
        status.start()
    assert str(err.value) == (
        f"{status.STATUS_DIR_ENV}={rank0}: rank0.lock is a folder, where this rank keeps its lock. "
        f"Fix: remove it (rm -r {lock}) and start the job again."
    )
    assert sorted(p.name for p in rank0.iterdir()) == ["rank0.lock"]  # nothing else left behind
    code = run_command(lambda args: 0, lambda argv: argv, [])
    assert code == 2 and capsys.readouterr().err == f"error: {err.value}\n"


def test_the_launcher_never_sees_a_starting_rank_as_exited(rank0, monkeypatch):
    """The launcher's watcher reads a free ``rank<R>.lock`` as a rank that has exited (a failure
    unless it reported ``done``). It polls while the rank starts, so its look here comes at the
    worst moment: just before the rank takes its lock. (CI once saw a rank reported "killed
    outright" 7.5 s into a job whose ranks were fine: the watcher had looked between the lock
    file's creation and its lock.)"""
    seen = []
    flock = fcntl.flock

    def flock_after_a_look(fd, operation):
        if operation == fcntl.LOCK_EX:
            watcher = supervise.Watcher(rank0)
            watcher.poll()
            seen.append(watcher.failures())
        return flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock_after_a_look)
    status.start()
    watcher = supervise.Watcher(rank0)
    assert (seen, watcher.failures(), sorted(watcher.poll())) == ([[]], [], [0])
    assert watcher.ranks[0].alive and watcher.ranks[0].status["state"] == "started"


def test_a_rank_holds_its_lock_and_reports_started(rank0):
    status.start()
    fd = os.open(rank0 / "rank0.lock", os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert '"state": "started"' in (rank0 / "rank0.json").read_text()
