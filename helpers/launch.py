"""``python -m helpers.launch``: run the training on several processes or machines, and supervise it.

::

    python -m helpers.launch --launcher mpirun --nproc_per_node 2 [--hostfile hosts] \\
        [--main_process_ip IP] [--main_process_port P] [--dry_run] -- <helpers.train flags>
    python -m helpers.launch --launcher ray --nproc_per_node 2 [--num_nodes M] \\
        [--ray_address auto|HOST:PORT] -- <helpers.train flags>

builds the commands with :mod:`helpers.launching.distributed` (mpirun: one command on the head node;
torchrun: one per node, the others started over ssh; ray: one Ray Train driver,
:mod:`helpers.launching.ray_train`, whose workers Ray places), streams rank 0's output, and returns the
job's exit code. The hostfile and accelerate configs go to ``<output_dir>/launch/`` (``--work_dir``),
and under torchrun each node's rank logs to ``<work_dir>/torchrun/``.

Supervision to the end: every rank of ``helpers.train`` reports to ``<work_dir>/status``
(:mod:`helpers.launching.supervise`), so this sees each rank exit even under mpirun. Once one rank has
exited (success or failure), the others get ``--exit_grace_seconds`` (60) to end; a rank alive
without progress for ``--stall_seconds`` (900) is stalled. Either way this stops the whole job
(TERM, then KILL: the launchers' process trees here, the ranks on other hosts over ssh) and
prints one message: the ranks that did not end, their last lines, and whether the outputs are
complete (``run_summary.json`` written); the exit code is 0 only if they are. A rank that fails
is named with its error, e.g. ``rank 1 failed: RuntimeError: ...``.

Not testable here: ssh to real machines (tests stand in a script for ssh and run every "node"
on localhost).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import queue
import re
import shlex
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import psutil

from helpers.core import errors
from helpers.launching import distributed, supervise
from helpers.launching import ray_train as ray_launch
from helpers.launching.distributed import ClusterLayout, LaunchCommand

logger = logging.getLogger(__name__)

LAUNCHERS = (*distributed.LAUNCHERS, "ray")
TRAIN_MODULES = ("helpers.train", "helpers.dreambooth")  # what every rank may run (--module)
# The first tag on a line names its rank; launchers also split lines and tag the pieces.
_TAGS = {
    "hydra": r"\[({rank})\] ",  # -l / -prepend-rank: "[1] text"
    "openmpi": r"\[\d+,({rank})\]<std(?:out|err)>: ?",  # --tag-output: "[1,1]<stderr>:text"
    "torchrun": r"\[default({rank})\]:",  # --tee 3: "[default1]:text"
}
# Ray prefixes each line it forwards with the actor and its pid, "(RayTrainWorker pid=123, ip=10.0.0.5) ";
# each worker's first line names its rank (ray_launch.WORKER_TAG), so the pid leads to the rank.
_RAY_PREFIX = re.compile(r"\((?P<actor>[A-Za-z_]\w*) pid=(?P<pid>\d+)(?:, ip=[^)]*)?\) ")
_RAY_WORKER = re.compile(re.escape(ray_launch.WORKER_TAG) + r" rank (\d+) ")
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")  # torch prefixes its own tracebacks
_EXCEPTION = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Failure)\b(?::.*)?$|^error: .+"
)
_WRAPPERS = (
    "CalledProcessError",
    "ChildFailedError",
)  # accelerate launch / torchrun re-raising a child's failure
# Errors a rank gets because another rank went away (gloo says "check the logs of the remote worker").
_SECONDARY = re.compile(r"remote worker|by peer|Broken pipe|SIGTERM|Socket Timeout|/gloo/", re.IGNORECASE)
_LAUNCHER_REPORTS = (  # (rank, reason) in the launchers' own failure summaries
    re.compile(
        r"RANK (?P<rank>\d+) PID \d+ RUNNING AT \S+\s*=*\s*(?P<reason>KILLED BY SIGNAL: \d+.*|EXIT CODE: \d+)"
    ),
    re.compile(r"Process name: \[\[\d+,\d+\],(?P<rank>\d+)\]\s+(?P<reason>Exit code:\s+\d+|Signal:.*)"),
    re.compile(r"Root Cause.*?rank\s+: (?P<rank>\d+).*?exitcode\s+: (?P<reason>-?\d+[^\n]*)", re.DOTALL),
    re.compile(re.escape(ray_launch.FAILED_TAG) + r" rank (?P<rank>\d+) (?P<reason>failed on node .*)"),
)


@dataclass
class JobResult:
    """How a job ended: exit code, duration, and who failed first with which error."""

    returncode: int
    seconds: float
    failed_rank: int | None = None
    error: str = ""
    killed: bool = False
    tails: dict[int, list[str]] = field(default_factory=dict)
    not_ended: list[int] = field(default_factory=list)  # ranks helpers.launch had to stop
    supervision: str = ""  # why helpers.launch stopped them, outputs, their last lines
    outputs_complete: bool | None = None  # run_summary.json written (None: output_dir unknown)
    input_error: str = ""  # a launcher's own "error: ..." line before any rank started (exit code 2)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def message(self) -> str:
        """One paragraph for a person: which rank failed, its error, its last lines."""
        if self.input_error and not self.ok:
            return self.input_error
        if self.supervision:
            failed = f"rank {self.failed_rank} failed: {self.error}\n" if self.error and not self.ok else ""
            return failed + self.supervision
        if self.ok:
            return f"job finished in {self.seconds:.1f} s"
        who = f"rank {self.failed_rank}" if self.failed_rank is not None else "the job"
        text = f"{who} failed (exit code {self.returncode}, after {self.seconds:.1f} s): {self.error or 'no error text'}"
        if self.killed:
            text += "\nthe other ranks did not stop on their own; helpers.launch stopped them"
        tail = self.tails.get(self.failed_rank, [])[-12:] if self.failed_rank is not None else []
        if tail:
            text += f"\nlast lines of rank {self.failed_rank}:\n  " + "\n  ".join(tail)
        return text

    def raise_for_failure(self) -> None:
        """Raise :class:`JobFailed` with :meth:`message` unless the job succeeded."""
        if not self.ok:
            raise JobFailed(self.message())


class JobFailed(RuntimeError):
    """A distributed job failed; the message names the rank and its error."""


def _shorten(error: str) -> str:
    """``CalledProcessError: Command '[...]' died with <Signals.SIGKILL: 9>.`` -> the gist."""
    m = re.search(r"died with <Signals\.(\w+): \d+>|returned non-zero exit status (-?\d+)", error)
    if not m or not any(w in error for w in _WRAPPERS):
        return error
    return (
        f"the training process was killed by {m[1]}"
        if m[1]
        else f"the training process exited with code {m[2]}"
    )


def diagnose(
    errors: dict[int, list[str]], first_seen: dict[int, float], launcher_text: str
) -> tuple[int | None, str]:
    """Pick the rank that failed first and its root error.

    A rank's root error is its first exception line that is not a launcher re-raising it; ranks
    whose error says a peer went away failed because of another rank, so they come last.
    Without any exception line, the launcher's own summary (Hydra, Open MPI, torchrun) decides.
    """
    candidates = []
    for rank, lines in errors.items():
        own = [ln for ln in lines if not any(w in ln for w in _WRAPPERS)]
        error = (own or lines)[0]
        candidates.append(
            (bool(_SECONDARY.search(error)), first_seen.get(rank, math.inf), rank, _shorten(error))
        )
    best = min(candidates) if candidates else None
    if best and not best[0]:
        return best[2], best[3]
    for pattern in _LAUNCHER_REPORTS:  # a rank killed outright prints nothing: its launcher knows
        m = pattern.search(launcher_text)
        if m:
            return int(m["rank"]), f"the launcher reports {m['reason'].strip()}"
    return (best[2], best[3]) if best else (None, "")


class _Output:
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

    def _aside(self, body: str, end: str) -> None:
        """A line kept for the log and for diagnosis, not shown."""
        if self.log:
            self.log.write(body + end)
        self.launcher_lines.append(body)

    def _line(self, rank: int | None, body: str, end: str) -> None:
        if self.log:
            self.log.write(body + end if rank is None else f"[{rank}] {body}{end}")
        if rank is None:
            self.launcher_lines.append(body)
            self.stream.write(body + end)
            return
        if rank == 0:
            self.stream.write(body + end)
        if end != "\r":  # progress-bar redraws are not worth keeping
            self.tails.setdefault(rank, deque(maxlen=40)).append(body)
        clean = _TORCH_RANK_PREFIX.sub("", body).strip()
        if clean.startswith("Traceback (most recent call last)"):
            self.first_traceback.setdefault(rank, time.monotonic())
        elif _EXCEPTION.match(clean):
            self.errors.setdefault(rank, []).append(clean)
            if rank in self.first_traceback or clean.startswith("error: "):
                self.failure_seen_at = self.failure_seen_at or time.monotonic()


def _pump(index: int, pipe, out: queue.Queue) -> None:
    """Read a process's output in chunks and queue its lines, each with its end (``\\n`` or ``\\r``)."""
    pending = ""
    fd = pipe.fileno()
    while chunk := os.read(fd, 65536):
        pending += chunk.decode("utf-8", errors="replace").replace("\r\n", "\n")
        *lines, pending = re.split(r"(?<=[\r\n])", pending)
        for line in lines:
            out.put((index, line[:-1], line[-1]))
    if pending:
        out.put((index, pending, "\n"))
    out.put((index, None, ""))


