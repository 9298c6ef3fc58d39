"""The command lines that start a job (mpirun, torchrun) and the environment every rank gets.

* Every rank runs ``python -m accelerate.commands.launch`` (what the ``accelerate launch`` script
  runs, minus a few seconds per process of importing the CLI's other subcommands), with the
  absolute path of this interpreter, so non-interactive ssh shells on the workers need no ``PATH``
  set up.
* ``MASTER_ADDR``, ``MASTER_PORT`` and ``OMP_NUM_THREADS`` are always passed explicitly: under
  MPI accelerate reads the rank from ``PMI_RANK``/``OMPI_COMM_WORLD_RANK`` but still needs the
  address, and would otherwise set one thread per process.
* On ``ccl`` every rank also gets oneCCL's variables (:func:`backend_variables`: transport,
  shared memory or the interface between nodes, yielding workers), each with a one-line reason
  that ``helpers.launch --dry_run`` prints as a comment before the command (``LaunchCommand.notes``).
  mpirun passes them with ``-genv``/``-x`` like the others: the ranks' oneCCL bootstraps through
  the c10d store, not through MPI, whichever MPI starts them (Intel MPI, MPICH, Open MPI)."""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from helpers.core.errors import DistributedError
from helpers.launching.accelerate_config import resolve_precision
from helpers.launching.layout import ClusterLayout, MpiFlavour, physical_cores
from helpers.ranks import oneccl
from helpers.ranks.backend import BACKEND_ENV, BACKENDS

LAUNCHERS = ("mpirun", "torchrun")


TRAIN_ENTRY = ("-m", "helpers.train")


def find_mpirun() -> str:
    """The ``mpirun`` to use: this environment's (Intel MPI from ``impi-rt``), else the first on PATH."""
    here = Path(sys.executable).parent / "mpirun"
    found = str(here) if here.exists() else shutil.which("mpirun")
    if not found:
        raise DistributedError(
            "no mpirun found: run `make setup` (installs Intel MPI, impi-rt, into .venv), or install "
            "Debian's mpich or openmpi-bin, or use --launcher torchrun"
        )
    return found


@functools.cache
def detect_mpi_flavour(mpirun: str | None = None) -> MpiFlavour:
    """Ask ``mpirun --version`` which MPI it belongs to.

    Raises:
        DistributedError: the program does not run or is not a known MPI launcher.
    """
    mpirun = mpirun or find_mpirun()
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(mpirun).parent), os.environ.get("PATH", "")]))
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30, env=env)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise DistributedError(f"{mpirun} --version failed ({err}): check the MPI installation") from None
    text = out.stdout + out.stderr
    if "Intel(R) MPI" in text:
        return MpiFlavour.INTEL
    if "Open MPI" in text or "OpenRTE" in text:
        return MpiFlavour.OPENMPI
    if "HYDRA" in text or "MPICH" in text:
        return MpiFlavour.MPICH
    raise DistributedError(f"{mpirun} is not Intel MPI, MPICH or Open MPI (--version said {text[:200]!r})")


def backend_variables(
    layout: ClusterLayout, backend: str, nodes: int | None = None
) -> list[tuple[str, str, str]]:
    """The backend's own variables for every rank, as ``(name, value, one-line reason)``.

    For ``ccl``: :func:`helpers.ranks.oneccl.environment` for this layout, with this machine's
    physical cores standing for every node's (a cluster of like nodes). Nothing for ``gloo``.

    Args:
        layout: the cluster.
        backend: ``"gloo"`` or ``"ccl"``.
        nodes: nodes of the job when the layout does not list them (Ray); default the layout's.
    """
    if backend not in BACKENDS:
        raise DistributedError(f"backend={backend!r}: use 'gloo' or 'ccl'")
    if backend == "gloo":
        return []
    return oneccl.environment(
        layout.nproc_per_node,
        nodes or layout.num_machines,
        physical_cores(),
        int(layout.threads_per_process or 1),
        layout.network_interface,
    )


def backend_notes(variables: list[tuple[str, str, str]]) -> tuple[str, ...]:
    """``NAME=value: reason`` for each of :func:`backend_variables`, as the dry run shows them."""
    return tuple(f"{name}={value}: {reason}" for name, value, reason in variables)


