"""``python -m helpers.dreambooth``: DreamBooth-LoRA training (see :mod:`helpers.dreambooth.command`)."""

from helpers.dreambooth.command import cli

if __name__ == "__main__":
    raise SystemExit(cli())
