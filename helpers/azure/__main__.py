"""``python -m helpers.azure``: see :mod:`helpers.azure.command`."""

from helpers.azure.command import cli

raise SystemExit(cli())
