"""What every model family is made of: its data (:class:`Family`), the conditioning its prompts
encode to (:class:`Conditioning`), and the image sizes SDXL's UNet is told about (:class:`ImageSizes`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ImageSizes:
    """One training picture's sizes, as SDXL's UNet is conditioned on them (``add_time_ids``).

    Attributes:
        original_size: ``(height, width)`` of the picture before it was resized or cropped.
        crop_top_left: ``(top, left)`` of the crop taken from the resized picture (``(0, 0)``: none).
        target_size: ``(height, width)`` of the picture the model sees (the training resolution).
    """

    original_size: tuple[int, int]
    crop_top_left: tuple[int, int]
    target_size: tuple[int, int]

    @classmethod
    def square(cls, resolution: int) -> ImageSizes:
        """A picture already ``resolution`` pixels square, not cropped (what generation assumes)."""
        return cls((resolution, resolution), (0, 0), (resolution, resolution))


@dataclass
class Conditioning:
    """What a batch of prompts encodes to.

    Attributes:
        prompt_embeds: the UNet's ``encoder_hidden_states``, ``[batch, tokens, width]``.
        pooled_prompt_embeds: SDXL's ``text_embeds``, ``[batch, pooled width]``; None for SD v1.
    """

    prompt_embeds: torch.Tensor
    pooled_prompt_embeds: torch.Tensor | None = None


EncodePrompt = Callable[[Sequence[torch.nn.Module], Sequence[torch.Tensor]], Conditioning]
"""``encode_prompt(text_encoders, input_ids) -> Conditioning``: one ids tensor per encoder, in order."""
UnetKwargs = Callable[[Conditioning, Sequence[ImageSizes]], dict]
"""``unet_kwargs(conditioning, sizes) -> dict``: the keyword arguments of the UNet call besides the
noisy latents and the timesteps; ``sizes`` has one entry per example (SD v1 ignores it)."""


@dataclass(frozen=True)
class Family:
    """A model family: how its pipeline folder is laid out, how prompts encode, how its UNet is called.

    Attributes:
        name: ``"sd1"`` or ``"sdxl"``.
        pipeline_class: the ``_class_name`` of its ``model_index.json``.
        tokenizers: the tokenizers' subfolders, one per text encoder, in order.
        text_encoders: the text encoders' subfolders, in the order ``encode_prompt`` takes them.
        text_encoder_classes: their transformers classes, by name.
        learned_embeds_files: the file a textual-inversion run writes for each text encoder's rows.
        encode_prompt: see :data:`EncodePrompt`.
        unet_kwargs: see :data:`UnetKwargs`.
        pipeline_extras: what its pipeline class is told besides the modules, when training loads or
            builds one (SD v1's: no safety checker, which training and its samples have no use for).
    """

    name: str
    pipeline_class: str
    tokenizers: tuple[str, ...]
    text_encoders: tuple[str, ...]
    text_encoder_classes: tuple[str, ...]
    learned_embeds_files: tuple[str, ...]
    encode_prompt: EncodePrompt
    unet_kwargs: UnetKwargs
    pipeline_extras: tuple[tuple[str, object], ...] = ()

    def diffusers_class(self) -> type:
        """diffusers' pipeline class of this family (``StableDiffusionPipeline``, ``StableDiffusionXLPipeline``)."""
        import diffusers  # at call time: a family is read before any model work, diffusers' import is not

        return getattr(diffusers, self.pipeline_class)
