"""Several processes, one training: cluster layout, accelerate configs, launch commands, checks.

The training code is the same in one process and in many (``helpers.train``); this module only
builds what starts it: the accelerate config file of each node, the ``mpirun`` or ``torchrun``
command lines with the environment every rank needs, and a pre-flight check of the nodes.
:mod:`helpers.launch` runs those commands and supervises the job.

Choices, measured on the development machines (reasons in docs/architecture.md):

* Backend ``gloo``. The oneCCL bindings (``oneccl_bindings_for_pytorch``, backend ``ccl``) are
  deprecated, not on the Python package registry, and accelerate >= 1.13 removed its support;
  :func:`select_backend` picks ``ccl`` only where the bindings import.
* Every rank runs ``python -m accelerate.commands.launch`` (what the ``accelerate launch`` script
  runs, minus 4 s per process of importing the CLI's other subcommands), with the absolute path
  of this interpreter, so non-interactive ssh shells on the workers need no ``PATH`` set up.
* ``MASTER_ADDR``, ``MASTER_PORT`` and ``OMP_NUM_THREADS`` are always passed explicitly: under
  MPI accelerate reads the rank from ``PMI_RANK``/``OMPI_COMM_WORLD_RANK`` but still needs the
  address, and would otherwise set one thread per process.

Tested across real interfaces on one machine: two "hosts" made of network namespaces, each with
its own sshd and two links, train through mpirun and torchrun over the interface the layout names
(``tests/launching/test_netns.py``). Not testable here: several real machines and oneCCL.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from helpers.core.files import write_text_atomic

DEFAULT_PORT = 29500
LAUNCHERS = ("mpirun", "torchrun")
MIXED_PRECISION = ("auto", "no", "bf16")
TRAIN_ENTRY = ("-m", "helpers.train")
PREFLIGHT_PACKAGES = (
    "torch",
    "ray",  # --launcher ray: every node must run the driver's Ray (and torch)
    "accelerate",
    "diffusers",
    "transformers",
    "safetensors",
    "sd-cpu-workshop-helpers",
)


class DistributedError(ValueError):
    """A layout, hostfile or launch setting is invalid; the message names it and the fix."""


class MpiFlavour(StrEnum):
    """Which MPI's ``mpirun``: the Hydra launchers (Intel MPI, MPICH) or Open MPI."""

    INTEL = "intel"
    MPICH = "mpich"
    OPENMPI = "openmpi"

    @property
    def hydra(self) -> bool:
        return self is not MpiFlavour.OPENMPI


@functools.cache
def _local_names() -> frozenset[str]:
    """Names and addresses of this machine (a hostfile may list the head node by its private IP)."""
    import psutil

    name = socket.gethostname()
    addresses = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return frozenset({"localhost", name, name.split(".")[0], *addresses})


def is_local_host(host: str) -> bool:
    """True if ``host`` names this machine (so it needs no ssh)."""
    return host in _local_names()


def physical_cores() -> int:
    """Physical cores of this machine (imported lazily: :mod:`helpers.core.cpu` imports torch)."""
    from helpers.core import cpu

    return cpu.physical_cores()


