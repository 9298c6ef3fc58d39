"""PyTorch pipelines: loading the concept (as a fine-tuned folder or embeddings on a base model)."""

from __future__ import annotations

import os
from typing import Any

import torch

from helpers.core.quiet import quiet_model_loading
from helpers.inference import openvino
from helpers.inference.common import InferenceInputError, hidden_size, is_openvino, is_openvino_folder
from helpers.inference.concept import check_concept, check_embeds, learned_embeds_file


def load_learned_embeds(
    pipe: Any, learned_embeds: str | os.PathLike, placeholder_token: str | None = None, compile: bool = True
) -> list[str]:
    """Load textual-inversion embeddings into a PyTorch or OpenVINO Stable Diffusion pipeline.

    It lives with the PyTorch loader, which uses it; an OpenVINO pipeline is handed to
    :func:`helpers.inference.openvino.insert_learned_embeds` (graph insertion, verified, then compile).

    Args:
        pipe: a ``StableDiffusionPipeline`` or ``OVStableDiffusionPipeline``.
        learned_embeds: ``learned_embeds.safetensors`` (or the training output_dir holding it).
        placeholder_token: load under this token instead of the one stored in the file.
        compile: OpenVINO only: compile after loading (export skips it).

    Returns:
        The tokens added (``<tok>``, then ``<tok>_1``... for multi-vector embeddings).
    """
    if is_openvino(pipe):
        return openvino.insert_learned_embeds(pipe, learned_embeds, placeholder_token, compile=compile)
    tokens = check_embeds(
        pipe.tokenizer, hidden_size(pipe), learned_embeds, placeholder_token, "this pipeline"
    )
    pipe.load_textual_inversion(str(learned_embeds_file(learned_embeds)), token=placeholder_token)
    return tokens


def load_pytorch_pipeline(
    model: str | os.PathLike,
    learned_embeds: str | os.PathLike | None = None,
    placeholder_token: str | None = None,
):
    """Load an fp32 PyTorch Stable Diffusion pipeline holding the learned concept.

    Args:
        model: the full fine-tuned folder, or the base model (``"tiny"``, a Hub id or a folder).
        learned_embeds: embeddings to load on top of a base model (None for a fine-tuned folder).
        placeholder_token: with ``learned_embeds``: load under this token; without: a token the
            fine-tuned folder must know (checked).

    Returns:
        A ``StableDiffusionPipeline`` without safety checker (the OpenVINO export has none either).
    """
    from diffusers import StableDiffusionPipeline

    path = check_concept(model, learned_embeds, placeholder_token)
    if is_openvino_folder(path):
        raise InferenceInputError(
            f"model {os.fspath(model)!r} is an OpenVINO export. Fix: use load_openvino_pipeline."
        )
    quiet_model_loading()
    pipe = StableDiffusionPipeline.from_pretrained(
        path, torch_dtype=torch.float32, safety_checker=None, requires_safety_checker=False
    )
    if learned_embeds is not None:
        load_learned_embeds(pipe, learned_embeds, placeholder_token)
    return pipe
