"""helpers: the small, tested package behind the Stable Diffusion on CPU clusters workshop.

One topic per module: config, models, data, cpu, textual_inversion, distributed, launch, azure,
inference, plots, notebooks, toyworld. Import the module you need, e.g. ``from helpers import models``.
"""

import logging

__version__ = "0.1.0"

# optimum-intel and optimum both install the top-level package "optimum" (on purpose): diffusers
# warns about it on every import, a line that means nothing to a workshop attendee.
logging.getLogger("diffusers.utils.import_utils").setLevel(logging.ERROR)
