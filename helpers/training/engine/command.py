"""What every training command (``python -m helpers.train``, ``python -m helpers.dreambooth``) does
around its ``main``: :func:`helpers.core.errors.run_cli` with the rank's status and Ctrl-C's line."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from helpers.core.errors import INPUT_ERRORS, one_line, run_cli
from helpers.ranks import status
from helpers.training.engine.checkpoints import INTERRUPTED_EXIT, interrupted_line
from helpers.training.models import HubUnavailableError


def run_command(
    main: Callable[[Any], Any], parse_args: Callable[[list[str] | None], Any], argv: list[str] | None
) -> int:
    """Parse, train, and turn input problems into one line and exit code 2; return the exit code.

    Logs at INFO with times (accelerate's loggers only from WARNING: a line per checkpoint file
    otherwise). Under ``helpers.launch`` the rank takes its lock and status first (:func:`status.start`)
    and reports success last (:func:`status.done`, the rank's report that it exits 0); Ctrl-C is the
    one line saying how to go on (resume, or start over when no checkpoint exists) and
    :data:`INTERRUPTED_EXIT`, rather than the traceback of wherever it hit.
    """
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    try:
        status.start()
    except INPUT_ERRORS as err:  # e.g. a link planted at this rank's status lock
        sys.stderr.write(f"error: {one_line(err)}\n")
        return 2
    parsed: list[Any] = []

    def parse(arguments: list[str] | None) -> Any:
        parsed.append(parse_args(arguments))
        return parsed[-1]

    try:
        code = run_cli(main, parse, argv, also=(HubUnavailableError,))
    except KeyboardInterrupt:
        # before the settings are read there is no run to speak of: the shell's own words suffice
        line = interrupted_line(parsed[0].output_dir) if parsed else "interrupted (Ctrl-C)"
        sys.stderr.write(f"\n{line}\n")
        return INTERRUPTED_EXIT
    if code == 0:
        status.done()
    return code
