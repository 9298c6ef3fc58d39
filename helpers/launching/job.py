"""Run a job and supervise it to the end (:func:`prepare_job`, then :func:`run_job`)."""

from __future__ import annotations

import dataclasses
import json
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
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from helpers.core import cpu
from helpers.core.errors import DistributedError
from helpers.dreambooth import inputs as dreambooth_inputs
from helpers.dreambooth.config import parse_args as parse_dreambooth_args
from helpers.launching import accelerate_config, preflight, ray_train, supervise
from helpers.launching.commands import LaunchCommand, detect_mpi_flavour, find_mpirun, launch_commands
from helpers.launching.layout import ClusterLayout, is_local_host, write_hostfile
from helpers.launching.rank_output import Output, diagnose
from helpers.ranks.backend import resolve_backend
from helpers.ranks.status import STATUS_DIR_ENV
from helpers.training import inputs as training_inputs
from helpers.training import models, models_xl
from helpers.training.config import parse_args as parse_train_args
from helpers.training.config import prepacks

logger = logging.getLogger(__name__)

FAILURE_GRACE_SECONDS = 5.0  # a rank that printed its error, to exit by itself before it is stopped

JOB_LOG = "job.log"  # every rank's output, beside the status folder

TRAIN_MODULES = ("helpers.train", "helpers.dreambooth")  # what every rank may run (--module)


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
    log_path: str | None = None  # every rank's output, tagged [rank]

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
        text = f"{who} failed after {self.seconds:.1f} s: {self.error or f'exit code {self.returncode}'}"
        if self.killed:
            text += "; helpers.launch stopped the other ranks"
        if self.log_path:
            return f"{text}. Every rank's output, tracebacks included: {self.log_path}"
        tail = self.tails.get(self.failed_rank, [])[-12:] if self.failed_rank is not None else []
        return text + (f"\nlast lines of rank {self.failed_rank}:\n  " + "\n  ".join(tail) if tail else "")

    def raise_for_failure(self) -> None:
        """Raise :class:`JobFailed` with :meth:`message` unless the job succeeded."""
        if not self.ok:
            raise JobFailed(self.message())


class JobFailed(RuntimeError):
    """A distributed job failed; the message names the rank and its error."""


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
    if cmd.host is None or is_local_host(cmd.host):
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
            :func:`helpers.launching.commands.launch_commands`.
        stream: where rank 0's lines and the launchers' own lines go (default stdout).
        exit_grace_seconds: once one rank has exited successfully, how long the others get to end
            before this stops the job. A failure (a rank that exits without succeeding, killed
            outright included, or a command exiting non-zero) stops the job at once; a rank that
            printed its error gets :data:`FAILURE_GRACE_SECONDS` to exit by itself.
        stall_seconds: stop the job when a rank alive has reported no progress for this long, or
            when a rank of the job's ``world_size`` has not started this long after the job did.
        timeout: kill the job after this many seconds in all (None: no limit).
        ssh: the ssh command for commands that run on another host.
        cwd: working folder of the job (on every host).
        log_path: also write every rank's lines, tagged ``[rank]``, to this file (default: with
            a status folder, ``job.log`` beside it, i.e. ``<output_dir>/launch/job.log``). Once the
            job has failed, and for any traceback, the lines go there only, not to ``stream``.

    Returns:
        The :class:`JobResult`; call ``raise_for_failure()`` to turn a failure into an exception.

    Raises:
        DistributedError: ``exit_grace_seconds`` or ``stall_seconds`` not positive (nothing started).
    """
    check_seconds(exit_grace_seconds=exit_grace_seconds, stall_seconds=stall_seconds)
    cwd = os.path.abspath(cwd or os.getcwd())
    status_dir = commands[0].status_dir
    watcher = supervise.Watcher(supervise.prepare(status_dir), commands[0].world_size) if status_dir else None
    if log_path is None and status_dir:
        log_path = Path(status_dir).parent / JOB_LOG
    log = _open_log(log_path) if log_path else None
    # Held until this function returns or this process dies: the ranks end themselves once it is free.
    held = supervise.hold_launcher_lock(status_dir) if status_dir else None
    job = _Job(commands, Output(stream or sys.stdout, log), watcher, ssh)
    with supervise.signals_interrupt():  # TERM (a scheduler, kill) and HUP stop the job as Ctrl-C does
        try:
            _start_processes(job, cwd)
            _supervise(job, exit_grace_seconds, stall_seconds, timeout)
        except BaseException:  # Ctrl-C, TERM, HUP, an error here: the ranks must not run on
            job.stop()
            raise
        finally:
            if held is not None:
                os.close(held)  # after stop(): a rank that sees it free now has been told already
            if log:
                log.close()
            if status_dir:
                supervise.remove_shared_memory(status_dir)  # a rank killed outright left its file
    result = _job_result(job)
    if status_dir:
        ray_train.remove_private_folder(status_dir)  # a Ray driver killed while stopping left it
    result.log_path = str(log_path) if log_path else None
    return result


def _open_log(path: str | os.PathLike) -> TextIO:
    """The job's log, truncated; never through a link planted at its name (a run would overwrite
    whatever file it points to)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as err:
        if not os.path.islink(path):
            raise
        raise DistributedError(
            f"{path} is a symbolic link: remove it (the job writes its log there)"
        ) from err
    return os.fdopen(fd, "w")


