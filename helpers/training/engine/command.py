"""What every training command (``python -m helpers.train``, ``python -m helpers.dreambooth``) does
around its ``main``: :func:`helpers.core.errors.run_training_cli` with the engine's own pieces."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from helpers.core.errors import run_training_cli
from helpers.ranks import status
from helpers.training.engine.checkpoints import INTERRUPTED_EXIT, interrupted_line
from helpers.training.models import HubUnavailableError


def run_command(
    main: Callable[[Any], Any], parse_args: Callable[[list[str] | None], Any], argv: list[str] | None
) -> int:
    """Parse, train, and turn input problems into one line and exit code 2; return the exit code.

    Under ``helpers.launch`` the rank takes its lock and status first (:func:`status.start`) and
    reports success last (:func:`status.done`); Ctrl-C is the one line saying how to go on (resume,
    or start over when no checkpoint exists) and :data:`INTERRUPTED_EXIT`.
    """
    return run_training_cli(
        main,
        parse_args,
        argv,
        status.start,
        lambda config: interrupted_line(config.output_dir),
        INTERRUPTED_EXIT,
        also=(HubUnavailableError,),
        done=status.done,
    )
