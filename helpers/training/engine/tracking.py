"""``--report_to tensorboard``: loss, learning rate and validation images through accelerate's tracker.

As in diffusers' scripts, the events go to ``output_dir/logging_dir`` (``logs`` by default), written
by accelerate's ``TensorBoardTracker`` on the main process only; ``tensorboard --logdir
OUTPUT_DIR/logs`` shows them. Both trainers call these functions (with ``--report_to none`` they do
nothing); their ``accelerator.end_training()`` closes the files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from PIL import Image

TENSORBOARD = "tensorboard"


def project_configuration(output_dir: str | os.PathLike, logging_dir: str) -> ProjectConfiguration:
    """accelerate's project folders, as diffusers' scripts set them (logging_dir under output_dir)."""
    return ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(Path(output_dir) / logging_dir))


def log_with(report_to: str) -> str | None:
    """The ``Accelerator(log_with=...)`` value of a ``--report_to`` setting."""
    return None if report_to == "none" else report_to


def start(accelerator: Accelerator, project_name: str, settings: Mapping[str, Any]) -> None:
    """Open the trackers (main process), with the run's scalar settings as TensorBoard hyperparameters.

    TensorBoard's hyperparameter table takes numbers, strings and booleans only; lists and None are left out.
    """
    hparams = {k: v for k, v in settings.items() if isinstance(v, (bool, int, float, str))}
    accelerator.init_trackers(project_name, config=hparams)


def log_step(accelerator: Accelerator, step: int, values: Mapping[str, float]) -> None:
    """One step's scalars (the trackers write on the main process; elsewhere nothing happens)."""
    accelerator.log(dict(values), step=step)


def log_images(accelerator: Accelerator, step: int, pictures: Iterable[str | os.PathLike]) -> None:
    """Validation pictures (the PNGs just saved) as one TensorBoard image batch, as diffusers logs them."""
    if not accelerator.is_main_process:
        return
    for tracker in accelerator.trackers:
        if tracker.name == TENSORBOARD:
            images = np.stack([np.asarray(Image.open(p).convert("RGB")) for p in pictures])
            tracker.writer.add_images("validation", images, step, dataformats="NHWC")
