"""run_job on plain commands (no training, no status folder): streaming, exit codes, stopping, the first failure."""

from __future__ import annotations

import io
import sys
import time

import pytest

from helpers import launch
from helpers.core.errors import DistributedError
from helpers.launching import job
from helpers.launching.commands import LaunchCommand
from helpers.training import data


def _python(code: str) -> LaunchCommand:
    return LaunchCommand((sys.executable, "-c", code))


def test_a_job_that_succeeds_streams_rank_0_and_reports_no_failure(tmp_path):
    stream = io.StringIO()
    result = job.run_job(
        [_python("print('[0] hello from rank 0'); print('[1] hello from rank 1')"), _python("print('[2] done')")],
        stream=stream, log_path=tmp_path / "job.log",
    )  # fmt: skip
    assert (result.returncode, result.killed, result.failed_rank, result.error) == (0, False, None, "")
    assert result.ok and result.message().startswith("job finished in ")
    assert "hello from rank 0" in stream.getvalue() and "hello from rank 1" not in stream.getvalue()
    assert "hello from rank 1" in (tmp_path / "job.log").read_text()


def test_a_failed_rank_is_named_and_the_others_stopped_at_once(tmp_path):
    """A command that exits non-zero stops the job at once, with the default exit grace (60 s,
    for ranks that end well): the other command, sleeping 60 s, is stopped long before. Its whole
    traceback (3,000 lines written one by one, so the exit is seen before they are all read) is in
    the log before the launcher's line."""
    crash = (
        "import sys\nprint('[1] Traceback (most recent call last):', flush=True)\n"
        "for k in range(3000): print(f'[1]   frame {k}', flush=True)\n"
        "print('[1] RuntimeError: boom', flush=True); sys.exit(3)"
    )
    hang = "import time; time.sleep(60)"
    started, stream = time.monotonic(), io.StringIO()
    result = job.run_job([_python(crash), _python(hang)], stream=stream, log_path=tmp_path / "job.log")
    assert time.monotonic() - started < 30
    assert (result.returncode, result.killed, result.failed_rank) == (3, True, 1)
    assert result.error == "RuntimeError: boom"
    assert result.message() == (
        f"rank 1 failed after {result.seconds:.1f} s: RuntimeError: boom; helpers.launch stopped the other "
        f"ranks. Every rank's output, tracebacks included: {tmp_path / 'job.log'}"
    )
    assert stream.getvalue() == ""  # the traceback is in the log, not on the screen
    log = (tmp_path / "job.log").read_text().splitlines()
    assert log[0] == "[1] Traceback (most recent call last):" and log[3000] == "[1]   frame 2999"
    assert log[-2:] == ["[1] RuntimeError: boom", "helpers.launch: stopping the job: a command failed"]


def test_the_timeout_stops_the_job():
    started = time.monotonic()
    result = job.run_job([_python("import time; time.sleep(60)")], stream=io.StringIO(), timeout=1)
    assert time.monotonic() - started < 30
    assert result.killed and not result.ok and result.returncode != 0


def test_ranks_that_never_start_stop_the_job_after_the_stall_limit(tmp_path):
    """A launcher that runs but never starts its ranks (MPI out of file descriptors, a node that never
    joins) is stopped once ``stall_seconds`` have passed without their reports, as a stalled rank is."""
    started = time.monotonic()
    command = LaunchCommand(("sleep", "600"), status_dir=str(tmp_path / "status"), world_size=2)
    result = job.run_job([command], stream=io.StringIO(), stall_seconds=3, log_path=tmp_path / "job.log")
    assert 3 < time.monotonic() - started < 30 and result.killed and result.returncode == 1
    assert result.supervision.splitlines()[0] == (
        "ranks 0, 1 of 2 did not start within 3 s of the job's start (no status report); helpers.launch "
        "stopped the job. Outputs unknown: no output_dir known to helpers.launch."
    )


def test_a_link_planted_where_the_job_writes_is_refused_and_its_target_kept(tmp_path, capsys, monkeypatch):
    """``<output_dir>/launch`` (emptied at every start) and ``job.log`` (truncated) never follow a link:
    one line and exit 2 before anything starts; the file the link points to keeps its content."""
    monkeypatch.chdir(tmp_path)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    (out / "launch").symlink_to(precious)
    train = ["--train_data_dir", str(data.sample_concept_dir()), "--output_dir", str(out)]
    assert launch.main(launch.parse_args(["--launcher", "torchrun", "--dry_run", "--", *train])) == 2
    assert capsys.readouterr().err == (
        f"error: {out / 'launch'} is a symbolic link: remove it, or pass another --work_dir (the job empties "
        "and writes it)\n"
    )
    log = tmp_path / "job.log"
    log.symlink_to(precious / "notes.txt")
    with pytest.raises(DistributedError, match="is a symbolic link: remove it"):
        job.run_job([_python("print('x')")], stream=io.StringIO(), log_path=log)
    assert (precious / "notes.txt").read_text() == "keep me" and sorted(
        p.name for p in precious.iterdir()
    ) == ["notes.txt"]
