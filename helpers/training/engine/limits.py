"""What sizes a run may ask for, checked before any model loads: the resolution against the model
and this machine's memory, the batch against the views there are.

Both trainers call these (Textual Inversion and DreamBooth-LoRA); inference checks the same hard cap
(:data:`helpers.training.config.MAX_RESOLUTION`).

**The memory bound.** A training step keeps the UNet's activations for its backward. They grow
with the latent's pixels ``(resolution / vae_factor)^2``, the UNet's first width
(``block_out_channels[0]``, the widest feature maps) and the pictures per step. On the Stable
Diffusion v1.5 shape in fp32 they come to about :data:`ACTIVATION_MAPS` feature maps of the
first level's size: the engine's measured peak grew from 5,144 MiB at 256 px to 6,498 MiB at 512 px
(batch 1, weights not prepacked; ``bench/results/xeon-avx512/train_memory-sd15-shape-{256,512}px.json``),
that is 451 MiB at 256 px, 361 maps of 32 x 32 x 320 floats. A resolution whose activations alone
exceed the memory available to this process (``MemAvailable`` shared by the node's processes) cannot
train here and is refused with the largest one that fits; the weights and the libraries need
memory too, so a resolution under the bound may still be short of memory (``helpers.launch`` warns).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import psutil

from helpers.core import cpu
from helpers.training.engine import TrainingInputError

ACTIVATION_MAPS = 360
"""Feature maps of the UNet's first level a training step keeps, as measured on the SD v1.5 shape."""
_FLOAT_BYTES = 4  # activations in fp32; bf16 halves most of them, so the bound errs on the safe side


def model_sizes(model_dir: str | os.PathLike) -> tuple[int, int, int]:
    """``(native resolution, VAE factor, first UNet width)`` of a diffusers folder, from its JSON only."""
    folder = Path(model_dir)
    unet = json.loads((folder / "unet" / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    factor = 2 ** (len(vae.get("block_out_channels", [0, 0, 0, 0])) - 1)
    return int(unet["sample_size"]) * factor, factor, int(unet["block_out_channels"][0])


def activation_bytes(resolution: int, pictures_per_step: int, model_dir: str | os.PathLike) -> int:
    """The activations one training step of this model keeps at ``resolution`` (see the module docstring)."""
    _, factor, width = model_sizes(model_dir)
    return ACTIVATION_MAPS * pictures_per_step * (resolution // factor) ** 2 * width * _FLOAT_BYTES


def check_resolution(
    resolution: int,
    pictures_per_step: int,
    model_dir: str | os.PathLike,
    available_bytes: int | None = None,
) -> None:
    """Refuse a ``resolution`` whose activations cannot fit in the memory this process has.

    Args:
        resolution: the training resolution.
        pictures_per_step: pictures in one forward (the batch; DreamBooth with prior preservation
            adds as many class pictures).
        model_dir: the resolved model folder (only its ``config.json`` files are read).
        available_bytes: the memory to fit in (default: ``MemAvailable`` over the node's processes).

    Raises:
        TrainingInputError: naming the estimate, the memory, the largest resolution that fits and
            the model's own.
    """
    need = activation_bytes(resolution, pictures_per_step, model_dir)
    have = (
        psutil.virtual_memory().available // cpu.local_processes()
        if available_bytes is None
        else available_bytes
    )
    if need <= have:
        return
    native, factor, width = model_sizes(model_dir)
    fits = int(factor * math.sqrt(have / (ACTIVATION_MAPS * pictures_per_step * width * _FLOAT_BYTES)))
    fits -= fits % 8
    side = resolution // factor
    raise TrainingInputError(
        f"resolution={resolution}: a training step of this model keeps about {need / 2**30:,.1f} GiB of "
        f"activations at {resolution} px ({pictures_per_step} picture(s) per step, {ACTIVATION_MAPS} maps of "
        f"{side}x{side}x{width} floats), more than the {have / 2**30:,.1f} GiB of memory available to this "
        f"process. Fix: --resolution {fits} or less (this model's own is {native})"
        + (", or fewer pictures per step" if pictures_per_step > 1 else "")
        + "."
    )


def check_batch_size(train_batch_size: int, views: int, counted: str) -> None:
    """Refuse a batch larger than the views there are to fill it with.

    Args:
        train_batch_size: pictures per process per step.
        views: the views one epoch holds (Textual Inversion: pictures x repeats; DreamBooth: pictures).
        counted: how ``views`` was counted, in words (e.g. ``"5 pictures x 100 repeats"``).

    Raises:
        TrainingInputError: naming both numbers and the fix.
    """
    if train_batch_size > views:
        raise TrainingInputError(
            f"train_batch_size={train_batch_size}: more than the {views:,} views there are to fill a batch "
            f"with ({counted}). Fix: --train_batch_size {views} or less."
        )
