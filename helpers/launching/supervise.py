"""Per-rank status for :mod:`helpers.launch`: which ranks started, which still run, who progresses.

Under mpirun the launcher sees one process (mpirun), under torchrun one per node: neither tells
when a single rank ends. So the launcher sets ``WORKSHOP_STATUS_DIR`` (a folder every rank sees
at the same path, ``<output_dir>/launch/status``) and each rank of ``helpers.train``:

* holds an exclusive ``flock`` on ``rank<R>.lock`` from its start until the process is gone. The
  kernel drops the lock whichever way the process ends (exit, exception, SIGKILL, a hang in
  interpreter teardown finally killed), so "lock free" means "exited", with no clock involved;
* rewrites ``rank<R>.json`` (host, pid, state, step, a beat counter) at every step and phase.
  The launcher times progress with its own clock: a rank whose beat counter has not moved for
  ``stall_seconds`` is stalled. A rank whose state is ``waiting`` (in a barrier while rank 0
  validates or saves) is not judged.

:func:`stop` ends a job: TERM, then KILL, to the launchers' process trees here and to the ranks
on other hosts (their host and pid come from the status files) over ssh.

The launcher holds an exclusive ``flock`` on ``launcher.lock`` in the same folder for the whole
job (:func:`hold_launcher_lock`), and every rank follows it (:func:`start` starts a thread that looks
once a second): when the lock is free, the launcher is gone, however it ended (SIGKILL of a restarted
notebook kernel included), and the rank sends itself SIGTERM. So no rank outlives its launcher by
more than about a second, and none goes on to write ``run_summary.json`` as if the run had finished;
its last complete checkpoint stays, and the run resumes from it.

A rank that is not a process of its own (a Ray Train worker runs the engine inside a long-lived
actor) calls :func:`finish` when its training function ends, which frees the lock as an exit
would; :func:`add_listener` lets such a rank see every beat (e.g. to report each step to Ray).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from helpers.core.files import write_text_atomic
from helpers.core.outputs import SUMMARY
from helpers.launching.distributed import is_local_host

STATUS_DIR_ENV = "WORKSHOP_STATUS_DIR"
WAITING = "waiting"
LAUNCHER_LOCK = "launcher.lock"
FOLLOW_SECONDS = 1.0  # how often a rank looks whether its launcher still holds its lock


def rank_from_env() -> int | None:
    """This process's global rank as the launchers set it (torchrun, Hydra/PMI, Open MPI)."""
    for name in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


# --- in the rank ---------------------------------------------------------------------------------


@dataclass
class _Reporter:
    folder: Path
    rank: int
    lock_fd: int
    beats: int = 0


_reporter: _Reporter | None = None
_finished = threading.Event()
Listener = Callable[[str, int | None], None]  # (state, step)
_listeners: list[Listener] = []