def job_env(layout: ClusterLayout, backend: str = "gloo") -> dict[str, str]:
    """Environment variables every rank needs, whatever the launcher.

    Args:
        layout: the cluster.
        backend: ``"gloo"`` or ``"ccl"`` (adds :func:`backend_variables`).
    """
    env = {
        "MASTER_ADDR": str(layout.main_process_ip),
        "MASTER_PORT": str(layout.main_process_port),
        "OMP_NUM_THREADS": str(layout.threads_per_process),
        "PYTHONUNBUFFERED": "1",  # rank output arrives as it is written, not at exit
        BACKEND_ENV: backend,  # init_backend, in every rank, starts this one
    }
    if layout.network_interface:
        env["GLOO_SOCKET_IFNAME"] = layout.network_interface
    env.update((name, value) for name, value, _ in backend_variables(layout, backend))
    return env


@dataclass(frozen=True)
class LaunchCommand:
    """One command to start, where, with which extra environment, and how its output is tagged.

    ``host`` None means "on this machine" (mpirun runs on the head node and reaches the others
    itself); a name means the node that must run it (torchrun runs once per node).
    """

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    host: str | None = None
    node_rank: int = 0
    output_tags: str = "hydra"  # hydra "[r] ", openmpi "[1,r]<stdout>:", torchrun "[default<local>]:"
    rank_offset: int = 0  # global rank of this command's local rank 0 (torchrun)
    status_dir: str | None = None  # the ranks' status folder (helpers.launching.supervise), if they report
    output_dir: str | None = None  # the run's output_dir, where run_summary.json marks it complete
    world_size: int | None = None  # the job's ranks in all, each expected to report (status_dir)
    notes: tuple[str, ...] = ()  # why the backend's variables are set ("NAME=value: reason"), dry run

    def shell(self) -> str:
        """The command as one shell line, ``VAR=value ... program args``."""
        return shlex.join([f"{k}={v}" for k, v in self.env.items()] + list(self.argv))


def accelerate_launch_argv(
    layout: ClusterLayout,
    entry: Sequence[str] = TRAIN_ENTRY,
    config_file: str | os.PathLike | None = None,
    mixed_precision: str = "no",
) -> list[str]:
    """What each MPI rank runs: ``python -m accelerate.commands.launch ... <entry>``.

    With ``config_file`` accelerate reads the node's YAML; without, the same settings go inline.
    """
    argv = [sys.executable, "-m", "accelerate.commands.launch"]
    if config_file:
        argv += ["--config_file", os.path.abspath(config_file)]
    else:
        argv += [
            "--cpu",
            "--num_machines",
            str(layout.num_machines),
            "--num_processes",
            str(layout.world_size),
            "--main_process_ip",
            str(layout.main_process_ip),
            "--main_process_port",
            str(layout.main_process_port),
            "--mixed_precision",
            resolve_precision(mixed_precision),
            "--dynamo_backend",
            "no",
        ]
    return argv + list(entry)


def _torchrun_argv(
    layout: ClusterLayout, node_rank: int, rest: Sequence[str], log_dir: str | os.PathLike | None
) -> tuple[str, ...]:
    flags = (
        f"--nnodes {layout.num_machines} --node_rank {node_rank} --nproc_per_node {layout.nproc_per_node} "
        f"--master_addr {layout.main_process_ip} --master_port {layout.main_process_port} "
        "--tee 3"  # tags every line with the local rank: "[default0]:"
    ).split()
    if log_dir is not None:  # without it, torchrun keeps the teed logs in a new /tmp/torchelastic_* folder
        flags += ["--log-dir", os.path.abspath(log_dir)]
    return (sys.executable, "-m", "torch.distributed.run", *flags, *rest)


