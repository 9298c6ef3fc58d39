"""helpers.ranks.status: a rank's lock never follows a link planted at its known name."""

from __future__ import annotations

import fcntl
import os

import pytest

from helpers.core.errors import InputError, run_training_cli
from helpers.ranks import status


@pytest.fixture
def rank0(tmp_path, monkeypatch):
    """This process as rank 0 of a job whose status folder is ``tmp_path/status``; its lock freed after."""
    folder = tmp_path / "status"
    folder.mkdir()
    monkeypatch.setenv(status.STATUS_DIR_ENV, str(folder))
    monkeypatch.setenv("RANK", "0")
    yield folder
    status.finish()


@pytest.mark.parametrize("kind", ["link", "folder"])
def test_a_link_or_folder_at_the_ranks_lock_is_one_line_and_its_target_untouched(
    tmp_path, rank0, kind, capsys
):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    lock = rank0 / "rank0.lock"
    lock.symlink_to(victim) if kind == "link" else lock.mkdir()
    with pytest.raises(InputError) as err:
        status.start()
    assert str(err.value) == (
        f"{status.STATUS_DIR_ENV}={rank0}: rank0.lock is a symbolic link or a folder, where this rank keeps its "
        f"lock. Fix: remove it (rm -r {lock}) and start the job again."
    )
    assert victim.read_text() == "precious" and sorted(p.name for p in rank0.iterdir()) == ["rank0.lock"]
    code = run_training_cli(lambda args: 0, lambda argv: argv, [], status.start, lambda _: "interrupted", 130)
    assert code == 2 and capsys.readouterr().err == f"error: {err.value}\n"


def test_a_rank_holds_its_lock_and_reports_started(rank0):
    status.start()
    fd = os.open(rank0 / "rank0.lock", os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert '"state": "started"' in (rank0 / "rank0.json").read_text()
