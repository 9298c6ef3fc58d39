"""helpers: the small, tested package behind the Stable Diffusion on CPU clusters workshop.

One topic per module: config, models, data, cpu, textual_inversion, distributed, launch, azure,
inference, plots, notebooks, toyworld. Import the module you need, e.g. ``from helpers import models``.
"""

from helpers.core.quiet import install_log_filters

__version__ = "0.1.0"

install_log_filters()  # known third-party noise, listed with reasons in helpers/core/quiet.py