def _process(cmd: LaunchCommand, ssh: Sequence[str], cwd: str) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that start ``cmd``: here, or on its host over ssh."""
    env = dict(os.environ, **cmd.env)
    if os.path.isabs(cmd.argv[0]):  # Intel MPI's mpirun finds mpiexec.hydra on PATH
        env["PATH"] = os.pathsep.join([str(Path(cmd.argv[0]).parent), env.get("PATH", "")])
    if cmd.host is None or distributed.is_local_host(cmd.host):
        return list(cmd.argv), env
    # -tt: closing the connection hangs up the remote launcher, so stopping the job stops it there too
    remote = f"cd {shlex.quote(cwd)} && {cmd.shell()}"
    return [*ssh, "-tt", "-o", "BatchMode=yes", cmd.host, remote], env


def run_job(
    commands: Sequence[LaunchCommand],
    *,
    stream: TextIO | None = None,
    exit_grace_seconds: float = 60.0,
    stall_seconds: float = 900.0,
    timeout: float | None = None,
    ssh: Sequence[str] = ("ssh",),
    cwd: str | os.PathLike | None = None,
    log_path: str | os.PathLike | None = None,
) -> JobResult:
    """Start the commands, stream rank 0's output, and supervise the job until every rank has ended.

    Args:
        commands: from :func:`prepare_job` (ranks report their status) or
            :func:`helpers.launching.distributed.launch_commands`.
        stream: where rank 0's lines and the launchers' own lines go (default stdout).
        exit_grace_seconds: once one rank has exited (or failed, or a command exited non-zero),
            how long the others get to end before this stops the job.
        stall_seconds: stop the job when a rank alive has reported no progress for this long.
        timeout: kill the job after this many seconds in all (None: no limit).
        ssh: the ssh command for commands that run on another host.
        cwd: working folder of the job (on every host).
        log_path: also write every rank's lines, tagged ``[rank]``, to this file.

    Returns:
        The :class:`JobResult`; call ``raise_for_failure()`` to turn a failure into an exception.

    Raises:
        DistributedError: ``exit_grace_seconds`` or ``stall_seconds`` not positive (nothing started).
    """
    _check_seconds(exit_grace_seconds=exit_grace_seconds, stall_seconds=stall_seconds)
    cwd = os.path.abspath(cwd or os.getcwd())
    status_dir, output_dir = commands[0].status_dir, commands[0].output_dir
    watcher = supervise.Watcher(supervise.prepare(status_dir)) if status_dir else None
    # Held until this function returns or this process dies: the ranks end themselves once it is free.
    held = supervise.hold_launcher_lock(status_dir) if status_dir else None
    log = open(log_path, "w") if log_path else None  # noqa: SIM115 - closed below
    out = _Output(stream or sys.stdout, log)
    lines: queue.Queue = queue.Queue()
    start, started_wall, procs = time.monotonic(), time.time(), []
    verdict: tuple[list[int], str] | None = None
    with supervise.signals_interrupt():  # TERM (a scheduler, kill) and HUP stop the job as Ctrl-C does
        try:
            for i, cmd in enumerate(commands):
                argv, env = _process(cmd, ssh, cwd)
                logger.info("starting %s", shlex.join(argv))
                p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=cwd, start_new_session=True)  # fmt: skip
                procs.append(p)
                threading.Thread(target=_pump, args=(i, p.stdout, lines), daemon=True).start()
            open_pipes, killed, ended_at, stopped_at = len(procs), False, None, math.inf
            while open_pipes:
                try:
                    i, text, end = lines.get(timeout=0.2)
                    if text is None:
                        open_pipes -= 1
                    else:
                        out.feed(i, commands[i], text, end)
                except queue.Empty:
                    pass
                now = time.monotonic()
                if watcher is not None and not killed:
                    watcher.poll(now)
                    verdict = watcher.verdict(
                        now, exit_grace_seconds, stall_seconds, any(p.poll() is None for p in procs)
                    )
                if out.failure_seen_at is None and any(p.poll() for p in procs):
                    out.failure_seen_at = now  # a command exited non-zero
                overdue = out.failure_seen_at is not None and now - out.failure_seen_at > exit_grace_seconds
                if not killed and (verdict or overdue or (timeout and now - start > timeout)):
                    why = verdict[1] if verdict else "a rank failed" if overdue else f"timeout of {timeout} s"
                    logger.warning("stopping the job: %s", why)
                    supervise.stop(procs, ranks=_alive_ranks(watcher), ssh=ssh)
                    killed, stopped_at = True, now
                if all(p.poll() is not None for p in procs):
                    ended_at = ended_at or now
                    if now - ended_at > 5:  # an orphan holds a pipe open: stop reading
                        break
        except BaseException:  # Ctrl-C, TERM, HUP, an error here: the ranks must not run on
            supervise.stop(procs, ranks=_alive_ranks(watcher), ssh=ssh)
            raise
        finally:
            if held is not None:
                os.close(held)  # after stop(): a rank that sees it free now has been told already
            if log:
                log.close()
    for p in procs:
        p.wait()
    code = next((p.returncode for p in procs if p.returncode), 0)
    if killed and code == 0:
        code = 1
    result = JobResult(code, time.monotonic() - start, killed=killed, input_error=out.input_error,
                       tails={r: list(t) for r, t in out.tails.items()})  # fmt: skip
    if verdict:
        result.not_ended = verdict[0]
        result.outputs_complete, outputs = supervise.outputs(output_dir, started_wall)
        tails = [
            f"last lines of rank {r}:\n  " + "\n  ".join(result.tails.get(r, [])[-12:]) for r in verdict[0]
        ]
        result.supervision = "\n".join([f"{verdict[1]} {outputs}", *tails])
        result.returncode = 0 if result.outputs_complete else 1
    failed_before_stop = out.failure_seen_at is not None and out.failure_seen_at < stopped_at
    if result.returncode and (not verdict or failed_before_stop):  # not the errors of ranks it stopped
        result.failed_rank, result.error = diagnose(
            out.errors, out.first_traceback, "\n".join(out.launcher_lines)
        )
    return result


def _alive_ranks(watcher: supervise.Watcher | None) -> list[tuple[str, int]]:
    """``(host, pid)`` of every rank that has not exited, as their status files say."""
    states = watcher.ranks.values() if watcher else []
    return [(s.status["host"], s.status["pid"]) for s in states if s.alive and "pid" in s.status]


def prepare_job(
    layout: ClusterLayout,
    train_args: Sequence[str],
    launcher: str = "mpirun",
    *,
    work_dir: str | os.PathLike | None = None,
    mpirun: str | None = None,
    backend: str | None = None,
    num_nodes: int = 1,
    ray_address: str | None = None,
    module: str = "helpers.train",
) -> list[LaunchCommand]:
    """Check the training flags, write the hostfile and accelerate configs, and build the commands.

    Args:
        layout: the cluster (for ``"ray"``: this machine's ``nproc_per_node`` and
            ``threads_per_process``; Ray finds the nodes itself).
        train_args: ``helpers.train`` flags; parsed here so a bad flag fails before any process starts.
        launcher: ``"mpirun"``, ``"torchrun"`` or ``"ray"`` (one command: the Ray Train driver of
            :mod:`helpers.launching.ray_train`).
        work_dir: folder for ``hostfile``, ``accelerate_config_node*.yaml``, the ranks' ``status/``
            and torchrun's rank logs, ``torchrun/`` (default ``<output_dir>/launch``, with the run,
            so two runs never share it; must be visible at the same path on every node, or copied
            there).
        mpirun: the mpirun program (default: this environment's, see :func:`distributed.find_mpirun`).
        backend: ``"gloo"``/``"ccl"`` (default :func:`distributed.select_backend`).
        num_nodes: ``"ray"`` only: nodes of the Ray cluster to spread the workers over.
        ray_address: ``"ray"`` only: ``"auto"`` or ``HOST:PORT`` of a running Ray cluster (default:
            a private Ray runtime on this machine, ended with the job).
        module: what every rank runs, one of :data:`TRAIN_MODULES` (``train_args`` are its flags).

    Returns:
        The commands to pass to :func:`run_job`.
    """
    if module == "helpers.dreambooth":  # its flag parser imports no torch, as helpers.training.config's
        from helpers.dreambooth.config import parse_args as parse_train_args

        data_flag = "instance_data_dir"
    else:
        from helpers.training.config import parse_args as parse_train_args

        data_flag = "train_data_dir"
    config = parse_train_args(list(train_args))
    if getattr(config, data_flag) and not Path(getattr(config, data_flag)).is_dir():
        raise distributed.DistributedError(
            f"--{data_flag} {getattr(config, data_flag)} is not a folder here; give the concept images' folder "
            "(the same path on every node)"
        )
    if launcher == "ray" and module != "helpers.train":
        raise distributed.DistributedError(
            f"--launcher ray runs helpers.train only; run {module} with mpirun or torchrun"
        )
    output_dir = Path(config.output_dir).resolve()
    work_dir = Path(work_dir) if work_dir is not None else output_dir / "launch"
    status_dir = str((work_dir / "status").resolve())
    if launcher == "ray":
        cmd = ray_launch.driver_command(
            train_args, nproc_per_node=layout.nproc_per_node, num_nodes=num_nodes, ray_address=ray_address,
            threads_per_process=int(layout.threads_per_process or 1), work_dir=work_dir, status_dir=status_dir,
        )  # fmt: skip
        return [dataclasses.replace(cmd, status_dir=status_dir, output_dir=str(output_dir))]
    configs = distributed.write_accelerate_configs(layout, work_dir, config.mixed_precision)
    kwargs = {}
    if launcher == "mpirun":
        mpirun = mpirun or distributed.find_mpirun()
        flavour = distributed.detect_mpi_flavour(mpirun)
        hostfile = work_dir / "hostfile"
        if not layout.is_local:
            distributed.write_hostfile(layout, hostfile, flavour)
        kwargs = dict(flavour=flavour, mpirun=mpirun, hostfile=hostfile.resolve(), config_file=configs[0])
    commands = distributed.launch_commands(
        layout, train_args, launcher, backend=backend or distributed.select_backend(),
        extra_env={supervise.STATUS_DIR_ENV: status_dir}, entry=("-m", module), log_dir=work_dir / "torchrun",
        **kwargs,
    )  # fmt: skip
    return [dataclasses.replace(c, status_dir=status_dir, output_dir=str(output_dir)) for c in commands]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``[launch options] -- [helpers.train flags]``; the train flags are in ``.train_args``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, train_args = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m helpers.launch",
        description="Run helpers.train on several processes or machines (mpirun, torchrun or Ray Train).",
        epilog="Everything after -- goes to helpers.train, e.g. -- --pretrained_model_name_or_path tiny ...",
    )
    parser.add_argument("--launcher", choices=LAUNCHERS, default="mpirun")
    parser.add_argument("--module", choices=TRAIN_MODULES, default="helpers.train",
                        help="what every rank runs; the flags after -- are its flags")  # fmt: skip
    parser.add_argument("--nproc_per_node", type=int, default=None,
                        help="processes per node (default: the hostfile's slots, else 1)")  # fmt: skip
    parser.add_argument(
        "--hostfile", help="one host per line; the first is the head node (default: this machine)"
    )
    parser.add_argument("--main_process_ip", help="address of rank 0 (default: the first host)")
    parser.add_argument("--main_process_port", type=int, default=distributed.DEFAULT_PORT)
    parser.add_argument(
        "--network_interface", help="NIC between the nodes, e.g. eth0 (default: let MPI choose)"
    )
    parser.add_argument("--threads_per_process", type=int, help="default: physical cores // nproc_per_node")
    parser.add_argument("--mpirun", help="mpirun program (default: this environment's Intel MPI, else PATH)")
    parser.add_argument("--num_nodes", type=int, default=None,
                        help="ray: nodes of the Ray cluster to use (default 1)")  # fmt: skip
    parser.add_argument("--ray_address", default=None,
                        help="ray: auto or HOST:PORT of a running cluster (default: a private Ray runtime here)")  # fmt: skip
    parser.add_argument("--work_dir", default=None,
                        help="where the hostfile, accelerate configs and rank status go (default: <output_dir>/launch)")  # fmt: skip
    parser.add_argument("--exit_grace_seconds", type=float, default=60.0,
                        help="once a rank has exited, seconds the others get to end before the job is stopped")  # fmt: skip
    parser.add_argument("--stall_seconds", type=float, default=900.0,
                        help="stop the job when a rank makes no progress (no step) for this long")  # fmt: skip
    parser.add_argument("--dry_run", action="store_true",
                        help="write the configs and print the command of every node; start nothing")  # fmt: skip
    args = parser.parse_args(own)
    if not train_args:
        parser.error("no training flags: add -- and the helpers.train flags, e.g. -- --train_data_dir DIR")
    args.train_args = train_args
    return args


def check_args(args: argparse.Namespace) -> None:
    """Reject launch options that cannot work, before anything starts.

    Raises:
        DistributedError: one line naming the option and the fix.
    """
    _check_seconds(exit_grace_seconds=args.exit_grace_seconds, stall_seconds=args.stall_seconds, cli=True)
    _check_ray_options(args)
    if args.dry_run:  # printing commands for a cluster need not reach it from here
        return
    if args.launcher == "ray":
        if args.ray_address:
            ray_launch.check_address(args.ray_address)
        else:
            threads = args.threads_per_process or max(
                1, distributed.physical_cores() // (args.nproc_per_node or 1)
            )
            ray_launch.check_local_layout(args.nproc_per_node or 1, args.num_nodes or 1, threads)
    if args.network_interface:
        names = sorted(psutil.net_if_addrs())
        if args.network_interface not in names:
            raise distributed.DistributedError(
                f"--network_interface {args.network_interface}: no such interface on this machine "
                f"(it has {', '.join(names)}); pass one of those, or leave the flag out to let MPI and gloo choose"
            )
    if args.hostfile:
        for host, _ in distributed.parse_hostfile(args.hostfile):
            if not _resolves(host):
                raise distributed.DistributedError(
                    f"--hostfile {args.hostfile}: host {host!r} does not resolve; correct the name, or add it "
                    "to /etc/hosts or to the ssh config (Host/HostName)"
                )


def _check_ray_options(args: argparse.Namespace) -> None:
    """Ray's options only with Ray, and the others' not with it."""
    if args.launcher != "ray":
        for flag in ("num_nodes", "ray_address"):
            if getattr(args, flag) is not None:
                raise distributed.DistributedError(
                    f"--{flag} is for --launcher ray only; with {args.launcher} the hostfile lists the nodes"
                )
        return
    for flag in ("hostfile", "main_process_ip", "network_interface", "mpirun"):
        if getattr(args, flag):
            raise distributed.DistributedError(
                f"--{flag}: not used with --launcher ray (Ray finds its nodes and addresses itself); drop it, "
                "and join a cluster with --ray_address"
            )
    if args.num_nodes is not None and args.num_nodes < 1:
        raise distributed.DistributedError(f"--num_nodes {args.num_nodes}: must be at least 1")
    if args.ray_address:
        ray_launch.parse_address(args.ray_address)


_DEFAULT_SECONDS = {"exit_grace_seconds": 60, "stall_seconds": 900}


def _check_seconds(cli: bool = False, **values: float) -> None:
    """Reject a supervision time that is not positive (one line naming it, as flag or argument)."""
    for name, value in values.items():
        if value <= 0:
            given = f"--{name} {value:g}" if cli else f"{name}={value:g}"
            raise distributed.DistributedError(
                f"{given}: must be more than 0 seconds; pass e.g. {_DEFAULT_SECONDS[name]} (the default)"
            )


def _resolves(host: str) -> bool:
    """True if ``host`` has an address here, directly or through the ssh config's HostName."""
    import socket

    names = [host]
    try:
        out = subprocess.run(["ssh", "-G", host], capture_output=True, text=True, timeout=10)
        names += [ln.split(None, 1)[1] for ln in out.stdout.splitlines() if ln.startswith("hostname ")]
    except (OSError, subprocess.TimeoutExpired):
        pass  # no ssh here: the name itself must resolve
    for name in names:
        try:
            socket.getaddrinfo(name, None)
            return True
        except OSError:
            continue
    return False


def layout_from_args(args: argparse.Namespace) -> ClusterLayout:
    """The :class:`ClusterLayout` the CLI options describe."""
    kwargs = dict(main_process_ip=args.main_process_ip, main_process_port=args.main_process_port,
                  network_interface=args.network_interface, threads_per_process=args.threads_per_process)  # fmt: skip
    return ClusterLayout.create(args.hostfile, args.nproc_per_node, **kwargs)


def main(args: argparse.Namespace) -> int:
    """Run (or with ``--dry_run`` print) the job; return its exit code."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        check_args(args)
        layout = layout_from_args(args)
        commands = prepare_job(layout, args.train_args, args.launcher, work_dir=args.work_dir, mpirun=args.mpirun,
                               num_nodes=args.num_nodes or 1, ray_address=args.ray_address, module=args.module)  # fmt: skip
    except (ValueError, *errors.INPUT_ERRORS) as err:  # DistributedError, ConfigError: nothing started
        print(f"error: {errors.one_line(err)}", file=sys.stderr)
        return 2
    if args.dry_run:
        for cmd in commands:
            where = "on the head node" if cmd.host is None else f"on node {cmd.node_rank} ({cmd.host})"
            print(f"# {args.launcher}, {where}, from {os.getcwd()}:\n{cmd.shell()}")
        return 0
    try:
        result = run_job(
            commands, exit_grace_seconds=args.exit_grace_seconds, stall_seconds=args.stall_seconds
        )
    except KeyboardInterrupt as stop:  # Ctrl-C, TERM or HUP: run_job has stopped every rank
        print(f"error: interrupted ({stop or 'Ctrl-C'}); every rank was stopped. The run is not finished: "
              "run the same command with --resume_from_checkpoint latest to go on from its last checkpoint",
              file=sys.stderr)  # fmt: skip
        return 130
    if not result.ok or result.supervision:  # one message; a warning when the outputs are complete
        print(f"{'error' if not result.ok else 'warning'}: {result.message()}", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main(parse_args()))
