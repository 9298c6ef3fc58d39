"""One run at a time in an output folder: :class:`FolderLock`, the ``flock`` a run holds on
``output_dir/.output_dir.lock`` from before its models load to its end (:func:`helpers.training.engine.folder.hold_output_dir`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import stat
import sys
from pathlib import Path

from helpers.ranks.status import rank_from_env
from helpers.training.engine import TrainingInputError

logger = logging.getLogger(__name__)

LOCK_FILE = ".output_dir.lock"
"""The file in ``output_dir`` whose ``flock`` the running run holds (removed when it ends)."""

_LOCK_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a link; a planted FIFO cannot block
_HELD: dict[Path, FolderLock] = {}  # the folders this process holds: its own checks must not refuse them


def is_main_process() -> bool:
    """Whether this process is its job's main process (rank 0, or not launched as a rank)."""
    return rank_from_env() in (None, 0)  # the launchers' variables: no process group yet


class FolderLock:
    """One run at a time in an output folder: an exclusive ``fcntl.flock`` on ``output_dir/.output_dir.lock``.

    The kernel frees a flock when its process ends, however it ends (SIGKILL included), so the
    file a killed run leaves is free and the next run takes it over. The file holds the holder's
    pid, host and command, for the line a second run gets. It is opened with ``O_NOFOLLOW``: a lock
    path that is a link, a folder or not a regular file is refused, never written through. Only a
    job's main process takes it:
    the ranks of one job share ``output_dir``. A flock keeps apart the runs of one host only
    (not two hosts writing one network folder).

    Args:
        output_dir: the run's folder (created by :meth:`acquire` if missing).
    """

    def __init__(self, output_dir: str | os.PathLike):
        self.folder = Path(output_dir)
        self.path = self.folder / LOCK_FILE
        self.taken_over: str | None = None  # the holder a killed run left in the file, if any
        self._fd: int | None = None

    def holder(self) -> str | None:
        """Who holds the lock now (``pid N on host H: command``), or None if no other run does."""
        if self.path.absolute() in _HELD:
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY | _LOCK_FLAGS)
        except FileNotFoundError:
            return None
        except OSError as err:  # a link, or not readable: then no run of this user holds it
            self._refuse_if_not_a_file(err)
            return None
        try:
            self._refuse_if_not_a_file(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _describe(_read_all(fd))
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def refuse_if_held(self) -> None:
        """Raise :class:`TrainingInputError` naming the run that holds the lock, if one does."""
        held = self.holder()
        if held is not None:
            raise self._in_use(held)

    def _refuse_if_not_a_file(self, opened: int | OSError) -> None:
        """Raise :class:`TrainingInputError` if the lock path is a link, a folder or not a regular file.

        Args:
            opened: the descriptor of the lock file (left open), or the error opening it raised.
        """
        if isinstance(opened, int):
            mode = os.fstat(opened).st_mode
            what = None if stat.S_ISREG(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        elif opened.errno == errno.ELOOP or self.path.is_symlink():
            what = (
                f"a symbolic link (to {os.readlink(self.path)})"
                if self.path.is_symlink()
                else "a symbolic link"
            )
        elif opened.errno == errno.EISDIR:
            what = "a folder"
        else:
            return
        if what is None:
            return
        raise TrainingInputError(
            f"output_dir {self.folder}: {LOCK_FILE} is {what}, where a run keeps its lock (a plain file it "
            f"creates; a link could make it overwrite another file). Fix: remove it (rm -r {self.path}), or "
            f"choose another output_dir."
        )

    def _in_use(self, held: str) -> TrainingInputError:
        return TrainingInputError(
            f"output_dir {self.folder} is in use by another run ({held}). "
            f"Fix: wait for that run to end (or stop it), or choose another output_dir."
        )

    def acquire(self) -> FolderLock:
        """Take the lock (creating the folder), or raise :class:`TrainingInputError` naming its holder."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a holder ending between our open and flock removes the file: open it again
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _LOCK_FLAGS, 0o644)
            except OSError as err:
                self._refuse_if_not_a_file(err)
                raise
            try:
                self._refuse_if_not_a_file(fd)
            except TrainingInputError:
                os.close(fd)
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = _describe(_read_all(fd))
                os.close(fd)
                raise self._in_use(held) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)
        else:
            raise TrainingInputError(f"output_dir {self.folder}: {LOCK_FILE} keeps changing. Fix: try again.")
        previous = _read_all(fd)
        self.taken_over = _describe(previous) if previous.strip() else None
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": " ".join(shlex.join(sys.orig_argv).split())[:300],
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        _HELD[self.path.absolute()] = self
        if self.taken_over:
            logger.warning(
                "output_dir %s: took over the lock of a run that ended (%s)", self.folder, self.taken_over
            )
        return self

    def release(self) -> None:
        """Remove the lock file and free the lock (the file first, so nobody locks a removed file)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):  # the folder went away: nothing to clean
            if _same_file(self._fd, self.path):
                self.path.unlink()
        os.close(self._fd)
        self._fd = None
        _HELD.pop(self.path.absolute(), None)

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_all(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode("utf-8", "replace")


def _describe(text: str) -> str:
    try:
        info = json.loads(text)
        return f"pid {info['pid']} on host {info['host']}: {info['command']}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no details"


def _same_file(fd: int, path: Path) -> bool:
    try:
        mine, theirs = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)