# --- layout ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterLayout:
    """Where the processes run: hosts, processes per host, rendezvous address, threads.

    Args:
        hosts: node names or addresses; the first is the head node (rank 0 runs there).
        nproc_per_node: processes on every node (the same on each).
        main_process_ip: address rank 0 listens on (default: ``127.0.0.1`` when every host is
            this machine, else the first host).
        main_process_port: TCP port of the rendezvous; must be open between the nodes. 0 picks one
            that is free on this machine now (run from the head node, as mpirun is).
        network_interface: NIC the nodes talk over (e.g. ``eth0``); None lets MPI and gloo choose.
        threads_per_process: intra-op threads of each process (default: physical cores of this
            machine // ``nproc_per_node``, nodes assumed alike). Always set explicitly on the ranks.
    """

    hosts: tuple[str, ...]
    nproc_per_node: int = 1
    main_process_ip: str | None = None
    main_process_port: int = DEFAULT_PORT
    network_interface: str | None = None
    threads_per_process: int | None = None

    def __post_init__(self) -> None:
        hosts = tuple(str(h).strip() for h in ([self.hosts] if isinstance(self.hosts, str) else self.hosts))
        object.__setattr__(self, "hosts", hosts)
        if not hosts or not all(hosts):
            raise DistributedError(f"hosts={self.hosts!r}: give at least one host name, e.g. ['localhost']")
        dupes = sorted({h for h in hosts if hosts.count(h) > 1})
        if dupes:
            raise DistributedError(
                f"hosts lists {dupes} more than once: list each node once, use nproc_per_node"
            )
        if not isinstance(self.nproc_per_node, int) or self.nproc_per_node < 1:
            raise DistributedError(
                f"nproc_per_node={self.nproc_per_node!r}: must be an integer of at least 1"
            )
        if not 0 <= int(self.main_process_port) <= 65535:
            raise DistributedError(
                f"main_process_port={self.main_process_port}: must be a TCP port, 1-65535, "
                "or 0 for one that is free on this machine"
            )
        if int(self.main_process_port) == 0:
            object.__setattr__(self, "main_process_port", free_port())
        if self.threads_per_process is not None and self.threads_per_process < 1:
            raise DistributedError(
                f"threads_per_process={self.threads_per_process}: must be at least 1 (or None)"
            )
        if self.main_process_ip is None:
            local = all(is_local_host(h) for h in hosts)
            object.__setattr__(self, "main_process_ip", "127.0.0.1" if local else hosts[0])
        if self.threads_per_process is None:
            object.__setattr__(self, "threads_per_process", max(1, physical_cores() // self.nproc_per_node))

    @property
    def num_machines(self) -> int:
        return len(self.hosts)

    @property
    def world_size(self) -> int:
        return len(self.hosts) * self.nproc_per_node

    @property
    def is_local(self) -> bool:
        """True when the job runs on this machine only (no hostfile, no ssh)."""
        return self.num_machines == 1 and is_local_host(self.hosts[0])

    @classmethod
    def local(cls, nproc_per_node: int = 2, **kwargs) -> ClusterLayout:
        """``nproc_per_node`` processes on this machine."""
        return cls(hosts=("localhost",), nproc_per_node=nproc_per_node, **kwargs)

    @classmethod
    def create(
        cls, hostfile: str | os.PathLike | None, nproc_per_node: int | None = None, **kwargs
    ) -> ClusterLayout:
        """From ``hostfile``, or ``nproc_per_node`` processes on this machine when it is empty."""
        if hostfile:
            return cls.from_hostfile(hostfile, nproc_per_node, **kwargs)
        return cls.local(nproc_per_node or 1, **kwargs)

    @classmethod
    def from_hostfile(
        cls, path: str | os.PathLike, nproc_per_node: int | None = None, **kwargs
    ) -> ClusterLayout:
        """Read the hosts from a hostfile (see :func:`parse_hostfile`).

        Args:
            path: the hostfile.
            nproc_per_node: processes per node; default the file's slot count, else 1.
            **kwargs: the other :class:`ClusterLayout` fields.
        """
        entries = parse_hostfile(path)
        slots = {n for _, n in entries if n is not None}
        if nproc_per_node is None:
            if len(slots) > 1:
                raise DistributedError(
                    f"{path}: hosts have different slot counts {sorted(slots)}; every node runs the same "
                    "number of processes here: pass nproc_per_node or make the counts equal"
                )
            nproc_per_node = slots.pop() if slots else 1
        return cls(hosts=tuple(h for h, _ in entries), nproc_per_node=nproc_per_node, **kwargs)


_HOSTFILE_LINE = re.compile(
    r"^(?P<host>[A-Za-z0-9_.\-\[\]]+)(?::(?P<colon>\d+))?(?:\s+slots\s*=\s*(?P<slots>\d+))?"
    r"(?:\s+max[-_]slots\s*=\s*\d+)?$"
)


def parse_hostfile(path: str | os.PathLike) -> list[tuple[str, int | None]]:
    """Read a hostfile in any of the usual syntaxes.

    Accepts one host per line as ``host``, ``host:N`` (Intel MPI / MPICH) or ``host slots=N``
    (Open MPI); ``#`` starts a comment.

    Returns:
        ``(host, slots or None)`` per line, in order.
    """
    path = Path(path)
    if not path.is_file():
        raise DistributedError(
            f"hostfile {path} does not exist: write one host per line (notebook 01 writes it for the Azure "
            "cluster), or use ClusterLayout.local() for processes on this machine"
        )
    entries = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _HOSTFILE_LINE.match(line)
        if not m:
            raise DistributedError(
                f"{path}:{number}: cannot read {raw.strip()!r}; expected 'host', 'host:N' or 'host slots=N'"
            )
        n = m["colon"] or m["slots"]
        entries.append((m["host"], int(n) if n else None))
    if not entries:
        raise DistributedError(f"hostfile {path} lists no host: write one host name or address per line")
    return entries


def write_hostfile(layout: ClusterLayout, path: str | os.PathLike, flavour: MpiFlavour) -> Path:
    """Write the layout's hosts in the syntax of ``flavour`` (``host:N`` or ``host slots=N``)."""
    fmt = "{host}:{n}" if flavour.hydra else "{host} slots={n}"
    text = "".join(fmt.format(host=h, n=layout.nproc_per_node) + "\n" for h in layout.hosts)
    return write_text_atomic(Path(path), text)


def free_port() -> int:
    """A TCP port that is free on this machine right now (for local runs and tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- accelerate config files ---------------------------------------------------------------------


CONFIG_TEMPLATE = Path(__file__).parent.parent / "assets" / "accelerate_config_template.yaml"


@dataclass(frozen=True)
class ConfigAnswer:
    """One question of the interactive ``accelerate config``, our answer, the key it sets, and why."""

    question: str  # "" for keys the questionnaire implies without asking
    answer: str
    key: str
    value: str  # as written in the YAML
    why: str


def _resolve_precision(mixed_precision: str) -> str:
    if mixed_precision not in MIXED_PRECISION:
        raise DistributedError(
            f"mixed_precision={mixed_precision!r}: must be one of {', '.join(MIXED_PRECISION)}"
        )
    if mixed_precision == "auto":
        from helpers.core import cpu

        return cpu.choose_precision("auto").mixed_precision
    return mixed_precision


def _yaml_value(value: object) -> str:
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=1000).strip()
    return text.removesuffix("...").strip()


def render_accelerate_config(
    layout: ClusterLayout,
    machine_rank: int = 0,
    mixed_precision: str = "no",
    mpirun_hostfile: str | os.PathLike | None = None,
) -> str:
    """One node's accelerate config: :data:`CONFIG_TEMPLATE` with its placeholders filled.

    Args:
        layout: the cluster.
        machine_rank: this node's index in ``layout.hosts``.
        mixed_precision: ``"no"`` (fp32), ``"bf16"`` or ``"auto"`` (bf16 only where this CPU has it).
        mpirun_hostfile: if given, ``accelerate launch`` itself starts mpirun with this hostfile;
            leave None when :mod:`helpers.launch` runs mpirun.
    """
    if not 0 <= machine_rank < layout.num_machines:
        raise DistributedError(
            f"machine_rank={machine_rank}: must be 0..{layout.num_machines - 1} for this layout"
        )
    hostfile = os.path.abspath(mpirun_hostfile) if mpirun_hostfile else None
    values = {
        "NUM_MACHINES": layout.num_machines,
        "MACHINE_RANK": machine_rank,
        "HEAD_NODE_IP": layout.main_process_ip,
        "MAIN_PROCESS_PORT": layout.main_process_port,
        "MPIRUN_ANSWER": "yes" if hostfile else "no",
        "MPIRUN_HOSTFILE": hostfile or "(not asked)",
        "MPIRUN_CONFIG": {"mpirun_hostfile": hostfile} if hostfile else {},
        "NUM_PROCESSES": layout.world_size,
        "NPROC_PER_NODE": layout.nproc_per_node,
        "MIXED_PRECISION": _resolve_precision(mixed_precision),
    }

    def fill(text: str, as_yaml: bool) -> str:
        for name, value in values.items():
            text = text.replace(f"<{name}>", _yaml_value(value) if as_yaml else str(value))
        return text

    lines = []
    for line in CONFIG_TEMPLATE.read_text().splitlines():
        value, sep, why = line.partition("  # ")
        lines.append(
            fill(line, False) if line.startswith("#") else fill(value, True) + sep + fill(why, False)
        )
    return "\n".join(lines) + "\n"


def config_answers(config_text: str) -> list[ConfigAnswer]:
    """The questions, answers, keys and reasons of a rendered config (for the notebook's table)."""
    answers, pending, question = [], [], None
    for line in config_text.splitlines():
        if line.startswith("# Q: "):
            question = line[5:]
        elif line.startswith("# A: ") and question is not None:
            pending.append((question, line[5:]))
            question = None
        elif line and not line.startswith("#"):
            key, rest = line.split(":", 1)
            value, _, why = rest.partition("  # ")
            for q, a in pending or [("", "")]:
                answers.append(ConfigAnswer(q, a, key, value.strip(), why.strip()))
            pending = []
    return answers


def write_accelerate_configs(
    layout: ClusterLayout,
    out_dir: str | os.PathLike,
    mixed_precision: str = "no",
    mpirun_hostfile: str | os.PathLike | None = None,
) -> list[Path]:
    """Write one accelerate config per node, ``accelerate_config_node{K}.yaml`` with ``machine_rank: K``.

    Args:
        layout: the cluster.
        out_dir: folder for the files (created).
        mixed_precision: ``"no"``, ``"bf16"`` or ``"auto"`` (resolved on this machine).
        mpirun_hostfile: see :func:`render_accelerate_config`.

    Returns:
        The paths, node 0 first. Copy file K to node K, or keep them on a folder every node sees.
    """
    out = Path(out_dir)
    return [
        write_text_atomic(
            out / f"accelerate_config_node{k}.yaml",
            render_accelerate_config(layout, k, mixed_precision, mpirun_hostfile),
        )
        for k in range(layout.num_machines)
    ]


# --- MPI flavour, backend, environment ----------------------------------------------------------


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


def select_backend() -> str:
    """``"ccl"`` if the oneCCL bindings import, else ``"gloo"`` (the one tested here)."""
    if importlib.util.find_spec("oneccl_bindings_for_pytorch") is None:
        return "gloo"
    try:
        import oneccl_bindings_for_pytorch  # noqa: F401  # registers the ccl backend with torch
    except Exception:  # noqa: BLE001 - a broken install falls back to the backend that works
        return "gloo"
    return "ccl"


BACKEND_ENV = "WORKSHOP_BACKEND"  # set by job_env for every rank: the backend the launcher chose


def init_backend(backend: str | None = None) -> str:
    """Start the process group with ``backend`` before accelerate does, where accelerate cannot.

    accelerate 1.15 always starts ``gloo`` on CPUs. For ``ccl`` this starts the group first
    (accelerate then reuses it); for ``gloo`` it does nothing. The trainers call it just before
    ``Accelerator()`` (:func:`helpers.training.engine.setup.make_accelerator`), with the backend the launcher
    put in every rank's environment (``WORKSHOP_BACKEND``, from :func:`job_env`); a process
    started without a launcher uses ``gloo``. The ``ccl`` path is untested here (the bindings are
    not installable).

    Args:
        backend: ``"gloo"`` or ``"ccl"`` (default: ``$WORKSHOP_BACKEND``, else ``"gloo"``).

    Returns:
        The backend in use.
    """
    backend = backend or os.environ.get(BACKEND_ENV) or "gloo"
    if backend == "ccl":
        import torch.distributed as dist

        try:
            import oneccl_bindings_for_pytorch  # noqa: F401  # registers the ccl backend with torch
        except ImportError as e:
            raise DistributedError(
                f"backend 'ccl' ({BACKEND_ENV}) needs oneccl_bindings_for_pytorch, which does not import "
                f"on {socket.gethostname()} ({e}): install it on every node, or launch with gloo"
            ) from e

        if not dist.is_initialized():
            rank = int(
                os.environ.get("RANK")
                or os.environ.get("PMI_RANK")
                or os.environ.get("OMPI_COMM_WORLD_RANK", 0)
            )
            size = int(
                os.environ.get("WORLD_SIZE")
                or os.environ.get("PMI_SIZE")
                or os.environ.get("OMPI_COMM_WORLD_SIZE", 1)
            )
            dist.init_process_group("ccl", rank=rank, world_size=size)
    elif backend != "gloo":
        raise DistributedError(f"{BACKEND_ENV}={backend!r}: use 'gloo' or 'ccl'")
    return backend


def job_env(layout: ClusterLayout, backend: str = "gloo") -> dict[str, str]:
    """Environment variables every rank needs, whatever the launcher.

    Args:
        layout: the cluster.
        backend: ``"gloo"`` or ``"ccl"`` (adds the oneCCL variables; untested here).
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
    if backend == "ccl":
        env.update(CCL_WORKER_COUNT="1", CCL_ATL_TRANSPORT="ofi")
        if layout.network_interface:
            env["FI_TCP_IFACE"] = layout.network_interface
    elif backend != "gloo":
        raise DistributedError(
            f"backend={backend!r}: use 'gloo' (or 'ccl' where oneccl_bindings_for_pytorch imports)"
        )
    return env


# --- commands ------------------------------------------------------------------------------------


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
            _resolve_precision(mixed_precision),
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
        backend: ``"gloo"`` or ``"ccl"`` (see :func:`select_backend`).
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
            )
            for k, host in enumerate(layout.hosts)
        ]
    mpirun = mpirun or find_mpirun()
    flavour = flavour or detect_mpi_flavour(mpirun)
    rank_argv = (
        list(program) if program else accelerate_launch_argv(layout, entry, config_file, mixed_precision)
    )
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
    return [LaunchCommand(argv=(*argv, *rank_argv, *train_args), env=launcher_env, output_tags=tags)]


# --- pre-flight ----------------------------------------------------------------------------------

_PROBE = r"""
import json, os, socket, sys
from importlib import metadata
req = json.loads(sys.argv[1])
out = {"python": sys.version.split()[0], "packages": {}, "paths": {}, "port_free": None}
for p in req["packages"]:
    try:
        out["packages"][p] = metadata.version(p)
    except metadata.PackageNotFoundError:
        out["packages"][p] = None
for p in req["paths"]:
    out["paths"][p] = os.path.exists(p)
if req["port"]:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", req["port"]))
        out["port_free"] = True
    except OSError:
        out["port_free"] = False
    s.close()
print("PROBE " + json.dumps(out))
"""


_SSH_FIX = (
    "make `ssh -o BatchMode=yes HOST true` work without a prompt: notebook 01's ssh config and key "
    "(ssh-copy-id), the right host name, the node running"
)
_PORT_FIX = "stop the process holding it (an earlier run?) or pick another main_process_port"


@dataclass(frozen=True)
class PreflightProblem:
    """Something that would stop or silently spoil a multi-node run, on one host, with the fix."""

    host: str
    check: str
    detail: str
    fix: str


def _probe(host: str, request: dict, ssh: Sequence[str], timeout: float) -> tuple[dict | None, str, int]:
    """Run the probe on ``host``; return (answer or None, last error line, exit code)."""
    cmd = [sys.executable, "-c", _PROBE, json.dumps(request)]
    if not is_local_host(host):
        cmd = [*ssh, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(timeout)}", host, shlex.join(cmd)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 20)
    except FileNotFoundError:
        return None, f"{cmd[0]} not found", 255
    except subprocess.TimeoutExpired:
        return None, f"no answer within {timeout + 20:.0f} s", 255
    for line in out.stdout.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line[len("PROBE ") :]), "", 0
    return None, (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1], out.returncode


def preflight(
    layout: ClusterLayout,
    data_dir: str | os.PathLike,
    *,
    paths: Sequence[str | os.PathLike] = (),
    packages: Sequence[str] = PREFLIGHT_PACKAGES,
    ssh: Sequence[str] = ("ssh",),
    timeout: float = 10.0,
) -> list[PreflightProblem]:
    """Check every node before a multi-node run; return what is wrong (empty: all good).

    Per host: reachable over ssh without a password prompt (``BatchMode``), this interpreter at
    the same path, the same Python and package versions as this machine, ``data_dir`` and
    ``paths`` present; on the head node: ``main_process_port`` free. Hosts that name this
    machine are checked without ssh.

    Args:
        layout: the cluster.
        data_dir: the concept images (relative paths are taken from the current folder).
        paths: more files every node needs (e.g. the accelerate config).
        packages: distributions whose versions must match.
        ssh: the ssh command, e.g. ``("ssh", "-F", "cluster/ssh_config")``.
        timeout: seconds to wait for each ssh connection.
    """
    wanted = [os.path.abspath(p) for p in (data_dir, *paths)]
    head = layout.main_process_ip if layout.main_process_ip in layout.hosts else layout.hosts[0]
    request = {"packages": list(packages), "paths": wanted, "port": 0}
    reference, err, _ = _probe("localhost", request, ssh, timeout)
    if reference is None:
        raise RuntimeError(f"cannot probe this machine itself: {err}")
    env_fix = f"install the same environment at {sys.executable} on every node (make setup)"
    problems: list[PreflightProblem] = []
    for host in layout.hosts:
        request["port"] = int(layout.main_process_port) if host == head else 0
        got, err, code = _probe(host, request, ssh, timeout)
        found: list[tuple[str, str, str]] = []  # (check, detail, fix)
        if got is None and code == 255:  # ssh's own failures exit 255
            found.append(("ssh", err, _SSH_FIX))
        elif got is None:
            found.append(("python", f"{sys.executable} did not run: {err}", env_fix))
        else:
            if got["python"] != reference["python"]:
                found.append(("python", f"Python {got['python']}, here {reference['python']}", env_fix))
            ref = reference["packages"]
            found += [
                ("packages", f"{p} {v}, here {ref[p]}", env_fix)
                for p, v in got["packages"].items()
                if v != ref[p]
            ]
            fix = "copy it to every node at the same path: rsync -a {0} {1}:{0}"
            found += [
                ("files", f"{f} is missing", fix.format(f, host)) for f, ok in got["paths"].items() if not ok
            ]
            if got["port_free"] is False:
                found.append(("port", f"port {layout.main_process_port} is in use", _PORT_FIX))
        problems += [PreflightProblem(host, *f) for f in found]
    return problems


def config_form(
    hostfile: str = "",
    nproc_per_node: int = 1,
    main_process_port: int = DEFAULT_PORT,
    mixed_precision: str = "auto",
    config_dir: str = "accelerate_configs",
):
    """An ipywidgets form that writes the per-node configs when its button is pressed.

    Optional: it never waits for input, so a headless run (papermill) just shows it.

    Returns:
        The form (an ``ipywidgets.VBox``); ``form.children[-2]`` is the button, the last child
        the output area that lists the files written.
    """
    import ipywidgets as w

    fields = {
        "hostfile": w.Text(hostfile, description="hostfile", placeholder="empty: this machine only"),
        "nproc_per_node": w.BoundedIntText(nproc_per_node, min=1, max=512, description="procs/node"),
        "main_process_port": w.BoundedIntText(main_process_port, min=1, max=65535, description="port"),
        "mixed_precision": w.Dropdown(
            options=MIXED_PRECISION, value=mixed_precision, description="precision"
        ),
        "config_dir": w.Text(config_dir, description="folder"),
    }
    button, output = w.Button(description="Write the config files", button_style="primary"), w.Output()

    def write(_button) -> None:
        v = {name: field.value for name, field in fields.items()}
        kwargs = {"main_process_port": v["main_process_port"]}
        with output:
            output.clear_output()
            try:
                layout = ClusterLayout.create(v["hostfile"], v["nproc_per_node"], **kwargs)
                paths = write_accelerate_configs(layout, v["config_dir"], v["mixed_precision"])
                print("wrote", *paths, sep="\n  ")  # noqa: T201 - the form's own output area
            except DistributedError as err:
                print(f"error: {err}")  # noqa: T201

    button.on_click(write)
    return w.VBox([*fields.values(), button, output])
