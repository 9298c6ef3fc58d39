"""Stable Diffusion v1 (and v2): one CLIP text encoder, its last hidden state conditions the UNet.

This is what the textual-inversion engine has always computed (``text_encoder(input_ids)[0]``,
the final layer norm's output, as the UNet's ``encoder_hidden_states``), written as a family.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from helpers.core.outputs import LEARNED_EMBEDS
from helpers.training.families.base import Conditioning, Family, ImageSizes


def encode_prompt(
    text_encoders: Sequence[torch.nn.Module], input_ids: Sequence[torch.Tensor]
) -> Conditioning:
    """The last hidden state of the one text encoder.

    Args:
        text_encoders: ``(text_encoder,)``.
        input_ids: ``(ids,)``, ``[batch, 77]``.
    """
    (text_encoder,), (ids,) = text_encoders, input_ids
    return Conditioning(prompt_embeds=text_encoder(ids)[0])


def unet_kwargs(conditioning: Conditioning, sizes: Sequence[ImageSizes] = ()) -> dict:
    """``encoder_hidden_states`` only: SD v1's UNet is told nothing about image sizes."""
    return {"encoder_hidden_states": conditioning.prompt_embeds}


FAMILY = Family(
    name="sd1",
    pipeline_class="StableDiffusionPipeline",
    tokenizers=("tokenizer",),
    text_encoders=("text_encoder",),
    text_encoder_classes=("CLIPTextModel",),
    learned_embeds_files=(LEARNED_EMBEDS,),
    encode_prompt=encode_prompt,
    unet_kwargs=unet_kwargs,
    # its pipeline takes a safety checker, which training, its samples and the toy models have not
    pipeline_extras=(("safety_checker", None), ("requires_safety_checker", False)),
)
