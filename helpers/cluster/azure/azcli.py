"""One ``az`` command and running it in this process: :class:`AzCommand`, :func:`run_az`, :class:`AzCommandError`."""

from __future__ import annotations

import io
import logging
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

NOT_FOUND_EXIT_CODE = 3  # what `az ... show` exits with when the resource does not exist


@dataclass(frozen=True)
class AzCommand:
    """One step of a plan: ``az <argv>`` plus what a reader and :func:`apply` need to know.

    Attributes:
        argv: the arguments after ``az``.
        description: what the step does and why, for people.
        mutating: whether it creates or changes something (and may cost money).
        verify: an ``az ... show`` that exits 0 when the resource exists and 3 when it does not.
        skip_if_found: skip the step when ``verify`` finds the resource. False for upserts
            (NSG rules), so a changed rule, e.g. a new ``ssh_source_cidr``, is applied on re-run.
        writes: local files (path -> content) generated just before the step runs.
        needs: local files (path -> how to create it) that must exist before anything runs.
        saves_state: path of the state file this step's JSON result becomes.
    """

    argv: tuple[str, ...]
    description: str
    mutating: bool
    verify: tuple[str, ...] | None = None
    skip_if_found: bool = True
    writes: Mapping[str, str] = field(default_factory=dict)
    needs: Mapping[str, str] = field(default_factory=dict)
    saves_state: str | None = None

    def shell(self) -> str:
        """The command as one shell-quoted line."""
        return "az " + shlex.join(self.argv)


@dataclass(frozen=True)
class AzResult:
    """What one in-process ``az`` call returned."""

    exit_code: int
    value: Any
    error: str


class _ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_az(argv: Sequence[str]) -> AzResult:
    """Run ``az <argv>`` in this process with a fresh CLI object; never raises for az errors.

    The error text is what az logs at ERROR level (e.g. ``Please run 'az login' to setup
    account.``); az also prints it to stderr as usual. A usage error exits 2 instead of raising.
    """
    from azure.cli.core import get_default_cli

    cli, errors = get_default_cli(), _ErrorRecords()
    cli_logger = logging.getLogger("cli")  # knack's logger: az reports every error through it
    cli_logger.addHandler(errors)
    try:
        code = cli.invoke(list(argv), out_file=io.StringIO())  # the result is read from cli.result
    except SystemExit as exc:  # argparse usage errors
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        cli_logger.removeHandler(errors)
    value = getattr(getattr(cli, "result", None), "result", None)
    return AzResult(int(code or 0), value if code == 0 else None, "\n".join(errors.messages))


class AzCommandError(RuntimeError):
    """A planned command failed; nothing after it ran.

    Attributes:
        step: 1-based index of the failed step in the plan.
        command: the failed :class:`AzCommand`.
        argv: what exactly failed (the step itself or its ``verify`` check).
        exit_code: az's exit code (1 error, 2 usage error, 3 not found).
        error: az's error message.
        completed: steps that ran or were skipped before the failure.
    """

    def __init__(
        self, step: int, command: AzCommand, argv: Sequence[str], result: AzResult, completed: list[int]
    ):
        self.step, self.command, self.argv = step, command, tuple(argv)
        self.exit_code, self.error, self.completed = result.exit_code, result.error, completed
        super().__init__(
            f"step {step} ({command.description}) failed with exit code {result.exit_code}:\n"
            f"  az {shlex.join(argv)}\n  {result.error or '(no message)'}\n"
            f"Nothing after step {step} ran; steps {completed} were done or already there. "
            "Fix the cause and run apply again: finished steps are skipped."
        )
