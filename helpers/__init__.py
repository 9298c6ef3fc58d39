"""helpers: the small, tested package behind the Stable Diffusion on CPU clusters workshop.

Grouped by what it does: ``core`` (errors, files, the CPU), ``training`` (the textual-inversion
engine), ``dreambooth``, ``launching`` (the launcher's side of a multi-process job), ``ranks`` (a
rank's side), ``cluster`` (Azure, prices, the scaling model), ``inference``, ``toyworld`` and
``workshop`` (notebooks, handouts, plots, forms). Every module is listed once, in
``docs/architecture.md``. Import the module you need, e.g. ``from helpers.training import models``.
"""

from helpers.core.quiet import install_log_filters

__version__ = "0.1.0"

install_log_filters()  # known third-party noise, listed with reasons in helpers/core/quiet.py