@dataclass
class _Job:
    """A job as :func:`run_job` supervises it: its processes, their lines, and what was decided."""

    commands: Sequence[LaunchCommand]
    out: Output
    watcher: supervise.Watcher | None
    ssh: Sequence[str]
    start: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    procs: list[subprocess.Popen] = field(default_factory=list)
    lines: queue.Queue = field(default_factory=queue.Queue)  # (command index, text or None at EOF, end)
    verdict: tuple[list[int], str] | None = None  # the watcher's: ranks that did not end, and why
    killed: bool = False
    stopped_at: float = math.inf
    failed_at: float | None = None  # when a rank exited without succeeding or a command exited non-zero
    failed_ranks: list[int] = field(default_factory=list)  # those first known to have failed (status reports)

    def stop(self) -> None:
        """Stop every process here and every rank still alive (on other hosts over ssh)."""
        supervise.stop(self.procs, ranks=_alive_ranks(self.watcher), ssh=self.ssh)


def _start_processes(job: _Job, cwd: str) -> None:
    """Start every command, each in its own session, with a thread queueing its output lines."""
    for i, cmd in enumerate(job.commands):
        argv, env = _process(cmd, job.ssh, cwd)
        logger.info("starting %s", shlex.join(argv))
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=env, cwd=cwd, start_new_session=True)  # fmt: skip
        job.procs.append(p)  # at once: stopping the job stops those already started
        threading.Thread(target=_pump, args=(i, p.stdout, job.lines), daemon=True).start()


def _supervise(job: _Job, exit_grace_seconds: float, stall_seconds: float, timeout: float | None) -> None:
    """Stream the lines until every output pipe is closed, stopping the job once when it must end."""
    open_pipes, ended_at = set(range(len(job.procs))), None
    while open_pipes:
        _feed_next_line(job, open_pipes, 0.2)
        now = time.monotonic()
        why = _reason_to_stop(job, now, exit_grace_seconds, stall_seconds, timeout)
        if why:
            _feed_what_exited_commands_wrote(job, open_pipes)  # their last lines (an error) come first
            job.out.aside(f"helpers.launch: stopping the job: {why}")  # the final message says it
            job.stop()
            job.killed, job.stopped_at = True, now
        if all(p.poll() is not None for p in job.procs):
            ended_at = ended_at or now
            if now - ended_at > 5:  # an orphan holds a pipe open: stop reading
                break


def _feed_next_line(job: _Job, open_pipes: set[int], wait_seconds: float) -> None:
    """Pass on the next line any command wrote (waiting at most ``wait_seconds``), or note a pipe closed."""
    try:
        i, text, end = job.lines.get(timeout=wait_seconds)
    except queue.Empty:
        return
    if text is None:
        open_pipes.discard(i)
    else:
        job.out.feed(i, job.commands[i], text, end)


