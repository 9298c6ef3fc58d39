"""What a DreamBooth-LoRA run checks before any model is resolved or loaded: its folders and pictures.

Apart from the trainer (:mod:`helpers.dreambooth.training`) so that ``helpers.launch`` can run the
same checks before any rank starts without importing the models' code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from helpers.dreambooth import class_images, saving
from helpers.dreambooth.config import DreamBoothConfig
from helpers.training import data
from helpers.training.engine import limits, loop
from helpers.training.engine.folder import OutputFolder, check_output_dir
from helpers.training.families import Family, sd1


@dataclass(frozen=True)
class CheckedInputs:
    """What :func:`check_inputs` found: the output folder's state, the checkpoint to resume (and,
    once the model is resolved, its family)."""

    folder: OutputFolder
    checkpoint: Path | None
    family: Family = sd1.FAMILY


def check_inputs(config: DreamBoothConfig) -> CheckedInputs:
    """Every cheap check of a run, before any model is resolved or loaded and before anything is written.

    The output folder as the textual-inversion engine checks it
    (:func:`helpers.training.engine.folder.check_output_dir`: not in use, no finished or interrupted
    run these settings would clobber), the pictures, and the checkpoint to resume
    (:func:`helpers.training.engine.loop.check_resume`). ``helpers.launch`` runs them too, before
    any rank starts.

    Raises:
        InputError: a missing or unusable folder, a folder in use or holding another run, no
            checkpoint.
    """
    folder = check_output_dir(config, saving.DREAMBOOTH)
    pictures = len(data.validate_image_folder(config.instance_data_dir, min_size=config.resolution))
    limits.check_batch_size(config.train_batch_size, pictures, f"{pictures} subject pictures")
    if config.with_prior_preservation:
        class_images.check_folder(config)
        class_images.image_files(config.class_data_dir, min_size=config.resolution)  # corrupt files, now
    return CheckedInputs(folder, loop.check_resume(config, folder))