def start() -> None:
    """Take this rank's lock and report ``started`` (no-op unless the launcher set the folder)."""
    global _reporter
    folder, rank = os.environ.get(STATUS_DIR_ENV), rank_from_env()
    if not folder or rank is None or _reporter is not None:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    # Never closed: the kernel releases the lock when the process is gone, not before.
    fd = os.open(Path(folder) / f"rank{rank}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _reporter = _Reporter(Path(folder), rank, fd)
    beat("started")
    follow_launcher(folder)


def follow_launcher(folder: str | os.PathLike) -> None:
    """If a launcher holds ``launcher.lock`` in ``folder``: SIGTERM this process once it is free.

    A thread looks every :data:`FOLLOW_SECONDS`; :func:`finish` stops it. Ranks call this through
    :func:`start`; the Ray driver, which is not a rank, calls it itself.
    """
    launcher = Path(folder) / LAUNCHER_LOCK
    if launcher.exists():
        _finished.clear()
        threading.Thread(target=_follow, args=(launcher,), name="follow-launcher", daemon=True).start()


def _follow(launcher: Path) -> None:
    """End this process (SIGTERM) once the launcher's lock is free, unless the rank has finished."""
    while _lock_held(launcher):
        if _finished.wait(FOLLOW_SECONDS):
            return
    if not _finished.is_set():
        os.kill(os.getpid(), signal.SIGTERM)


def beat(state: str, step: int | None = None) -> None:
    """Report progress: ``state`` (e.g. ``training``, ``saving``, ``waiting``) and the step.

    Every listener (:func:`add_listener`) is called first, in this thread; an exception it raises
    propagates to the caller (the training loop), as the failure of this rank.
    """
    for listener in list(_listeners):
        listener(state, step)
    r = _reporter
    if r is None:
        return
    r.beats += 1
    status = {"rank": r.rank, "host": socket.gethostname(), "pid": os.getpid(), "state": state,
              "step": step, "beats": r.beats}  # fmt: skip
    write_text_atomic(r.folder / f"rank{r.rank}.json", json.dumps(status))


def finish() -> None:
    """This rank has ended although its process lives on: free its lock (read as an exit) and
    stop reporting. A no-op unless :func:`start` took the lock."""
    global _reporter
    r, _reporter = _reporter, None
    _finished.set()  # a launcher that ends after this rank must not stop its process (a Ray actor)
    if r is not None:
        os.close(r.lock_fd)  # closing the only descriptor releases the flock


def add_listener(listener: Listener) -> None:
    """Call ``listener(state, step)`` at every :func:`beat` of this process, until removed."""
    _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    """Stop calling ``listener`` (no error if it is not registered)."""
    if listener in _listeners:
        _listeners.remove(listener)


# --- in the launcher -----------------------------------------------------------------------------


def _tree(procs: Sequence[subprocess.Popen]) -> list[psutil.Process]:
    """The commands' descendants here (ranks, proxies), found before any is signalled."""
    found = []
    for p in procs:
        try:
            found += psutil.Process(p.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    return found


def stop(
    procs: Sequence[subprocess.Popen],
    wait: float = 5.0,
    ranks: Sequence[tuple[str, int]] = (),
    ssh: Sequence[str] = ("ssh",),
) -> None:
    """TERM, then KILL: each command's process group, every descendant here (a rank may have
    left the group), and ``ranks`` given as ``(host, pid)`` on other hosts, over ssh."""
    tree = _tree(procs)
    remote = [(h, pid) for h, pid in ranks if not is_local_host(h)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        for child in tree:
            try:
                child.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        for host, pid in remote:
            kill = [*ssh, "-o", "BatchMode=yes", host, f"kill -{sig.name[3:]} {pid}"]
            subprocess.run(kill, capture_output=True, timeout=30, check=False)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and (
            any(p.poll() is None for p in procs) or any(map(_alive, tree))
        ):
            time.sleep(0.1)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def hold_launcher_lock(folder: str | os.PathLike) -> int:
    """Take the launcher's lock in the status folder; its ranks end once it is free (:func:`start`).

    Returns:
        The descriptor: close it when the job has ended (the kernel frees it anyway when this
        process is gone). It is not inherited by the commands started after it.
    """
    fd = os.open(Path(folder) / LAUNCHER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def interrupt(signum: int, frame: object) -> None:
    """A signal handler that raises :class:`KeyboardInterrupt` naming the signal."""
    raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")


@contextlib.contextmanager
def signals_interrupt(signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Within the block, TERM and HUP raise :class:`KeyboardInterrupt` as Ctrl-C does.

    A scheduler's time limit, ``kill`` or a closed terminal then goes through the same clean-up as
    Ctrl-C (the job is stopped, never orphaned). Outside the main thread, where Python cannot set
    handlers, the block runs unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, interrupt) for s in signals}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def prepare(folder: str | os.PathLike) -> Path:
    """Empty the status folder before a job starts (an earlier run's free locks read as exited)."""
    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def _lock_held(path: Path) -> bool:
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


@dataclass
class RankState:
    """What the launcher knows of one rank."""

    rank: int
    alive: bool
    status: dict = field(default_factory=dict)
    exited_at: float | None = None  # launcher's monotonic clock
    progress_at: float = 0.0  # when its beat counter last moved


class Watcher:
    """Polls the status folder; says which ranks exited, which still run, which stalled."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.ranks: dict[int, RankState] = {}

    def poll(self, now: float | None = None) -> dict[int, RankState]:
        now = time.monotonic() if now is None else now
        for lock in self.folder.glob("rank*.lock"):
            rank = int(lock.stem[4:])
            state = self.ranks.get(rank) or RankState(rank, True, progress_at=now)
            self.ranks[rank] = state
            try:
                status = json.loads((self.folder / f"rank{rank}.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                status = state.status
            if status.get("beats") != state.status.get("beats"):
                state.progress_at = now
            state.status = status
            if state.alive and not _lock_held(lock):
                state.alive, state.exited_at = False, now
        return self.ranks

    def first_exit(self) -> tuple[int, float] | None:
        """The rank that exited first and when, if any did."""
        done = [(s.exited_at, r) for r, s in self.ranks.items() if s.exited_at is not None]
        return (min(done)[1], min(done)[0]) if done else None

    def running(self) -> list[int]:
        return sorted(r for r, s in self.ranks.items() if s.alive)

    def stalled(self, now: float, stall_seconds: float) -> list[int]:
        """Alive ranks whose beats have not moved for ``stall_seconds``.

        A rank reporting ``waiting`` (in a collective, or a barrier while rank 0 saves) waits for a
        stalled one and is not named, unless every rank alive is stale and waiting: then the
        collective itself hangs and all of them are named.
        """
        alive = {r: s for r, s in self.ranks.items() if s.alive}
        stale = sorted(r for r, s in alive.items() if now - s.progress_at > stall_seconds)
        working = [r for r in stale if alive[r].status.get("state") != WAITING]
        return working or (stale if len(stale) == len(alive) else [])

    def verdict(
        self, now: float, exit_grace: float, stall_seconds: float, launcher_running: bool
    ) -> tuple[list[int], str] | None:
        """The ranks to stop and why (one sentence), or None while the job is fine."""
        first, running = self.first_exit(), self.running()
        if first is not None and now - first[1] > exit_grace:
            if running:
                return running, (
                    f"{_ranks(running)} did not end within {exit_grace:g} s of rank {first[0]} exiting; "
                    f"helpers.launch stopped {'it' if len(running) == 1 else 'them'}."
                )
            last = max(s.exited_at or 0.0 for s in self.ranks.values())
            if launcher_running and now - last > exit_grace:
                return [], (
                    f"every rank exited, but the launcher did not end within {exit_grace:g} s; "
                    "helpers.launch stopped it."
                )
        stalled = self.stalled(now, stall_seconds)
        if stalled:
            where = "; ".join(
                f"rank {r}: {self.ranks[r].status.get('state', 'started')}, step {self.ranks[r].status.get('step')}"
                for r in stalled
            )
            return stalled, (
                f"{_ranks(stalled)} made no progress for {stall_seconds:g} s (last report: {where}); "
                "helpers.launch stopped the job."
            )
        return None


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def outputs(output_dir: str | None, since: float) -> tuple[bool | None, str]:
    """Whether the run finished its outputs (``run_summary.json`` written since ``since``), in words."""
    if output_dir is None:
        return None, "Outputs unknown: no output_dir known to helpers.launch."
    path = Path(output_dir) / SUMMARY
    if path.is_file() and path.stat().st_mtime >= since - 1:
        return True, f"Outputs complete: {path} was written."
    return False, f"Outputs incomplete: {path} was not written."
