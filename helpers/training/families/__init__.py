"""Model families: how a pipeline of one family encodes prompts and calls its UNet.

The training engine has two axes: a *method* says what is trained (Textual Inversion's rows,
DreamBooth's LoRA), a *family* says how the model it trains is driven. A family is data and two
functions (:class:`~helpers.training.families.base.Family`):

* ``encode_prompt(text_encoders, input_ids) -> Conditioning``: from each tokenizer's ids to what
  the UNet reads;
* ``unet_kwargs(conditioning, sizes) -> dict``: the UNet call's keyword arguments, given each
  example's :class:`~helpers.training.families.base.ImageSizes`.

Families (:data:`FAMILIES`), read from the ``_class_name`` of a pipeline's ``model_index.json``
(:func:`family_of`):

* :mod:`~helpers.training.families.sd1` (``StableDiffusionPipeline``: SD v1 and v2): one CLIP
  encoder, its last hidden state;
* :mod:`~helpers.training.families.sdxl` (``StableDiffusionXLPipeline``): two encoders, their
  penultimate hidden states concatenated, the second's pooled output and the images' sizes as
  ``added_cond_kwargs``.

Nothing here knows a method; a method calls :func:`diffusion_loss` (from the prompts' token ids) or
:func:`prediction_and_target` (from a conditioning it made) with its own trainable parts installed
in the modules.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from helpers.core.errors import InputError
from helpers.core.outputs import MODEL_INDEX
from helpers.training.families import sd1, sdxl
from helpers.training.families.base import Conditioning, Family, ImageSizes

__all__ = [
    "FAMILIES",
    "Conditioning",
    "Family",
    "ImageSizes",
    "UnsupportedFamilyError",
    "diffusion_loss",
    "family_of",
    "load_text_encoders",
    "load_tokenizers",
    "noise_prediction",
    "prediction_and_target",
    "tokenize",
]

FAMILIES: dict[str, Family] = {family.name: family for family in (sd1.FAMILY, sdxl.FAMILY)}
"""Every supported family by name."""
_BY_CLASS = {family.pipeline_class: family for family in FAMILIES.values()}
SUPPORTED = (
    "Stable Diffusion v1/v2 (StableDiffusionPipeline) and Stable Diffusion XL (StableDiffusionXLPipeline)"
)


class UnsupportedFamilyError(InputError):
    """The model folder holds a pipeline of a family this package cannot train; names the supported ones."""


def family_of(model_dir: str | os.PathLike) -> Family:
    """The family of a local diffusers pipeline folder, from its ``model_index.json``.

    Reads one small file: call it before any model loads, so an unsupported model stops at once.

    Raises:
        UnsupportedFamilyError: the pipeline class is not one of :data:`FAMILIES` (SD3, Flux,
            Kandinsky, the SDXL refiner...), or ``model_index.json`` is missing or names none.
    """
    index = Path(model_dir) / MODEL_INDEX
    try:
        class_name = json.loads(index.read_text(encoding="utf-8")).get("_class_name")
    except (OSError, ValueError, AttributeError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else type(err).__name__
        raise UnsupportedFamilyError(
            f"model {model_dir}: cannot read the pipeline class from {index} ({reason}). Fix: pass a "
            f"diffusers pipeline folder (saved with save_pretrained) of {SUPPORTED}."
        ) from None
    family = _BY_CLASS.get(class_name)
    if family is None:
        raise UnsupportedFamilyError(
            f"model {model_dir} is a {class_name or 'pipeline without a _class_name'}, which this "
            f"package cannot train: the supported families are {SUPPORTED}."
        )
    return family


def load_tokenizers(model_dir: str | os.PathLike, family: Family) -> tuple:
    """The family's tokenizers from a local pipeline folder, in ``encode_prompt``'s order."""
    # transformers is imported here, not at the top: about 14 s beyond torch on a busy 2-core
    # machine (measured), which family_of's callers must not pay before their input is checked.
    from transformers import CLIPTokenizer

    return tuple(CLIPTokenizer.from_pretrained(Path(model_dir), subfolder=sub) for sub in family.tokenizers)


def load_text_encoders(
    model_dir: str | os.PathLike, family: Family, dtype: torch.dtype = torch.float32, first: int = 0
) -> tuple[torch.nn.Module, ...]:
    """The family's text encoders from a local pipeline folder, in ``dtype`` (fp32 by default).

    Args:
        first: the first encoder to load (1: all but the first, which a caller loaded already).
    """
    import transformers  # at call time for the reason load_tokenizers gives

    pairs = list(zip(family.text_encoders, family.text_encoder_classes, strict=True))[first:]
    return tuple(
        getattr(transformers, cls).from_pretrained(Path(model_dir), subfolder=sub, dtype=dtype)
        for sub, cls in pairs
    )


def tokenize(tokenizers: Sequence, prompts: Sequence[str]) -> list[torch.Tensor]:
    """Each tokenizer's ids of the prompts, ``[len(prompts), model_max_length]`` each, as the
    pipelines tokenize (padded to the full length, truncated)."""
    return [
        tok(
            list(prompts),
            padding="max_length",
            max_length=tok.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        for tok in tokenizers
    ]


def noise_prediction(
    family: Family,
    unet: torch.nn.Module,
    noisy_latents: torch.Tensor,
    timesteps: torch.Tensor,
    conditioning: Conditioning,
    sizes: Sequence[ImageSizes] = (),
) -> torch.Tensor:
    """The UNet's prediction for a batch, called as the family's pipeline calls it."""
    return unet(noisy_latents, timesteps, **family.unet_kwargs(conditioning, sizes)).sample


def prediction_and_target(
    family: Family,
    unet: torch.nn.Module,
    noise_scheduler,
    latents: torch.Tensor,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
    conditioning: Conditioning,
    sizes: Sequence[ImageSizes] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The UNet's prediction for the noised latents (already scaled by the VAE's scaling factor),
    and what it should have predicted (the noise, or the velocity for ``v_prediction`` models)."""
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    pred = noise_prediction(family, unet, noisy, timesteps, conditioning, sizes)
    if noise_scheduler.config.prediction_type == "v_prediction":
        return pred, noise_scheduler.get_velocity(latents, noise, timesteps)
    return pred, noise


def diffusion_loss(
    family: Family,
    unet: torch.nn.Module,
    text_encoders: Sequence[torch.nn.Module],
    noise_scheduler,
    input_ids: Sequence[torch.Tensor],
    latents: torch.Tensor,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
    sizes: Sequence[ImageSizes] = (),
) -> torch.Tensor:
    """The denoising loss of one batch from its prompts' token ids: the prompts encoded as ``family``
    does, then the mean squared error of :func:`prediction_and_target`."""
    conditioning = family.encode_prompt(text_encoders, input_ids)
    pred, target = prediction_and_target(
        family, unet, noise_scheduler, latents, noise, timesteps, conditioning, sizes
    )
    return F.mse_loss(pred.float(), target.float(), reduction="mean")