def _mpirun_argv(
    layout: ClusterLayout,
    flavour: MpiFlavour,
    mpirun: str,
    hostfile: str | os.PathLike,
    env: Mapping[str, str],
) -> tuple[list[str], dict[str, str], str]:
    """mpirun's own part of the command line (before each rank's command), the variables for mpirun
    itself, and how its output lines are tagged, for ``flavour`` (Hydra or Open MPI)."""
    n, ppn = str(layout.world_size), str(layout.nproc_per_node)
    launcher_env: dict[str, str] = {}
    if flavour.hydra:
        argv = [mpirun, "-l"]
        argv += ["-hosts", "localhost"] if layout.is_local else ["-f", str(hostfile)]
        argv += ["-n", n, "-ppn", ppn]
        if layout.network_interface:
            if flavour is MpiFlavour.INTEL:
                launcher_env["I_MPI_HYDRA_IFACE"] = layout.network_interface
            else:
                argv += ["-iface", layout.network_interface]
        for k, v in env.items():
            argv += ["-genv", k, v]
        tags = "hydra"
    else:
        argv = [mpirun, "--tag-output", "--bind-to", "none"]  # default binding pins each rank to one core
        if os.geteuid() == 0:
            argv.append("--allow-run-as-root")
        argv += ["--host", f"localhost:{ppn}"] if layout.is_local else ["--hostfile", str(hostfile)]
        argv += ["-n", n, "--npernode", ppn]
        if layout.network_interface:
            iface = layout.network_interface
            argv += ["--mca", "btl_tcp_if_include", iface, "--mca", "oob_tcp_if_include", iface]
        for k, v in env.items():
            argv += ["-x", f"{k}={v}"]
        argv += ["-x", "PATH"]  # Open MPI forwards nothing it is not told to
        tags = "openmpi"
    return argv, launcher_env, tags


def launch_commands(
    layout: ClusterLayout,
    train_args: Sequence[str],
    launcher: str = "mpirun",
    *,
    flavour: MpiFlavour | None = None,
    mpirun: str | None = None,
    hostfile: str | os.PathLike = "hostfile",
    config_file: str | os.PathLike | None = None,
    mixed_precision: str = "no",
    backend: str = "gloo",
    entry: Sequence[str] = TRAIN_ENTRY,
    program: Sequence[str] | None = None,
    extra_env: Mapping[str, str] | None = None,
    log_dir: str | os.PathLike | None = None,
) -> list[LaunchCommand]:
    """The exact command lines that start the training on every node.

    Args:
        layout: the cluster.
        train_args: ``helpers.train`` flags, e.g. ``["--max_train_steps", "30", ...]``.
        launcher: ``"mpirun"`` (one command, on the head node) or ``"torchrun"`` (one per node).
        flavour: MPI flavour (default: detected from ``mpirun``).
        mpirun: the mpirun program (default :func:`find_mpirun`).
        hostfile: hostfile path for multi-node MPI; write it with :func:`write_hostfile`.
        config_file: accelerate YAML every rank reads (must exist at this path on every node);
            None passes the same settings as flags.
        mixed_precision: for the inline accelerate flags when there is no config file.
        backend: ``"gloo"`` or ``"ccl"`` (see :func:`helpers.ranks.backend.resolve_backend`).
        entry: what accelerate launch / torchrun runs (``-m module`` or a script path).
        program: for mpirun only, replace each rank's whole command (tests, diagnostics).
        extra_env: more variables every rank gets (passed as the job's own, on every node).
        log_dir: for torchrun only, its ``--log-dir``: each launch keeps its ranks' output there, in a
            new ``<run id>_*/attempt_0/<local rank>/`` folder. Without it torchrun keeps them in a
            new ``/tmp/torchelastic_*`` folder that nothing removes.

    Returns:
        The commands; render each with :meth:`LaunchCommand.shell`.
    """
    if launcher not in LAUNCHERS:
        raise DistributedError(f"launcher={launcher!r}: use one of {', '.join(LAUNCHERS)}")
    env = {**job_env(layout, backend), **(extra_env or {})}
    notes = backend_notes(backend_variables(layout, backend))
    train_args = [str(a) for a in train_args]
    if launcher == "torchrun":
        rank_env = {k: v for k, v in env.items() if not k.startswith("MASTER_")}  # torchrun sets those
        return [
            LaunchCommand(
                argv=_torchrun_argv(layout, k, [*entry, *train_args], log_dir),
                env=rank_env,
                host=host,
                node_rank=k,
                output_tags="torchrun",
                rank_offset=k * layout.nproc_per_node,
                notes=notes,
            )
            for k, host in enumerate(layout.hosts)
        ]
    mpirun = mpirun or find_mpirun()
    flavour = flavour or detect_mpi_flavour(mpirun)
    rank_argv = (
        list(program) if program else accelerate_launch_argv(layout, entry, config_file, mixed_precision)
    )
    argv, launcher_env, tags = _mpirun_argv(layout, flavour, mpirun, hostfile, env)
    return [
        LaunchCommand(argv=(*argv, *rank_argv, *train_args), env=launcher_env, output_tags=tags, notes=notes)
    ]
