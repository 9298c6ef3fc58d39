"""``python -m helpers.inference``: see :mod:`helpers.inference.command`."""

from helpers.inference.command import cli

raise SystemExit(cli())
