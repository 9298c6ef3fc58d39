"""DreamBooth with LoRA and prior preservation on CPUs: diffusers' ``train_dreambooth_lora.py``, lean.

One subject (3-5 pictures) is bound to a rare word in a prompt ("a photo of sks toy") by training
small low-rank updates of the UNet's attention (LoRA, through peft, as diffusers does); with prior
preservation the base model's own pictures of the class ("a photo of a toy") are trained on too, so
the class keeps its meaning. The result is ``pytorch_lora_weights.safetensors`` (a few MB for SD
v1.5) that stock ``StableDiffusionPipeline.load_lora_weights`` loads, and optionally the full
pipeline with the LoRA fused in.

* :mod:`~helpers.dreambooth.config`: ``DreamBoothConfig``, the flags of diffusers' script (no torch import:
  ``helpers.launch`` parses with it).
* :mod:`~helpers.dreambooth.class_images`: the class pictures, generated when missing (resumable, split
  across processes, reused).
* :mod:`~helpers.dreambooth.data`: subject/class pairs and their views (one cached latent per picture).
* :mod:`~helpers.dreambooth.lora`: the LoRA layers, the file and its stock loader, the fused pipeline.
* :mod:`~helpers.dreambooth.training`: the training loop (the textual-inversion engine's cached latents
  and keyed draws; only the LoRA matrices trained and all-reduced).
* :mod:`~helpers.dreambooth.saving`: the run's folder, checkpoints, resumption, samples, final outputs.
* :mod:`~helpers.dreambooth.evaluate`: pictures, the toy world's judge, the comparison with Textual Inversion.
* :mod:`~helpers.dreambooth.command`: ``python -m helpers.dreambooth``.

The names the notebooks use are importable from here, and load torch and diffusers on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "train": "training",
    "lora_report": "evaluate",
    "class_share": "evaluate",
    "compare_methods": "evaluate",
}

__all__ = [*_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"helpers.dreambooth.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'helpers.dreambooth' has no attribute {name!r}")
