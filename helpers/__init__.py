"""helpers: the small, tested package behind the Stable Diffusion on CPU clusters workshop.

One topic per module: config, models, data, cpu, textual_inversion, distributed, launch, azure,
inference, plots, notebooks, toyworld. Import the module you need, e.g. ``from helpers import models``.
"""

import logging

__version__ = "0.1.0"

# optimum-intel and optimum both install the top-level package "optimum" (on purpose): diffusers
# warns about it on every import, a line that means nothing to a workshop attendee.
logging.getLogger("diffusers.utils.import_utils").setLevel(logging.ERROR)
# torchvision is left out on purpose (the registry's build breaks the CPU torch); transformers' PIL
# image processors are the intended fallback, not news.
logging.getLogger("transformers.utils.import_utils").setLevel(logging.ERROR)
# Adding a placeholder token resizes the embedding matrix; the new rows are overwritten right away
# (by the initializer word in training, by the learned vectors in load_textual_inversion).
logging.getLogger("transformers.modeling_utils").setLevel(logging.ERROR)
