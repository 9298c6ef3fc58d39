"""The cluster's layout: hosts, processes per host, the main process's address, and hostfiles."""

from __future__ import annotations

import functools
import os
import re
import socket
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import psutil

from helpers.core.errors import DistributedError
from helpers.core.files import write_text_atomic

DEFAULT_PORT = 29500


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

    name = socket.gethostname()
    addresses = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return frozenset({"localhost", name, name.split(".")[0], *addresses})


def is_local_host(host: str) -> bool:
    """True if ``host`` names this machine (so it needs no ssh)."""
    return host in _local_names()


def physical_cores() -> int:
    """Physical cores of this machine (imported lazily: :mod:`helpers.core.cpu` imports torch)."""
    # imported here: helpers.core.cpu imports torch (+1.9 s CPU on this module's 0.1 s import,
    # measured with time.process_time); only a layout without threads_per_process needs it
    from helpers.core import cpu

    return cpu.physical_cores()


@dataclass(frozen=True)
class ClusterLayout:
    """Where the processes run: hosts, processes per host, rendezvous address, threads.

    Args:
        hosts: node names or addresses; the first is the head node (rank 0 runs there).
        nproc_per_node: processes on every node (the same on each).
        main_process_ip: address rank 0 listens on (default: ``127.0.0.1`` when every host is
            this machine, else the first host).
        main_process_port: TCP port of the rendezvous; must be open between the nodes. 0 picks one
            that is free on this machine now (run from the head node, as mpirun is). None (the
            default): that on this machine alone, so two jobs side by side never meet on one
            port; :data:`DEFAULT_PORT` across machines (open it between them).
        network_interface: NIC the nodes talk over (e.g. ``eth0``); None lets MPI and gloo choose.
        threads_per_process: intra-op threads of each process (default: physical cores of this
            machine // ``nproc_per_node``, nodes assumed alike). Always set explicitly on the ranks.
    """

    hosts: tuple[str, ...]
    nproc_per_node: int = 1
    main_process_ip: str | None = None
    main_process_port: int | None = None
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
        if self.main_process_port is None:
            local = all(is_local_host(h) for h in hosts)
            object.__setattr__(self, "main_process_port", 0 if local else DEFAULT_PORT)
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
