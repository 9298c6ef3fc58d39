"""The one kind of error a person fixes by changing an input, and how command lines report it.

Raise :class:`InputError` (or a subclass) for bad input a person can fix: the message is one
line that names the input and says the fix. Every ``python -m helpers.<x>`` entry point runs
``main(parse_args(argv))`` through :func:`run_cli`, which prints such an error as one
``error: ...`` line and exits 2 (argparse's code for bad usage), without a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import yaml


class InputError(ValueError):
    """Bad input a person can fix: one line naming the input and the fix; a command line exits 2."""


INPUT_ERRORS: tuple[type[BaseException], ...] = (
    InputError,
    FileNotFoundError,
    FileExistsError,
    yaml.YAMLError,
)
"""What :func:`run_cli` reports as one line and exit code 2: input errors and missing or clashing files."""


def one_line(err: BaseException) -> str:
    """The error's message on one line (YAML's parser errors span several: they are joined with '; ')."""
    return "; ".join(line.strip() for line in str(err).splitlines() if line.strip()) or type(err).__name__


def run_cli(
    main: Callable[[Any], Any],
    parse_args: Callable[[list[str] | None], Any],
    argv: list[str] | None = None,
    also: tuple[type[BaseException], ...] = (),
) -> int:
    """Run ``main(parse_args(argv))``; report :data:`INPUT_ERRORS` (and ``also``) as ``error: ...``, exit 2.

    Args:
        main: the command; an int result is the exit code, anything else means 0.
        parse_args: turns ``argv`` (None: ``sys.argv[1:]``) into what ``main`` takes.
        argv: the arguments.
        also: further error types a person fixes outside the inputs (e.g. no network).

    Returns:
        The exit code.
    """
    try:
        result = main(parse_args(argv))
    except (*INPUT_ERRORS, *also) as err:
        sys.stderr.write(f"error: {one_line(err)}\n")
        return 2
    return result if isinstance(result, int) and not isinstance(result, bool) else 0
