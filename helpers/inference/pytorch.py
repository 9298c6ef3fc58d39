"""PyTorch pipelines: loading the concept (as a fine-tuned folder or embeddings on a base model).

Both families: ``StableDiffusionPipeline`` (SD v1/v2: one text encoder, one ``learned_embeds``
file) and ``StableDiffusionXLPipeline`` (two text encoders: stock ``load_textual_inversion`` runs
twice, the second time with ``text_encoder=pipe.text_encoder_2, tokenizer=pipe.tokenizer_2`` and
``learned_embeds_2.safetensors``, as diffusers documents for its SDXL textual-inversion script).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from helpers.core.quiet import quiet_model_loading
from helpers.inference import openvino
from helpers.inference.common import (
    InferenceInputError,
    is_openvino,
    is_openvino_folder,
)
from helpers.inference.concept import check_concept, check_pipe_embeds
from helpers.training.families import family_of


def load_learned_embeds(
    pipe: Any, learned_embeds: str | os.PathLike, placeholder_token: str | None = None, compile: bool = True
) -> list[str]:
    """Load textual-inversion embeddings into a PyTorch or OpenVINO pipeline, into every text encoder.

    It lives with the PyTorch loader, which uses it; an OpenVINO pipeline is handed to
    :func:`helpers.inference.openvino.insert_learned_embeds` (graph insertion, verified, then compile).
    Every file is checked against its encoder before the first is loaded.

    Args:
        pipe: a ``StableDiffusionPipeline``, ``StableDiffusionXLPipeline`` or their OpenVINO twins.
        learned_embeds: ``learned_embeds.safetensors`` (or the training output_dir holding it); for
            SDXL ``learned_embeds_2.safetensors`` must lie beside it (it goes into ``text_encoder_2``).
        placeholder_token: load under this token instead of the one stored in the files.
        compile: OpenVINO only: compile after loading (export skips it).

    Returns:
        The tokens added to each tokenizer (``<tok>``, then ``<tok>_1``... for multi-vector embeddings).
    """
    if is_openvino(pipe):
        return openvino.insert_learned_embeds(pipe, learned_embeds, placeholder_token, compile=compile)
    checked = check_pipe_embeds(pipe, learned_embeds, placeholder_token)
    for (file, _), (tokenizer, encoder) in checked:
        pipe.load_textual_inversion(
            str(file), token=placeholder_token, tokenizer=tokenizer, text_encoder=encoder
        )
    return checked[0][0][1]


def load_pytorch_pipeline(
    model: str | os.PathLike,
    learned_embeds: str | os.PathLike | None = None,
    placeholder_token: str | None = None,
):
    """Load an fp32 PyTorch pipeline of the model's family holding the learned concept.

    Args:
        model: the full fine-tuned folder, or the base model (``"tiny"``, ``"tiny-xl"``, a Hub id or a folder).
        learned_embeds: embeddings to load on top of a base model (None for a fine-tuned folder); for
            SDXL the first encoder's file, ``learned_embeds_2.safetensors`` beside it.
        placeholder_token: with ``learned_embeds``: load under this token; without: a token the
            fine-tuned folder must know (checked).

    Returns:
        A ``StableDiffusionPipeline`` without safety checker (the OpenVINO export has none either),
        or a ``StableDiffusionXLPipeline`` (which has none).
    """

    path = check_concept(model, learned_embeds, placeholder_token)
    if is_openvino_folder(path):
        raise InferenceInputError(
            f"model {os.fspath(model)!r} is an OpenVINO export. Fix: use load_openvino_pipeline."
        )
    family = family_of(path)
    quiet_model_loading()
    extra = dict(family.pipeline_extras)  # SD v1's: no safety checker
    pipe = family.diffusers_class().from_pretrained(path, torch_dtype=torch.float32, **extra)
    if learned_embeds is not None:
        load_learned_embeds(pipe, learned_embeds, placeholder_token)
    return pipe
