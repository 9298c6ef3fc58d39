"""The process group every rank starts: ``gloo``, or ``ccl`` (oneCCL) where it is built.

The launcher chooses the backend (:func:`select_backend`) and puts it in every rank's
environment (``WORKSHOP_BACKEND``); each rank starts it with :func:`init_backend` just before
``Accelerator()``."""

from __future__ import annotations

import importlib.util
import os
import socket

from helpers.core.errors import DistributedError


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
