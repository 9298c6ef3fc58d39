"""``python -m helpers.train`` (or ``accelerate launch -m helpers.train``): textual inversion.

Flags are those of diffusers' ``examples/textual_inversion/textual_inversion.py``; see
``python -m helpers.train --help``. ``--config run.yaml`` loads settings that flags override.
Bad input (settings, images, the output folder, a checkpoint, a run that diverged) is one
``error: ...`` line and exit code 2 (:func:`helpers.core.errors.run_cli`).
"""

from __future__ import annotations

import gc

if __name__ == "__main__":
    gc.disable()  # while the imports below run; exit_with turns it back on (see its docstring)

import logging

from helpers.core.errors import exit_with
from helpers.ranks import faults, status
from helpers.training.config import TrainConfig, parse_args
from helpers.training.engine.command import run_command
from helpers.training.textual_inversion import TrainResult, train

__all__ = ["cli", "main", "parse_args"]


def main(args: TrainConfig) -> TrainResult:
    """Train with validated settings and return what the run produced."""
    result = train(args)
    logging.getLogger(__name__).info("learned embeddings: %s", result.learned_embeds_path)
    faults.hang_after_training(status.rank_from_env() or 0)  # test-only
    return result


def cli(argv: list[str] | None = None) -> int:
    """Entry point, as every ``python -m helpers.<x>``: see :func:`helpers.training.engine.command.run_command`."""
    return run_command(main, parse_args, argv)


if __name__ == "__main__":
    exit_with(cli)
