"""``python -m helpers.inference``: see :mod:`helpers.inference.command`."""

import gc

if __name__ == "__main__":
    gc.disable()  # while the imports below run; exit_with turns it back on (see its docstring)

from helpers.core.errors import exit_with
from helpers.inference.command import cli

if __name__ == "__main__":
    exit_with(cli)