def _feed_what_exited_commands_wrote(job: _Job, open_pipes: set[int], limit_seconds: float = 2.0) -> None:
    """Pass on every line the commands that have exited wrote before they did: a reader thread may
    still hold some when the exit is seen. Within ``limit_seconds``: a child may hold their pipe open."""
    deadline = time.monotonic() + limit_seconds
    while time.monotonic() < deadline and any(job.procs[i].poll() is not None for i in open_pipes):
        _feed_next_line(job, open_pipes, 0.05)


def _reason_to_stop(
    job: _Job, now: float, exit_grace_seconds: float, stall_seconds: float, timeout: float | None
) -> str | None:
    """Poll the ranks' status and the processes; say why the job must be stopped now (None: it need not)."""
    if job.killed:
        return None
    out = job.out
    if job.watcher is not None:
        job.watcher.poll(now)
        if not job.failed_ranks:
            job.failed_ranks = job.watcher.first_failed()
            if job.failed_ranks:
                job.failed_at = job.failed_at or now
        job.verdict = job.watcher.verdict(
            now, exit_grace_seconds, stall_seconds, any(p.poll() is None for p in job.procs)
        )
    if job.failed_at is None and any(p.poll() for p in job.procs):
        job.failed_at = now  # a command exited non-zero
    if job.failed_at is not None:
        out.failure_seen_at = out.failure_seen_at or job.failed_at
        out.quiet = True
        if _anything_alive(job):  # a failed job does not wait: its other ranks would only hang
            who = f"rank {' or '.join(map(str, job.failed_ranks))}" if job.failed_ranks else "a command"
            return f"{who} failed"
        return None
    errored = out.failure_seen_at is not None and now - out.failure_seen_at > FAILURE_GRACE_SECONDS
    if job.verdict or errored or (timeout and now - job.start > timeout):
        return job.verdict[1] if job.verdict else "a rank failed" if errored else f"timeout of {timeout} s"
    return None


def _anything_alive(job: _Job) -> bool:
    """A command still running here, or a rank (here or on another host) that has not exited."""
    return any(p.poll() is None for p in job.procs) or bool(_alive_ranks(job.watcher))


