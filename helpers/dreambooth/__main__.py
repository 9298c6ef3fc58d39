"""``python -m helpers.dreambooth``: DreamBooth-LoRA training (see :mod:`helpers.dreambooth.command`)."""

from helpers.dreambooth.command import cli
from helpers.errors import exit_with

if __name__ == "__main__":
    exit_with(cli)
