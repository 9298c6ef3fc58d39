"""The process group every rank starts: ``gloo``, or ``ccl`` (oneCCL) where it can be used.

The launcher resolves ``--backend`` (:func:`resolve_backend`: ``auto`` is ``ccl`` where
:func:`helpers.ranks.oneccl.available` and, for ranks on one machine, ``/dev/shm`` has room, else
``gloo``) and puts the choice in every rank's
environment (``WORKSHOP_BACKEND``, with oneCCL's variables from
:func:`helpers.ranks.oneccl.environment`); each rank starts it with :func:`init_backend` just
before ``Accelerator()``. ``ccl`` is the workshop's own extension (:mod:`helpers.ranks.oneccl`), or
Intel's ``oneccl_bindings_for_pytorch`` where that imports.

Tested here (``tests/launching/test_launch.py``, ``test_netns.py``): the engine on ccl under
mpirun, torchrun and Ray gives the gloo run's embeddings; ccl across two network namespaces; a
killed rank ends a ccl job as a gloo one; ``--backend ccl`` where it cannot load is one line.
"""

from __future__ import annotations

import logging
import os
import socket

import torch.distributed as dist

from helpers.core.errors import DistributedError
from helpers.ranks import oneccl

BACKENDS = ("gloo", "ccl")
BACKEND_ENV = "WORKSHOP_BACKEND"  # set by job_env for every rank: the backend the launcher chose

logger = logging.getLogger(__name__)


def select_backend(one_machine: bool = False) -> str:
    """``"ccl"`` where it can be used here (built and loads, or the official bindings), else ``"gloo"``.

    With ``one_machine`` (every rank on this machine, so ccl's ranks talk through ``/dev/shm``),
    also only where ``/dev/shm`` has room for them (:func:`helpers.ranks.oneccl.shared_memory_shortfall`);
    where it has not, a warning says why the job runs on gloo.
    """
    if not oneccl.available()[0]:
        return "gloo"
    if one_machine and (short := oneccl.shared_memory_shortfall()):
        logger.warning(f"--backend auto: gloo, not ccl: {short}")
        return "gloo"
    return "ccl"


def resolve_backend(requested: str | None = "auto", one_machine: bool = False) -> str:
    """The backend a job runs on: ``auto`` (or None) is :func:`select_backend`.

    Args:
        requested: ``auto`` (None), ``gloo`` or ``ccl``.
        one_machine: every rank runs on this machine: ccl then needs room in ``/dev/shm``
            (:func:`select_backend`); ``ccl`` asked for without it is an error.

    Raises:
        DistributedError: ``ccl`` asked for where it cannot be used (one line: what is missing and
            the fix), or an unknown name.
    """
    if requested in (None, "auto"):
        return select_backend(one_machine)
    if requested == "ccl":
        ok, reason = oneccl.available()
        if ok and one_machine and (short := oneccl.shared_memory_shortfall()):
            ok, reason = False, short
        if not ok:
            raise DistributedError(f"--backend ccl: {reason} (or use --backend gloo)")
    elif requested != "gloo":
        raise DistributedError(f"--backend {requested}: use auto, gloo or ccl")
    return requested


def _env_int(*names: str, default: int) -> int:
    return int(next((os.environ[n] for n in names if os.environ.get(n)), default))


def init_backend(backend: str | None = None) -> str:
    """Start the process group with ``backend`` before accelerate does, where accelerate cannot.

    accelerate 1.15 always starts ``gloo`` on CPUs and reuses a group that exists. For ``ccl``
    this registers the backend (:func:`helpers.ranks.oneccl.load`) and starts the group first;
    for ``gloo`` it does nothing. Ray Train has already started a gloo group in its workers (it
    cannot create a backend it does not know); that one is replaced by a ccl group (rank 0 picks a
    new port and sends it over the gloo group). Rank and world size come from ``RANK``/``WORLD_SIZE``
    (torchrun, Ray) or MPI's variables (mpirun); the address from ``MASTER_ADDR``/``MASTER_PORT``.

    Args:
        backend: ``"gloo"`` or ``"ccl"`` (default: ``$WORKSHOP_BACKEND``, else ``"gloo"``).

    Returns:
        The backend in use.

    Raises:
        DistributedError: ``ccl`` cannot be loaded on this node, or an unknown backend.
    """
    backend = backend or os.environ.get(BACKEND_ENV) or "gloo"
    if backend not in BACKENDS:
        raise DistributedError(f"{BACKEND_ENV}={backend!r}: use 'gloo' or 'ccl'")
    if backend == "gloo":
        return backend
    try:
        oneccl.load()
    except (oneccl.CclUnavailable, OSError) as err:
        raise DistributedError(
            f"backend 'ccl' ({BACKEND_ENV}) cannot be used on {socket.gethostname()}: {err} "
            "(on every node), or launch with --backend gloo"
        ) from err
    if dist.is_initialized():
        if dist.get_backend() == backend:
            return backend
        _replace_group(backend)
        return backend
    rank = _env_int("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", default=0)
    size = _env_int("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", default=1)
    dist.init_process_group(backend, rank=rank, world_size=size)
    return backend


def _replace_group(backend: str) -> None:
    """Replace the default group (Ray's gloo) by one on ``backend`` with the same ranks."""
    rank, size = dist.get_rank(), dist.get_world_size()
    port = [0]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    address = f"tcp://{os.environ['MASTER_ADDR']}:{port[0]}"
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=size)
