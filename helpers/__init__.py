"""helpers: the small, tested package behind the Stable Diffusion on CPU clusters workshop.

One topic per module (see ARCHITECTURE.md): config, models, data, cpu, textual_inversion,
distributed, azure, inference, plots, notebooks. Import the module you need, e.g.
``from helpers import models``.
"""

__version__ = "0.1.0"
