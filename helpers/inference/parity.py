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
    encoder_pairs,
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


def prompt_ids(pipe: Any, prompt: str, encoder: int = 0) -> torch.Tensor:
    """Token ids the pipeline feeds a text encoder for ``prompt`` (multi-vector tokens expanded).

    Args:
        encoder: which text encoder's tokenizer: 0, or 1 for SDXL's ``tokenizer_2``.
    """
    tok, _ = encoder_pairs(pipe)[encoder]
    text = pipe.maybe_convert_prompt(prompt, tok)
    return tok(
        text, padding="max_length", max_length=tok.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids


def text_embeddings(pipe: Any, prompt: str, encoder: int = 0) -> torch.Tensor:
    """A text encoder's last hidden state for ``prompt``, shape ``[1, 77, hidden]``.

    Args:
        encoder: which text encoder: 0, or 1 for SDXL's ``text_encoder_2`` (whose first output is
            the pooled projection, so the hidden state is read by name, for PyTorch and OpenVINO).
    """
    _, text_encoder = encoder_pairs(pipe)[encoder]
    with torch.inference_mode():
        return torch.as_tensor(text_encoder(prompt_ids(pipe, prompt, encoder)).last_hidden_state).float()


def text_encoder_max_abs_diff(pipe_a: Any, pipe_b: Any, prompt: str) -> float:
    """Max abs difference of two pipelines' text-encoder outputs for ``prompt``, over every text encoder.

    Raises:
        InferenceInputError: the pipelines are of different families, or tokenize ``prompt``
            differently (one lacks the concept, in one of its encoders).
    """
    count = len(encoder_pairs(pipe_a))
    if count != len(encoder_pairs(pipe_b)):
        raise InferenceInputError(
            "the two pipelines have different numbers of text encoders (an SD v1 and an SDXL pipeline). "
            "Fix: compare an OpenVINO export with the PyTorch model it was exported from."
        )
    diffs = []
    for i in range(count):
        ids_a, ids_b = prompt_ids(pipe_a, prompt, i), prompt_ids(pipe_b, prompt, i)
        if not torch.equal(ids_a, ids_b):
            which = "" if count == 1 else f" (text encoder {i + 1} of {count})"
            raise InferenceInputError(
                f"prompt {prompt!r} tokenizes differently in the two pipelines{which}, so one of them lacks the "
                f"learned token. Fix: load the same learned embeddings (or fine-tuned folder) into both."
            )
        diff = text_embeddings(pipe_a, prompt, i) - text_embeddings(pipe_b, prompt, i)
        diffs.append(float(diff.abs().max()))
    return max(diffs)


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
