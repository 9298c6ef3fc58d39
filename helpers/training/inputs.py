"""What a Textual Inversion run checks before any model is resolved or loaded: its folders and pictures.

Apart from the trainer (:mod:`helpers.training.textual_inversion`) so that ``helpers.launch`` can
run the same checks before any rank starts without importing the models' code.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from helpers.core import cpu
from helpers.training import data
from helpers.training.config import TrainConfig
from helpers.training.engine import TrainingInputError, limits, loop
from helpers.training.engine.folder import OutputFolder, check_output_dir
from helpers.training.families import Family, sd1


@dataclass(frozen=True)
class CheckedInputs:
    """What :func:`check_inputs` found: the images, the output folder's state, the checkpoint to resume
    (and, once resolved, the base model's folder, its family and its tokenizers, one per text encoder)."""

    images: list[Path]
    folder: OutputFolder
    checkpoint: Path | None
    model_dir: Path | None = None
    tokenizer: Any = None
    family: Family = sd1.FAMILY
    tokenizer_2: Any = None


def check_inputs(config: TrainConfig) -> CheckedInputs:
    """Every cheap check of a run, before any model is resolved or loaded.

    IPEX if asked for, the output folder (:func:`helpers.training.engine.folder.check_output_dir`),
    the images and the checkpoint to resume (:func:`helpers.training.engine.loop.check_resume`).

    Raises:
        TrainingInputError, helpers.training.data.ImageFolderError: one message with the fix.
    """
    if config.train_data_dir is None:
        raise TrainingInputError(
            "train_data_dir is not set. Fix: pass a folder of 3-5 images of your concept, "
            f"or the bundled sample: --train_data_dir {data.sample_concept_dir()}"
        )
    if config.use_ipex and (problem := cpu.ipex_problem()):
        raise TrainingInputError(f"use_ipex: {problem}. Fix: {cpu.IPEX_FIX}, or leave use_ipex off.")
    folder = check_output_dir(config)
    images = data.validate_image_folder(config.train_data_dir, min_size=config.resolution)
    limits.check_batch_size(
        config.train_batch_size,
        len(images) * config.repeats,
        f"{len(images)} pictures x repeats {config.repeats}",
    )
    return CheckedInputs(images, folder, loop.check_resume(config, folder))
