"""``python -m helpers.inference``: see :mod:`helpers.inference.command`."""

from helpers.errors import exit_with
from helpers.inference.command import cli

exit_with(cli)
