"""The launcher's side of supervision: which ranks run, which stalled, and stopping a job.

Each rank reports to a status folder (:mod:`helpers.ranks.status`). :class:`Watcher` polls it;
:func:`stop` ends a job: TERM, then KILL, to the launchers' process trees here and to the ranks
on other hosts (their host and pid come from the status files) over ssh. The launcher holds
``launcher.lock`` there for the whole job (:func:`hold_launcher_lock`): its ranks end themselves
once it is free, however the launcher ended; :func:`signals_interrupt` makes TERM and HUP stop the
job as Ctrl-C does."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from helpers.core.outputs import SUMMARY
from helpers.launching.layout import is_local_host
from helpers.ranks import oneccl
from helpers.ranks.status import DONE, LAUNCHER_LOCK, WAITING, lock_held


def _tree(procs: Sequence[subprocess.Popen]) -> list[psutil.Process]:
    """The commands' descendants here (ranks, proxies), found before any is signalled."""
    found = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            found += psutil.Process(p.pid).children(recursive=True)
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
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
        for child in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.send_signal(sig)
        for host, pid in remote:
            kill = [*ssh, "-o", "BatchMode=yes", host, f"kill -{sig.name[3:]} {pid}"]
            subprocess.run(kill, capture_output=True, timeout=30, check=False)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and (
            any(p.poll() is None for p in procs) or any(map(_alive, tree))
        ):
            time.sleep(0.1)


def _alive(proc: psutil.Process | int) -> bool:
    """Whether the process (or pid) still runs here: not exited, not a zombie."""
    try:
        return (psutil.Process(proc) if isinstance(proc, int) else proc).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def hold_launcher_lock(folder: str | os.PathLike) -> int:
    """Take the launcher's lock in the status folder; its ranks end once it is free (:func:`start`).

    Returns:
        The descriptor: close it when the job has ended (the kernel frees it anyway when this
        process is gone). It is not inherited by the commands started after it.
    """
    fd = os.open(Path(folder) / LAUNCHER_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
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
    """Empty the status folder before a job starts (an earlier run's free locks read as exited),
    after removing what its ranks here left in shared memory (:func:`remove_shared_memory`)."""
    folder = Path(folder)
    remove_shared_memory(folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def remove_shared_memory(folder: str | os.PathLike) -> list[str]:
    """Remove the shared-memory files of the ranks of this machine reporting in ``folder`` that
    are gone (:func:`helpers.ranks.oneccl.remove_regions`: a rank killed outright leaves its file).

    :func:`helpers.launching.job.run_job` calls it once its job has ended, and, through
    :func:`prepare`, for the previous job in the same folder (its launcher may have been killed
    outright too). Ranks still alive keep theirs. Returns the names removed.
    """
    gone = []
    for path in Path(folder).glob("rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            report = json.loads(path.read_text())
            pid = report.get("pid")
            if is_local_host(str(report.get("host"))) and type(pid) is int and not _alive(pid):
                gone.append(pid)
    return oneccl.remove_regions(gone)


@dataclass
class RankState:
    """What the launcher knows of one rank."""

    rank: int
    alive: bool
    status: dict = field(default_factory=dict)
    exited_at: float | None = None  # launcher's monotonic clock
    progress_at: float = 0.0  # when its beat counter last moved

    @property
    def failed(self) -> bool:
        """Exited without reporting success (:data:`helpers.ranks.status.DONE`): an exception, or
        killed outright (an out-of-memory kill prints nothing)."""
        return not self.alive and self.status.get("state") != DONE


class Watcher:
    """Polls the status folder; says which ranks exited, which still run, which stalled, and which
    of the job's ``world_size`` ranks never started (none known without it)."""

    def __init__(
        self, folder: str | os.PathLike, world_size: int | None = None, started: float | None = None
    ):
        self.folder = Path(folder)
        self.ranks: dict[int, RankState] = {}
        self.world_size = world_size
        self.started = time.monotonic() if started is None else started  # the launcher's clock

    def poll(self, now: float | None = None) -> dict[int, RankState]:
        now = time.monotonic() if now is None else now
        for lock in self.folder.glob("rank*.lock"):
            rank = int(lock.stem[4:])
            state = self.ranks.get(rank) or RankState(rank, True, progress_at=now)
            self.ranks[rank] = state
            ended = state.alive and not lock_held(lock)  # before the report: a rank's last is written by then
            try:
                status = json.loads((self.folder / f"rank{rank}.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                status = state.status
            if status.get("beats") != state.status.get("beats"):
                state.progress_at = now
            state.status = status
            if ended:
                state.alive, state.exited_at = False, now
        return self.ranks

    def failures(self) -> list[int]:
        """The ranks that exited without succeeding, in the order they exited."""
        return [r for _, r in sorted((s.exited_at, r) for r, s in self.ranks.items() if s.failed)]

    def first_failed(self) -> list[int]:
        """The ranks first found to have failed: every one that the same poll found exited. Which of
        them ended first is unknown (a rank that raises takes its peers down within milliseconds);
        :func:`helpers.launching.rank_output.diagnose` tells the root cause from the peers' errors."""
        failed = self.failures()
        return (
            [r for r in failed if self.ranks[r].exited_at == self.ranks[failed[0]].exited_at]
            if failed
            else []
        )

    def first_exit(self) -> tuple[int, float] | None:
        """The rank that exited first and when, if any did."""
        done = [(s.exited_at, r) for r, s in self.ranks.items() if s.exited_at is not None]
        return (min(done)[1], min(done)[0]) if done else None

    def running(self) -> list[int]:
        return sorted(r for r, s in self.ranks.items() if s.alive)

    def missing(self) -> list[int]:
        """The job's ranks that have not started: no lock of theirs in the folder yet."""
        return [r for r in range(self.world_size or 0) if r not in self.ranks]

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
        missing = self.missing()  # e.g. MPI could not spawn them, or a node never joined
        if missing and now - self.started > stall_seconds:
            return running, (
                f"{_ranks(missing)} of {self.world_size} did not start within {stall_seconds:g} s of the "
                "job's start (no status report); helpers.launch stopped the job."
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
    """``rank 3``, ``ranks 0, 2`` or, for runs of three or more, ``ranks 0, 4-99``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs]
    return "ranks " + ", ".join(parts)


def outputs(output_dir: str | None, since: float) -> tuple[bool | None, str]:
    """Whether the run finished its outputs (``run_summary.json`` written since ``since``), in words."""
    if output_dir is None:
        return None, "Outputs unknown: no output_dir known to helpers.launch."
    path = Path(output_dir) / SUMMARY
    if path.is_file() and path.stat().st_mtime >= since - 1:
        return True, f"Outputs complete: {path} was written."
    return False, f"Outputs incomplete: {path} was not written."
