"""Stable Diffusion XL: two text encoders, and a UNet told the pooled prompt and the image's sizes.

As ``StableDiffusionXLPipeline.encode_prompt`` and diffusers' SDXL training scripts compute it:

- ``encoder_hidden_states``: the penultimate hidden states of ``text_encoder`` (CLIP ViT-L, 768
  wide in SDXL base 1.0) and ``text_encoder_2`` (OpenCLIP ViT-bigG, 1280), concatenated on the
  last axis (2048), each encoder reading its own tokenizer's ids of the same prompt;
- ``added_cond_kwargs["text_embeds"]``: the projected pooled output of ``text_encoder_2``;
- ``added_cond_kwargs["time_ids"]``: per example, ``original_size + crop_top_left + target_size``
  (six numbers, height before width). Each example has its own row, so a batch of pictures of
  different sizes, or a short last batch, is conditioned right; diffusers' textual-inversion
  script builds ``train_batch_size`` rows whatever the batch holds.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from helpers.core.outputs import LEARNED_EMBEDS, LEARNED_EMBEDS_2
from helpers.training.families.base import Conditioning, Family, ImageSizes


def encode_prompt(
    text_encoders: Sequence[torch.nn.Module], input_ids: Sequence[torch.Tensor]
) -> Conditioning:
    """Both encoders' penultimate hidden states concatenated, and the second's projected pooled output.

    Args:
        text_encoders: ``(text_encoder, text_encoder_2)``; the second a ``CLIPTextModelWithProjection``.
        input_ids: each tokenizer's ids of the same prompts, ``[batch, 77]`` each, in the same order.
    """
    encoder_1, encoder_2 = text_encoders
    ids_1, ids_2 = input_ids
    hidden_1 = encoder_1(ids_1, output_hidden_states=True).hidden_states[-2]
    out_2 = encoder_2(ids_2, output_hidden_states=True)
    return Conditioning(
        prompt_embeds=torch.cat([hidden_1, out_2.hidden_states[-2]], dim=-1),
        pooled_prompt_embeds=out_2.text_embeds,
    )


def add_time_ids(sizes: Sequence[ImageSizes]) -> torch.Tensor:
    """``[len(sizes), 6]`` in float32: each example's original size, crop top-left and target size.

    Always float32, whatever the UNet computes in: the UNet turns them into sinusoidal features in
    float32 anyway, and bf16 holds integers exactly only up to 256 (a 333 px side would become 332,
    683 become 684). diffusers' SDXL training scripts cast them to the mixed-precision dtype; its
    pipeline uses the prompt embeddings' dtype (fp16 at most: exact up to 2048), so float32 here is
    what generation sees.
    """
    rows = [list(s.original_size + s.crop_top_left + s.target_size) for s in sizes]
    return torch.tensor(rows, dtype=torch.float32)


def view_sizes(
    original_size: tuple[int, int], resolution: int, center_crop: bool = False, flipped: bool = False
) -> ImageSizes:
    """The sizes of a training view made as :class:`helpers.training.data.ConceptDataset` makes it.

    Without ``center_crop`` the whole picture is resized to ``resolution`` square: nothing is cut
    off, the crop is ``(0, 0)`` (as in diffusers' ``textual_inversion_sdxl.py``, which resizes to the
    square first, so its ``--center_crop`` cuts nothing either). With ``center_crop`` the centred
    square is cut first; its top-left is given where SDXL's training measured crops, in the picture
    scaled so that its shorter side is ``resolution`` (and from the mirrored side when ``flipped``).

    Args:
        original_size: ``(height, width)`` of the picture as loaded (after its EXIF rotation).
        resolution: the side of the square view.
    """
    height, width = original_size
    if not center_crop:
        return ImageSizes((height, width), (0, 0), (resolution, resolution))
    side = min(height, width)
    top, left = (height - side) // 2, (width - side) // 2  # the square data.py cuts
    if flipped:
        left = width - side - left
    scale = resolution / side
    return ImageSizes((height, width), (round(top * scale), round(left * scale)), (resolution, resolution))


def unet_kwargs(conditioning: Conditioning, sizes: Sequence[ImageSizes]) -> dict:
    """``encoder_hidden_states`` and ``added_cond_kwargs`` (``text_embeds``, ``time_ids``).

    Raises:
        ValueError: ``sizes`` does not have one entry per example of the batch.
    """
    batch = conditioning.prompt_embeds.shape[0]
    if len(sizes) != batch:
        raise ValueError(f"SDXL's UNet needs the sizes of each of the {batch} examples, got {len(sizes)}")
    time_ids = add_time_ids(sizes).to(conditioning.prompt_embeds.device)
    return {
        "encoder_hidden_states": conditioning.prompt_embeds,
        "added_cond_kwargs": {"text_embeds": conditioning.pooled_prompt_embeds, "time_ids": time_ids},
    }


FAMILY = Family(
    name="sdxl",
    pipeline_class="StableDiffusionXLPipeline",
    tokenizers=("tokenizer", "tokenizer_2"),
    text_encoders=("text_encoder", "text_encoder_2"),
    text_encoder_classes=("CLIPTextModel", "CLIPTextModelWithProjection"),
    learned_embeds_files=(LEARNED_EMBEDS, LEARNED_EMBEDS_2),
    encode_prompt=encode_prompt,
    unet_kwargs=unet_kwargs,
)
