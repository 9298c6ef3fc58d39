"""A rank's reports to its launcher (:mod:`helpers.launching.supervise` reads them).

Under mpirun the launcher sees one process (mpirun), under torchrun one per node: neither tells
when a single rank ends. So the launcher sets ``WORKSHOP_STATUS_DIR`` (a folder every rank sees
at the same path, ``<output_dir>/launch/status``) and each rank of ``helpers.train``:

* holds an exclusive ``flock`` on ``rank<R>.lock`` from its start until the process is gone. The
  kernel drops the lock whichever way the process ends (exit, exception, SIGKILL, a hang in
  interpreter teardown finally killed), so "lock free" means "exited", with no clock involved;
* rewrites ``rank<R>.json`` (host, pid, state, step, a beat counter) at every step and phase, and
  ``done`` (:func:`done`) once its command has succeeded: a lock freed without it is a rank that
  failed (an exception, or killed outright, e.g. by the out-of-memory killer), and the launcher
  stops the others at once instead of waiting for them;
* follows the launcher: the launcher holds ``launcher.lock`` in the same folder for the whole job,
  and a thread here looks once a second; when the lock is free the launcher is gone, however it
  ended (SIGKILL of a restarted notebook kernel included), and the rank sends itself SIGTERM. So
  no rank outlives its launcher by more than about a second, and none goes on to write
  ``run_summary.json`` as if the run had finished; its last complete checkpoint stays.

A rank that is not a process of its own (a Ray Train worker runs the engine inside a long-lived
actor) calls :func:`finish` when its training function ends, which frees the lock as an exit
would."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from helpers.core.errors import InputError
from helpers.core.files import write_text_atomic

STATUS_DIR_ENV = "WORKSHOP_STATUS_DIR"


WAITING = "waiting"


DONE = "done"  # the rank's command succeeded: it exits 0 (a free lock without it is a failure)


LAUNCHER_LOCK = "launcher.lock"


FOLLOW_SECONDS = 1.0  # how often a rank looks whether its launcher still holds its lock


def rank_from_env() -> int | None:
    """This process's global rank as the launchers set it (torchrun, Hydra/PMI, Open MPI)."""
    names = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")
    return next((int(os.environ[n]) for n in names if os.environ.get(n, "").isdigit()), None)


@dataclass
class _Reporter:
    folder: Path
    rank: int
    lock_fd: int
    beats: int = 0


_reporter: _Reporter | None = None


_finished = threading.Event()


def start() -> None:
    """Take this rank's lock and report ``started`` (no-op unless the launcher set the folder)."""
    global _reporter
    folder, rank = os.environ.get(STATUS_DIR_ENV), rank_from_env()
    if not folder or rank is None or _reporter is not None:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    # Never closed: the kernel releases the lock when the process is gone, not before.
    path = Path(folder) / f"rank{rank}.lock"
    try:
        fd = _locked_file(path)
    except IsADirectoryError:
        raise InputError(
            f"{STATUS_DIR_ENV}={folder}: {path.name} is a folder, where this rank keeps its lock. "
            f"Fix: remove it (rm -r {path}) and start the job again."
        ) from None
    _reporter = _Reporter(Path(folder), rank, fd)
    beat("started")
    follow_launcher(folder)


def _locked_file(path: Path) -> int:
    """A descriptor holding an exclusive ``flock`` on a new file that only then takes ``path``'s name.

    The launcher reads a lock it finds free as a rank that has exited, so the name must never show
    an unlocked file: created and locked under a hidden name, the file is renamed into place. The
    rename replaces a file or a symbolic link planted at ``path`` and never follows it; a folder
    there raises :class:`IsADirectoryError`. The descriptor is not inherited by child processes.
    """
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.unlink(missing_ok=True)  # left by an earlier process with this pid
    fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(staging, path)
    except BaseException:
        os.close(fd)
        staging.unlink(missing_ok=True)
        raise
    return fd


def _terminate_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def follow_launcher(folder: str | os.PathLike, gone: Callable[[], None] = _terminate_self) -> None:
    """If a launcher holds ``launcher.lock`` in ``folder``: call ``gone`` once it is free (by
    default SIGTERM to this process, which its handler turns into the usual clean-up).

    A thread looks every :data:`FOLLOW_SECONDS`; :func:`finish` stops it. Ranks call this through
    :func:`start`; the Ray driver, which is not a rank, calls it itself with a ``gone`` that ends
    its runtime from this thread (its main thread may sit in Ray's C++ wait, where no Python
    signal handler runs).
    """
    launcher = Path(folder) / LAUNCHER_LOCK
    if launcher.exists():
        _finished.clear()
        threading.Thread(target=_follow, args=(launcher, gone), name="follow-launcher", daemon=True).start()


def _follow(launcher: Path, gone: Callable[[], None]) -> None:
    """Call ``gone`` once the launcher's lock is free, unless the rank has finished."""
    while lock_held(launcher):
        if _finished.wait(FOLLOW_SECONDS):
            return
    if not _finished.is_set():
        gone()


def beat(state: str, step: int | None = None) -> None:
    """Report progress: ``state`` (e.g. ``training``, ``saving``, ``waiting``) and the step."""
    r = _reporter
    if r is None:
        return
    r.beats += 1
    status = {"rank": r.rank, "host": socket.gethostname(), "pid": os.getpid(), "state": state,
              "step": step, "beats": r.beats}  # fmt: skip
    write_text_atomic(r.folder / f"rank{r.rank}.json", json.dumps(status))


def done() -> None:
    """Report that this rank's command succeeded; it exits 0 next. The launcher reads a rank whose
    lock is free without this report as failed, and stops the job at once."""
    beat(DONE)


def finish(succeeded: bool = True) -> None:
    """This rank has ended although its process lives on: free its lock (read as an exit) and
    stop reporting. A no-op unless :func:`start` took the lock.

    Args:
        succeeded: report :data:`DONE` first (else the launcher reads the end as a failure).
    """
    global _reporter
    if succeeded and _reporter is not None:
        done()
    r, _reporter = _reporter, None
    _finished.set()  # a launcher that ends after this rank must not stop its process (a Ray actor)
    if r is not None:
        os.close(r.lock_fd)  # closing the only descriptor releases the flock


def lock_held(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the shared lock if it was granted
    return False