def _job_result(job: _Job) -> JobResult:
    """Wait for every process; the exit code, the supervision's verdict and the first failure."""
    for p in job.procs:
        p.wait()
    code = next((p.returncode for p in job.procs if p.returncode), 0)
    if job.killed and code <= 0:  # a command it stopped (TERM, then KILL) ends with a signal of ours: 1
        code = 1
    out, verdict = job.out, job.verdict
    result = JobResult(code, time.monotonic() - job.start, killed=job.killed, input_error=out.input_error,
                       tails={r: list(t) for r, t in out.tails.items()})  # fmt: skip
    if verdict:
        result.not_ended = verdict[0]
        result.outputs_complete, outputs = supervise.outputs(job.commands[0].output_dir, job.started_wall)
        tails = [
            f"last lines of rank {r}:\n  " + "\n  ".join(result.tails.get(r, [])[-12:]) for r in verdict[0]
        ]
        result.supervision = "\n".join([f"{verdict[1]} {outputs}", *tails])
        result.returncode = 0 if result.outputs_complete else 1
    failed_before_stop = out.failure_seen_at is not None and out.failure_seen_at < job.stopped_at
    if result.returncode and (not verdict or failed_before_stop):  # not the errors of ranks it stopped
        result.failed_rank, result.error = diagnose(
            out.errors, out.first_traceback, "\n".join(out.launcher_lines), ranks=job.failed_ranks
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
        mpirun: the mpirun program (default: this environment's, see :func:`find_mpirun`).
        backend: ``"auto"`` (None), ``"gloo"`` or ``"ccl"``, resolved by
            :func:`helpers.ranks.backend.resolve_backend` before anything is written (``ccl`` where
            it cannot load, or where ranks on this machine would find too little ``/dev/shm``, is a
            :class:`DistributedError`).
        num_nodes: ``"ray"`` only: nodes of the Ray cluster to spread the workers over.
        ray_address: ``"ray"`` only: ``"auto"`` or ``HOST:PORT`` of a running Ray cluster (default:
            a private Ray runtime on this machine, ended with the job).
        module: what every rank runs, one of :data:`TRAIN_MODULES` (``train_args`` are its flags).

    Returns:
        The commands to pass to :func:`run_job`.
    """
    # This machine's part in the job: its nodes of the layout, whether it runs rank 0, every rank.
    if launcher == "ray":  # the private runtime is this machine; a Ray cluster places the workers itself
        nodes_here = 0 if ray_address else 1
        rank0_here = every_rank_here = ray_address is None
    else:
        nodes_here = sum(is_local_host(host) for host in layout.hosts)
        rank0_here, every_rank_here = is_local_host(layout.hosts[0]), layout.is_local
    config = _check_train_flags(module, train_args, rank0_here)
    if launcher != "ray":  # Ray's private runtime is held to this machine's CPUs (check_local_layout)
        preflight.check_ranks_fit(layout.nproc_per_node, nodes_here)
    backend = resolve_backend(backend, one_machine=every_rank_here)
    output_dir = Path(config.output_dir).resolve()
    work_dir = Path(work_dir) if work_dir is not None else output_dir / "launch"
    _refuse_linked_work_dir(work_dir)
    status_dir = str((work_dir / "status").resolve())
    if launcher == "ray":
        commands = [ray_train.driver_command(
            train_args, nproc_per_node=layout.nproc_per_node, num_nodes=num_nodes, ray_address=ray_address,
            threads_per_process=int(layout.threads_per_process or 1), work_dir=work_dir, status_dir=status_dir,
            backend=backend, module=module,
        )]  # fmt: skip
    else:
        configs = accelerate_config.write_accelerate_configs(layout, work_dir, config.mixed_precision)
        kwargs = _mpirun_kwargs(layout, work_dir, mpirun, configs[0]) if launcher == "mpirun" else {}
        commands = launch_commands(
            layout, train_args, launcher, backend=backend,
            extra_env={STATUS_DIR_ENV: status_dir}, entry=("-m", module), log_dir=work_dir / "torchrun",
            **kwargs,
        )  # fmt: skip
    # Last, once nothing can fail: a refused flag stays the one line printed.
    _warn_if_short_of_memory(layout, config, module, nodes_here)
    world_size = layout.nproc_per_node * (num_nodes if launcher == "ray" else layout.num_machines)
    return [
        dataclasses.replace(c, status_dir=status_dir, output_dir=str(output_dir), world_size=world_size)
        for c in commands
    ]


def _refuse_linked_work_dir(work_dir: Path) -> None:
    """A symbolic link where the job empties or writes (a planted one would redirect the writes) is a
    :class:`DistributedError`."""
    for path in (work_dir, work_dir / "status", work_dir / JOB_LOG):  # emptied or written at every start
        if path.is_symlink():
            raise DistributedError(
                f"{path} is a symbolic link: remove it, or pass another --work_dir (the job empties and writes it)"
            )


def _mpirun_kwargs(layout: ClusterLayout, work_dir: Path, mpirun: str | None, config_file: Path) -> dict:
    """mpirun's part of :func:`launch_commands`' arguments; the hostfile written for a multi-node layout."""
    mpirun = mpirun or find_mpirun()
    flavour = detect_mpi_flavour(mpirun)
    hostfile = work_dir / "hostfile"
    if not layout.is_local:
        write_hostfile(layout, hostfile, flavour)
    return dict(flavour=flavour, mpirun=mpirun, hostfile=hostfile.resolve(), config_file=config_file)


# Per module of TRAIN_MODULES: its flags' parser, its data folder's flag, its cheap checks.
_METHOD_CHECKS = {
    "helpers.train": (parse_train_args, "train_data_dir", training_inputs),
    "helpers.dreambooth": (parse_dreambooth_args, "instance_data_dir", dreambooth_inputs),
}


def _check_train_flags(module: str, train_args: Sequence[str], rank0_here: bool):
    """The flags of ``module`` parsed as its ranks will parse them; its data folder must be one here.

    Where rank 0 runs on this machine (it owns the output folder), also the run's own cheap checks,
    as its ranks would run them first (:mod:`helpers.training.inputs`, :mod:`helpers.dreambooth.inputs`):
    the output folder (a finished run that would be clobbered, a folder in use), the pictures, the
    checkpoint to resume. So those are one line and exit 2 before any rank starts, and before this
    writes its ``launch/`` folder into the output folder.
    """
    parse, data_flag, checks = _METHOD_CHECKS[module]
    config = parse(list(train_args))
    if getattr(config, data_flag) and not Path(getattr(config, data_flag)).is_dir():
        raise DistributedError(
            f"--{data_flag} {getattr(config, data_flag)} is not a folder here; give the concept images' folder "
            "(the same path on every node)"
        )
    if rank0_here:
        with warnings.catch_warnings():  # e.g. small pictures: the ranks warn, once each run
            warnings.simplefilter("ignore")
            checks.check_inputs(config)
    return config


def _warn_if_short_of_memory(layout: ClusterLayout, config, module: str, nodes_here: int) -> None:
    """Print :func:`helpers.launching.preflight.memory_warning` on stderr when this machine's ranks need
    more memory than it has.

    Only where a measurement applies and this machine is known to run ranks: ``helpers.train``
    (DreamBooth's memory is not measured) on a model of Stable Diffusion v1.5's or SDXL's layer sizes
    (not the offline toy models, nor a local folder with another UNet) in a precision and prepacking
    measured for it, on a host of the layout or in Ray's private runtime here (``nodes_here``: the
    nodes of the job this machine is). Other nodes' memory cannot be read from here and is not checked.
    """
    shape = _measured_shape(config.pretrained_model_name_or_path)
    if module != "helpers.train" or shape is None:
        return
    if not nodes_here:
        return
    precision = cpu.choose_precision(config.mixed_precision).mixed_precision  # as this CPU's ranks will
    packed = prepacks(config.prepack_convs, config.resolution) or prepacks(
        config.prepack_linears, config.resolution
    )
    prepack = packed and not config.use_ipex
    try:
        line = preflight.memory_warning(
            layout.nproc_per_node, config.resolution, precision, prepack, shape=shape, nodes_here=nodes_here
        )
    except ValueError:  # nothing measured for this precision and prepacking of the shape
        return
    if line:
        print(line, file=sys.stderr)


# The Hub's models of the measured shapes; another Hub id is taken to be SD v1.5's (the workshop's).
_HUB_SHAPES = {"stabilityai/stable-diffusion-xl-base-1.0": "sdxl"}


def _measured_shape(model: str) -> str | None:
    """Whose layer sizes ``model``'s UNet has, where memory is measured: ``"sd15"`` (Stable Diffusion
    v1.5) or ``"sdxl"`` (SDXL base 1.0), read from its UNet config (a local folder, or a Hub id in
    Hugging Face's cache); else None (the offline toy models, a UNet of other widths). A Hub id not in
    the cache is :data:`_HUB_SHAPES`' or SD v1.5's."""
    if model in models.OFFLINE_MODELS:
        return None
    unet_config = Path(model).expanduser() / "unet" / "config.json"
    if not unet_config.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(model, "unet/config.json")
        except ValueError:  # not a repository id either
            cached = None
        if not isinstance(cached, str):
            return _HUB_SHAPES.get(model, "sd15")
        unet_config = Path(cached)
    try:
        widths = list(json.loads(unet_config.read_text())["block_out_channels"])
    except (OSError, ValueError, KeyError, TypeError):  # not a diffusers UNet's config
        return None
    shapes = {"sd15": models.SD15_SHAPE_UNET_CONFIG, "sdxl": models_xl.SDXL_SHAPE_CONFIGS[2]}
    return next((name for name, unet in shapes.items() if widths == list(unet["block_out_channels"])), None)


_DEFAULT_SECONDS = {"exit_grace_seconds": 60, "stall_seconds": 900}


def check_seconds(cli: bool = False, **values: float) -> None:
    """Reject a supervision time that is not positive (one line naming it, as flag or argument)."""
    for name, value in values.items():
        if value <= 0:
            given = f"--{name} {value:g}" if cli else f"{name}={value:g}"
            raise DistributedError(
                f"{given}: must be more than 0 seconds; pass e.g. {_DEFAULT_SECONDS[name]} (the default)"
            )
