"""run_job on plain commands (no training, no status folder): streaming, exit codes, stopping, the first failure."""

from __future__ import annotations

import io
import sys
import time

from helpers.launching import job
from helpers.launching.commands import LaunchCommand


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


def test_a_failed_rank_is_named_and_the_others_stopped_after_the_grace():
    crash = "import sys; print('[1] Traceback (most recent call last):'); print('[1] RuntimeError: boom'); sys.exit(3)"
    hang = "import time; time.sleep(60)"
    started = time.monotonic()
    result = job.run_job([_python(crash), _python(hang)], stream=io.StringIO(), exit_grace_seconds=1)
    assert time.monotonic() - started < 30
    assert (result.returncode, result.killed, result.failed_rank) == (3, True, 1)
    assert result.error == "RuntimeError: boom"
    assert "the other ranks did not stop on their own; helpers.launch stopped them" in result.message()


def test_the_timeout_stops_the_job():
    started = time.monotonic()
    result = job.run_job([_python("import time; time.sleep(60)")], stream=io.StringIO(), timeout=1)
    assert time.monotonic() - started < 30
    assert result.killed and not result.ok and result.returncode != 0
