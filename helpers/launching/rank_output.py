"""Reading the ranks' output: which rank a line is from, which rank failed first, with which error.

The launchers tag each line with its rank (Hydra ``[1] ``, Open MPI ``[1,1]<stderr>:``, torchrun
``[default1]:``, Ray's ``(RayTrainWorker pid=…)`` with the worker's first line naming its rank).
:class:`Output` streams rank 0's lines and keeps every rank's tail; :func:`diagnose` names the
root cause (the first rank's own exception, not its peers' "remote worker" errors or the
launchers' wrappers)."""

from __future__ import annotations

import math
import re
import signal
import time
from collections import deque
from collections.abc import Collection
from typing import TextIO

from helpers.launching.commands import LaunchCommand

# The first tag on a line names its rank; launchers also split lines and tag the pieces.
WORKER_TAG = "helpers.launching.ray_train worker:"  # first line of each Ray worker: its rank, pid and node
FAILED_TAG = "helpers.launching.ray_train: ray worker"  # the Ray driver's line about a worker that failed
_TAGS = {
    "hydra": r"\[({rank})\] ",  # -l / -prepend-rank: "[1] text"
    "openmpi": r"\[\d+,({rank})\]<std(?:out|err)>: ?",  # --tag-output: "[1,1]<stderr>:text"
    "torchrun": r"\[default({rank})\]:",  # --tee 3: "[default1]:text"
}


# Ray prefixes each line it forwards with the actor and its pid, "(RayTrainWorker pid=123, ip=10.0.0.5) ";
# each worker's first line names its rank (WORKER_TAG), so the pid leads to the rank.
_RAY_PREFIX = re.compile(r"\((?P<actor>[A-Za-z_]\w*) pid=(?P<pid>\d+)(?:, ip=[^)]*)?\) ")


_RAY_WORKER = re.compile(re.escape(WORKER_TAG) + r" rank (\d+) ")


_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")  # torch prefixes its own tracebacks


_EXCEPTION = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Failure)\b(?::.*)?$|^error: .+"
)


_WRAPPERS = (
    "CalledProcessError",
    "ChildFailedError",
)  # accelerate launch / torchrun re-raising a child's failure


# Errors a rank gets because another rank went away (gloo says "check the logs of the remote worker").
SECONDARY = re.compile(r"remote worker|by peer|Broken pipe|SIGTERM|Socket Timeout|/gloo/", re.IGNORECASE)


_LAUNCHER_REPORTS = (  # (rank, reason) in the launchers' own failure summaries
    re.compile(
        r"RANK (?P<rank>\d+) PID \d+ RUNNING AT \S+\s*=*\s*(?P<reason>KILLED BY SIGNAL: \d+.*|EXIT CODE: \d+)"
    ),
    re.compile(r"Process name: \[\[\d+,\d+\],(?P<rank>\d+)\]\s+(?P<reason>Exit code:\s+\d+|Signal:.*)"),
    re.compile(r"Root Cause.*?rank\s+: (?P<rank>\d+).*?exitcode\s+: (?P<reason>-?\d+[^\n]*)", re.DOTALL),
    re.compile(re.escape(FAILED_TAG) + r" rank (?P<rank>\d+) (?P<reason>failed on node .*)"),
)


OOM_HINT = "for example by the out-of-memory killer"
SILENT_END = f"it ended without an error message, as a process killed outright does (SIGKILL, {OOM_HINT})"


