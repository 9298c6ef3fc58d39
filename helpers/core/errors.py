"""The one kind of error a person fixes by changing an input, and how command lines report it.

Raise :class:`InputError` (or a subclass) for bad input a person can fix: the message is one
line that names the input and says the fix. Every ``python -m helpers.<x>`` entry point runs
``main(parse_args(argv))`` through :func:`run_cli`, which prints such an error as one
``error: ...`` line and exits 2 (argparse's code for bad usage), without a traceback.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import yaml


class InputError(ValueError):
    """Bad input a person can fix: one line naming the input and the fix; a command line exits 2."""


class DistributedError(ValueError):
    """A layout, hostfile, backend or launch setting is invalid; the message names it and the fix."""


INPUT_ERRORS: tuple[type[BaseException], ...] = (
    InputError,
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    yaml.YAMLError,
)
"""What :func:`run_cli` reports as one line and exit code 2: input errors, and files or folders that
are missing, clashing, not readable or writable by this user, or a file where a folder is needed
(or the other way round). Other ``OSError``s (a full disk, an I/O error) and everything else keep
their traceback: they are not the input's fault, or they are bugs."""

_OS_FIXES = {
    PermissionError: "check the path's permissions, or choose a path this user can read and write",
    IsADirectoryError: "pass a file here, not a folder",
    NotADirectoryError: "a part of this path is a file: pass a folder",
    FileExistsError: "choose another path, or remove what is there",
    FileNotFoundError: "check the path",
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line, as every other bad input is.

    argparse prints the whole usage (a dozen lines for a command with many flags) before its
    message; here the message names the fix instead: ``error: <message> (see <prog> --help)``,
    exit code 2. Its sub-command parsers are of this class too.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def one_line(err: BaseException) -> str:
    """The error's message on one line.

    Messages of several lines (YAML's parser errors, lists of problems) are joined with '; '
    (a heading ending in ':' and its first item with a space). An error raised by the
    operating system (``[Errno 13] Permission denied: 'x'``) becomes ``x: permission denied. Fix: ...``.
    """
    if isinstance(err, OSError) and err.strerror and err.filename is not None:
        fix = next((text for kind, text in _OS_FIXES.items() if isinstance(err, kind)), None)
        text = f"{os.fsdecode(err.filename)}: {err.strerror[:1].lower()}{err.strerror[1:]}"
        return f"{text}. Fix: {fix}" if fix else text
    text = ""
    for line in (raw.strip().removeprefix("- ") for raw in str(err).splitlines()):
        if line:  # a list under a heading ("...:\n  - a\n  - b") reads "...: a; b"
            text += (" " if text.endswith(":") else "; " if text else "") + line
    return text or type(err).__name__


def read_yaml(path: str | os.PathLike, what: str = "YAML file", error: type[InputError] = InputError) -> Any:
    """Parse a YAML file a person wrote; whatever is wrong with the file is one ``error`` naming it.

    Args:
        path: the file.
        what: how the message names it, e.g. ``"config file"``.
        error: the :class:`InputError` subclass to raise (the caller's own).

    Returns:
        The parsed document (None for an empty file).

    Raises:
        error: the file is missing, a folder, unreadable, not text, or not valid YAML (the
            message gives the line and column of the problem).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist. Fix: check the path") from None
    except IsADirectoryError:
        raise error(f"{what} {path} is a folder. Fix: pass the YAML file, not the folder") from None
    except PermissionError:
        raise error(f"{what} {path} cannot be read (permission denied). Fix: check its permissions") from None
    except UnicodeDecodeError as err:
        raise error(
            f"{what} {path} is not a text file ({err.reason} at byte {err.start}). Fix: pass a YAML file"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = "; ".join(str(p) for p in (err.context, err.problem) if p)
        raise error(
            f"{what} {path}{where}: YAML syntax error: {problem}. Fix: correct the YAML there"
        ) from None
    except yaml.YAMLError as err:
        raise error(f"{what} {path}: YAML syntax error: {one_line(err)}. Fix: correct the YAML") from None


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


def exit_with(cli: Callable[[], int]) -> NoReturn:
    """``raise SystemExit(cli())`` for a ``python -m`` command that loads models, minus the cycle
    collector's passes over objects that live until the process ends.

    Python's full collections walk every object it tracks, and torch, diffusers and transformers
    make many: the passes while importing, loading and exiting cost a training command seconds
    (measured: ``docs/performance.md``, the guides' command end to end).

    So a command module turns the collector off before its imports (``gc.disable()`` under
    ``if __name__ == "__main__"``, above them) and ends with ``exit_with(cli)``, which
    :func:`gc.freeze`-s the objects alive now (taking them out of every later collection), turns
    the collector back on, and freezes again after the command (the models, just before the exit).
    Later objects are collected as usual, and objects are still freed when their last reference
    goes. Only for a process's ``__main__``: frozen objects are never searched for cycles again.
    """
    gc.freeze()
    gc.enable()
    code = cli()
    gc.freeze()
    raise SystemExit(code)
