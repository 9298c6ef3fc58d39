"""``python -m helpers.launch``: run the training on several processes or machines, and supervise it.

::

    python -m helpers.launch --launcher mpirun --nproc_per_node 2 [--hostfile hosts] \\
        [--main_process_ip IP] [--main_process_port P] [--dry_run] -- <helpers.train flags>
    python -m helpers.launch --launcher ray --nproc_per_node 2 [--num_nodes M] \\
        [--ray_address auto|HOST:PORT] -- <helpers.train flags>

builds the commands with :mod:`helpers.launching.commands` (mpirun: one command on the head node;
torchrun: one per node, the others started over ssh; ray: one Ray Train driver,
:mod:`helpers.launching.ray_train`, whose workers Ray places), streams rank 0's output, and returns the
job's exit code. The hostfile and accelerate configs go to ``<output_dir>/launch/`` (``--work_dir``),
and under torchrun each node's rank logs to ``<work_dir>/torchrun/``.

Supervision to the end: every rank of ``helpers.train`` reports to ``<work_dir>/status``
(:mod:`helpers.launching.supervise`), so this sees each rank exit even under mpirun. A rank that
fails (exits without reporting success, killed outright included) stops the whole job at once, in
one line naming the rank and the cause, e.g. ``rank 1 failed after 12.3 s: killed by SIGKILL, for
example by the out-of-memory killer``; the ranks' tracebacks go to ``<work_dir>/job.log`` (named in
that line), not to the screen. Once one rank has exited successfully, the others get
``--exit_grace_seconds`` (60) to end; a rank alive without progress for ``--stall_seconds`` (900)
is stalled, and so is a job with a rank that has not started that long after the job did (MPI
could not spawn it, a node never joined). Either way this stops the whole job (TERM, then KILL: the launchers' process trees
here, the ranks on other hosts over ssh) and prints one message: the ranks that did not end, their
last lines, and whether the outputs are complete (``run_summary.json`` written); the exit code is
0 only if they are. On one machine the rendezvous port is a free one (two jobs side by side both
run); a given ``--main_process_port`` in use is one ``error:`` line before any rank starts.

The ranks' process group is ``--backend`` (``auto``: ``ccl``, the workshop's oneCCL backend, where
``make setup`` built it and it loads, else ``gloo``; :mod:`helpers.ranks.backend`); ``--backend ccl``
where it cannot load is one ``error:`` line naming what is missing, before anything is written.
``--dry_run`` prints each oneCCL variable with its reason above the command.

Not testable here: ssh to real machines (tests stand in a script for ssh and run every "node"
on localhost).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import psutil

from helpers.core import errors
from helpers.core.errors import DistributedError
from helpers.launching import commands, preflight, ray_train
from helpers.launching.job import TRAIN_MODULES, check_seconds, prepare_job, run_job
from helpers.launching.layout import DEFAULT_PORT, ClusterLayout, parse_hostfile, physical_cores
from helpers.ranks.backend import BACKENDS
from helpers.training.engine import checkpoints

LAUNCHERS = (*commands.LAUNCHERS, "ray")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse ``[launch options] -- [helpers.train flags]``; the train flags are in ``.train_args``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, train_args = argv[:split], argv[split + 1 :]
    parser = errors.ArgumentParser(
        prog="python -m helpers.launch",
        description="Run helpers.train on several processes or machines (mpirun, torchrun or Ray Train).",
        epilog="Everything after -- goes to helpers.train, e.g. -- --pretrained_model_name_or_path tiny ...",
    )
    parser.add_argument("--launcher", choices=LAUNCHERS, default="mpirun")
    parser.add_argument("--backend", choices=("auto", *BACKENDS), default="auto",
                        help="the ranks' process group: ccl (oneCCL, built by make setup) or gloo; auto: ccl where built")  # fmt: skip
    parser.add_argument("--module", choices=TRAIN_MODULES, default="helpers.train",
                        help="what every rank runs; the flags after -- are its flags")  # fmt: skip
    parser.add_argument("--nproc_per_node", type=int, default=None,
                        help="processes per node (default: the hostfile's slots, else 1)")  # fmt: skip
    parser.add_argument(
        "--hostfile", help="one host per line; the first is the head node (default: this machine)"
    )
    parser.add_argument("--main_process_ip", help="address of rank 0 (default: the first host)")
    parser.add_argument("--main_process_port", type=int, default=None,
                        help=f"rendezvous port, checked free before any rank starts (default: a free one on one "
                             f"machine, {DEFAULT_PORT} across machines)")  # fmt: skip
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
                        help="once a rank has exited successfully, seconds the others get to end before the job is "
                             "stopped (a failed rank stops the job at once)")  # fmt: skip
    parser.add_argument("--stall_seconds", type=float, default=900.0,
                        help="stop the job when a rank makes no progress (no step), or has not started, for this long")  # fmt: skip
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
    for name in ("nproc_per_node", "num_nodes", "threads_per_process"):  # 0 used to run one process
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise DistributedError(
                f"--{name} {value}: must be at least 1 (or leave the flag out for the default)"
            )
    check_seconds(exit_grace_seconds=args.exit_grace_seconds, stall_seconds=args.stall_seconds, cli=True)
    _check_ray_options(args)
    if args.dry_run:  # printing commands for a cluster need not reach it from here
        return
    if args.launcher == "ray":
        if args.ray_address:
            ray_train.check_address(args.ray_address)
        else:
            threads = args.threads_per_process or max(1, physical_cores() // (args.nproc_per_node or 1))
            ray_train.check_local_layout(args.nproc_per_node or 1, args.num_nodes or 1, threads)
    if args.network_interface:
        names = sorted(psutil.net_if_addrs())
        if args.network_interface not in names:
            raise DistributedError(
                f"--network_interface {args.network_interface}: no such interface on this machine "
                f"(it has {', '.join(names)}); pass one of those, or leave the flag out to let MPI and gloo choose"
            )
    if args.hostfile:
        for host, _ in parse_hostfile(args.hostfile):
            if not _resolves(host):
                raise DistributedError(
                    f"--hostfile {args.hostfile}: host {host!r} does not resolve; correct the name, or add it "
                    "to /etc/hosts or to the ssh config (Host/HostName)"
                )


def _check_ray_options(args: argparse.Namespace) -> None:
    """Ray's options only with Ray, and the others' not with it."""
    if args.launcher != "ray":
        for flag in ("num_nodes", "ray_address"):
            if getattr(args, flag) is not None:
                raise DistributedError(
                    f"--{flag} is for --launcher ray only; with {args.launcher} the hostfile lists the nodes"
                )
        return
    for flag in ("hostfile", "main_process_ip", "network_interface", "mpirun"):
        if getattr(args, flag):
            raise DistributedError(
                f"--{flag}: not used with --launcher ray (Ray finds its nodes and addresses itself); drop it, "
                "and join a cluster with --ray_address"
            )
    if args.num_nodes is not None and args.num_nodes < 1:
        raise DistributedError(f"--num_nodes {args.num_nodes}: must be at least 1")
    if args.ray_address:
        ray_train.parse_address(args.ray_address)


def _resolves(host: str) -> bool:
    """True if ``host`` has an address here, directly or through the ssh config's HostName."""

    names = [host]
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):  # no ssh here: the name itself must resolve
        out = subprocess.run(["ssh", "-G", host], capture_output=True, text=True, timeout=10)
        names += [ln.split(None, 1)[1] for ln in out.stdout.splitlines() if ln.startswith("hostname ")]
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
        if args.launcher != "ray" and not args.dry_run:  # Ray picks its own ports
            preflight.check_port(layout)
        commands = prepare_job(layout, args.train_args, args.launcher, work_dir=args.work_dir, mpirun=args.mpirun,
                               num_nodes=args.num_nodes or 1, ray_address=args.ray_address, module=args.module,
                               backend=args.backend)  # fmt: skip
    except (ValueError, *errors.INPUT_ERRORS) as err:  # DistributedError, ConfigError: nothing started
        print(f"error: {errors.one_line(err)}", file=sys.stderr)
        return 2
    if args.dry_run:
        for cmd in commands:
            where = "on the head node" if cmd.host is None else f"on node {cmd.node_rank} ({cmd.host})"
            notes = "".join(f"#   {note}\n" for note in cmd.notes)
            print(f"# {args.launcher}, {where}, from {os.getcwd()}:\n{notes}{cmd.shell()}")
        return 0
    try:
        result = run_job(
            commands, exit_grace_seconds=args.exit_grace_seconds, stall_seconds=args.stall_seconds
        )
    except KeyboardInterrupt as stop:  # Ctrl-C, TERM or HUP: run_job has stopped every rank
        go_on = (
            "run the same command with --resume_from_checkpoint latest to go on from its last checkpoint"
            if checkpoints.list_checkpoints(Path(commands[0].output_dir))
            else "no checkpoint was written yet, so it must start over: run the same command again"
        )
        print(f"error: interrupted ({stop or 'Ctrl-C'}); every rank was stopped. The run is not finished: {go_on}",
              file=sys.stderr)  # fmt: skip
        return 130
    if not result.ok or result.supervision:  # one message; a warning when the outputs are complete
        print(f"{'error' if not result.ok else 'warning'}: {result.message()}", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    raise SystemExit(main(parse_args()))