def killed_by(signum: int) -> str:
    """How a person reads a rank's death by signal ``signum``."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return f"killed by {name}, {OOM_HINT}" if signum == signal.SIGKILL else f"killed by {name}"


# A signal in the launchers' words: Hydra's "KILLED BY SIGNAL: 9", torchrun's "exitcode : -9",
# Open MPI's "Signal: 9", subprocess's "died with <Signals.SIGKILL: 9>".
_SIGNAL = re.compile(r"KILLED BY SIGNAL: (\d+)|^-(\d+)\b|Signal:\s*(\d+)|died with <Signals\.\w+: (\d+)>")


def _shorten(error: str) -> str:
    """``CalledProcessError: Command '[...]' died with <Signals.SIGKILL: 9>.`` -> the gist."""
    m = re.search(r"died with <Signals\.\w+: (\d+)>|returned non-zero exit status (-?\d+)", error)
    if not m or not any(w in error for w in _WRAPPERS):
        return error
    return (
        f"the training process was {killed_by(int(m[1]))}"
        if m[1]
        else f"the training process exited with code {m[2]}"
    )


def _launcher_words(reason: str) -> str:
    """A launcher's report of a rank's end, with a signal said as :func:`killed_by` says it."""
    reason = reason.strip()
    m = _SIGNAL.search(reason)
    return (
        f"{killed_by(int(next(g for g in m.groups() if g)))} (the launcher reports {reason})"
        if m
        else (f"the launcher reports {reason}")
    )


def _stopped_by_us(reason: str) -> bool:
    """A launcher's report of SIGTERM for the rank known to have failed is the stop helpers.launch
    sent its wrapper (``accelerate launch``) after the rank itself had died, not the cause."""
    m = _SIGNAL.search(reason.strip())
    return bool(m) and int(next(g for g in m.groups() if g)) == signal.SIGTERM


def diagnose(
    errors: dict[int, list[str]],
    first_seen: dict[int, float],
    launcher_text: str,
    ranks: Collection[int] = (),
) -> tuple[int | None, str]:
    """Pick the rank that failed first and its root error.

    A rank's root error is its first exception line that is not a launcher re-raising it; ranks
    whose error says a peer went away failed because of another rank, so they come last.
    Without any exception line, the launcher's own summary (Hydra, Open MPI, torchrun) decides.

    Args:
        errors, first_seen: :class:`Output`'s exception lines and first traceback times per rank.
        launcher_text: the launchers' own lines.
        ranks: the ranks first known to have failed (their status reports; one poll may find
            several), if any are: the one among them with a root error, else one its launcher
            reports (not the TERM of our own stop), else one that printed nothing
            (:data:`SILENT_END`), else the first with a peer's error. A rank seen to end first
            with a peer's error was taken down by another: when every one of them printed such
            an error, another rank's root error wins (the rank that raised may still be
            shutting down when its peer, told at once, has already exited).
    """
    everyone = []
    for r, lines in errors.items():
        own = [ln for ln in lines if not any(w in ln for w in _WRAPPERS)]
        error = (own or lines)[0]
        everyone.append((bool(SECONDARY.search(error)), first_seen.get(r, math.inf), r, _shorten(error)))
    candidates = [c for c in everyone if c[2] in ranks] if ranks else everyone
    best = min(candidates) if candidates else None
    if best and not best[0]:
        return best[2], best[3]
    roots = [c for c in everyone if not c[0]]
    if best and roots and all(r in errors for r in ranks):
        return min(roots)[2], min(roots)[3]
    for pattern in _LAUNCHER_REPORTS:  # a rank killed outright prints nothing: its launcher knows
        for m in pattern.finditer(launcher_text):
            if not ranks or (int(m["rank"]) in ranks and not _stopped_by_us(m["reason"])):
                return int(m["rank"]), _launcher_words(m["reason"])
    if ranks:
        silent = [r for r in ranks if r not in errors]
        return (silent[0], SILENT_END) if silent else (best[2], best[3])
    return (best[2], best[3]) if best else (None, "")


class Output:
    """Sorts a job's output lines by rank, streams rank 0's, and remembers every rank's errors."""

    def __init__(self, stream: TextIO, log: TextIO | None):
        self.stream, self.log = stream, log
        self.tails: dict[int, deque[str]] = {}
        self.errors: dict[int, list[str]] = {}
        self.first_traceback: dict[int, float] = {}
        self.launcher_lines: deque[str] = deque(maxlen=400)
        self.failure_seen_at: float | None = None
        self.redrawing: dict[int, int] = {}  # command -> local rank whose last piece ended in "\r"
        self.ray_ranks: dict[int, int] = {}  # Ray worker pid -> rank
        self.input_error = ""  # the first "error: ..." line of a launcher itself (not of a rank)
        self.quiet = False  # the job failed: nothing more on the screen, every line to the log
        self.in_traceback: set[int | None] = set()  # ranks (None: the launchers) inside a traceback

    def feed(self, index: int, cmd: LaunchCommand, text: str, end: str) -> None:
        """Take one piece of a command's output (``end`` is ``\\n`` or ``\\r``)."""
        if cmd.output_tags == "ray":
            self._feed_ray(text, end)
            return
        tag = re.compile(_TAGS[cmd.output_tags].format(rank=r"\d+"))
        # Launchers tag lines, not progress-bar redraws: an untagged piece after a "\r" continues that rank.
        current = self.redrawing.pop(index, None)
        pieces: list[tuple[int | None, str]] = []
        pos = 0
        # A rank's text written in several pieces may carry more tags mid-line, its own or other ranks'.
        for m in tag.finditer(text):
            pieces.append((current, text[pos : m.start()]))
            current, pos = int(m[1]), m.end()
        pieces.append((current, text[pos:]))
        merged: list[tuple[int | None, str]] = []
        for rank, piece in pieces:
            if merged and merged[-1][0] == rank:
                merged[-1] = (rank, merged[-1][1] + piece)
            elif piece or rank is not None:
                merged.append((rank, piece))
        for k, (local, body) in enumerate(merged):
            last = k == len(merged) - 1
            if last and local is not None and end == "\r":
                self.redrawing[index] = local
            self._line(None if local is None else local + cmd.rank_offset, body, end if last else "\n")

    def _feed_ray(self, text: str, end: str) -> None:
        """A line of the Ray driver: its own (progress bar, messages) or one Ray forwarded from an actor."""
        m = _RAY_PREFIX.search(text)
        if m is None:
            if text.startswith("error: ") and not self.input_error:  # the driver's input error: shown once,
                self.input_error = text[len("error: ") :]  # by helpers.launch's message
                self._aside(text, end)
            else:
                self._line(None, text, end)
            return
        pid, body = int(m["pid"]), text[m.end() :]
        if m.start():  # a progress-bar redraw the forwarded line came right after: it ends the bar's
            # line only if the forwarded line is shown (rank 0's), else the bar keeps redrawing in place
            shown = m["actor"] == "RayTrainWorker" and self.ray_ranks.get(pid, 0) == 0
            self._line(None, text[: m.start()], "\n" if shown else "\r")
        if m["actor"] != "RayTrainWorker":  # the Train controller and Ray's helpers: log only
            self._aside(f"({m['actor']}) {body}", end)
            return
        worker = _RAY_WORKER.match(body)
        if worker:
            self.ray_ranks[pid] = int(worker[1])
        self._line(self.ray_ranks.get(pid), body, end)

    def aside(self, text: str) -> None:
        """A line of the launcher's own for the log, not the screen."""
        self._aside(text, "\n")

    def _aside(self, body: str, end: str) -> None:
        """A line kept for the log and for diagnosis, not shown."""
        if self.log:
            self.log.write(body + end)
        self.launcher_lines.append(body)

    def _line(self, rank: int | None, body: str, end: str) -> None:
        """One piece of output: to the log, to the screen (rank 0's and the launchers', never a
        traceback nor anything once the job has failed: the log has them), and read for errors."""
        if self.log:
            self.log.write(body + end if rank is None else f"[{rank}] {body}{end}")
        clean = _TORCH_RANK_PREFIX.sub("", body).strip()
        if clean.startswith("Traceback (most recent call last)"):
            self.in_traceback.add(rank)
        if rank is None:
            self.launcher_lines.append(body)
        elif end != "\r":  # progress-bar redraws are not worth keeping
            self.tails.setdefault(rank, deque(maxlen=40)).append(body)
        if rank is not None and clean.startswith("Traceback (most recent call last)"):
            self.first_traceback.setdefault(rank, time.monotonic())
        elif rank is not None and _EXCEPTION.match(clean):
            self.errors.setdefault(rank, []).append(clean)
            if rank in self.first_traceback or clean.startswith("error: "):
                self.failure_seen_at = self.failure_seen_at or time.monotonic()
                self.quiet = True
        if rank in (None, 0) and not self.quiet and rank not in self.in_traceback:
            self.stream.write(body + end)
