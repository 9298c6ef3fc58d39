"""The training engine in parts: the run loop both methods run on, and Textual Inversion's own pieces
(:mod:`helpers.training.textual_inversion` is that method; :mod:`helpers.dreambooth` the other).

* :mod:`~helpers.training.engine.loop`: the run's life once (folder, resume, steps, checkpoints,
  summary) and the :class:`~helpers.training.engine.loop.Method` interface.
* :mod:`~helpers.training.engine.events`: what a run tells its listeners (each step, each save).
* :mod:`~helpers.training.engine.rows`: the placeholder tokens and their trainable rows.
* :mod:`~helpers.training.engine.step`: data order, cached latents, keyed random draws, the loss, and
  :func:`~helpers.training.engine.step.training_step`, one optimisation step (the benchmarks time this same one).
* :mod:`~helpers.training.engine.latents`: the persistent latent cache (a re-run does not load the VAE).
* :mod:`~helpers.training.engine.prepack`: the frozen UNet's convolutions and linear layers (and the text
  encoder's linear layers) with weights laid out for oneDNN once, not in every step
  (``prepack_convs``, ``prepack_linears``).
* :mod:`~helpers.training.engine.attention`: the bf16 UNet's attention kernel, chosen by the size of the
  score matrix.
* :mod:`~helpers.training.engine.setup`: from settings to a :class:`~helpers.training.engine.setup.Run` ready to train.
* :mod:`~helpers.training.engine.folder`: the state of an output folder (empty, finished, interrupted),
  read before any model loads; what ``--overwrite_output_dir`` removes.
* :mod:`~helpers.training.engine.lock`: one run per folder (the folder's ``flock``).
* :mod:`~helpers.training.engine.limits`: the resolution and batch a model, the memory and the views allow.
* :mod:`~helpers.training.engine.checkpoints`: resumable checkpoints: save, rotate, find, check.
* :mod:`~helpers.training.engine.saving`: learned embeddings, JSON records, validation samples, the full pipeline.
"""

from __future__ import annotations

from helpers.core.errors import InputError


class TrainingInputError(InputError):
    """A problem with the inputs of a run, found before any heavy work; the message says the fix."""


class TrainingDivergedError(InputError):
    """The loss or the learned rows stopped being finite: a setting (learning rate, precision) must change."""
