"""``python -m helpers.train`` (or ``accelerate launch -m helpers.train``): textual inversion.

Flags are those of diffusers' ``examples/textual_inversion/textual_inversion.py``; see
``python -m helpers.train --help``. ``--config run.yaml`` loads settings that flags override.
"""

from __future__ import annotations

import logging
import sys

from helpers import faults, supervise
from helpers.config import ConfigError, TrainConfig, parse_args
from helpers.data import ImageFolderError
from helpers.models import HubUnavailableError
from helpers.textual_inversion import TrainingInputError, TrainResult, train

__all__ = ["main", "parse_args"]


def main(config: TrainConfig) -> TrainResult:
    """Train with validated settings and return what the run produced."""
    return train(config)


def cli(argv: list[str] | None = None) -> int:
    """Parse, train, and turn input problems into one clear message and exit code 2."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # one line per checkpoint file otherwise
    supervise.start()  # under helpers.launch: this rank's lock and status, until the process is gone
    try:
        result = main(parse_args(argv))
    except (ConfigError, ImageFolderError, TrainingInputError, HubUnavailableError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    logging.getLogger(__name__).info("learned embeddings: %s", result.learned_embeds_path)
    faults.hang_after_training(supervise.rank_from_env() or 0)  # test-only
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
