"""How close an OpenVINO pipeline is to PyTorch: text-encoder outputs and images, same seed and scheduler."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from helpers.inference.common import (
    IMAGE_PSNR_MIN_DB,
    PSNR_IDENTICAL_DB,
    TEXT_ENCODER_ATOL,
    InferenceInputError,
)
from helpers.inference.generation import generate


@dataclass
class Parity:
    """How close an OpenVINO pipeline is to PyTorch for one prompt, seed and scheduler."""

    text_encoder_max_abs_diff: float
    image_psnr: float
    image_max_abs_diff: int

    @property
    def ok(self) -> bool:
        """True when both numbers are within the stated tolerances."""
        return self.text_encoder_max_abs_diff < TEXT_ENCODER_ATOL and self.image_psnr > IMAGE_PSNR_MIN_DB


def prompt_ids(pipe: Any, prompt: str) -> torch.Tensor:
    """Token ids the pipeline feeds its text encoder for ``prompt`` (multi-vector tokens expanded)."""
    text = pipe.maybe_convert_prompt(prompt, pipe.tokenizer)
    tok = pipe.tokenizer
    return tok(
        text, padding="max_length", max_length=tok.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids


def text_embeddings(pipe: Any, prompt: str) -> torch.Tensor:
    """The text encoder's last hidden state for ``prompt``, shape ``[1, 77, hidden]``."""
    with torch.inference_mode():
        return pipe.text_encoder(prompt_ids(pipe, prompt))[0].float()


def text_encoder_max_abs_diff(pipe_a: Any, pipe_b: Any, prompt: str) -> float:
    """Max abs difference of two pipelines' text-encoder outputs for ``prompt``.

    Raises:
        InferenceInputError: the pipelines tokenize ``prompt`` differently (one lacks the concept).
    """
    ids_a, ids_b = prompt_ids(pipe_a, prompt), prompt_ids(pipe_b, prompt)
    if not torch.equal(ids_a, ids_b):
        raise InferenceInputError(
            f"prompt {prompt!r} tokenizes differently in the two pipelines, so one of them lacks the learned "
            f"token. Fix: load the same learned embeddings (or fine-tuned folder) into both."
        )
    return float((text_embeddings(pipe_a, prompt) - text_embeddings(pipe_b, prompt)).abs().max())


def _pixels(images: Sequence[Any]) -> np.ndarray:
    return np.stack([np.asarray(img, dtype=np.uint8) for img in images]).astype(np.float64)


def image_psnr(images_a: Sequence[Any], images_b: Sequence[Any]) -> float:
    """Peak signal-to-noise ratio of two image lists, in dB, over uint8 pixels (peak 255).

    Identical images give :data:`PSNR_IDENTICAL_DB` (100). 40 dB means a typical pixel is off by
    about 2.5 of 255 levels: invisible to the eye.
    """
    a, b = _pixels(images_a), _pixels(images_b)
    if a.shape != b.shape:
        raise ValueError(f"image lists differ in shape: {a.shape} vs {b.shape}")
    mse = float(np.mean((a - b) ** 2))
    return PSNR_IDENTICAL_DB if mse == 0 else min(PSNR_IDENTICAL_DB, 10 * math.log10(255.0**2 / mse))


def image_max_abs_diff(images_a: Sequence[Any], images_b: Sequence[Any]) -> int:
    """Largest difference of any pixel channel between two image lists, in uint8 levels (0-255)."""
    return int(np.abs(_pixels(images_a) - _pixels(images_b)).max())


def _scheduler_config(pipe: Any) -> dict[str, Any]:
    return {k: v for k, v in dict(pipe.scheduler.config).items() if not k.startswith("_")}


def compare(
    pt_pipe: Any,
    ov_pipe: Any,
    prompt: str,
    num_inference_steps: int = 20,
    guidance_scale: float = 7.5,
    seed: int = 0,
    height: int | None = None,
    width: int | None = None,
) -> Parity:
    """Parity of an OpenVINO pipeline against PyTorch: text encoder and images, same seed and scheduler.

    Raises:
        InferenceInputError: the schedulers differ (the images would not be comparable).
    """
    if type(pt_pipe.scheduler) is not type(ov_pipe.scheduler) or _scheduler_config(
        pt_pipe
    ) != _scheduler_config(ov_pipe):
        raise InferenceInputError(
            f"the pipelines' schedulers differ ({type(pt_pipe.scheduler).__name__} vs "
            f"{type(ov_pipe.scheduler).__name__}). Fix: give both the same scheduler, e.g. "
            f"ov_pipe.scheduler = type(pt_pipe.scheduler).from_config(pt_pipe.scheduler.config)."
        )
    kwargs = dict(
        num_inference_steps=num_inference_steps,
        guidance_scale=guidance_scale,
        seed=seed,
        height=height,
        width=width,
        warmup=False,
    )
    pt_images = generate(pt_pipe, prompt, **kwargs).images
    ov_images = generate(ov_pipe, prompt, **kwargs).images
    return Parity(
        text_encoder_max_abs_diff=text_encoder_max_abs_diff(pt_pipe, ov_pipe, prompt),
        image_psnr=image_psnr(pt_images, ov_images),
        image_max_abs_diff=image_max_abs_diff(pt_images, ov_images),
    )
